// gemslib's native replay of planned calls (see gemslib/native.py and runtime.CallPlans).
//
// A table maps a call's signature (each argument's type, shape, strides, dtype, device,
// 16-byte alignment and requires_grad; plain numbers by value; grad mode; the current
// device) to its plan: the outputs to allocate and the compiled kernels to launch with the
// call's data pointers. run(*args, **kwargs) computes the signature, finds the plan,
// allocates, launches on the current stream with cuLaunchKernel(Ex) and returns the outputs,
// or returns None when the table has no plan for the call (the Python path then runs).
// The plans are made in Python from the calls' recorded launches; nothing here decides.
//
// For an aten override, register_replay() also puts a kernel of its own after autograd
// (the ADInplaceOrView key, for functional operators only): it keys the call from the
// dispatcher's stack, replays a plan there without entering Python's boxing, and otherwise
// passes the call on to the override's Python kernel, leaving its key pending so that the
// plan Python makes of the call is kept under it.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include "cuda.h"

namespace {

// ---- the driver, found at run time (nothing is linked against libcuda) ----------------

using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, CUstream, void**, void**);
using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
using StreamIsCapturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);
using GetErrorString = CUresult (*)(CUresult, const char**);
using FuncSetAttribute = CUresult (*)(CUfunction, CUfunction_attribute, int);
using CtxSynchronize = CUresult (*)();
using TensorMapEncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                          const cuuint64_t*, const cuuint64_t*,
                                          const cuuint32_t*, const cuuint32_t*,
                                          CUtensorMapInterleave, CUtensorMapSwizzle,
                                          CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

struct Driver {
  LaunchKernel launch = nullptr;
  LaunchKernelEx launch_ex = nullptr;
  CtxGetCurrent ctx_get_current = nullptr;
  StreamIsCapturing stream_is_capturing = nullptr;
  GetErrorString error_string = nullptr;
  FuncSetAttribute func_set_attribute = nullptr;
  CtxSynchronize ctx_synchronize = nullptr;
  TensorMapEncodeTiled encode_tiled = nullptr;
};

Driver driver;

bool load_driver() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!handle) handle = dlopen("libcuda.so.1", RTLD_NOW);
  if (!handle) return false;
  driver.launch = reinterpret_cast<LaunchKernel>(dlsym(handle, "cuLaunchKernel"));
  driver.launch_ex = reinterpret_cast<LaunchKernelEx>(dlsym(handle, "cuLaunchKernelEx"));
  driver.ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(handle, "cuCtxGetCurrent"));
  driver.stream_is_capturing =
      reinterpret_cast<StreamIsCapturing>(dlsym(handle, "cuStreamIsCapturing"));
  driver.error_string = reinterpret_cast<GetErrorString>(dlsym(handle, "cuGetErrorString"));
  driver.func_set_attribute =
      reinterpret_cast<FuncSetAttribute>(dlsym(handle, "cuFuncSetAttribute"));
  driver.ctx_synchronize = reinterpret_cast<CtxSynchronize>(dlsym(handle, "cuCtxSynchronize"));
  driver.encode_tiled =
      reinterpret_cast<TensorMapEncodeTiled>(dlsym(handle, "cuTensorMapEncodeTiled"));
  return driver.launch && driver.launch_ex && driver.ctx_get_current &&
         driver.stream_is_capturing && driver.error_string && driver.func_set_attribute &&
         driver.ctx_synchronize;  // encode_tiled: only plans with tensor maps need it
}

bool driver_failed(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return false;
  const char* message = nullptr;
  if (driver.error_string) driver.error_string(result, &message);
  PyErr_Format(PyExc_RuntimeError, "gemslib: %s failed: %s (CUresult %d)", what,
               message ? message : "unknown error", static_cast<int>(result));
  return true;
}

// ---- a plan ----------------------------------------------------------------------------

enum ParamKind : uint8_t { POINTER_SLOT, POINTER_SCRATCH, CONSTANT, TENSOR_MAP };

struct Param {
  ParamKind kind;
  int slot;        // POINTER_SLOT, TENSOR_MAP: the call's tensor; POINTER_SCRATCH: the pair
  uint64_t value;  // CONSTANT: the bytes cuLaunchKernel copies; POINTER_SCRATCH: byte offset;
                   // TENSOR_MAP: which of the plan's maps
};

// A TMA descriptor's fixed part, encoded per call on the slot's pointer as Triton's
// fill_tma_descriptor encodes it (dimensions innermost first, strides in bytes).
struct MapSpec {
  int element_type, rank, swizzle, padding;
  cuuint32_t box[5];
  cuuint64_t shape[5];
  cuuint64_t strides[5];
};

struct Launch {
  CUfunction function;
  unsigned grid[3];
  unsigned num_warps, num_ctas, shared_memory;
  bool cooperative, pdl;
  std::vector<Param> params;
};

struct Output {
  std::vector<int64_t> shape, stride;
  c10::ScalarType dtype;
  bool zeroed;
};

struct Scratch {  // a split_scratch pair: (counters, floats), which one
  int64_t n_counters, n_floats;
  int which;
};

struct Plan {
  int device_index;
  std::vector<int> inputs;  // positions of the tensor arguments, in slot order
  std::vector<Output> outputs;
  std::vector<Scratch> scratch;
  std::vector<MapSpec> maps;
  std::vector<Launch> launches;
  // the result: -1 = the one output `single`, else a tuple of (output index or -1, value)
  int single = -1;
  std::vector<std::pair<int, PyObject*>> returned;  // owned references for the constants
  ~Plan() {
    for (auto& item : returned) Py_XDECREF(item.second);
  }
};

// ---- the signature of a call -----------------------------------------------------------

PyTypeObject* tensor_type = nullptr;     // torch.Tensor
PyTypeObject* parameter_type = nullptr;  // torch.nn.Parameter
PyObject* split_scratch_fn = nullptr;    // runtime.split_scratch

template <typename T>
void put(std::string& key, T value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// The tensors found while keying, for the replay's pointers.
struct Keyed {
  std::vector<const at::Tensor*> tensors;
  std::vector<void*> starts;
};

enum Tag : char { TENSOR = 't', INT = 'i', BOOL = 'b', FLOAT = 'f', NONE = 'n', SEQ = 's',
                  NAME = 'k', ALIAS = 'a', DTYPE = 'd' };

// Appends one plain value to the key; false where it is not one this table keys.
bool put_value(std::string& key, PyObject* value) {
  if (value == Py_None) {
    key.push_back(NONE);
  } else if (PyBool_Check(value)) {
    key.push_back(BOOL);
    key.push_back(value == Py_True);
  } else if (PyLong_CheckExact(value)) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) return false;
    key.push_back(INT);
    put(key, v);
  } else if (PyFloat_CheckExact(value)) {
    key.push_back(FLOAT);
    put(key, PyFloat_AS_DOUBLE(value));
  } else if (THPDtype_Check(value)) {
    key.push_back(DTYPE);
    put<int8_t>(key, static_cast<int8_t>(reinterpret_cast<THPDtype*>(value)->scalar_type));
  } else {
    return false;
  }
  return true;
}

// Tensors a plan may take: defined, strided, with memory of their own (not a fake, meta or
// functional tensor, nor one a Python subclass or mode handles).
const c10::DispatchKeySet not_plain_keys({c10::DispatchKey::Python,
                                          c10::DispatchKey::PythonTLSSnapshot,
                                          c10::DispatchKey::Functionalize});

bool put_tensor(std::string& key, const at::Tensor& t, bool stop_on_grad, Keyed& keyed) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_meta() || !t.has_storage() ||
      !(t.key_set() & not_plain_keys).empty())
    return false;
  {
    bool requires_grad = t.requires_grad();
    if (stop_on_grad && requires_grad) return false;
    void* start = const_cast<void*>(t.unsafeGetTensorImpl()->data());  // start, any dtype
    keyed.tensors.push_back(&t);
    keyed.starts.push_back(start);
    key.push_back(TENSOR);
    auto sizes = t.sizes();
    auto strides = t.strides();
    put<int32_t>(key, static_cast<int32_t>(sizes.size()));
    for (size_t d = 0; d < sizes.size(); ++d) {
      put<int64_t>(key, sizes[d]);
      put<int64_t>(key, strides[d]);
    }
    put<int8_t>(key, static_cast<int8_t>(t.scalar_type()));
    c10::Device device = t.device();
    put<int8_t>(key, static_cast<int8_t>(device.type()));
    put<int8_t>(key, device.index());
    put<uint8_t>(key, static_cast<uint8_t>(reinterpret_cast<uintptr_t>(start) & 15));
    key.push_back(requires_grad);
    return true;
  }
}

bool put_argument(std::string& key, PyObject* arg, bool stop_on_grad, Keyed& keyed) {
  PyTypeObject* type = Py_TYPE(arg);
  if (type == tensor_type || type == parameter_type)
    return put_tensor(key, THPVariable_Unpack(arg), stop_on_grad, keyed);
  if (PyTuple_CheckExact(arg) || PyList_CheckExact(arg)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(arg);
    PyObject** items = PySequence_Fast_ITEMS(arg);
    key.push_back(SEQ);
    key.push_back(PyTuple_CheckExact(arg) ? 't' : 'l');
    put<int32_t>(key, static_cast<int32_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i)
      if (!put_value(key, items[i])) return false;
    return true;
  }
  return put_value(key, arg);
}

// The start of every key: the current device and grad mode; false where CUDA is unusable.
bool put_context(std::string& key, bool& grad) {
  grad = c10::GradMode::is_enabled();
  int8_t current = -1;
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) {
    try {
      current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index();
    } catch (const std::exception&) {
      return false;  // CUDA unusable here: no key, the Python path reports what is wrong
    }
  }
  put<int8_t>(key, current);
  key.push_back(grad);
  return true;
}

// The end of every key: which tensors start at one address (k and v as one tensor, say).
void put_aliasing(std::string& key, const Keyed& keyed) {
  const auto& starts = keyed.starts;
  for (size_t i = 1; i < starts.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (starts[i] == starts[j]) {
        key.push_back(ALIAS);
        put<int16_t>(key, static_cast<int16_t>(i));
        put<int16_t>(key, static_cast<int16_t>(j));
        break;
      }
    }
  }
}

// The key of a call from Python, or false where this table keys no such call.
bool signature(std::string& key, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
               bool below_autograd, Keyed& keyed) {
  bool grad;
  if (!put_context(key, grad)) return false;
  bool stop_on_grad = grad && !below_autograd;
  for (Py_ssize_t i = 0; i < nargs; ++i)
    if (!put_argument(key, args[i], stop_on_grad, keyed)) return false;
  if (kwnames) {
    Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < n; ++i) {
      Py_ssize_t length = 0;
      const char* name = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(kwnames, i), &length);
      if (!name) return false;
      key.push_back(NAME);
      put<int32_t>(key, static_cast<int32_t>(length));
      key.append(name, length);
      if (!put_value(key, args[nargs + i])) return false;
    }
  }
  put_aliasing(key, keyed);
  return true;
}

// The key of a call on the dispatcher's stack (its schema's arguments, in order), or false
// where the table keys no such call. Only the kernel after autograd makes and reads these.
bool stack_signature(std::string& key, c10::ArrayRef<c10::IValue> args, bool below_autograd,
                     Keyed& keyed) {
  bool grad;
  if (!put_context(key, grad)) return false;
  key.push_back('D');  // never equal to a key of Python objects
  bool stop_on_grad = grad && !below_autograd;
  for (const c10::IValue& v : args) {
    if (v.isTensor()) {
      if (!put_tensor(key, v.toTensor(), stop_on_grad, keyed)) return false;
    } else if (v.isNone()) {
      key.push_back(NONE);
    } else if (v.isBool()) {
      key.push_back(BOOL);
      key.push_back(v.toBool());
    } else if (v.isInt()) {
      key.push_back(INT);
      put<int64_t>(key, v.toInt());
    } else if (v.isDouble()) {
      key.push_back(FLOAT);
      put<double>(key, v.toDouble());
    } else if (v.isIntList()) {
      auto items = v.toIntList();
      key.push_back(SEQ);
      put<int32_t>(key, static_cast<int32_t>(items.size()));
      for (int64_t item : items) {
        key.push_back(INT);
        put<int64_t>(key, item);
      }
    } else {
      return false;
    }
  }
  put_aliasing(key, keyed);
  return true;
}

// Keys of calls the kernel after autograd passed on to Python, by thread: the plan Python makes
// of such a call is kept under its key (see Table.add), with the tensors' starts to check.
struct Pending {
  uint64_t id;
  const void* table;
  std::string key;
  std::vector<void*> starts;
};
thread_local std::vector<Pending> pending;
thread_local uint64_t pending_ids = 0;

// ---- the table -------------------------------------------------------------------------

struct TableObject {
  PyObject_HEAD
  bool below_autograd;
  std::unordered_map<std::string, std::shared_ptr<Plan>>* plans;
  // split_scratch pairs fetched per (device, stream, n_counters, n_floats): kept referenced
  std::unordered_map<std::string, PyObject*>* scratch;
  uint64_t replays;
};

PyObject* scratch_pointers(TableObject* self, const Plan& plan, CUstream stream,
                           std::vector<uint64_t>& pointers) {
  for (const Scratch& s : plan.scratch) {
    std::string key;
    put<int>(key, plan.device_index);
    put<void*>(key, static_cast<void*>(stream));
    put<int64_t>(key, s.n_counters);
    put<int64_t>(key, s.n_floats);
    if (self->scratch->size() >= 64 && !self->scratch->count(key)) {
      // a new stream (a graph capture's warm-up, say) past 64 kept pairs: drop them as
      // split_scratch does, once no kernel can still be using them
      if (driver_failed(driver.ctx_synchronize(), "cuCtxSynchronize")) return nullptr;
      for (auto& item : *self->scratch) Py_DECREF(item.second);
      self->scratch->clear();
    }
    auto found = self->scratch->find(key);
    PyObject* pair;
    if (found == self->scratch->end()) {
      PyObject* torch_device = nullptr;
      {
        PyObject* torch_module = PyImport_ImportModule("torch");
        if (!torch_module) return nullptr;
        torch_device = PyObject_CallMethod(torch_module, "device", "si", "cuda", plan.device_index);
        Py_DECREF(torch_module);
      }
      if (!torch_device) return nullptr;
      pair = PyObject_CallFunction(split_scratch_fn, "OLLK", torch_device,
                                   static_cast<long long>(s.n_counters),
                                   static_cast<long long>(s.n_floats),
                                   static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(stream)));
      Py_DECREF(torch_device);
      if (!pair) return nullptr;
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
          Py_TYPE(PyTuple_GET_ITEM(pair, 0)) != tensor_type ||
          Py_TYPE(PyTuple_GET_ITEM(pair, 1)) != tensor_type) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "gemslib: split_scratch gave no pair of tensors");
        return nullptr;
      }
      (*self->scratch)[key] = pair;  // the reference is the table's
    } else {
      pair = found->second;
    }
    const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(pair, s.which));
    pointers.push_back(reinterpret_cast<uint64_t>(const_cast<void*>(t.unsafeGetTensorImpl()->data())));
  }
  return Py_None;
}

bool encode_map(CUtensorMap* map, const MapSpec& spec, uint64_t base) {
  if (!driver.encode_tiled) {
    PyErr_SetString(PyExc_RuntimeError, "gemslib: the driver has no cuTensorMapEncodeTiled");
    return false;
  }
  cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  return !driver_failed(
      driver.encode_tiled(map, static_cast<CUtensorMapDataType>(spec.element_type),
                          static_cast<cuuint32_t>(spec.rank), reinterpret_cast<void*>(base),
                          spec.shape, spec.strides, spec.box, element_strides,
                          CU_TENSOR_MAP_INTERLEAVE_NONE,
                          static_cast<CUtensorMapSwizzle>(spec.swizzle),
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                          spec.padding ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                                       : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
      "cuTensorMapEncodeTiled");
}

bool launch(const Plan& plan, const Launch& l, CUstream stream,
            const std::vector<uint64_t>& pointers, const std::vector<uint64_t>& scratch_pointers_) {
  uint64_t values[64];
  CUtensorMap maps[8];  // aligned to 64 bytes by its type, as a __grid_constant__ map must be
  void* params[66];
  size_t n = l.params.size(), n_maps = 0;
  if (n > 64) {
    PyErr_SetString(PyExc_RuntimeError, "gemslib: a planned launch with over 64 parameters");
    return false;
  }
  for (size_t i = 0; i < n; ++i) {
    const Param& p = l.params[i];
    if (p.kind == TENSOR_MAP) {
      if (n_maps == 8) {
        PyErr_SetString(PyExc_RuntimeError, "gemslib: a planned launch with over 8 tensor maps");
        return false;
      }
      if (!encode_map(&maps[n_maps], plan.maps[p.value], pointers[p.slot])) return false;
      params[i] = &maps[n_maps++];
      continue;
    }
    if (p.kind == POINTER_SLOT) values[i] = pointers[p.slot];
    else if (p.kind == POINTER_SCRATCH) values[i] = scratch_pointers_[p.slot] + p.value;
    else values[i] = p.value;
    params[i] = &values[i];
  }
  CUdeviceptr global_scratch = 0, profile_scratch = 0;  // plans exist only without them
  params[n] = &global_scratch;
  params[n + 1] = &profile_scratch;
  if (l.grid[0] * l.grid[1] * l.grid[2] == 0) return true;
  if (l.num_ctas == 1 && !l.cooperative && !l.pdl) {
    return !driver_failed(driver.launch(l.function, l.grid[0], l.grid[1], l.grid[2],
                                        32 * l.num_warps, 1, 1, l.shared_memory, stream, params,
                                        nullptr),
                          "cuLaunchKernel");
  }
  CUlaunchAttribute attributes[4];
  unsigned n_attributes = 0;
  if (l.pdl) {
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[n_attributes].value.programmaticStreamSerializationAllowed = 1;
    ++n_attributes;
  }
  if (l.cooperative) {
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[n_attributes].value.cooperative = 1;
    ++n_attributes;
  }
  if (l.num_ctas != 1) {
    attributes[n_attributes] = CUlaunchAttribute{};
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[n_attributes].value.clusterDim.x = l.num_ctas;
    attributes[n_attributes].value.clusterDim.y = 1;
    attributes[n_attributes].value.clusterDim.z = 1;
    ++n_attributes;
    attributes[n_attributes] = CUlaunchAttribute{};
    attributes[n_attributes].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[n_attributes].value.clusterSchedulingPolicyPreference =
        CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
    ++n_attributes;
    if (l.num_ctas == 16 &&
        driver_failed(driver.func_set_attribute(
                          l.function, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                      "cuFuncSetAttribute"))
      return false;
  }
  CUlaunchConfig config{};
  config.gridDimX = l.grid[0] * l.num_ctas;
  config.gridDimY = l.grid[1];
  config.gridDimZ = l.grid[2];
  config.blockDimX = 32 * l.num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = l.shared_memory;
  config.hStream = stream;
  config.attrs = attributes;
  config.numAttrs = n_attributes;
  return !driver_failed(driver.launch_ex(&config, l.function, params, nullptr),
                        "cuLaunchKernelEx");
}

// Replays `plan` for the keyed call into `outputs`: 1 done, 0 not here (no driver, a capture
// that needs fresh scratch, a thread without a CUDA context: the caller's other path runs),
// -1 failed with a Python error set. Holds the GIL.
int replay_into(TableObject* self, const Plan& plan, const Keyed& keyed,
                std::vector<at::Tensor>& outputs) {
  if (!driver.launch || !c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA)) return 0;
  c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(plan.device_index));
  CUstream stream;
  try {
    auto* guard = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    stream = static_cast<CUstream>(guard->getStream(device).native_handle());
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return -1;
  }
  if (!plan.scratch.empty()) {
    CUstreamCaptureStatus capturing = CU_STREAM_CAPTURE_STATUS_NONE;
    if (driver_failed(driver.stream_is_capturing(stream, &capturing), "cuStreamIsCapturing"))
      return -1;
    if (capturing != CU_STREAM_CAPTURE_STATUS_NONE) return 0;  // fresh scratch: Python's path
  }
  CUcontext context = nullptr;
  if (driver_failed(driver.ctx_get_current(&context), "cuCtxGetCurrent")) return -1;
  if (!context) return 0;  // a thread that has not used CUDA yet: Python's path sets it

  std::vector<uint64_t> pointers;
  pointers.reserve(plan.inputs.size() + plan.outputs.size());
  for (int position : plan.inputs)
    pointers.push_back(reinterpret_cast<uint64_t>(keyed.starts[position]));
  outputs.reserve(plan.outputs.size());
  try {
    auto options = at::TensorOptions().device(device);
    for (const Output& o : plan.outputs) {
      if (o.zeroed) outputs.push_back(at::zeros(o.shape, options.dtype(o.dtype)));
      else outputs.push_back(at::empty_strided(o.shape, o.stride, options.dtype(o.dtype)));
      pointers.push_back(reinterpret_cast<uint64_t>(const_cast<void*>(outputs.back().unsafeGetTensorImpl()->data())));
    }
  } catch (const std::exception& err) {
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return -1;
  }
  std::vector<uint64_t> scratch;
  if (!plan.scratch.empty() && !scratch_pointers(self, plan, stream, scratch)) return -1;
  for (const Launch& l : plan.launches)
    if (!launch(plan, l, stream, pointers, scratch)) return -1;
  ++self->replays;
  return 1;
}

PyObject* replay(TableObject* self, const Plan& plan, const Keyed& keyed) {
  std::vector<at::Tensor> outputs;
  int done = replay_into(self, plan, keyed, outputs);
  if (done < 0) return nullptr;
  if (done == 0) Py_RETURN_NONE;
  if (plan.single >= 0) return THPVariable_Wrap(std::move(outputs[plan.single]));
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(plan.returned.size()));
  if (!result) return nullptr;
  for (size_t i = 0; i < plan.returned.size(); ++i) {
    const auto& item = plan.returned[i];
    PyObject* value;
    if (item.first >= 0) {
      value = THPVariable_Wrap(outputs[item.first]);
      if (!value) {
        Py_DECREF(result);
        return nullptr;
      }
    } else {
      value = item.second;
      Py_INCREF(value);
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), value);
  }
  return result;
}

// Table.run(*args, **kwargs): the planned call's outputs, or None.
PyObject* table_run(PyObject* self_, PyObject* const* args, Py_ssize_t nargsf,
                    PyObject* kwnames) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  if (self->plans->empty()) Py_RETURN_NONE;
  Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  std::string key;
  key.reserve(256);
  Keyed keyed;
  if (!signature(key, args, nargs, kwnames, self->below_autograd, keyed)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  auto found = self->plans->find(key);
  if (found == self->plans->end()) Py_RETURN_NONE;
  std::shared_ptr<Plan> plan = found->second;  // kept while it runs (a clear() in a callback)
  return replay(self, *plan, keyed);
}

// Reads an int from a Python object, into `out`; false (an error set) otherwise.
template <typename T>
bool as_int(PyObject* obj, T& out) {
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) return false;
  out = static_cast<T>(v);
  return true;
}

bool int_list(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "gemslib: a sequence of ints");
  if (!fast) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    int64_t v;
    if (!as_int(PySequence_Fast_GET_ITEM(fast, i), v)) {
      Py_DECREF(fast);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

// maps: ((host element type, element bytes, swizzle, box, shape, strides in elements,
// NaN padding), ...), dimensions outermost first as Python gives them.
bool parse_maps(PyObject* maps, std::vector<MapSpec>& out) {
  PyObject* fast = PySequence_Fast(maps, "maps");
  if (!fast) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    MapSpec m{};
    int element_size;
    PyObject *box, *shape, *strides;
    std::vector<int64_t> box_v, shape_v, strides_v;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iiiOOOi", &m.element_type,
                          &element_size, &m.swizzle, &box, &shape, &strides, &m.padding) ||
        !int_list(box, box_v) || !int_list(shape, shape_v) || !int_list(strides, strides_v)) {
      Py_DECREF(fast);
      return false;
    }
    m.rank = static_cast<int>(shape_v.size());
    if (m.rank < 1 || m.rank > 5 || box_v.size() != shape_v.size() ||
        strides_v.size() != shape_v.size() || element_size < 1 || strides_v.back() != 1) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "gemslib: a tensor map needs rank 1-5, a box and "
                                        "strides for every dim, and a unit last stride");
      return false;
    }
    for (int d = 0; d < m.rank; ++d) {  // innermost first
      m.box[m.rank - 1 - d] = static_cast<cuuint32_t>(box_v[d]);
      m.shape[m.rank - 1 - d] = static_cast<cuuint64_t>(shape_v[d]);
    }
    for (int d = 0; d + 1 < m.rank; ++d)
      m.strides[m.rank - 2 - d] = static_cast<cuuint64_t>(element_size * strides_v[d]);
    out.push_back(m);
  }
  Py_DECREF(fast);
  return true;
}

// Table.add(args, kwargs, plan): keeps `plan` for the signature of (args, kwargs). The plan is
// (device index, input positions, outputs, scratch, launches, result), with
//   outputs: ((shape, stride, scalar type number, zeroed), ...)
//   scratch: ((n_counters, n_floats, which), ...)
//   launches: ((function, (gx, gy, gz), num_warps, num_ctas, shared memory, cooperative, pdl,
//               ((kind, slot, value), ...)), ...), kind 0 a slot's pointer, 1 a scratch
//               pointer (value: its byte offset), 2 the constant bytes `value`, 3 a tensor
//               map on the slot's pointer (value: which of `maps`)
//   result: the one output's index, or ((output index or -1, value), ...)
//   maps (optional): see parse_maps
// Returns whether the call's signature is one this table keys.
PyObject* table_add(PyObject* self_, PyObject* args) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  PyObject *call_args, *call_kwargs, *spec;
  if (!PyArg_ParseTuple(args, "O!O!O!", &PyTuple_Type, &call_args, &PyDict_Type, &call_kwargs,
                        &PyTuple_Type, &spec))
    return nullptr;
  // the key, as run() will make it: positional arguments, then keywords in the dict's order
  Py_ssize_t nargs = PyTuple_GET_SIZE(call_args);
  Py_ssize_t nkw = PyDict_GET_SIZE(call_kwargs);
  std::vector<PyObject*> flat(nargs + nkw);
  for (Py_ssize_t i = 0; i < nargs; ++i) flat[i] = PyTuple_GET_ITEM(call_args, i);
  PyObject* kwnames = nullptr;
  if (nkw) {
    kwnames = PyTuple_New(nkw);
    if (!kwnames) return nullptr;
    PyObject *name, *value;
    Py_ssize_t pos = 0, i = 0;
    while (PyDict_Next(call_kwargs, &pos, &name, &value)) {
      Py_INCREF(name);
      PyTuple_SET_ITEM(kwnames, i, name);
      flat[nargs + i] = value;
      ++i;
    }
  }
  std::string key;
  Keyed keyed;
  bool keyable = signature(key, flat.data(), nargs, kwnames, self->below_autograd, keyed);
  Py_XDECREF(kwnames);
  if (!keyable) PyErr_Clear();
  // a call the kernel after autograd passed on: its plan is kept under that kernel's key, if
  // the call's tensors are the ones it keyed (in the same order)
  bool from_stack = false;
  for (auto it = pending.rbegin(); it != pending.rend(); ++it) {
    if (it->table != self) continue;
    bool same = keyable && keyed.starts.size() <= it->starts.size();
    for (size_t i = 0; same && i < keyed.starts.size(); ++i) same = keyed.starts[i] == it->starts[i];
    if (!same) Py_RETURN_FALSE;
    key = it->key;
    from_stack = true;
    pending.erase(std::next(it).base());
    break;
  }
  if (!keyable) Py_RETURN_FALSE;
  auto plan = std::make_shared<Plan>();
  PyObject *inputs, *outputs, *scratch, *launches, *result, *maps = nullptr;
  if (!PyArg_ParseTuple(spec, "iOOOOO|O", &plan->device_index, &inputs, &outputs, &scratch,
                        &launches, &result, &maps))
    return nullptr;
  if (maps && !parse_maps(maps, plan->maps)) return nullptr;
  std::vector<int64_t> positions;
  if (!int_list(inputs, positions)) return nullptr;
  // run() hands the replay the keyed tensors in argument order: map positions to them
  std::vector<int> tensor_index(nargs, -1);
  for (Py_ssize_t i = 0, t = 0; i < nargs; ++i) {
    PyTypeObject* type = Py_TYPE(flat[i]);
    if (type == tensor_type || type == parameter_type) tensor_index[i] = static_cast<int>(t++);
  }
  for (int64_t p : positions) {
    if (p < 0 || p >= nargs || tensor_index[p] < 0) {
      PyErr_SetString(PyExc_ValueError, "gemslib: a plan input that is no tensor argument");
      return nullptr;
    }
    plan->inputs.push_back(tensor_index[p]);
  }
  PyObject* fast = PySequence_Fast(outputs, "outputs");
  if (!fast) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject *shape, *stride, *dtype;
    int zeroed;
    Output o;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOOp", &shape, &stride, &dtype,
                          &zeroed) ||
        !int_list(shape, o.shape) || !int_list(stride, o.stride)) {
      Py_DECREF(fast);
      return nullptr;
    }
    if (!THPDtype_Check(dtype) || o.shape.size() != o.stride.size()) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_TypeError, "gemslib: a plan output needs (shape, stride, dtype)");
      return nullptr;
    }
    o.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    o.zeroed = zeroed;
    plan->outputs.push_back(std::move(o));
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(scratch, "scratch");
  if (!fast) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Scratch s;
    long long n_counters, n_floats;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "LLi", &n_counters, &n_floats,
                          &s.which)) {
      Py_DECREF(fast);
      return nullptr;
    }
    s.n_counters = n_counters;
    s.n_floats = n_floats;
    plan->scratch.push_back(s);
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(launches, "launches");
  if (!fast) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    Launch l;
    unsigned long long function;
    int cooperative, pdl;
    PyObject* params;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "K(III)IIIppO", &function,
                          &l.grid[0], &l.grid[1], &l.grid[2], &l.num_warps, &l.num_ctas,
                          &l.shared_memory, &cooperative, &pdl, &params)) {
      Py_DECREF(fast);
      return nullptr;
    }
    l.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(function));
    l.cooperative = cooperative;
    l.pdl = pdl;
    PyObject* pfast = PySequence_Fast(params, "params");
    if (!pfast) {
      Py_DECREF(fast);
      return nullptr;
    }
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(pfast); ++j) {
      int kind, slot;
      unsigned long long value;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(pfast, j), "iiK", &kind, &slot, &value)) {
        Py_DECREF(pfast);
        Py_DECREF(fast);
        return nullptr;
      }
      size_t limit = kind == POINTER_SCRATCH ? plan->scratch.size()
                                             : plan->inputs.size() + plan->outputs.size();
      bool bad_map = kind == TENSOR_MAP && value >= plan->maps.size();
      if (kind < 0 || kind > TENSOR_MAP || bad_map ||
          (kind != CONSTANT && (slot < 0 || static_cast<size_t>(slot) >= limit))) {
        Py_DECREF(pfast);
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "gemslib: a plan parameter out of range");
        return nullptr;
      }
      l.params.push_back(Param{static_cast<ParamKind>(kind), slot, value});
    }
    Py_DECREF(pfast);
    if (l.params.size() > 64) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "gemslib: a plan launch with over 64 parameters");
      return nullptr;
    }
    plan->launches.push_back(std::move(l));
  }
  Py_DECREF(fast);
  if (PyLong_Check(result)) {
    if (!as_int(result, plan->single)) return nullptr;
    if (plan->single < 0 || static_cast<size_t>(plan->single) >= plan->outputs.size()) {
      PyErr_SetString(PyExc_ValueError, "gemslib: a plan result out of range");
      return nullptr;
    }
  } else {
    fast = PySequence_Fast(result, "result");
    if (!fast) return nullptr;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
      int index;
      PyObject* value;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iO", &index, &value)) {
        Py_DECREF(fast);
        return nullptr;
      }
      if (index >= static_cast<int>(plan->outputs.size())) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "gemslib: a plan result out of range");
        return nullptr;
      }
      if (from_stack && index < 0 && value != Py_None && !PyBool_Check(value) &&
          !PyLong_CheckExact(value) && !PyFloat_CheckExact(value)) {
        Py_DECREF(fast);
        Py_RETURN_FALSE;  // a returned constant the dispatcher's stack cannot hold
      }
      Py_INCREF(value);
      plan->returned.emplace_back(index, value);
    }
    Py_DECREF(fast);
  }
  (*self->plans)[key] = std::move(plan);
  Py_RETURN_TRUE;
}

PyObject* table_clear(PyObject* self_, PyObject*) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  self->plans->clear();
  for (auto& item : *self->scratch) Py_DECREF(item.second);
  self->scratch->clear();
  Py_RETURN_NONE;
}

// Table.key(*args, **kwargs): the signature's bytes, or None (for tests of the keying).
PyObject* table_key(PyObject* self_, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  std::string key;
  Keyed keyed;
  if (!signature(key, args, PyVectorcall_NARGS(nargsf), kwnames, self->below_autograd, keyed)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

PyObject* table_len(PyObject* self_, void*) {
  return PyLong_FromSize_t(reinterpret_cast<TableObject*>(self_)->plans->size());
}

PyObject* table_replays(PyObject* self_, void*) {
  return PyLong_FromUnsignedLongLong(reinterpret_cast<TableObject*>(self_)->replays);
}

int table_init(PyObject* self_, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  int below_autograd = 0;
  static const char* names[] = {"below_autograd", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|p", const_cast<char**>(names),
                                   &below_autograd))
    return -1;
  self->below_autograd = below_autograd;
  return 0;
}

PyObject* table_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<TableObject*>(type->tp_alloc(type, 0));
  if (!self) return nullptr;
  self->plans = new std::unordered_map<std::string, std::shared_ptr<Plan>>();
  self->scratch = new std::unordered_map<std::string, PyObject*>();
  self->below_autograd = false;
  self->replays = 0;
  return reinterpret_cast<PyObject*>(self);
}

void table_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<TableObject*>(self_);
  for (auto& item : *self->scratch) Py_DECREF(item.second);
  delete self->scratch;
  delete self->plans;
  Py_TYPE(self_)->tp_free(self_);
}

// ---- the kernel after autograd -----------------------------------------------------------

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

std::string python_error_text() {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  std::string text = "gemslib: a native replay failed";
  if (value) {
    PyObject* str = PyObject_Str(value);
    if (str) {
      const char* utf8 = PyUnicode_AsUTF8(str);
      if (utf8) text = utf8;
      Py_DECREF(str);
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  PyErr_Clear();
  return text;
}

// The result of `plan` as the schema's returns, or false where they do not match it.
bool returns_fit(const Plan& plan, size_t n_returns) {
  return plan.single >= 0 ? n_returns == 1 : plan.returned.size() == n_returns;
}

// The plan's results onto the stack as the schema's returns: a None where the schema returns a
// Tensor is an undefined tensor (what torch makes of a Python kernel's None there).
void push_returns(const Plan& plan, std::vector<at::Tensor>& outputs,
                  const c10::FunctionSchema& schema, torch::jit::Stack* stack) {
  if (plan.single >= 0) {
    torch::jit::push(stack, std::move(outputs[plan.single]));
    return;
  }
  const auto& returns = schema.returns();
  for (size_t i = 0; i < plan.returned.size(); ++i) {
    const auto& item = plan.returned[i];
    PyObject* value = item.second;
    if (item.first >= 0) torch::jit::push(stack, outputs[item.first]);
    else if (value == Py_None && returns[i].type()->kind() == c10::TypeKind::TensorType)
      torch::jit::push(stack, at::Tensor());
    else if (value == Py_None) torch::jit::push(stack, c10::IValue());
    else if (PyBool_Check(value)) torch::jit::push(stack, value == Py_True);
    else if (PyLong_CheckExact(value)) torch::jit::push(stack, static_cast<int64_t>(PyLong_AsLongLong(value)));
    else torch::jit::push(stack, PyFloat_AS_DOUBLE(value));
  }
}

// Registered for one functional aten operator at ADInplaceOrView, after autograd and before
// the backend's kernel (the override's Python kernel): a planned call is replayed here, any
// other passed on.
class ReplayKernel final : public c10::OperatorKernel {
 public:
  ReplayKernel(PyObject* table, PyObject* allowed) : table_(table), allowed_(allowed) {
    Py_INCREF(table_);
    Py_INCREF(allowed_);
  }
  ~ReplayKernel() override {
    if (Py_IsInitialized() && !python_finalizing()) {  // at exit the references just go
      PyGILState_STATE gil = PyGILState_Ensure();
      Py_DECREF(table_);
      Py_DECREF(allowed_);
      PyGILState_Release(gil);
    }
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    auto* table = reinterpret_cast<TableObject*>(table_);
    const auto& schema = op.schema();
    const size_t n_args = schema.arguments().size();
    uint64_t pending_id = 0;
    // a Python mode (fake tensors while tracing, gemslib's planning) or a subclass sees the
    // call first: nothing to replay here
    if ((keys & not_plain_keys).empty()) {
      PyGILState_STATE gil = PyGILState_Ensure();
      std::string key;
      key.reserve(256);
      Keyed keyed;
      if (stack_signature(key, torch::jit::last(stack, n_args), table->below_autograd, keyed)) {
        auto found = table->plans->find(key);
        if (found == table->plans->end()) {
          pending_id = ++pending_ids;
          pending.push_back(Pending{pending_id, table, std::move(key), keyed.starts});
        } else if (returns_fit(*found->second, schema.returns().size()) && allowed()) {
          std::shared_ptr<Plan> plan = found->second;
          std::vector<at::Tensor> outputs;
          int done = replay_into(table, *plan, keyed, outputs);
          if (done < 0) {
            std::string text = python_error_text();
            PyGILState_Release(gil);
            throw std::runtime_error(text);
          }
          if (done > 0) {
            torch::jit::drop(stack, n_args);
            push_returns(*plan, outputs, schema, stack);
            PyGILState_Release(gil);
            return;
          }
        }
      }
      PyGILState_Release(gil);
    }
    struct PopPending {  // whatever the call does, its key is not left pending
      uint64_t id;
      ~PopPending() {
        if (!id) return;
        for (auto it = pending.begin(); it != pending.end(); ++it) {
          if (it->id == id) {
            pending.erase(it);
            break;
          }
        }
      }
    } pop{pending_id};
    op.redispatchBoxed(
        keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::ADInplaceOrView),
        stack);
  }

 private:
  bool allowed() {  // runtime's verdict: no call being planned, no launch hook, nothing forced
    PyObject* verdict = PyObject_CallNoArgs(allowed_);
    if (!verdict) {
      PyErr_Clear();
      return false;
    }
    bool yes = verdict == Py_True;
    Py_DECREF(verdict);
    return yes;
  }

  PyObject* table_;
  PyObject* allowed_;
};

struct RegistrationObject {
  PyObject_HEAD
  torch::Library* library;
};

PyObject* registration_remove(PyObject* self_, PyObject*) {
  auto* self = reinterpret_cast<RegistrationObject*>(self_);
  delete self->library;  // unregisters the kernel
  self->library = nullptr;
  Py_RETURN_NONE;
}

void registration_dealloc(PyObject* self_) {
  auto* self = reinterpret_cast<RegistrationObject*>(self_);
  if (!python_finalizing()) delete self->library;  // at exit the dispatcher goes with it
  Py_TYPE(self_)->tp_free(self_);
}

PyMethodDef registration_methods[] = {
    {"remove", registration_remove, METH_NOARGS, "unregister the kernel (idempotent)"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject RegistrationType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyMethodDef table_methods[] = {
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_run)),
     METH_FASTCALL | METH_KEYWORDS, "run(*args, **kwargs): the planned call's outputs, or None"},
    {"add", table_add, METH_VARARGS, "add(args, kwargs, plan): keep a plan for this signature"},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table_key)),
     METH_FASTCALL | METH_KEYWORDS, "key(*args, **kwargs): the signature's bytes, or None"},
    {"clear", table_clear, METH_NOARGS, "forget every plan and kept scratch"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef table_getset[] = {
    {"size", table_len, nullptr, "plans kept", nullptr},
    {"replays", table_replays, nullptr, "calls replayed", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject TableType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* module_setup(PyObject*, PyObject* args) {
  PyObject *tensor, *parameter, *scratch;
  if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &tensor, &PyType_Type, &parameter,
                        &scratch))
    return nullptr;
  Py_INCREF(tensor);
  Py_INCREF(parameter);
  Py_INCREF(scratch);
  tensor_type = reinterpret_cast<PyTypeObject*>(tensor);
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter);
  split_scratch_fn = scratch;
  Py_RETURN_NONE;
}

// register_replay(name, table, allowed): the kernel after autograd for the operator `name`
// ("aten::_softmax", "aten::add.Tensor"), replaying `table`'s plans while `allowed()` is
// True. Returns a Registration; its remove() (or its end) unregisters.
PyObject* module_register_replay(PyObject*, PyObject* args) {
  const char* qualified;
  PyObject *table, *allowed;
  if (!PyArg_ParseTuple(args, "sO!O", &qualified, &TableType, &table, &allowed)) return nullptr;
  std::string full(qualified);
  size_t colons = full.find("::");
  if (colons == std::string::npos || colons == 0 || colons + 2 >= full.size()) {
    PyErr_Format(PyExc_ValueError, "gemslib: register_replay needs 'namespace::name', got '%s'",
                 qualified);
    return nullptr;
  }
  std::string ns = full.substr(0, colons), name = full.substr(colons + 2);
  if (!PyCallable_Check(allowed)) {
    PyErr_SetString(PyExc_TypeError, "gemslib: register_replay needs a callable `allowed`");
    return nullptr;
  }
  auto* registration = PyObject_New(RegistrationObject, &RegistrationType);
  if (!registration) return nullptr;
  registration->library = nullptr;
  try {
    auto library = std::make_unique<torch::Library>(
        torch::Library::IMPL, ns, c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                            std::make_unique<ReplayKernel>(table, allowed)));
    registration->library = library.release();
  } catch (const std::exception& err) {
    Py_DECREF(registration);
    PyErr_SetString(PyExc_RuntimeError, err.what());
    return nullptr;
  }
  return reinterpret_cast<PyObject*>(registration);
}

PyObject* module_load_driver(PyObject*, PyObject*) {
  if (load_driver()) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef module_methods[] = {
    {"setup", module_setup, METH_VARARGS,
     "setup(torch.Tensor, torch.nn.Parameter, split_scratch)"},
    {"register_replay", module_register_replay, METH_VARARGS,
     "register_replay(name, table, allowed): replay an aten override's plans after autograd"},
    {"load_driver", module_load_driver, METH_NOARGS,
     "find the CUDA driver's launch functions; False where there is no driver"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "gemslib_launch",
                          "gemslib's native replay of planned calls", -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_gemslib_launch() {
  TableType.tp_name = "gemslib_launch.Table";
  TableType.tp_basicsize = sizeof(TableObject);
  TableType.tp_flags = Py_TPFLAGS_DEFAULT;
  TableType.tp_doc = "Planned calls of one operator, keyed by signature";
  TableType.tp_new = table_new;
  TableType.tp_init = table_init;
  TableType.tp_dealloc = table_dealloc;
  TableType.tp_methods = table_methods;
  TableType.tp_getset = table_getset;
  if (PyType_Ready(&TableType) < 0) return nullptr;
  RegistrationType.tp_name = "gemslib_launch.Registration";
  RegistrationType.tp_basicsize = sizeof(RegistrationObject);
  RegistrationType.tp_flags = Py_TPFLAGS_DEFAULT;
  RegistrationType.tp_doc = "A replay kernel registered after autograd for one aten operator";
  RegistrationType.tp_dealloc = registration_dealloc;
  RegistrationType.tp_methods = registration_methods;
  if (PyType_Ready(&RegistrationType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (!module) return nullptr;
  Py_INCREF(&TableType);
  if (PyModule_AddObject(module, "Table", reinterpret_cast<PyObject*>(&TableType)) < 0) {
    Py_DECREF(&TableType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
