"""Launches past Triton's launcher: a launch's key (what its compiled kernel depends on), the
compiled kernel kept per key, and later launches handed straight to the compiled launcher
(:func:`launch_kept`, :class:`KeptKernel`), which a call being planned records."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from triton import knobs

from gemslib.runtime import env, state
from gemslib.runtime.cuda import current_stream_handle
from gemslib.runtime.env import DIRECT_LAUNCH


SCALARS = (int, float, bool, type(None))


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


DESCRIPTORS = _descriptor_types()  # host-side TMA descriptors a kept launch may take


class _Address:
    """A data pointer standing for a tensor where Triton's launcher asks one for it."""
    __slots__ = ("pointer",)

    def __init__(self, pointer: int):
        self.pointer = pointer

    def data_ptr(self) -> int:
        return self.pointer


class MapOn:
    """A tensor descriptor as a plan keeps it: all but its base (shape, strides, padding), and
    as a replay passes it, on the new base (what Triton's launcher reads of a descriptor)."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, shape: tuple, strides: tuple, padding: str):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding

    def at(self, pointer: int) -> "MapOn":
        return MapOn(_Address(pointer), self.shape, self.strides, self.padding)


def launch_key(config, grid: tuple, args) -> tuple[tuple | None, list]:
    """(key, launch arguments) of a launch. The key is what its compiled kernel depends on:
    the config, the grid, each tensor's dtype and 16-byte alignment, and every other argument
    by type and value (Triton specialises integers on being 1 and on divisibility by 16, so
    the value covers it), each host TMA descriptor by :func:`descriptor_key`; None where an
    argument is none of these: such launches go through Triton every time. The launch
    arguments are ``args`` with each tensor's data pointer in its place (the compiled launcher
    takes a pointer as an integer without asking the driver about it; a descriptor stays,
    the launcher makes its tensor map). One pass: this runs on every launch."""
    key = [config, grid]
    pointers = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            pointer = arg.data_ptr()
            key.append(arg.dtype)
            key.append(not pointer & 15)
            pointers.append(pointer)
        elif type(arg) in SCALARS:
            key.append(type(arg))
            key.append(arg)
            pointers.append(arg)
        elif isinstance(arg, DESCRIPTORS):
            key.append(descriptor_key(arg))
            pointers.append(arg)
        else:
            return None, pointers
    return tuple(key), pointers


def descriptor_key(descriptor) -> tuple:
    """What a compiled kernel depends on of a host TMA descriptor: its kind, the base's dtype
    and 16-byte alignment, the block, the shared layout (Gluon's) and the padding; its shape
    and strides are launch parameters."""
    base = descriptor.base
    return (type(descriptor), base.dtype, tuple(descriptor.block_shape),
            getattr(descriptor, "layout", None), descriptor.padding, not base.data_ptr() & 15)


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


def launch_hooked() -> bool:
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


def launch_kept(kept: dict, key: tuple, fn, grid, args, kwargs: Callable[[], dict],
                 launch_args) -> None:
    """``fn[grid](*args, **kwargs())`` by way of ``kept`` (key and device -> what
    :func:`_compiled_launch` gives): the first launch of a key, or any with a launch hook
    installed, goes through Triton (keeping the compiled kernel); the others go straight to
    the compiled launcher with ``launch_args`` on the current stream, and a call being planned
    records them."""
    device = torch.cuda.current_device()
    compiled = kept.get((key, device))
    if compiled is None or launch_hooked():
        state.not_plannable()
        kernel_kwargs = kwargs()
        kernel = fn[grid](*args, **kernel_kwargs)
        if compiled is None and len(kept) < 1024:
            compiled = _compiled_launch(fn, kernel, grid, args, kernel_kwargs)
            if compiled is not None:
                kept[key, device] = compiled
        return
    launch_compiled(compiled, current_stream_handle(device), launch_args)
    planning = state.planning.launches
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
        if env.INTERPRETER or key is None:
            state.not_plannable()
            self.fn[grid](*args, **constexprs, **options)
            return
        if DIRECT_LAUNCH._switched_off:
            state.not_plannable()
            self.fn[grid](*args, **constexprs, **options)
            return
        launch_kept(self._compiled, key, self.fn, grid, args, lambda: {**constexprs, **options},
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
            elif isinstance(arg, DESCRIPTORS):
                key.append(descriptor_key(arg))
                launch_args.append(arg)  # Triton's launcher makes its tensor map
            elif type(arg) in SCALARS:
                key.append((type(arg), arg))
                launch_args.append(arg)
            else:
                return None, launch_args
        return tuple(key), launch_args

