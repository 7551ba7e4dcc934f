"""Where gemslib kernels run and with which launch configurations.

Two backends share one code path: a CUDA GPU, where Triton compiles the kernels and each takes
its launch configuration from ``tune_configs/<device>.yaml`` (else ``default.yaml``); and the
Triton interpreter (``TRITON_INTERPRET=1``), where the same kernels run on CPU tensors, one
program at a time, and nothing is benchmarked.

The package, one responsibility a module (each imports its siblings, never this file):

* ``env``: environment flags, the interpreter, the dispatch key, kernel paths;
* ``cuda``: device name and SM count, stream handle, graph capture, kept scratch, ``cdiv``;
* ``configs``: the YAML schema, validation and the file in use;
* ``tuned``: :class:`TunedKernel`, its config per shape bucket and autotuning;
* ``launch``: launches past Triton's launcher, kept per key (:class:`KeptKernel`);
* ``custom_op``: the "does a kernel take this call" predicates and :class:`CustomOp`;
* ``recording``: the tuner's recording of a workload's calls;
* ``plans``: call plans, decided once per signature and replayed;
* ``native``: the C++ replay of plans (``_launch.cpp`` and its ``_launch_*.h`` headers);
* ``state``: the state several of them share (the call being planned, blocks open).

This file re-exports what operator files, the registry, the tuner and tests use as
``runtime.<name>``.
"""

from gemslib.runtime.configs import (CONFIG_ENV, SCHEMA_VERSION, Bucket, Hardware,
                                     LaunchConfig, TuneConfigError, TuneConfigFile,
                                     active_configs, config_choice, config_path,
                                     current_hardware, fusion_verdict, ignoring_verdicts,
                                     load_tune_config, parse_launch_config, parse_tune_config,
                                     shipped_configs_dir, user_configs_dir, verdicts_ignored,
                                     within)
from gemslib.runtime.cuda import (captured, cdiv, current_stream_handle, device_name,
                                  multiprocessor_count, next_power_of_2, normalize_device_name,
                                  split_scratch)
from gemslib.runtime.custom_op import (INTERPRETER_BF16_DOT, KERNEL_DTYPES, CustomOp,
                                       dot_kernel_runs, kernel_runs, on_kernel_device,
                                       wants_custom_op)
from gemslib.runtime.env import (DEPENDENT_LAUNCH, DIRECT_LAUNCH, GRAPH_OVERLOADS, INTERPRETER,
                                 NATIVE_REPLAY, KernelPath, dependent_launch_here, device_type,
                                 dispatch_key, early_dependents_here, env_flag,
                                 quiet_interpreter)
from gemslib.runtime.launch import KeptKernel, launch_compiled, specialization_key, tensor_key
from gemslib.runtime.plans import (CallPlans, call_plan_counts, clear_call_plans,
                                   launched_outside_plans, native_replay_allowed, native_spec)
from gemslib.runtime.recording import RecordedCall, recording_calls
from gemslib.runtime.tuned import KERNELS, TunedKernel, reload_configs

__all__ = [
    "CONFIG_ENV", "SCHEMA_VERSION", "Bucket", "Hardware", "LaunchConfig", "TuneConfigError",
    "TuneConfigFile", "active_configs", "config_choice", "config_path", "current_hardware",
    "fusion_verdict", "ignoring_verdicts", "verdicts_ignored",
    "load_tune_config", "parse_launch_config", "parse_tune_config", "shipped_configs_dir",
    "user_configs_dir", "within",
    "captured", "cdiv", "current_stream_handle", "device_name", "multiprocessor_count",
    "next_power_of_2", "normalize_device_name", "split_scratch",
    "INTERPRETER_BF16_DOT", "KERNEL_DTYPES", "CustomOp", "dot_kernel_runs", "kernel_runs",
    "on_kernel_device", "wants_custom_op",
    "DEPENDENT_LAUNCH", "DIRECT_LAUNCH", "GRAPH_OVERLOADS", "INTERPRETER", "NATIVE_REPLAY",
    "KernelPath",
    "dependent_launch_here", "device_type", "dispatch_key", "early_dependents_here", "env_flag",
    "quiet_interpreter",
    "KeptKernel", "launch_compiled", "specialization_key", "tensor_key",
    "CallPlans", "call_plan_counts", "clear_call_plans", "launched_outside_plans",
    "native_replay_allowed", "native_spec",
    "RecordedCall", "recording_calls",
    "KERNELS", "TunedKernel", "reload_configs",
]
