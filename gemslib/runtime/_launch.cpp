// gemslib's native replay of planned calls (see gemslib/runtime/native.py and plans.py).
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
//
// The pieces are in the _launch_*.h headers beside this file: the driver, a plan, the
// signature, the table's replay and the kernel after autograd; here are the table's
// Python methods and the module.

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
#include "_launch_driver.h"
#include "_launch_plan.h"
#include "_launch_signature.h"
#include "_launch_replay.h"
#include "_launch_after_autograd.h"

namespace {

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

// same_data_ptrs(args, packed): whether args[i] is a tensor whose data_ptr() is p for each
// (i, p) in `packed` (bytes of int64 pairs). A step graph checks its static inputs' addresses
// with it on every call; torch's own check converts every tensor of the list first.
PyObject* module_same_data_ptrs(PyObject*, PyObject* args) {
  PyObject *inputs, *packed;
  if (!PyArg_ParseTuple(args, "OS", &inputs, &packed)) return nullptr;
  if (!PyTuple_Check(inputs) && !PyList_Check(inputs)) {
    PyErr_SetString(PyExc_TypeError, "gemslib: same_data_ptrs needs a tuple or list");
    return nullptr;
  }
  Py_ssize_t bytes = PyBytes_GET_SIZE(packed);
  if (bytes % (2 * sizeof(int64_t)) != 0) {
    PyErr_SetString(PyExc_ValueError, "gemslib: same_data_ptrs needs (index, pointer) pairs");
    return nullptr;
  }
  const auto* pairs = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(packed));
  Py_ssize_t count = PySequence_Fast_GET_SIZE(inputs);
  PyObject** items = PySequence_Fast_ITEMS(inputs);
  for (Py_ssize_t k = 0; k < bytes / static_cast<Py_ssize_t>(sizeof(int64_t)); k += 2) {
    int64_t index = pairs[k];
    if (index < 0 || index >= count || !THPVariable_Check(items[index])) Py_RETURN_FALSE;
    const at::Tensor& tensor = THPVariable_Unpack(items[index]);
    try {
      if (reinterpret_cast<int64_t>(tensor.const_data_ptr()) != pairs[k + 1]) Py_RETURN_FALSE;
    } catch (const std::exception&) {  // a tensor without storage has no address to match
      Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
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
    {"same_data_ptrs", module_same_data_ptrs, METH_VARARGS,
     "same_data_ptrs(args, packed): each args[i].data_ptr() == p for the (i, p) int64 pairs"},
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
