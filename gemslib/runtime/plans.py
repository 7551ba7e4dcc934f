"""Call plans: an operator's repeated eager call, decided once per signature and replayed by
generated Python, or by the native table (:mod:`gemslib.runtime.native`) where it is on."""

from __future__ import annotations

import struct
from typing import Any, Callable, Mapping, Sequence

import torch

from gemslib.runtime import env, native, state
from gemslib.runtime.cuda import current_stream_handle, in_split_scratch, split_scratch
from gemslib.runtime.env import DIRECT_LAUNCH, NATIVE_REPLAY
from gemslib.runtime.launch import DESCRIPTORS, SCALARS, MapOn, launch_hooked


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided
_is_compiling = torch.compiler.is_compiling
_PLAIN_VALUES = frozenset({int, float, bool, type(None), torch.dtype, torch.device, torch.layout,
                           torch.memory_format})
_PLANS: list["CallPlans"] = []
_PLAN_TRIES = 2  # watched calls of a signature before it is left unplanned


def native_replay_allowed() -> bool:
    """Whether a plan may be replayed by the native table now (:mod:`.native`): not
    inside a call being planned (which records its launches in Python), with no Triton launch
    hook installed (a profiler wants Triton's launches), no config forced and neither the
    direct launch nor the native replay switched off. The native kernel registered after
    autograd asks it before each replay."""
    return (state.planning.launches is None and not state.forcing
            and not DIRECT_LAUNCH._switched_off and not NATIVE_REPLAY._switched_off
            and not launch_hooked())


def launched_outside_plans() -> None:
    """For an operator that launches a kernel itself, not through :class:`TunedKernel`: a
    call being planned then gets no plan (a plan replays only the launches it recorded)."""
    state.not_plannable()


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
                state.planning.zeroed.add(zeroed.data_ptr())
        elif packet not in _PLAN_SAFE_OPS:
            state.not_plannable()
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
                if position in slot_at and isinstance(value, MapOn):
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


def _tensor_map_spec(fixed: MapOn, meta) -> tuple | None:
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
    """``plan`` as :mod:`.native`'s table takes it (see ``_launch.cpp``'s
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
                fixed = _tensor_map_spec(value, meta) if isinstance(value, MapOn) else None
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
    planned, the call's own code runs again. Where :mod:`.native` is on, each plan is
    also kept in the operator's native table, which :meth:`replayed` asks first (and, for an
    aten override, the kernel it registers after autograd).
    """

    def __init__(self, name: str, below_autograd: bool = False):
        self.name, self.below_autograd = name, below_autograd
        self._plans: dict[tuple, _Plan] = {}
        self._tries: dict[tuple, int] = {}  # calls of a signature not (yet) planned
        self._native = None  # the plans' native table, once one is made
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
        if env.INTERPRETER or state.forcing or DIRECT_LAUNCH._switched_off or _is_compiling():
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
        if plan is None or state.planning.launches is not None or launch_hooked():
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
        native table too, where :mod:`.native` is on); returns what ``call`` returns
        (a tensor, or a tuple of tensors and Nones)."""
        if key is None or key in self._plans or state.planning.launches is not None:
            return call()
        tries = self._tries.get(key)
        if tries is None:  # a first call compiles and tunes: planned from the second
            if len(self._tries) < 4096:
                self._tries[key] = 0
            return call()
        if tries >= _PLAN_TRIES:
            return call()  # not replayable (it computes with torch, say): no more watching
        self._tries[key] = tries + 1
        state.planning.launches, state.planning.zeroed = launches, zeroed = [], set()
        try:
            with _PlanningMode():
                result = call()
        finally:
            state.planning.launches = state.planning.zeroed = None
        plan = self._replayable(args, result, launches, zeroed)
        if plan is not None and len(self._plans) < 1024:
            self._plans[key] = plan
            del self._tries[key]
            self._keep_native(plan, args, kwargs)
        return result

    def native_table(self):
        """This operator's table in :mod:`.native` (made on first use), or None where
        the native path is off."""
        if self._native is None:
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
                not isinstance(t, torch.Tensor) and type(t) not in SCALARS for t in returned):
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
                        place = in_split_scratch(pointer)
                        if place is None:
                            return None  # a tensor the call made for itself, or a view in one
                        slot = slot_of[pointer] = len(inputs) + len(outputs) + len(scratch)
                        scratch.append(place)
                    template[position] = None
                    slots.append((position, slot))
                elif isinstance(arg, DESCRIPTORS):
                    slot = slot_of.get(arg.base.data_ptr())
                    if slot is None or slot >= len(inputs) + len(outputs):
                        return None  # a map on memory the call made for itself, or on scratch
                    template[position] = MapOn(None, tuple(arg.shape), tuple(arg.strides),
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


