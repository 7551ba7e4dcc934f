// The CUDA driver's functions, found at run time (nothing is linked against libcuda).
// Part of _launch.cpp (gemslib.runtime.native builds it), inside its anonymous namespace.

#pragma once

#include <Python.h>
#include <dlfcn.h>
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

}  // namespace
