// The signature of a call, from Python's arguments or the dispatcher's stack: the key a
// table keeps a plan under.
// Part of _launch.cpp (gemslib.runtime.native builds it), inside its anonymous namespace.

#pragma once

#include <Python.h>
#include <cstdint>
#include <string>
#include <vector>
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include "_launch_plan.h"

namespace {

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

}  // namespace
