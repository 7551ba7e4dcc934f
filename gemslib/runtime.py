"""Where gemslib kernels run and with which launch configurations.

Two backends share one code path:

* a CUDA GPU: kernels are compiled by Triton and get their launch configuration from
  ``tune_configs/<device>.yaml`` (e.g. ``nvidia_h200.yaml``), else ``default.yaml``;
* the Triton interpreter (``TRITON_INTERPRET=1``): the same kernels run on CPU tensors, one
  program at a time, and nothing is ever benchmarked (the first candidate config is used).

Config files (schema in ``tune_configs/README.md``) are validated when loaded; a malformed file
raises :class:`TuneConfigError` naming the file and the key. ``GEMSLIB_TUNE_CONFIG=path`` picks
a file explicitly. Each kernel is declared once as a :class:`TunedKernel`, which selects the
bucket matching a call's shape and launches with that bucket's fixed config, or with the best
of its candidates, measured once per (bucket, dtype, size class) on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
import yaml
from triton import knobs

log = logging.getLogger("gemslib")

CONFIG_ENV = "GEMSLIB_TUNE_CONFIG"
SCHEMA_VERSION = 1
_LAUNCH_KEYS = ("num_warps", "num_stages")


def env_flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "").strip().lower() in ("1", "true", "yes",
                                                                             "on")


# Triton decides at decoration time whether @triton.jit builds interpreted functions, so the
# mode is frozen when gemslib is imported, exactly like the kernels themselves.
INTERPRETER: bool = env_flag("TRITON_INTERPRET")


def device_type() -> str:
    """``"cpu"`` under the Triton interpreter, else ``"cuda"``."""
    return "cpu" if INTERPRETER else "cuda"


def dispatch_key() -> str:
    """The dispatch key gemslib overrides aten operators under: ``CPU`` or ``CUDA``."""
    return "CPU" if INTERPRETER else "CUDA"


@contextlib.contextmanager
def _quietly():
    import warnings

    import numpy

    with numpy.errstate(all="ignore"), warnings.catch_warnings():
        # Triton 3.6's interpreter indexes loops with one-element numpy arrays
        warnings.filterwarnings("ignore", "Conversion of an array with ndim > 0 to a scalar",
                                DeprecationWarning)
        yield


def quiet_interpreter():
    """Around interpreted launches: the interpreter computes in numpy, which warns where the
    kernels meet -inf, NaN or overflow on purpose (exp of a large shift, log2 of a zero sum,
    inf inputs), and Triton 3.6's interpreter trips a numpy DeprecationWarning itself; the
    results are the intended ones, as on a GPU, so those warnings would only reach user
    scripts as noise (or, under ``-W error``, fail the launch). A no-op on a GPU."""
    return _quietly() if INTERPRETER else contextlib.nullcontext()


class KernelPath:
    """An alternative kernel an operator takes where it applies (a Gluon kernel on sm_90, say),
    on by default. ``with path.switched_off():`` keeps the calls inside the block, whichever
    thread runs them (autograd's backward runs in its own), on the operator's Triton kernel: how
    tuning problems and benchmarks pick a path, instead of flipping a module flag."""

    def __init__(self, op: str, description: str):
        self.op, self.description = op, description
        self._switched_off = 0  # nesting depth of switched_off() blocks

    @property
    def on(self) -> bool:
        return not self._switched_off

    @contextlib.contextmanager
    def switched_off(self):
        self._switched_off += 1
        try:
            yield
        finally:
            self._switched_off -= 1

    def __repr__(self) -> str:
        return f"<gemslib kernel path {self.op}: {self.description}, {'on' if self.on else 'off'}>"


DIRECT_LAUNCH = KernelPath("every operator", "launches of a repeated call straight to the "
                           "compiled kernel, past Triton's argument binding")
NATIVE_REPLAY = KernelPath("every operator", "planned calls replayed in C++ (gemslib.native), "
                           "not by their generated Python")
# Programmatic dependent launch (sm_90 and later): a kernel built for it (TunedKernel's
# ``dependent_launch``) starts its blocks while the kernel before it on the stream finishes,
# and waits in griddepcontrol.wait before touching memory (0.6 us a boundary on the H200,
# NOTES). GEMSLIB_PDL=0 launches them plain
DEPENDENT_LAUNCH: bool = env_flag("GEMSLIB_PDL", default=True)


@functools.cache
def dependent_launch_here() -> bool:
    """Whether kernels built for it are launched dependent in this process: GEMSLIB_PDL not
    0, a real GPU, the current one of compute capability 9.0 or later."""
    return DEPENDENT_LAUNCH and not INTERPRETER and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() >= (9, 0)


_SCALARS = (int, float, bool, type(None))


def _descriptor_types() -> tuple[type, ...]:
    types = []
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
        types.append(GluonDescriptor)
    except ImportError:
        pass
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor as ToolsDescriptor
        types.append(ToolsDescriptor)
    except ImportError:
        pass
    return tuple(types)


_DESCRIPTORS = _descriptor_types()  # host-side TMA descriptors a kept launch may take


class _Address:
    """A data pointer standing for a tensor where Triton's launcher asks one for it."""
    __slots__ = ("pointer",)

    def __init__(self, pointer: int):
        self.pointer = pointer

    def data_ptr(self) -> int:
        return self.pointer


class _MapOn:
    """A tensor descriptor as a plan keeps it: all but its base (shape, strides, padding), and
    as a replay passes it, on the new base (what Triton's launcher reads of a descriptor)."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape: tuple, strides: tuple, padding: str):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding

    def at(self, pointer: int) -> "_MapOn":
        return _MapOn(_Address(pointer), self.shape, self.strides, self.padding)


def _launch_key(config, grid: tuple, args) -> tuple[tuple | None, list]:
    """(key, launch arguments) of a launch. The key is what its compiled kernel depends on:
    the config, the grid, each tensor's dtype and 16-byte alignment, and every other argument
    by type and value (Triton specialises integers on being 1 and on divisibility by 16, so
    the value covers it); None where an argument is neither a tensor nor a plain number (a
    TMA descriptor, say): such launches go through Triton every time. The launch arguments
    are ``args`` with each tensor's data pointer in its place (the compiled launcher takes a
    pointer as an integer without asking the driver about it). One pass: this runs on every
    launch."""
    key = [config, grid]
    pointers = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            pointer = arg.data_ptr()
            key.append(arg.dtype)
            key.append(not pointer & 15)
            pointers.append(pointer)
        elif type(arg) in _SCALARS:
            key.append(type(arg))
            key.append(arg)
            pointers.append(arg)
        else:
            return None, pointers
    return tuple(key), pointers


def specialization_key(values) -> tuple:
    """What a compiled kernel depends on of these non-constexpr scalar arguments, as Triton
    specialises them: an int by being 1 (then compiled in), by divisibility by 16 and by
    fitting int32; a float or bool by its type. For a kept launch whose kernel reads none of
    them in a heuristic (which would see the values)."""
    return tuple((int, value == 1, value % 16 == 0, -2**31 <= value < 2**31)
                 if type(value) is int else type(value) for value in values)


def tensor_key(tensors) -> tuple[tuple, list]:
    """(what Triton specialises each tensor on: its dtype and 16-byte alignment, the tensors'
    data pointers), ``None`` entries staying None, for a caller that keys the rest itself."""
    key, pointers = [], []
    for t in tensors:
        if t is None:
            key.append(None)
            pointers.append(None)
        else:
            pointer = t.data_ptr()
            key.append((t.dtype, not pointer & 15))
            pointers.append(pointer)
    return tuple(key), pointers


def launch_compiled(compiled: tuple, stream: int, launch_args) -> None:
    """Launch a kept compiled kernel (:func:`_compiled_launch`'s ``(launcher, grid, function,
    cooperative, pdl, metadata, constexprs, parameter types, descriptor metadata)``) on
    ``stream``: the tensors in ``launch_args``
    as data pointers, the constexprs after them, no launch hooks."""
    launch, grid3, function, cooperative, pdl, metadata, constexprs, _, _ = compiled
    launch(*grid3, stream, function, cooperative, pdl, None, None, metadata, None, None, None,
           *launch_args, *constexprs)


def _hooked(hook) -> bool:
    """A Triton launch hook that does something (Triton's default is an empty chain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooked() -> bool:
    """Either Triton launch hook does something (a profiler wants to see the launches)."""
    hooks = knobs.runtime
    return _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook)


class _Opaque:
    """Stands for a tensor when a heuristic is evaluated for the direct path: a heuristic that
    reads a tensor depends on more than the launch key, and then the launch is not kept."""

    def __getattr__(self, name):
        raise _ReadsATensor

    def __index__(self):
        raise _ReadsATensor


class _ReadsATensor(Exception):
    pass


def _compiled_launch(fn, kernel, grid, args, kwargs) -> tuple | None:
    """What :func:`launch_compiled` needs to launch ``kernel`` (the compiled kernel of
    ``fn[grid](*args, **kwargs)``) again without Triton: its launcher, the grid, the handle,
    the launch flags and metadata, the constexprs after ``args`` (every one must come from
    ``kwargs`` or a heuristic of them: a default left to Triton would be missing), the
    parameter types and the tensor descriptors' metadata. None where the kernel cannot be
    launched so (it needs scratch memory, which Triton's wrapper allocates per launch)."""
    heuristics = _heuristic_values(fn, args, kwargs)
    if heuristics is None:
        return None
    jitted, values = heuristics
    rest = jitted.arg_names[len(args):]
    if not all(name in values for name in rest):
        return None
    kernel._init_handles()
    launcher = kernel.run
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None  # scratch is allocated per launch by Triton's wrapper (or a launcher unknown)
    return (launcher.launch, (*grid, 1, 1)[:3], kernel.function,
            launcher.launch_cooperative_grid, launcher.launch_pdl, kernel.packed_metadata,
            tuple(values[name] for name in rest), _parameter_types(kernel),
            getattr(getattr(kernel, "metadata", None), "tensordesc_meta", None))


def _launch_kept(kept: dict, key: tuple, fn, grid, args, kwargs: Callable[[], dict],
                 launch_args) -> None:
    """``fn[grid](*args, **kwargs())`` by way of ``kept`` (key and device -> what
    :func:`_compiled_launch` gives): the first launch of a key, or any with a launch hook
    installed, goes through Triton (keeping the compiled kernel); the others go straight to
    the compiled launcher with ``launch_args`` on the current stream, and a call being planned
    records them."""
    device = torch.cuda.current_device()
    compiled = kept.get((key, device))
    if compiled is None or _launch_hooked():
        _not_plannable()
        kernel_kwargs = kwargs()
        kernel = fn[grid](*args, **kernel_kwargs)
        if compiled is None and len(kept) < 1024:
            compiled = _compiled_launch(fn, kernel, grid, args, kernel_kwargs)
            if compiled is not None:
                kept[key, device] = compiled
        return
    launch_compiled(compiled, current_stream_handle(device), launch_args)
    planning = _planning.launches
    if planning is not None:
        planning.append((compiled, args, launch_args))


def _parameter_types(kernel) -> tuple | None:
    """The Triton types of a compiled kernel's parameters, one per argument in order
    (``"constexpr"`` for those compiled in), or None where the kernel does not say."""
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    return tuple(signature.values()) if isinstance(signature, dict) else None


def _heuristic_values(fn, args, kwargs: dict) -> tuple[Any, dict] | None:
    """(the jitted function under ``fn``'s ``triton.heuristics`` layers, kwargs with their
    values) as Triton's Heuristics.run computes them, tensors opaque; None where a heuristic
    reads a tensor."""
    from triton.runtime.autotuner import Heuristics

    kwargs = dict(kwargs)
    while isinstance(fn, Heuristics):
        named = {name: (_Opaque() if isinstance(arg, torch.Tensor) else arg)
                 for name, arg in zip(fn.arg_names, args)}
        try:
            for name, heuristic in fn.values.items():
                kwargs[name] = heuristic({**named, **kwargs})
        except _ReadsATensor:
            return None
        fn = fn.fn
    return fn, kwargs


def on_kernel_device(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives where the kernels can run (CUDA, or CPU when interpreted)."""
    return tensor.is_cpu if INTERPRETER else tensor.is_cuda  # attributes: cheap on the hot path


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def kernel_runs(*tensors: torch.Tensor | None) -> bool:
    """The Triton kernels take these tensors (``None`` entries ignored): a kernel dtype, on the
    kernel device. Anything else is computed by torch."""
    for t in tensors:  # a plain loop: this runs on every call
        if t is not None and (t.dtype not in KERNEL_DTYPES or not on_kernel_device(t)):
            return False
    return True


# Triton 3.6's interpreter computes tl.dot on bf16 operands wrongly (it multiplies the raw bit
# patterns), so under the interpreter bf16 calls of the dot-product kernels go to torch. Tests
# that only record launches (to compile them for sm_90) switch this on.
interpret_bf16_dots = False


def dot_kernel_runs(*tensors: torch.Tensor | None) -> bool:
    """:func:`kernel_runs` for kernels built on ``tl.dot``: also False for bf16 tensors under
    the interpreter (see ``interpret_bf16_dots``)."""
    if not kernel_runs(*tensors):
        return False
    return not INTERPRETER or interpret_bf16_dots or all(
        t is None or t.dtype != torch.bfloat16 for t in tensors)


INTERPRETER_BF16_DOT = "bf16 under the Triton interpreter (its bf16 tl.dot is wrong)"


def wants_custom_op(*tensors: torch.Tensor | None) -> bool:
    """Route a public call through its ``torch.ops.gemslib`` op, because autograd or
    torch.compile has to see it; otherwise the launcher is called directly (less host time)."""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return torch.compiler.is_compiling()


class CustomOp:
    """One operator of ``torch.ops.gemslib``, defined once from its pieces.

    ``impl`` computes it (tensors in, tensors out) and ``fake`` gives its outputs' shapes and
    dtypes for tracing; with ``backward`` it is differentiable, and :meth:`__call__` runs it
    the way the caller's context needs:

    * while torch.compile traces, the custom op (``register_fake`` + ``register_autograd``), so
      the graph holds ``torch.ops.gemslib.<name>`` and its backward op;
    * otherwise an eager ``torch.autograd.Function`` with the same ``impl``, ``setup_context``
      and ``backward``: the custom op's Python dispatch costs 150-200 us of host time per
      forward + backward even on a fast host, more than the kernels at most sizes.

    ``setup_context(ctx, inputs, output)`` saves what the backward needs (register_autograd's
    form). ``backward(ctx, *grads, ops)`` returns one gradient per input; ``ops`` holds the
    operators named in ``uses`` (and this one), by name, each as the graph needs it: under
    torch.compile their custom ops, in eager mode their ``impl`` (no dispatch), or their eager
    Functions when ``differentiable_backward``.

    Unless ``differentiable_backward`` (the backward is built from differentiable calls), an
    eager backward with ``create_graph=True`` raises instead of giving second derivatives that
    silently miss this operation.
    """

    def __init__(self, name: str, impl: Callable, fake: Callable, *,
                 mutates_args: Sequence[str] = (), setup_context: Callable | None = None,
                 backward: Callable | None = None, uses: Sequence[CustomOp] = (),
                 differentiable_backward: bool = False):
        self.name, self.impl = name, impl
        self.op = torch.library.custom_op(f"gemslib::{name}",
                                          _recordable(name, impl, bool(mutates_args)),
                                          mutates_args=mutates_args)
        self.op.register_fake(fake)
        self.eager_function: type[torch.autograd.Function] | None = None
        if backward is None:
            return
        operators = (self, *uses)
        traced = _OpCalls({o.name: o.op for o in operators})
        # eager: a differentiable backward calls differentiable operators (this one's Function
        # exists once __init__ returns, hence _apply); any other calls the bare implementations
        eager = _OpCalls({
            o.name: o._apply if differentiable_backward and (o is self or o.eager_function)
            else o.impl for o in operators})
        self.op.register_autograd(functools.partial(backward, ops=traced),
                                  setup_context=setup_context)
        self.eager_function = _eager_function(
            self.function_name, impl, setup_context, functools.partial(backward, ops=eager),
            differentiable_backward)

    @property
    def function_name(self) -> str:
        """The eager Function's name (what ``grad_fn`` shows): ``silu_and_mul`` ->
        ``SiluAndMulFunction``."""
        return "".join(part.capitalize() for part in self.name.split("_")) + "Function"

    def _apply(self, *args):
        return self.eager_function.apply(*args)

    def __call__(self, *args):
        if self.eager_function is None or torch.compiler.is_compiling():
            return self.op(*args)
        return self.eager_function.apply(*args)


class _OpCalls:
    """The operators a backward calls, as attributes (``ops.silu_backward(grad, x)``)."""

    def __init__(self, calls: Mapping[str, Callable]):
        self.__dict__.update(calls)


def _eager_function(name: str, forward: Callable, setup_context: Callable, backward: Callable,
                    differentiable_backward: bool) -> type[torch.autograd.Function]:
    if not differentiable_backward:
        first_order = backward

        def backward(ctx, *grads):
            if torch.is_grad_enabled():  # autograd enables grad in backward only for create_graph
                raise RuntimeError(f"gemslib: {name} has no second derivative (a backward with "
                                   "create_graph=True went through it)")
            return first_order(ctx, *grads)

    def forward_and_setup(ctx, *args):
        # the older forward(ctx, ...) form: Function.apply binds default arguments with
        # inspect.signature on every call when setup_context is separate (about 50 us)
        output = forward(*args)
        setup_context(ctx, args, output)
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward_and_setup), "backward": staticmethod(backward)})


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device_index: int) -> int:
    """SMs of a CUDA device, for grids sized to fill it (1 under the interpreter, which runs
    one program at a time)."""
    if INTERPRETER:
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def current_stream_handle(device_index: int | None) -> int:
    """The raw handle of the current CUDA stream (what Triton launches on), without building a
    ``torch.cuda.Stream`` object: this runs on decode's hot path."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:  # not exposed by this torch build
        return torch.cuda.current_stream(device_index).cuda_stream
    return getter(torch.cuda.current_device() if device_index is None else device_index)


_split_scratch_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def captured(fn: Callable[[], Any], warmup_calls: int = 2) -> tuple[Any, Any]:
    """(a CUDA graph of one ``fn()`` call, what that call returned): ``warmup_calls`` calls
    first, on a side stream as torch asks, so every kernel is compiled and tuned and every
    call plan made before the capture. Replays rewrite the returned tensors' memory; the
    caller keeps them (and ``fn``'s inputs) alive as long as the graph. Raises what the
    capture raises (a call that synchronises with the host, say)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def split_scratch(device: torch.device, n_counters: int, n_floats: int,
                  stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(arrivals, parts) for a launch whose programs split a reduction and merge it in the last
    program to arrive: ``n_counters`` zeroed int32 counters and ``n_floats`` fp32 of room for
    the partial results. Kept per device, stream and size and reused: launches on one stream
    run in order, the merging program puts its counter back to 0, and every launch writes its
    parts before reading them, so a decode step allocates and clears nothing (kernels of
    different operators may share them). While a CUDA graph is being captured, fresh ones that
    belong to the graph; kept ones never come from a graph's memory pool (see
    :func:`_outside_graph_pools`). ``stream``: the current stream's handle, where the caller
    has it already."""
    def make():
        return (torch.zeros(n_counters, dtype=torch.int32, device=device),
                torch.empty(n_floats, dtype=torch.float32, device=device))

    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return make()
    if stream is None:
        stream = current_stream_handle(device.index) if cuda else 0
    key = (device.type, device.index, stream, n_counters, n_floats)
    scratch = _split_scratch_cache.get(key)
    if scratch is None:
        if len(_split_scratch_cache) >= 64:  # later work may reuse the memory
            if cuda:
                torch.cuda.synchronize()  # no kernel still uses what is dropped
            _split_scratch_cache.clear()
        scratch = _outside_graph_pools(device, make) if cuda else make()
        _split_scratch_cache[key] = scratch
    return scratch


def _outside_graph_pools(device: torch.device, make: Callable):
    """``make()`` run on a thread of its own, its stream synchronised (the zeroing done before
    any other stream reads the tensors): memory kept across calls must not come from a CUDA
    graph's private pool, and torch.compile's CUDA-graph trees route every allocation of the
    thread that warms a graph up to that pool (and then check that the pool holds nothing but
    the graphs' outputs)."""
    made: list = []

    def run():
        try:
            with torch.cuda.device(device):
                made.append(make())
                torch.cuda.current_stream().synchronize()
        except BaseException as err:  # raised again in the caller's thread
            made.append(err)

    worker = threading.Thread(target=run, name="gemslib-scratch")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def next_power_of_2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (Triton's is a constexpr function: slow from Python);
    1 for n <= 1."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a jit function: ~10 us per call from Python)."""
    return -(-a // b)


def normalize_device_name(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"``: lower case, runs of other characters -> ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def device_name() -> str:
    """Normalized name of the current device, ``"interpreter"``, or ``"no_gpu"``.

    Initialises CUDA, so it is only called when a kernel is about to run.
    """
    if INTERPRETER:
        return "interpreter"
    if not torch.cuda.is_available():
        return "no_gpu"
    return normalize_device_name(torch.cuda.get_device_name())


# --------------------------------------------------------------------------------------------
# Config files
# --------------------------------------------------------------------------------------------


class TuneConfigError(ValueError):
    """A tune-config file is malformed or does not fit the kernel it configures."""


@dataclass(frozen=True)
class LaunchConfig:
    """Meta-parameters (constexpr block sizes) plus Triton's launch options."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 1

    @functools.cached_property
    def meta_dict(self) -> dict[str, int]:
        return dict(self.meta)

    @functools.cached_property
    def launch_kwargs(self) -> dict[str, int]:
        """What the Triton launch takes: meta-parameters plus num_warps and num_stages."""
        return {**self.meta_dict, "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class Bucket:
    """Configs for the calls whose shape keys are all <= ``max`` (``None``: every call)."""

    max: Mapping[str, int] | None
    configs: tuple[LaunchConfig, ...]
    autotune: bool
    where: str  # "file: ops.silu.silu_fwd[0]", for error messages

    def matches(self, shape: Mapping[str, int]) -> bool:
        return within(self.max, shape)


def within(bound: Mapping[str, int] | None, shape: Mapping[str, int]) -> bool:
    """Whether a bucket's ``max`` admits the call: ``shape[key] <= bound[key]`` for every key
    of ``bound`` (``None``: no bound, every call)."""
    return bound is None or all(shape[k] <= v for k, v in bound.items())


@dataclass(frozen=True)
class TuneConfigFile:
    path: Path
    device: str
    ops: Mapping[str, Mapping[str, tuple[Bucket, ...]]]


def _fail(path: Path, where: str, message: str) -> TuneConfigError:
    return TuneConfigError(f"tune config {path}: {where}: {message}")


def _positive_int(path: Path, where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _fail(path, where, f"expected {kind}, got {value!r}")
    return value


def parse_launch_config(path: Path, where: str, raw: Any) -> LaunchConfig:
    """One config (a mapping of meta-parameters, num_warps, num_stages), validated; errors
    name ``path`` and ``where``."""
    if not isinstance(raw, dict) or not raw:
        raise _fail(path, where, f"expected a mapping of parameters, got {raw!r}")
    meta = []
    for key, value in raw.items():
        if not isinstance(key, str):
            raise _fail(path, where, f"parameter names must be strings, got {key!r}")
        # meta-parameters may be 0 (a kernel's way to say "off", e.g. softmax_split_fwd CHUNK)
        _positive_int(path, f"{where}.{key}", value, minimum=1 if key in _LAUNCH_KEYS else 0)
        if key not in _LAUNCH_KEYS:
            meta.append((key, value))
    num_warps = raw.get("num_warps", 4)
    if num_warps & (num_warps - 1) or num_warps > 32:
        raise _fail(path, f"{where}.num_warps", f"expected a power of two <= 32, got {num_warps}")
    return LaunchConfig(meta=tuple(sorted(meta)), num_warps=num_warps,
                        num_stages=raw.get("num_stages", 1))


def _parse_bucket(path: Path, where: str, raw: Any) -> Bucket:
    if not isinstance(raw, dict):
        raise _fail(path, where, f"expected a mapping with 'config' or 'autotune', got {raw!r}")
    unknown = set(raw) - {"max", "config", "autotune"}
    if unknown:
        raise _fail(path, where, f"unknown keys {sorted(unknown)} (allowed: max, config, autotune)")
    if ("config" in raw) == ("autotune" in raw):
        raise _fail(path, where, "needs exactly one of 'config' (fixed) or 'autotune' (candidates)")
    bound = None
    if "max" in raw:
        if not isinstance(raw["max"], dict) or not raw["max"]:
            raise _fail(path, f"{where}.max", f"expected a mapping of shape keys, got {raw['max']!r}")
        bound = {k: _positive_int(path, f"{where}.max.{k}", v, minimum=0)  # 0: a flag off
                 for k, v in raw["max"].items()}
    if "config" in raw:
        configs = (parse_launch_config(path, f"{where}.config", raw["config"]),)
    else:
        candidates = raw["autotune"]
        if not isinstance(candidates, list) or not candidates:
            raise _fail(path, f"{where}.autotune", "expected a non-empty list of configs")
        configs = tuple(parse_launch_config(path, f"{where}.autotune[{i}]", c)
                        for i, c in enumerate(candidates))
    return Bucket(max=bound, configs=configs, autotune="autotune" in raw, where=f"{path}: {where}")


def parse_tune_config(path: Path, data: Any) -> TuneConfigFile:
    """Validate the YAML document ``data`` read from ``path``; see tune_configs/README.md."""
    if not isinstance(data, dict):
        raise _fail(path, "<top level>", f"expected a mapping, got {type(data).__name__}")
    for key in ("schema", "device", "ops"):
        if key not in data:
            raise _fail(path, key, "missing")
    unknown = set(data) - {"schema", "device", "source", "tuned", "ops"}
    if unknown:
        raise _fail(path, "<top level>", f"unknown keys {sorted(unknown)}")
    if data["schema"] != SCHEMA_VERSION:
        raise _fail(path, "schema", f"expected {SCHEMA_VERSION}, got {data['schema']!r}")
    if "tuned" in data and not isinstance(data["tuned"], dict):
        raise _fail(path, "tuned", f"expected a mapping (gpu, torch, triton, date, ...), got "
                                   f"{data['tuned']!r}")
    if not isinstance(data["device"], str):
        raise _fail(path, "device", f"expected a string, got {data['device']!r}")
    if not isinstance(data["ops"], dict):
        raise _fail(path, "ops", f"expected a mapping of operators, got {data['ops']!r}")
    ops: dict[str, dict[str, tuple[Bucket, ...]]] = {}
    for op, kernels in data["ops"].items():
        if not isinstance(kernels, dict):
            raise _fail(path, f"ops.{op}", f"expected a mapping of kernels, got {kernels!r}")
        ops[op] = {}
        for kernel, buckets in kernels.items():
            where = f"ops.{op}.{kernel}"
            if not isinstance(buckets, list) or not buckets:
                raise _fail(path, where, "expected a non-empty list of buckets")
            parsed = tuple(_parse_bucket(path, f"{where}[{i}]", b) for i, b in enumerate(buckets))
            if parsed[-1].max is not None:
                raise _fail(path, f"{where}[{len(parsed) - 1}]",
                            "the last bucket must have no 'max' so that every shape has a config")
            ops[op][kernel] = parsed
    return TuneConfigFile(path=path, device=data["device"], ops=ops)


def load_tune_config(path: str | os.PathLike) -> TuneConfigFile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TuneConfigError(f"tune config {path}: cannot read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TuneConfigError(f"tune config {path}: not valid YAML: {err}") from None
    return parse_tune_config(path, data)


def shipped_configs_dir() -> Path:
    from gemslib import tune_configs

    return Path(tune_configs.__file__).parent


_config_lock = threading.Lock()
_active: tuple[TuneConfigFile, TuneConfigFile] | None = None


def config_path() -> Path:
    """The file in use: ``$GEMSLIB_TUNE_CONFIG``, else ``<device>.yaml``, else ``default.yaml``."""
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(explicit)
    candidate = shipped_configs_dir() / f"{device_name()}.yaml"
    return candidate if candidate.is_file() else shipped_configs_dir() / "default.yaml"


def active_configs() -> tuple[TuneConfigFile, TuneConfigFile]:
    """(file in use, default.yaml); a kernel missing from the first is looked up in the second."""
    global _active
    with _config_lock:
        if _active is None:
            selected = load_tune_config(config_path())
            default_path = shipped_configs_dir() / "default.yaml"
            default = selected if selected.path == default_path else load_tune_config(default_path)
            _active = (selected, default)
        return _active


def reload_configs() -> None:
    """Forget loaded files and chosen configs (after changing ``GEMSLIB_TUNE_CONFIG``)."""
    global _active
    with _config_lock:
        _active = None
    for kernel in KERNELS.values():
        kernel.clear_cache()


# --------------------------------------------------------------------------------------------
# Kernels with tuned launch configs
# --------------------------------------------------------------------------------------------

KERNELS: dict[str, "TunedKernel"] = {}

class TunedKernel:
    """A Triton kernel whose constexpr ``tunables`` and launch options come from the config files.

    ``launcher_knobs`` are config keys the launcher reads (in ``grid(meta)`` and its plan) that
    are not kernel parameters: they are not passed to the kernel, so they do not specialise its
    compilation. A config holds exactly ``tunables`` plus ``launcher_knobs``.

    ``shape_keys`` name the sizes a launcher passes to :meth:`launch`; buckets in the YAML are
    bounded by those names. The entry for kernel ``name`` of operator ``op`` lives under
    ``ops.<op>.<name>`` in the config file.

    ``cluster_knob``: the launcher knob whose value is the number of CTAs in a thread-block
    cluster (Triton's ``num_ctas`` compile option), for kernels written for clusters.

    ``device_asserts``: the kernel's ``tl.device_assert`` checks of its inputs' values (which
    Triton compiles only in debug mode) are compiled in, without debug mode's integer-overflow
    checks. A failed one stops the kernel with a device-side assert, which torch reports at
    the next synchronisation (and which leaves the CUDA context unusable, as torch's own do).

    ``dependent_launch``: the kernel has a ``PDL`` constexpr and, where it is set, calls
    ``gdc_wait()`` before its first load or store; :func:`dependent_launch_here` says whether
    it is then set and the kernel launched with Triton's ``launch_pdl``.
    """

    def __init__(self, op: str, name: str, fn, tunables: Sequence[str], shape_keys: Sequence[str],
                 launcher_knobs: Sequence[str] = (), cluster_knob: str | None = None,
                 device_asserts: bool = False, dependent_launch: bool = False):
        self.op, self.name, self.fn = op, name, fn
        self.launcher_knobs = frozenset(launcher_knobs)
        if cluster_knob is not None and cluster_knob not in self.launcher_knobs:
            raise ValueError(f"{name}: cluster_knob {cluster_knob!r} must be one of the "
                             f"launcher_knobs {sorted(self.launcher_knobs)}")
        self.cluster_knob = cluster_knob
        self.tunables = frozenset(tunables) | self.launcher_knobs  # every key of a config
        self.shape_keys = tuple(shape_keys)
        self.options = {"debug": True, "sanitize_overflow": False} if device_asserts else {}
        self.dependent_launch = dependent_launch
        self._chosen: dict[tuple, LaunchConfig] = {}
        self._checked: set[str] = set()
        self._forced: LaunchConfig | None = None
        self._recording: list[tuple[int, ...]] | None = None  # shapes seen inside forced()
        self._kernel_kwargs: dict[LaunchConfig, dict[str, int]] = {}
        self._compiled: dict[tuple, tuple] = {}  # replay key -> (launcher, constexprs)
        KERNELS[f"{op}.{name}"] = self

    def clear_cache(self) -> None:
        clear_call_plans()
        self._chosen.clear()
        self._checked.clear()
        self._kernel_kwargs.clear()
        self._compiled.clear()

    @contextlib.contextmanager
    def forced(self, config: LaunchConfig):
        """Launch every call with ``config`` inside the block (for sweeps and the tuner).

        Yields a list that collects the shapes (in ``shape_keys`` order) of the calls made in
        the block, launched or planned, in order: how the tuner learns which bucket a problem
        reaches, even when ``config`` cannot run there."""
        names = set(config.meta_dict)
        if names != self.tunables:
            raise ValueError(f"{self.name}: config parameters {sorted(names)} do not match the "
                             f"kernel's tunables {sorted(self.tunables)}")
        global _forcing
        previous, self._forced = self._forced, config
        outer, self._recording = self._recording, []
        _forcing += 1
        try:
            yield self._recording
        finally:
            _forcing -= 1
            self._forced, self._recording = previous, outer

    def buckets(self) -> tuple[Bucket, ...]:
        for config_file in active_configs():
            buckets = config_file.ops.get(self.op, {}).get(self.name)
            if buckets is not None:
                return buckets
        selected, default = active_configs()
        raise TuneConfigError(f"no launch config for ops.{self.op}.{self.name} in "
                              f"{selected.path} or {default.path}")

    def _check_bucket(self, bucket: Bucket) -> None:
        if bucket.where in self._checked:
            return
        if bucket.max is not None:
            unknown = set(bucket.max) - set(self.shape_keys)
            if unknown:
                raise TuneConfigError(f"tune config {bucket.where}.max: unknown shape keys "
                                      f"{sorted(unknown)} (kernel {self.name} has {list(self.shape_keys)})")
        for config in bucket.configs:
            names = set(config.meta_dict)
            if names != self.tunables:
                raise TuneConfigError(
                    f"tune config {bucket.where}: parameters {sorted(names)} do not match kernel "
                    f"{self.name}'s tunables {sorted(self.tunables)}")
        self._checked.add(bucket.where)

    def select(self, shape: Sequence[int]) -> tuple[int, Bucket]:
        """The first bucket whose bounds admit ``shape`` (given in ``shape_keys`` order)."""
        named = dict(zip(self.shape_keys, shape))
        for index, bucket in enumerate(self.buckets()):
            self._check_bucket(bucket)
            if bucket.matches(named):
                return index, bucket
        raise AssertionError("unreachable: the last bucket has no bound")

    def launch(self, grid: Callable[[dict], tuple], *args, shape: Sequence[int],
               restore: Sequence[torch.Tensor] = (), config: LaunchConfig | None = None) -> None:
        """Launch on ``grid(meta)`` with the config chosen for ``shape``.

        ``restore`` lists tensors the kernel overwrites that are also inputs (in-place calls):
        they are saved and restored around autotuning runs. ``config`` forces a config (tuner).
        """
        if _workload is not None:
            _workload.launches.append((self, tuple(int(size) for size in shape)))
        if config is None:
            config = self._forced
            if config is not None:
                self._recording.append(tuple(shape))
        if config is None:
            key = tuple(shape)
            config = self._chosen.get(key)
            if config is None:
                config = self._choose(grid, args, shape, restore)
                if len(self._chosen) < 4096:
                    self._chosen[key] = config
        if DIRECT_LAUNCH.on and not INTERPRETER:
            grid_size = tuple(grid(config.meta_dict))
            key, launch_args = _launch_key(config, grid_size, args)
            if key is not None:
                self.replay(key, config, grid_size, args, launch_args)
                return
        self.run(config, grid, args)

    def planned_config(self, shape: Sequence[int]) -> LaunchConfig:
        """The config a call of ``shape`` runs with when the bucket has one (or one is forced);
        for an autotuned bucket, its first candidate (the choice is made at launch)."""
        if _workload is not None:  # a call routed by its config may launch nothing of ours
            _workload.launches.append((self, tuple(int(size) for size in shape)))
        if self._forced is not None:
            self._recording.append(tuple(shape))
            return self._forced
        key = ("planned", *shape)
        config = self._chosen.get(key)
        if config is None:
            config = self.select(shape)[1].configs[0]
            if len(self._chosen) < 4096:
                self._chosen[key] = config
        return config

    def config_for(self, shape: Sequence[int]) -> LaunchConfig | None:
        """The config a call of ``shape`` would use, if already decided (for reports)."""
        return self._forced or self._chosen.get(tuple(shape))

    def kernel_kwargs(self, config: LaunchConfig) -> dict[str, int]:
        """What the kernel's launch takes from ``config``: its constexprs (the launcher's knobs
        left out), num_warps, num_stages, num_ctas (from ``cluster_knob``) and the kernel's
        compile options."""
        kwargs = self._kernel_kwargs.get(config)
        if kwargs is None:
            kwargs = {key: value for key, value in config.launch_kwargs.items()
                      if key not in self.launcher_knobs}
            if self.cluster_knob is not None:
                kwargs["num_ctas"] = config.meta_dict[self.cluster_knob]
            kwargs.update(self.options)
            if self.dependent_launch:
                kwargs["PDL"] = dependent_launch_here()
                if kwargs["PDL"]:
                    kwargs["launch_pdl"] = True
            if len(self._kernel_kwargs) < 4096:
                self._kernel_kwargs[config] = kwargs
        return kwargs

    def run(self, config: LaunchConfig, grid, args) -> None:
        _not_plannable()
        if INTERPRETER:
            with quiet_interpreter():
                self.fn[grid(config.meta_dict)](*args, **self.kernel_kwargs(config))
            return
        self.fn[grid(config.meta_dict)](*args, **self.kernel_kwargs(config))

    def replay(self, key: tuple, config: LaunchConfig, grid: tuple[int, ...], args,
               launch_args) -> None:
        """:meth:`run` for a launch that repeats every step with new tensors (decode).

        ``key`` determines the config, the grid, every argument that is not a tensor and each
        tensor's dtype and alignment, and ``launch_args`` are ``args`` with the tensors' data
        pointers in their place (:func:`_launch_key` makes both; :func:`tensor_key` gives the
        tensors' part). The first call with a key goes through Triton and keeps the compiled
        kernel; later calls hand it to the compiled launcher directly on the current stream,
        skipping Triton's argument binding, heuristics, cache lookup and launcher wrapper,
        which are most of a small launch's host time. Kept only where every parameter after
        ``args`` is a constexpr the config or a heuristic of the key's values gives (a
        default left to Triton would be missing from the direct launch) and the kernel needs
        no scratch memory; with a launch hook installed (a profiler), Triton's own launch
        runs, so the hook sees it.
        """
        if INTERPRETER:
            self.run(config, lambda meta: grid, args)
            return
        _launch_kept(self._compiled, key, self.fn, grid, args, lambda: self.kernel_kwargs(config),
                     launch_args)

    def _choose(self, grid, args, shape, restore) -> LaunchConfig:
        index, bucket = self.select(shape)
        if not bucket.autotune or len(bucket.configs) == 1 or INTERPRETER:
            return bucket.configs[0]
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        size_class = tuple(1 << max(int(s) - 1, 0).bit_length() for s in shape)
        key = ("autotune", index, dtypes, size_class)
        if key not in self._chosen:
            self._chosen[key] = self._autotune(bucket, grid, args, restore)
        return self._chosen[key]

    def _autotune(self, bucket: Bucket, grid, args, restore) -> LaunchConfig:
        import triton.testing

        saved = [t.clone() for t in restore]
        timings = []
        for config in bucket.configs:
            try:
                ms = triton.testing.do_bench(lambda: self.run(config, grid, args),
                                             warmup=5, rep=25, return_mode="median")
            except Exception as err:  # a candidate that does not compile (resources) is skipped
                log.debug("gemslib autotune %s: %s failed: %s", self.name, config, err)
                continue
            finally:
                for tensor, copy in zip(restore, saved):
                    tensor.copy_(copy)
            timings.append((ms, config))
        if not timings:
            raise RuntimeError(f"gemslib: no candidate config of {bucket.where} runs on this GPU")
        best = min(timings, key=lambda item: item[0])[1]
        log.debug("gemslib autotune %s: picked %s", self.name, best.launch_kwargs)
        return best


# --------------------------------------------------------------------------------------------
# A workload's calls, recorded for the tuner (python -m gemslib.tune --model)
# --------------------------------------------------------------------------------------------


class KeptKernel:
    """A kernel with fixed constexprs launched outside :class:`TunedKernel` (a Gluon kernel
    that takes tensor descriptors): its first launch per key goes through Triton and keeps
    the compiled kernel; later ones go straight to the compiled launcher, and a call being
    planned records them, its descriptors as tensor maps on the call's tensors (a plan
    encodes them again on the new tensors). The key: the grid, the constexprs and launch
    options, each tensor's dtype and 16-byte alignment, each descriptor's dtype, block,
    layout, padding and base alignment, and every other argument by type and value."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict[tuple, tuple] = {}

    def launch(self, grid: tuple, args: tuple, constexprs: Mapping[str, Any], **options) -> None:
        """``fn[grid](*args, **constexprs, **options)``, kept as above."""
        key, launch_args = self._key(grid, args, constexprs, options)
        if INTERPRETER or key is None:
            _not_plannable()
            self.fn[grid](*args, **constexprs, **options)
            return
        if DIRECT_LAUNCH._switched_off:
            _not_plannable()
            self.fn[grid](*args, **constexprs, **options)
            return
        _launch_kept(self._compiled, key, self.fn, grid, args, lambda: {**constexprs, **options},
                     launch_args)

    @staticmethod
    def _key(grid, args, constexprs, options) -> tuple[tuple | None, list]:
        key = [tuple(grid), tuple(constexprs.items()), tuple(options.items())]
        launch_args = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                pointer = arg.data_ptr()
                key.append((arg.dtype, not pointer & 15))
                launch_args.append(pointer)
            elif isinstance(arg, _DESCRIPTORS):
                base = arg.base
                key.append((type(arg), base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None),
                            arg.padding, not base.data_ptr() & 15))
                launch_args.append(arg)  # Triton's launcher makes its tensor map
            elif type(arg) in _SCALARS:
                key.append((type(arg), arg))
                launch_args.append(arg)
            else:
                return None, launch_args
        return tuple(key), launch_args


@dataclass
class RecordedCall:
    """One custom-op call that launched ``kernel`` at ``shape``, kept to be run again: ``run()``
    calls the op's implementation on copies of the arguments it was called with (fresh copies
    each time for an op that writes into its inputs)."""
    op: str
    kernel: "TunedKernel"
    shape: tuple[int, ...]
    impl: Callable
    args: tuple
    kwargs: dict
    mutates: bool

    def run(self):
        args, kwargs = (_copied((self.args, self.kwargs)) if self.mutates
                        else (self.args, self.kwargs))
        return self.impl(*args, **kwargs)


class _Workload:
    def __init__(self):
        self.launches: list[tuple[TunedKernel, tuple[int, ...]]] = []
        self.calls: dict[tuple[str, tuple[int, ...]], RecordedCall] = {}


_workload: _Workload | None = None


@contextlib.contextmanager
def recording_calls():
    """Record, inside the block, the first custom-op call (through ``torch.ops.gemslib``, as a
    compiled graph makes them) that launches each (tuned kernel, shape): yields a dict
    ``{(kernel's "op.name", shape): RecordedCall}`` that fills as the block runs. Call plans
    are off meanwhile, so every launch is seen."""
    global _workload, _forcing
    outer, _workload = _workload, _Workload()
    _forcing += 1
    try:
        yield _workload.calls
    finally:
        _forcing -= 1
        _workload = outer


def _copied(value):
    """``value`` with every tensor copied into new memory of its strides."""
    if isinstance(value, torch.Tensor):
        try:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                       device=value.device).copy_(value)
        except RuntimeError:  # overlapping strides (an expanded tensor)
            return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _recordable(name: str, impl: Callable, mutates: bool) -> Callable:
    """``impl`` as the custom op runs it: as it is, unless a workload is being recorded."""
    @functools.wraps(impl)
    def run(*args, **kwargs):
        workload = _workload
        if workload is None:
            return impl(*args, **kwargs)
        before = len(workload.launches)
        saved = _copied((args, kwargs))  # before the call: an in-place op changes its inputs
        out = impl(*args, **kwargs)
        for kernel, shape in workload.launches[before:]:
            key = (f"{kernel.op}.{kernel.name}", shape)
            if key not in workload.calls:
                workload.calls[key] = RecordedCall(name, kernel, shape, impl, *saved, mutates)
        return out
    # the schema is inferred from the signature, its string annotations resolved in impl's module
    run.__signature__ = inspect.signature(impl, eval_str=True)
    return run


# --------------------------------------------------------------------------------------------
# Call plans: an operator's repeated eager call, decided once
# --------------------------------------------------------------------------------------------

class _PlanningState(threading.local):
    """The call being planned on this thread: its launches (None entries: unplannable) and the
    outputs it zeroed. Class defaults, so that reading them where nothing is being planned
    (every call) is an attribute lookup, not a caught AttributeError."""
    launches: list | None = None
    zeroed: set | None = None


_planning = _PlanningState()
_forcing = 0  # forced() blocks open: configs are being swept, no plan applies
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_is_compiling = torch.compiler.is_compiling
_PLAIN_VALUES = frozenset({int, float, bool, type(None), torch.dtype, torch.device, torch.layout,
                           torch.memory_format})
_PLANS: list["CallPlans"] = []
_PLAN_TRIES = 2  # watched calls of a signature before it is left unplanned


def native_replay_allowed() -> bool:
    """Whether a plan may be replayed by the native table now (:mod:`gemslib.native`): not
    inside a call being planned (which records its launches in Python), with no Triton launch
    hook installed (a profiler wants Triton's launches), no config forced and neither the
    direct launch nor the native replay switched off. The native kernel registered after
    autograd asks it before each replay."""
    return (_planning.launches is None and not _forcing and not DIRECT_LAUNCH._switched_off
            and not NATIVE_REPLAY._switched_off and not _launch_hooked())


def _not_plannable() -> None:
    planning = _planning.launches
    if planning is not None:
        planning.append(None)


def launched_outside_plans() -> None:
    """For an operator that launches a kernel itself, not through :class:`TunedKernel`: a
    call being planned then gets no plan (a plan replays only the launches it recorded)."""
    _not_plannable()


def call_plan_counts() -> dict[str, tuple[int, int]]:
    """Per operator or aten override with planned calls: (signatures planned, signatures seen
    but not planned), for reports of which calls replay."""
    return {plans.name: (len(plans._plans), len(plans._tries)) for plans in _PLANS
            if plans._plans or plans._tries}


def clear_call_plans() -> None:
    """Forget every operator's plans (configs reloaded, caches cleared)."""
    for plans in _PLANS:
        plans.clear()


class _PlanningMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches the call being planned: any aten operator that computes (a copy, a fill, a
    torch fallback) makes it unplannable, since a plan replays only the kernel launches.
    Allocations and views pass, and so do zeroed allocations (``zeros``, ``zero_``), whose
    memory is noted: an output made so is allocated zeroed again by the plan."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        result = func(*args, **(kwargs or {}))
        if packet is _aten.zeros or packet is _aten.zero_:
            zeroed = result if packet is _aten.zeros else args[0]
            if zeroed.numel():
                _planning.zeroed.add(zeroed.data_ptr())
        elif packet not in _PLAN_SAFE_OPS:
            _not_plannable()
        return result


_aten = torch.ops.aten
_PLAN_SAFE_OPS = frozenset({
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.view, _aten._unsafe_view,
    _aten.reshape, _aten.as_strided, _aten.alias, _aten.detach, _aten.t, _aten.transpose,
    _aten.permute, _aten.expand, _aten.unsqueeze, _aten.squeeze, _aten.select, _aten.slice,
    _aten.movedim, _aten.unflatten, _aten.flatten, _aten.split, _aten.chunk, _aten.narrow})


class _Plan:
    """The launches of one decided call: each compiled kernel with its arguments, the call's
    tensors (its tensor arguments, then the outputs it allocates, then kept scratch) as slots
    filled with their data pointers. ``run(*args)`` is a function generated for this plan alone
    (its allocations, pointers and launches written out, every constant bound by name): a
    replayed call's host time is then the allocations and the launches, little more."""
    __slots__ = ("device", "inputs", "outputs", "scratch", "result", "launches", "run")

    def __init__(self, device, inputs, outputs, scratch, result, launches):
        self.device, self.inputs, self.outputs = device, inputs, outputs
        self.scratch, self.result, self.launches = scratch, result, launches
        self.run = self._generate()

    def __call__(self, *args):
        """The call again, for ``args`` of the signature it was planned for."""
        return self.run(*args)

    def _generate(self) -> Callable:
        names = {"empty_strided": torch.empty_strided, "zeros": torch.zeros,
                 "device": self.device, "split_scratch": split_scratch}
        if getattr(torch._C, "_cuda_getCurrentRawStream", None) is not None and \
                self.device.index is not None:  # looked up per call: tests swap it
            names["torch_C"] = torch._C
            stream = f"torch_C._cuda_getCurrentRawStream({self.device.index})"
        else:
            names["current_stream_handle"] = current_stream_handle
            stream = f"current_stream_handle({self.device.index!r})"
        lines = ["def replay(*args):"]
        for slot, position in enumerate(self.inputs):
            lines.append(f"    p{slot} = args[{position}].data_ptr()")
        first_output = len(self.inputs)
        for index, (shape, stride, dtype, zeroed) in enumerate(self.outputs):
            names[f"shape{index}"], names[f"stride{index}"] = shape, stride
            names[f"dtype{index}"] = dtype
            if zeroed:
                lines.append(f"    out{index} = zeros(shape{index}, dtype=dtype{index}, "
                             f"device=device)")
            else:
                lines.append(f"    out{index} = empty_strided(shape{index}, stride{index}, "
                             f"dtype=dtype{index}, device=device)")
            lines.append(f"    p{first_output + index} = out{index}.data_ptr()")
        lines.append(f"    stream = {stream}")
        # each kept scratch pair fetched once, for the stream at hand
        first_scratch = first_output + len(self.outputs)
        pairs: dict[tuple[int, int], str] = {}
        on_stream = ", stream" if "torch_C" in names else ""
        for index, (n_counters, n_floats, which, offset) in enumerate(self.scratch):
            pair = pairs.get((n_counters, n_floats))
            if pair is None:
                pair = pairs[n_counters, n_floats] = f"pair{len(pairs)}"
                lines.append(f"    {pair} = split_scratch(device, {n_counters}, {n_floats}"
                             f"{on_stream})")
            lines.append(f"    p{first_scratch + index} = {pair}[{which}].data_ptr() + {offset}")
        for n, (compiled, template, slots) in enumerate(self.launches):
            launch, grid3, function, cooperative, pdl, metadata, constexprs, _, _ = compiled
            names[f"launch{n}"], names[f"metadata{n}"] = launch, metadata
            head = [f"grid{n}_{axis}" for axis in range(3)] + ["stream", f"function{n}",
                                                               f"cooperative{n}", f"pdl{n}"]
            for axis, size in enumerate(grid3):
                names[f"grid{n}_{axis}"] = size
            names[f"function{n}"], names[f"cooperative{n}"] = function, cooperative
            names[f"pdl{n}"] = pdl
            slot_at = dict(slots)
            values = []
            for position, value in enumerate(template):
                if position in slot_at and isinstance(value, _MapOn):
                    names[f"map{n}_{position}"] = value
                    values.append(f"map{n}_{position}.at(p{slot_at[position]})")
                elif position in slot_at:
                    values.append(f"p{slot_at[position]}")
                else:
                    names[f"arg{n}_{position}"] = value
                    values.append(f"arg{n}_{position}")
            for position, value in enumerate(constexprs):
                names[f"constexpr{n}_{position}"] = value
                values.append(f"constexpr{n}_{position}")
            lines.append(f"    launch{n}({', '.join(head)}, None, None, metadata{n}, None, None, "
                         f"None, {', '.join(values)})")
        if type(self.result) is int:
            lines.append(f"    return out{self.result}")
        else:
            returned = []
            for index, (is_output, value) in enumerate(self.result):
                if is_output:
                    returned.append(f"out{value}")
                else:
                    names[f"returned{index}"] = value
                    returned.append(f"returned{index}")
            lines.append(f"    return ({', '.join(returned)},)")
        exec(compile("\n".join(lines), f"<gemslib plan {len(self.launches)} launches>", "exec"),
             names)
        return names["replay"]


_INT_PARAMS = {"i1": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64, "u1": 8, "u8": 8,
               "u16": 16, "u32": 32, "u64": 64}
_FLOAT_PARAMS = {"fp16": "<e", "fp32": "<f", "f32": "<f", "fp64": "<d"}


def _parameter_bytes(kind: str, value) -> int | None:
    """A scalar parameter as the little-endian bytes cuLaunchKernel copies (as an integer),
    packed as Triton's launcher packs it; None for a type the native replay does not pass."""
    if kind in _INT_PARAMS:
        if type(value) not in (int, bool):
            return None
        return int(value) & ((1 << _INT_PARAMS[kind]) - 1)
    if kind in _FLOAT_PARAMS and type(value) in (int, float):
        return int.from_bytes(struct.pack(_FLOAT_PARAMS[kind], value), "little")
    if kind == "bf16" and type(value) in (int, float):  # Triton truncates the fp32 bits
        return int.from_bytes(struct.pack("<f", value), "little") >> 16
    return None


def _tensor_map_spec(fixed: _MapOn, meta) -> tuple | None:
    """A descriptor's fixed part as the native replay encodes it per call, the way Triton's
    ``fill_tma_descriptor`` does: (host element type, element bytes, swizzle, box, shape,
    strides in elements, NaN padding), or None for a descriptor Triton did not lower to a
    tensor map (or an fp4-padded one)."""
    if not isinstance(meta, dict) or meta.get("fp4_padded"):
        return None
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        return None
    if fixed.strides[-1] != 1:
        return None
    return (TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["elem_size"], meta["swizzle"],
            tuple(meta["block_size"]), tuple(fixed.shape), tuple(fixed.strides),
            int(fixed.padding == "nan"))


def native_spec(plan: _Plan) -> tuple | None:
    """``plan`` as :mod:`gemslib.native`'s table takes it (see ``_launch.cpp``'s
    ``Table.add``), or None where a launch has a parameter it does not pass (a tuple, a
    descriptor Triton did not make a tensor map of) or its kernel did not say its parameter
    types. A tensor map parameter is the slot of its base and its fixed part (``maps``),
    followed by the shape (i32) and strides (i64) Triton's launcher passes after it."""
    first_scratch = len(plan.inputs) + len(plan.outputs)
    launches = []
    maps = []
    for compiled, template, slots in plan.launches:
        _, grid3, function, cooperative, pdl, metadata, constexprs, types, maps_meta = compiled
        values = (*template, *constexprs)
        if types is None or len(types) != len(values) or not isinstance(function, int):
            return None
        slot_at = dict(slots)
        params = []
        descriptor = 0
        for position, (kind, value) in enumerate(zip(types, values)):
            if kind == "constexpr":
                continue
            if not isinstance(kind, str):
                return None
            if kind.startswith("tensordesc"):
                slot = slot_at.get(position)
                meta = maps_meta[descriptor] if maps_meta and descriptor < len(maps_meta) \
                    else None
                descriptor += 1
                fixed = _tensor_map_spec(value, meta) if isinstance(value, _MapOn) else None
                if slot is None or fixed is None:
                    return None
                params.append((3, slot, len(maps)))
                maps.append(fixed)
                params.extend((2, 0, size & 0xFFFFFFFF) for size in value.shape)
                params.extend((2, 0, stride & 0xFFFFFFFFFFFFFFFF) for stride in value.strides)
                continue
            if kind.startswith("*"):
                slot = slot_at.get(position)
                if slot is None:
                    return None
                if slot >= first_scratch:
                    index = slot - first_scratch
                    params.append((1, index, plan.scratch[index][3]))
                else:
                    params.append((0, slot, 0))
                continue
            packed = _parameter_bytes(kind, value)
            if packed is None or position in slot_at:
                return None
            params.append((2, 0, packed))
        num_warps, num_ctas, shared = metadata
        launches.append((function, tuple(grid3), num_warps, num_ctas, shared, bool(cooperative),
                         bool(pdl), tuple(params)))
    if type(plan.result) is int:
        result = plan.result
    else:
        result = tuple((value, None) if is_output else (-1, value)
                       for is_output, value in plan.result)
    outputs = tuple((tuple(shape), tuple(stride), dtype, zeroed)
                    for shape, stride, dtype, zeroed in plan.outputs)
    scratch = tuple((n_counters, n_floats, which)
                    for n_counters, n_floats, which, _ in plan.scratch)
    return (plan.device.index, tuple(plan.inputs), outputs, scratch, tuple(launches), result,
            tuple(maps))


class _Route:
    """A signature's decided path as a Python function (see :meth:`CallPlans.keep`)."""
    __slots__ = ("run",)

    def __init__(self, run: Callable):
        self.run = run


class CallPlans:
    """An operator's eager calls without autograd, decided once per signature and replayed.

    Such a call spends most of its host time deciding what its signature alone determines:
    the checks' verdict, the layout, the config, the grid and the launch key, each from every
    tensor argument's type, shape, strides, dtype, device and 16-byte alignment (and which of
    them start at one address), and the other arguments' values. :meth:`signature` makes that
    key (``None`` where no plan may apply: autograd must see the call, torch.compile is
    tracing, a config is forced, the direct launch is off, an argument is a tensor subclass or
    not a plain value); :meth:`get` gives the plan of a signature seen before; :meth:`plan`
    runs the call's own code and keeps a plan of it when it is replayable:

    * every GPU operation it made was a launch of a kept compiled kernel
      (:meth:`TunedKernel.replay`), an allocation, a view, or the zeroing of an output (aten
      operators are watched with a dispatch mode);
    * each tensor argument of those launches starts where one of the call's tensors or
      outputs starts, or lies in a kept :func:`split_scratch` pair;
    * its outputs are fresh tensors of their own storage (plain numbers and Nones among them
      are returned as they were).

    A signature's first call (which compiles and tunes) is never planned, and one whose next
    two calls were not replayable is not watched again (the watching costs more host time
    than it saves). A plan allocates the outputs alike (zeroed where the call zeroed them),
    fetches the scratch of the current stream and launches the same kernels with the new
    pointers on that stream; with a Triton launch hook installed, or inside a call being
    planned, the call's own code runs again. Where :mod:`gemslib.native` is on, each plan is
    also kept in the operator's native table, which :meth:`replayed` asks first (and, for an
    aten override, the kernel it registers after autograd).
    """

    def __init__(self, name: str, below_autograd: bool = False):
        self.name, self.below_autograd = name, below_autograd
        self._plans: dict[tuple, _Plan] = {}
        self._tries: dict[tuple, int] = {}  # calls of a signature not (yet) planned
        self._native = None  # the native table of the plans (gemslib.native), once one is made
        _PLANS.append(self)

    def clear(self) -> None:
        self._plans.clear()
        self._tries.clear()
        if self._native is not None:
            self._native.clear()

    def signature(self, *args, **kwargs) -> tuple | None:
        """The key of a call with these arguments (a plan replays with the positional ones;
        keyword ones must be plain values). ``below_autograd``: the caller is a kernel the
        dispatcher runs after autograd (an aten override), so tensors that require grad do
        not stop a plan (grad mode and requires_grad are in the key all the same: an
        override's check may read them)."""
        if INTERPRETER or _forcing or DIRECT_LAUNCH._switched_off or _is_compiling():
            return None
        grad = torch.is_grad_enabled()
        stop = grad and not self.below_autograd
        key = [torch.cuda.current_device() if torch.cuda.is_initialized() else None, grad]
        append = key.append
        starts = []
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN_TENSORS:
                if (stop and arg.requires_grad) or arg.layout is not _STRIDED:
                    return None
                start = arg.data_ptr()
                starts.append(start)
                append((arg.shape, arg.stride(), arg.dtype, arg.device, start & 15,
                        arg.requires_grad))
            elif kind in _PLAIN_VALUES:
                append((kind, arg))
            elif (kind is list or kind is tuple) and _PLAIN_VALUES.issuperset(map(type, arg)):
                append((kind, tuple(arg)))
            else:
                return None
        for name, arg in kwargs.items():
            if type(arg) not in _PLAIN_VALUES:
                return None
            append((name, type(arg), arg))
        if len(starts) > 1 and len(set(starts)) < len(starts):  # k and v as one tensor, say
            append(tuple(starts.index(start) for start in starts))
        return tuple(key)

    def replayed(self, *args, **kwargs) -> tuple[tuple | None, Any]:
        """(the call's key, its outputs replayed by its plan, or None where it has none): the
        start of a planned operator, which runs its own path when the second is None and
        hands the key to :meth:`plan`."""
        native = self._native
        if native is not None and native_replay_allowed() and not _is_compiling():
            planned = native.run(*args, **kwargs)
            if planned is not None:
                return None, planned
        key = self.signature(*args, **kwargs)
        plan = self.get(key)
        return key, (plan.run(*args) if plan is not None else None)

    def get(self, key: tuple | None) -> _Plan | None:
        """The plan of ``key`` (None: none yet, a launch hook wants Triton's launches, or the
        caller runs inside a call being planned, which records the launches themselves)."""
        plan = self._plans.get(key)
        if plan is None or _planning.launches is not None or _launch_hooked():
            return None
        return plan

    def keep(self, key: tuple | None, run: Callable) -> None:
        """Make ``run`` the plan of ``key``: later calls of that signature go to ``run`` with
        their positional arguments (what :meth:`replayed` gives them), skipping the checks and
        the choice of path. For a call whose decided path is more than gemslib's launches (a
        vendor GEMM between two planned gemslib operators), which no launch plan can replay;
        ``run`` must compute the call's result for any arguments of the signature."""
        if key is not None and len(self._plans) < 1024:
            self._plans[key] = _Route(run)
            self._tries.pop(key, None)

    def plan(self, key: tuple | None, args: Sequence, call: Callable,
             kwargs: Mapping[str, Any] | None = None):
        """``call()``, the operator's own path for ``args`` and ``kwargs`` (those given to
        :meth:`signature`), keeping its plan under ``key`` when it is replayable (in the
        native table too, where :mod:`gemslib.native` is on); returns what ``call`` returns
        (a tensor, or a tuple of tensors and Nones)."""
        if key is None or key in self._plans or _planning.launches is not None:
            return call()
        tries = self._tries.get(key)
        if tries is None:  # a first call compiles and tunes: planned from the second
            if len(self._tries) < 4096:
                self._tries[key] = 0
            return call()
        if tries >= _PLAN_TRIES:
            return call()  # not replayable (it computes with torch, say): no more watching
        self._tries[key] = tries + 1
        _planning.launches, _planning.zeroed = launches, zeroed = [], set()
        try:
            with _PlanningMode():
                result = call()
        finally:
            _planning.launches = _planning.zeroed = None
        plan = self._replayable(args, result, launches, zeroed)
        if plan is not None and len(self._plans) < 1024:
            self._plans[key] = plan
            del self._tries[key]
            self._keep_native(plan, args, kwargs)
        return result

    def native_table(self):
        """This operator's table in :mod:`gemslib.native` (made on first use), or None where
        the native path is off."""
        if self._native is None:
            from gemslib import native

            module = native.module()
            if module is not None:
                self._native = module.Table(below_autograd=self.below_autograd)
        return self._native

    def _keep_native(self, plan: _Plan, args: Sequence, kwargs: Mapping[str, Any] | None):
        table = self.native_table()
        spec = native_spec(plan) if table is not None else None
        if spec is not None:
            table.add(tuple(args), dict(kwargs or {}), spec)

    @staticmethod
    def _replayable(args, result, launches, zeroed) -> _Plan | None:
        if not launches or None in launches:
            return None
        single = isinstance(result, torch.Tensor)
        returned = [result] if single else list(result)
        outputs = [t for t in returned if isinstance(t, torch.Tensor)]
        if not outputs or any(type(t) not in _PLAIN_TENSORS for t in outputs) or any(
                not isinstance(t, torch.Tensor) and type(t) not in _SCALARS for t in returned):
            return None
        for t in outputs:  # fresh, dense, owning its whole storage
            extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
            if t.numel() and (t.storage_offset() or
                              t.untyped_storage().nbytes() != extent * t.element_size()):
                return None
        inputs = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        slot_of = {}
        for slot, i in enumerate(inputs):  # inputs that start together: the key says which
            slot_of.setdefault(args[i].data_ptr(), slot)
        for index, t in enumerate(outputs):
            if not t.numel():
                continue  # nothing a launch could write
            if t.data_ptr() in slot_of:
                return None  # an output aliasing an input, or another output
            slot_of[t.data_ptr()] = len(inputs) + index
        scratch = []
        planned = []
        for compiled, kernel_args, launch_args in launches:
            template, slots = list(launch_args), []
            for position, arg in enumerate(kernel_args):
                if isinstance(arg, torch.Tensor):
                    pointer = launch_args[position]
                    slot = slot_of.get(pointer)
                    if slot is None:
                        place = _in_split_scratch(pointer)
                        if place is None:
                            return None  # a tensor the call made for itself, or a view in one
                        slot = slot_of[pointer] = len(inputs) + len(outputs) + len(scratch)
                        scratch.append(place)
                    template[position] = None
                    slots.append((position, slot))
                elif isinstance(arg, _DESCRIPTORS):
                    slot = slot_of.get(arg.base.data_ptr())
                    if slot is None or slot >= len(inputs) + len(outputs):
                        return None  # a map on memory the call made for itself, or on scratch
                    template[position] = _MapOn(None, tuple(arg.shape), tuple(arg.strides),
                                                arg.padding)
                    slots.append((position, slot))
            planned.append((compiled, tuple(template), tuple(slots)))
        if zeroed - {t.data_ptr() for t in outputs if t.numel()}:
            return None  # memory zeroed that is no output (an input, scratch): not replayed
        # outputs the call zeroed (contiguous ones only) are allocated zeroed again
        specs = tuple((tuple(t.shape), t.stride(), t.dtype,
                       t.numel() > 0 and t.data_ptr() in zeroed) for t in outputs)
        if any(zero and not t.is_contiguous() for t, (_, _, _, zero) in zip(outputs, specs)):
            return None
        index = {id(t): i for i, t in enumerate(outputs)}
        where = index[id(result)] if single else tuple(
            (True, index[id(t)]) if isinstance(t, torch.Tensor) else (False, t)
            for t in returned)
        return _Plan(outputs[0].device, tuple(inputs), specs, tuple(scratch), where,
                     tuple(planned))


def _in_split_scratch(pointer: int) -> tuple[int, int, int, int] | None:
    """(n_counters, n_floats, which of the pair, byte offset) of a pointer into a kept
    :func:`split_scratch` pair, which a plan fetches again for the stream it runs on."""
    for (_, _, _, n_counters, n_floats), pair in _split_scratch_cache.items():
        for which, t in enumerate(pair):
            start = t.data_ptr()
            if start <= pointer < start + t.numel() * t.element_size():
                return n_counters, n_floats, which, pointer - start
    return None
