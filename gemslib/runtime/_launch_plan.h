// A plan: the outputs a planned call allocates and the kernels it launches.
// Part of _launch.cpp (gemslib.runtime.native builds it), inside its anonymous namespace.

#pragma once

#include <Python.h>
#include <cstdint>
#include <utility>
#include <vector>
#include <c10/core/ScalarType.h>
#include "cuda.h"

namespace {

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

}  // namespace
