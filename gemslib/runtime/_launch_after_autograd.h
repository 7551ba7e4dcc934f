// The kernel registered after autograd for an aten override: replays a planned call from
// the dispatcher's stack, passes any other on.
// Part of _launch.cpp (gemslib.runtime.native builds it), inside its anonymous namespace.

#pragma once

#include <Python.h>
#include <stdexcept>
#include <string>
#include <vector>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include "_launch_plan.h"
#include "_launch_replay.h"
#include "_launch_signature.h"

namespace {

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

}  // namespace
