"""What the fusion families declare, and what a compile in flight records.

Each family module of ``gemslib.passes`` declares its fusions as ``GRAPH_PATTERNS`` (a tuple of
:class:`GraphPattern`) and ``GRAPH_REWRITES`` (a tuple of :class:`GraphRewrite`); the pass
manager collects them. The backend opens a :class:`CompileRecord` for each compile; the passes
write into it what a warm compile (one that inductor's caches serve, skipping the passes) must
redo: the fusion counts and the parameters merged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch


@dataclass(frozen=True)
class GraphPattern:
    """One form a model writes that an operator computes.

    ``search(*inputs, **scalars)`` is written the way models write it and ``replace`` (same
    signature) calls the operator; both are traced by inductor's pattern matcher with
    ``example_inputs()`` (tensors only) and ``scalars`` (a value for each scalar argument, which
    then matches any value: an epsilon, a scale). A traced pattern keeps node targets and
    structure, but not every constant (a dtype, a dim, an exponent may become a wildcard), so
    ``check(match)`` must prove the matched site is this computation (dtypes, dims, shapes,
    constants); a site it refuses is left to inductor.
    """

    fusion: str  # the name fusion_report() counts it under, and its option's
    search: Callable
    replace: Callable
    example_inputs: Callable[[], Sequence[Any]]
    check: Callable[[Any], bool]
    scalars: Mapping[str, float | int] = field(default_factory=dict)
    # patterns of a lower stage are matched over the whole graph first: a form whose last node
    # another pattern's first could swallow (rotary's final add, read by an add + RMSNorm)
    stage: int = 0


@dataclass(frozen=True)
class GraphRewrite:
    """A fusion that is not one fixed pattern (a varying number of projections of one input,
    parameters merged once): ``rewrite(graph, real_value)`` edits an inductor post-grad
    ``torch.fx.Graph`` in place and returns one description per site it fused.
    ``real_value(placeholder)`` is the real tensor the compiled graph was called with for that
    input (a parameter), or None where it is not known; a rewrite that needs one must leave the
    site alone without it. Rewrites run before the patterns, repeatedly until none fuses
    anything more, so one may build on another's output; ``after_patterns`` ones run after
    the patterns instead (they read the patterns' gemslib nodes, e.g. an rms_norm). Within
    its phase, a rewrite of a higher ``stage`` runs once those of the lower stages have fused
    all they can (it reads what they make, or must not take their sites from them).
    """

    fusion: str  # the name fusion_report() counts it under, and its option's
    rewrite: Callable[[Any, Callable[[Any], Any]], Sequence[str]]
    after_patterns: bool = False
    stage: int = 0


def rows_and_cols(value: Any) -> dict[str, int] | None:
    """``{"rows": .., "cols": ..}`` of a (FakeTensor) value whose sizes are all static: the
    last dim, and the product of the others. None for symbolic sizes or a 0-d value."""
    shape = getattr(value, "shape", None)
    if not shape or not all(isinstance(size, int) for size in shape):
        return None
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return {"rows": rows, "cols": shape[-1]}


# the fusions of the compile in flight that are on only where the tune config's verdicts
# measured them faster (their option "measured"): GemslibPasses sets it while it runs
_measured_only: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "gemslib_measured_only", default=frozenset())


@contextlib.contextmanager
def measured_only(fusions: frozenset[str]):
    """Inside the block, :func:`verdict_allows` lets ``fusions`` replace a site only where a
    verdict says gemslib's path is faster."""
    token = _measured_only.set(frozenset(fusions))
    try:
        yield
    finally:
        _measured_only.reset(token)


def verdict_allows(fusion: str, value: Any) -> bool:
    """Whether the tune config in use lets ``fusion`` replace a site whose main input is
    ``value`` (a FakeTensor): its ``verdicts`` say which path the tuner measured faster per
    rows-and-columns bucket (``python -m gemslib.tune --verdicts``); see
    :func:`verdict_allows_at`."""
    return verdict_allows_at(fusion, rows_and_cols(value))


def verdict_allows_at(fusion: str, shape: Mapping[str, int] | None) -> bool:
    """Whether the tune config in use lets ``fusion`` replace a site of ``shape`` (the keys its
    verdicts bound, e.g. ``rows`` and ``cols``; a key left out where its size is symbolic, so
    that only buckets not bounding it apply). Where it has no verdict for the shape (or
    ``shape`` is None), gemslib's path, but for a fusion on only where measured
    (:func:`measured_only`), which is then left out."""
    from gemslib import runtime

    verdict = None if shape is None else runtime.fusion_verdict(fusion, shape)
    if verdict is None:
        return fusion not in _measured_only.get()
    return verdict == "gemslib"


@dataclass
class CompileRecord:
    """One backend compile: ``inputs`` are the real values its graph's placeholders stand for
    (the backend's example inputs, or with ``leaves`` the plain tensors its tensor subclasses
    hold: see ``manager.compile_record``); the passes, when they run, set ``ran`` and count
    ``fusions`` and the ``merged`` groups of parameters as indices into ``inputs``."""

    inputs: list[Any]
    leaves: bool = False
    state: str = ""  # what of the inputs, besides their metadata, decides a fusion
    ran: bool = False
    fusions: Counter = field(default_factory=Counter)
    merged: list[list[int]] = field(default_factory=list)

    def record_merge(self, tensors: Sequence[torch.Tensor]) -> None:
        """Note that ``tensors`` (some of ``inputs``) were merged into one buffer."""
        positions = {id(value): i for i, value in enumerate(self.inputs)}
        if all(id(t) in positions for t in tensors):
            self.merged.append([positions[id(t)] for t in tensors])


_in_flight: contextvars.ContextVar[CompileRecord | None] = contextvars.ContextVar(
    "gemslib_compile_in_flight", default=None)


def in_flight() -> CompileRecord | None:
    """The record of the backend compile under way, or None (the passes installed by hand, or
    a graph compiled after the backend returned: a training graph's backward)."""
    return _in_flight.get()


@contextlib.contextmanager
def compiling(record: CompileRecord):
    """Make ``record`` the compile in flight inside the block."""
    token = _in_flight.set(record)
    try:
        yield record
    finally:
        _in_flight.reset(token)
