// A table of plans, and a plan's replay: allocations, kept scratch, tensor maps, launches.
// Part of _launch.cpp (gemslib.runtime.native builds it), inside its anonymous namespace.

#pragma once

#include <Python.h>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>
#include "_launch_driver.h"
#include "_launch_plan.h"
#include "_launch_signature.h"

namespace {

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

}  // namespace
