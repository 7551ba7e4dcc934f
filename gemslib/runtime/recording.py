"""The tuner's recording of a workload (``python -m gemslib.tune --model``): the first
custom-op call that launches each (tuned kernel, shape), kept to be run again."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from gemslib.runtime import state

if TYPE_CHECKING:
    from gemslib.runtime.tuned import TunedKernel


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


class Workload:
    """What :func:`recording_calls` collects: every (tuned kernel, shape) launched, in order,
    and the first call of each, kept to be run again."""

    def __init__(self):
        self.launches: list[tuple[TunedKernel, tuple[int, ...]]] = []
        self.calls: dict[tuple[str, tuple[int, ...]], RecordedCall] = {}


@contextlib.contextmanager
def recording_calls():
    """Record, inside the block, the first custom-op call (through ``torch.ops.gemslib``, as a
    compiled graph makes them) that launches each (tuned kernel, shape): yields a dict
    ``{(kernel's "op.name", shape): RecordedCall}`` that fills as the block runs. Call plans
    are off meanwhile, so every launch is seen."""
    outer, state.workload = state.workload, Workload()
    state.forcing += 1
    try:
        yield state.workload.calls
    finally:
        state.forcing -= 1
        state.workload = outer


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


def recordable(name: str, impl: Callable, mutates: bool) -> Callable:
    """``impl`` as the custom op runs it: as it is, unless a workload is being recorded."""
    @functools.wraps(impl)
    def run(*args, **kwargs):
        workload = state.workload
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
