"""The aten override registry.

Each operator file in ``ops/`` and ``fused/`` declares what it implements::

    ATEN_OVERRIDES = (
        AtenOverride("aten::silu", _aten_silu, unsupported=_why_not_silu),
        ...
    )
    SELF_CHECKS = (SelfCheck(...), ...)
    TUNING = (TuneSpace(...), ...)

and this module collects those declarations by walking the two packages; the operator's name
is its file name. :func:`enable` registers a wrapper per aten overload through
``torch.library.Library("aten", "IMPL")`` under the backend's dispatch key (``CUDA``, or ``CPU``
under the Triton interpreter). The wrapper asks the declaration whether it supports the call
and otherwise calls the kernel that was registered before, fetched with
``torch.library.get_kernel`` at enable time, never the aten op itself (that would recurse).
A call whose signature (shapes, strides, dtypes, values) the wrapper has served before replays
its plan (:class:`gemslib.runtime.CallPlans`), skipping the check and the implementation's
host work.
Leaving the block (or :func:`disable`) removes exactly what the block registered.

One exception to that exact restore: where torch has no kernel of its own for an overridden
aten overload on gemslib's backend (today ``aten::_fused_rms_norm_backward`` on torch's CPU
build, the backend of the Triton interpreter), the first ``enable()`` that overrides it installs
the declaration's ``fallback`` (plain torch arithmetic) as that backend's kernel, for the rest
of the process. An autograd graph recorded inside a ``with gemslib.enable():`` block runs its
backward when ``loss.backward()`` is called, often after the block has closed, and the backward
operator must then still have a kernel. That kernel serves the operator as enable()'s wrapper
would while a block claims it (gemslib's kernel, or the fallback for what the kernel does not
take), and runs the fallback otherwise; enable() registers nothing more for it. Nothing else
outlives the block; :func:`permanent_fallbacks` lists what was installed.

``enable()`` refuses to start (a ``RuntimeError``, before registering anything) when torch has
no kernel on the backend for an overload it would override and has no fallback for, e.g. on
torch's CPU build without ``TRITON_INTERPRET=1``, where the backend is CUDA.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from gemslib import checks, runtime

log = logging.getLogger("gemslib")


@dataclass(frozen=True)
class AtenOverride:
    """``impl`` serves aten overload ``aten`` (e.g. ``"aten::silu.out"``) when ``unsupported``,
    called with the same arguments, returns ``None``; otherwise it returns the reason and the
    original kernel runs. ``fallback`` computes unsupported calls where the backend has no
    kernel of its own for the op (e.g. ``_fused_rms_norm_backward`` on torch's CPU build): it
    takes the op's arguments, must serve every call, and stays installed as the backend's
    kernel once an ``enable()`` needed it (module docstring). ``dispatch_keys`` names the
    backends the override exists on: SDPA, for instance, reaches different aten operators on
    CPU and on CUDA."""

    aten: str
    impl: Callable
    unsupported: Callable[..., str | None]
    fallback: Callable | None = None
    dispatch_keys: tuple[str, ...] = ("CPU", "CUDA")


@dataclass(frozen=True)
class SelfCheck:
    """A small problem for ``python -m gemslib``: ``run(*inputs)`` against ``reference`` in
    float64. ``make_inputs(device, dtype)`` draws fresh random inputs; ``torch_peer`` is what a
    user would call without gemslib (timed beside gemslib on a GPU). ``term_scale(*inputs)`` is
    the size of the terms an output combines after rounding them to the dtype (0: none), so
    absolute errors up to the dtype's rtol times it are rounding, not a fault."""

    name: str
    make_inputs: Callable[[torch.device, torch.dtype, int], tuple]
    run: Callable
    reference: Callable
    torch_peer: Callable
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    term_scale: Callable[..., float] = lambda *inputs: 0.0


@dataclass(frozen=True)
class TuneBucket:
    """One bucket of a kernel's tune-config entry, for ``python -m gemslib.tune``: the calls
    whose shape keys are all <= ``max`` (``None``: the last bucket, every other call), and a
    representative problem inside it. ``make(device)`` draws the problem's inputs and returns
    a callable that runs it (launching the kernel, whose config the tuner forces) and returns
    its output tensor(s); ``label`` names the problem (e.g. ``"4096x14336"``)."""
    max: Mapping[str, int] | None
    label: str
    make: Callable[[torch.device], Callable[[], object]]

    def matches(self, shape: Mapping[str, int]) -> bool:
        return runtime.within(self.max, shape)


@dataclass(frozen=True)
class TuneSpace:
    """How ``python -m gemslib.tune`` tunes ``kernel`` (a runtime.TunedKernel): every config of
    ``candidates`` (dicts of the kernel's tunables plus num_warps / num_stages) is checked and
    timed on each bucket's problem, and the fastest right one becomes that bucket's config.
    ``buckets`` are in the file's order: the first whose ``max`` admits a shape serves it."""
    kernel: object
    candidates: tuple[Mapping[str, int], ...]
    buckets: tuple[TuneBucket, ...]


@dataclass(frozen=True)
class Operator:
    name: str
    module: object
    overrides: tuple[AtenOverride, ...]
    self_checks: tuple[SelfCheck, ...]
    tuning: tuple[TuneSpace, ...] = ()


_OPERATOR_PACKAGES = ("gemslib.ops", "gemslib.fused")
_operators: dict[str, Operator] | None = None


def operators() -> Mapping[str, Operator]:
    """Every operator file of ``gemslib.ops`` and ``gemslib.fused``, by name."""
    global _operators
    if _operators is None:
        found = {}
        for package_name in _OPERATOR_PACKAGES:
            package = importlib.import_module(package_name)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                if info.name.startswith("_"):
                    continue
                module = importlib.import_module(f"{package_name}.{info.name}")
                found[info.name] = Operator(
                    name=info.name, module=module,
                    overrides=tuple(o for o in getattr(module, "ATEN_OVERRIDES", ())
                                    if runtime.dispatch_key() in o.dispatch_keys),
                    self_checks=tuple(getattr(module, "SELF_CHECKS", ())),
                    tuning=tuple(getattr(module, "TUNING", ())))
        _operators = found
    return _operators


def registered_ops() -> dict[str, tuple[str, ...]]:
    """Operators that ``enable()`` can switch on, each with the aten overloads it overrides."""
    return {name: tuple(o.aten for o in op.overrides)
            for name, op in operators().items() if op.overrides}


def _select(ops: Iterable[str] | None, exclude: Iterable[str] | None) -> list[str]:
    known = registered_ops()

    def check(argument: str, names):
        if isinstance(names, str):
            raise TypeError(f"gemslib.enable: {argument} must be a list of operator names, "
                            f"got the string {names!r}")
        names = list(names)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"gemslib.enable: unknown operator(s) {unknown} in {argument}; "
                             f"registered: {sorted(known)}")
        return names

    chosen = check("ops", ops) if ops is not None else sorted(known)
    excluded = set(check("exclude", exclude)) if exclude is not None else set()
    return [name for name in chosen if name not in excluded]


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

_lock = threading.RLock()
_activations: list["Activation"] = []
_served_by: dict[str, "Activation"] = {}  # aten overload -> the activation that overrides it


def _record(aten: str, served: bool) -> None:
    for activation in _activations:
        if activation.record:
            (activation.calls if served else activation.fallbacks)[aten] += 1


_override_plans: dict[str, runtime.CallPlans] = {}


def _make_wrapper(override: AtenOverride, original) -> Callable:
    """The kernel enable() registers: gemslib's implementation, or for calls it does not take
    ``original`` (the kernel registered before; None: the declaration's ``fallback``)."""
    aten = override.aten
    if original is not None:
        original_call = original.call_boxed
    else:
        def original_call(keyset, *args, **kwargs):
            return override.fallback(*args, **kwargs)

    plans = _override_plans.get(aten)
    if plans is None:  # one per overload, kept across activations (the override is the same)
        plans = _override_plans[aten] = runtime.CallPlans(aten, below_autograd=True)

    def wrapper(keyset, *args, **kwargs):
        key, planned = plans.replayed(*args, **kwargs)
        if planned is not None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s -> gemslib (planned)", aten)
            _record(aten, True)
            return planned
        reason = override.unsupported(*args, **kwargs)
        if reason is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s -> gemslib", aten)
            _record(aten, True)
            return plans.plan(key, args, lambda: override.impl(*args, **kwargs), kwargs)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s -> torch (%s)", aten, reason)
        _record(aten, False)
        return original_call(keyset, *args, **kwargs)

    wrapper.__name__ = f"gemslib_{aten.replace('::', '_').replace('.', '_')}"
    return wrapper


def _has_kernel(aten: str, key: str) -> bool:
    """Whether the dispatcher has a kernel for ``aten`` under ``key`` (its own, or one computed
    from a composite registration): what ``torch.library.get_kernel`` needs."""
    return torch._C._dispatch_has_computed_kernel_for_dispatch_key(aten, key)


def _check_kernels_exist(overrides: list[AtenOverride], key: str) -> None:
    """A clear error, before anything is registered, where the backend has no kernels: torch's
    CPU build asked for CUDA (no TRITON_INTERPRET=1), or an override without a ``fallback``
    whose op has no ``key`` kernel to hand unsupported calls to (get_kernel would fail)."""
    where = ("gemslib's kernels run on CUDA GPUs, or on CPU tensors in the Triton interpreter: "
             "set TRITON_INTERPRET=1 before importing gemslib to run them on the CPU")
    missing = [o.aten for o in overrides if o.fallback is None and not _has_kernel(o.aten, key)]
    if overrides and key == "CUDA" and not torch.backends.cuda.is_built():
        example = f" (e.g. {missing[0]} has no CUDA kernel)" if missing else ""
        raise RuntimeError(
            f"gemslib.enable: this torch build ({torch.__version__}) has no CUDA kernels, so there "
            f"is nothing on CUDA to override{example}. {where}.")
    if missing:
        raise RuntimeError(f"gemslib.enable: torch has no {key} kernel for {', '.join(missing)}, "
                           f"which gemslib would override and hand unsupported calls to. {where}.")


def _register_native_replay(aten: str, key: str):
    """The native replay kernel for an override's planned calls, registered after autograd
    (gemslib.runtime.native; its Registration), or None: not on CUDA, the native path off, or an
    operator with a kernel of its own at that key (in-place and out= overloads bump version
    counters there), which keeps the Python kernel alone."""
    if key != "CUDA" or torch._C._dispatch_has_kernel_for_dispatch_key(aten, "ADInplaceOrView"):
        return None
    plans = _override_plans.get(aten)
    table = plans.native_table() if plans is not None else None
    if table is None:
        return None
    from gemslib.runtime import native

    return native.module().register_replay(aten, table, runtime.native_replay_allowed)


_permanent_library = None  # torch.library.Library, kept for the whole process
_permanent_fallbacks: dict[str, str] = {}  # aten overload -> the dispatch-table line it added


def _install_permanent_fallback(override: AtenOverride, key: str) -> None:
    """Register a ``key`` kernel for ``override.aten`` for the rest of the process (see the
    module docstring: the one exception to exact restore): ``override.fallback``, or gemslib's
    wrapper while an activation serves the op. One kernel does both because torch (2.11) allows
    one Python kernel per operator and key: enable() then registers nothing for this op and
    only claims it (``_served_by``)."""
    global _permanent_library
    if _permanent_library is None:
        _permanent_library = torch.library.Library("aten", "IMPL")
    aten = override.aten
    served = _make_wrapper(override, None)

    def permanent(keyset, *args, **kwargs):
        if aten in _served_by:
            return served(keyset, *args, **kwargs)
        return override.fallback(*args, **kwargs)

    permanent.__name__ = f"gemslib_fallback_{aten.replace('::', '_').replace('.', '_')}"
    _permanent_library.impl(aten.split("::", 1)[1], permanent, key, with_keyset=True)
    _permanent_fallbacks[override.aten] = next(
        line for line in torch._C._dispatch_dump_table(override.aten).splitlines()
        if line.startswith(f"{key}:"))
    log.debug("%s: installed gemslib's fallback as the %s kernel (no kernel of torch's own)",
              override.aten, key)


def permanent_fallbacks() -> dict[str, str]:
    """The aten overloads whose backend kernel gemslib installed for good (torch had none), each
    with the line it added to ``torch._C._dispatch_dump_table``; see the module docstring."""
    with _lock:
        return dict(_permanent_fallbacks)


class Activation:
    """One ``enable()`` call: the registrations it made, undone by :meth:`close`.

    Usable as a context manager; with ``record=True``, ``calls`` and ``fallbacks`` count per
    aten overload how often gemslib served a call and how often it handed one to torch.
    """

    def __init__(self, ops=None, exclude=None, record: bool = False):
        self.ops = tuple(_select(ops, exclude))
        self.record = record
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.aten_overloads: tuple[str, ...] = ()
        self._library = None
        self._replays: list = []  # gemslib.runtime.native's kernels after autograd
        key = runtime.dispatch_key()
        with _lock:
            todo = [override for name in self.ops for override in operators()[name].overrides
                    if override.aten not in _served_by]  # else an enclosing enable() serves it
            _check_kernels_exist(todo, key)
            for override in todo:
                if override.fallback is not None and not _has_kernel(override.aten, key):
                    _install_permanent_fallback(override, key)
            library = torch.library.Library("aten", "IMPL")
            mine = []
            replays = []
            try:
                for override in todo:
                    if override.aten in _served_by:
                        continue  # declared twice: the first declaration serves it
                    if override.aten in _permanent_fallbacks:  # it serves whoever claims it
                        mine.append(override.aten)
                        _served_by[override.aten] = self
                        continue
                    original = torch.library.get_kernel(override.aten, key)
                    with warnings.catch_warnings():
                        # torch warns on every override of an existing kernel: that is the point
                        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously")
                        library.impl(override.aten.split("::", 1)[1],
                                     _make_wrapper(override, original), key, with_keyset=True)
                    replay = _register_native_replay(override.aten, key)
                    if replay is not None:
                        replays.append(replay)
                    mine.append(override.aten)
                    _served_by[override.aten] = self
            except BaseException:
                for replay in replays:
                    replay.remove()
                library._destroy()
                for aten in mine:
                    _served_by.pop(aten, None)
                raise
            self._library = library
            self._replays = replays
            self.aten_overloads = tuple(mine)
            _activations.append(self)

    @property
    def active(self) -> bool:
        return self in _activations

    def close(self) -> None:
        """Remove exactly the registrations this activation made (idempotent)."""
        with _lock:
            if self not in _activations:
                return
            for replay in self._replays:
                replay.remove()
            self._library._destroy()
            for aten in self.aten_overloads:
                if _served_by.get(aten) is self:
                    del _served_by[aten]
            _activations.remove(self)

    def __enter__(self) -> "Activation":
        return self

    def __exit__(self, *exc_info) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        return f"<gemslib activation {state}: {list(self.ops)}>"


def enable(ops: Iterable[str] | None = None, exclude: Iterable[str] | None = None,
           record: bool = False) -> Activation:
    """Override the aten operators of ``ops`` (default: all registered) minus ``exclude``.

    Works as a global switch (``gemslib.enable()`` ... ``gemslib.disable()``) and as a context
    manager (``with gemslib.enable(): ...``), which restores the dispatcher on exit, also when
    the block raises. Nested calls add only what is not already overridden.
    """
    return Activation(ops=ops, exclude=exclude,
                      record=checks.as_bool("gemslib.enable", "record", record))


def disable() -> None:
    """Undo every active ``enable()``, innermost first."""
    with _lock:
        for activation in reversed(list(_activations)):
            activation.close()


def is_enabled() -> bool:
    return bool(_activations)
