"""A compiled step replayed from a CUDA graph of its own: the backend's lean alternative to
inductor's CUDA-graph trees for a graph called over and over with one signature (a decode
step), behind the backend option ``gemslib.step_graphs``: by default (``"auto"``) taken for a
graph whose outputs are small (``backend.AUTO_OUTPUT_BYTES``), since each replay copies them;
``GEMSLIB_STEP_GRAPHS=1`` / ``0`` takes it always / never.

Per call the trees run a few hundred microseconds of Python (docs/notes/decode.md, the
step's host part); a :class:`StepGraph` runs one pointer check, one copy of the inputs that
move, the replay and a copy of each output:

1. the first ``WARMUP_CALLS`` calls run the compiled step as it is (compiles, autotuning,
   call plans), and note each tensor input's address;
2. the next call captures the step: an input whose address stayed put (parameters, buffers,
   a static cache) is read in place and checked on every later call; one that moved (the
   token, its positions) gets a static twin that each call copies it into;
3. every later call with the same static addresses and the same moving inputs' layouts
   replays the graph and returns copies of its outputs, so that no output a caller keeps is
   rewritten by the next replay (the trees return the graph's own buffers and raise when an
   overwritten one is read; a runner that cannot raise must not hand them out).

A call with a static input at another address captures the step again with that input
among the moving ones (at most ``RECAPTURES`` times); a call with a moving input of another
layout runs the compiled step without a graph. A step compiled with dynamic sizes gets them
as numbers among its inputs: :class:`StepGraphs` keeps a :class:`StepGraph` for each set of
their values (``SIZES`` at most; calls of further sizes run without a graph), as inductor's
trees record one graph a size. A step that cannot be captured safely (a
symbolic size among its inputs, a tensor off the GPU, an output that aliases an input, an
input the step writes that moves between calls (its twin would take the write), a capture
that fails, too many recaptures) runs without a graph from then on, said once in the log.
"""

from __future__ import annotations

import array
import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("gemslib.passes")

WARMUP_CALLS = 2
RECAPTURES = 2
SIZES = 8  # captured graphs a step keeps, one a set of dynamic sizes (each its own memory)


def _new_graph():
    return torch.cuda.CUDAGraph()


def _side_stream():
    return torch.cuda.Stream()


def _on_stream(stream, step: Callable[[], Any]):
    """``step()`` run on ``stream``, ordered after the current stream's work and before its
    next (the warm-up that precedes a capture on that stream: what a kernel allocates per
    stream, gemslib's split scratch, is then there before the capture)."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        outputs = step()
    current.wait_stream(stream)
    return outputs


def _record(graph, stream, step: Callable[[], Any]):
    """``step()``'s kernels captured into ``graph`` on ``stream`` (run by its replays, not
    now); returns its outputs, which every replay rewrites."""
    with torch.cuda.graph(graph, stream=stream):
        return step()


def _on_gpu(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda


def packed_pairs(indices: list[int], pointers: list[int]) -> bytes:
    """The (index, pointer) pairs as the native ``same_data_ptrs`` reads them: int64 bytes."""
    return array.array("q", [value for pair in zip(indices, pointers) for value in pair]).tobytes()


def _pointer_check(indices: list[int], pointers: list[int]) -> Callable[[Sequence[Any]], bool]:
    """``check(args)``: whether ``args[i].data_ptr() == pointers[k]`` for each ``indices[k] =
    i``. Run on every call over every static input (a step's parameters and cache: ~200 at
    16 layers), so in gemslib's native module where it is built (~7 ns a tensor on a CPU
    that takes ~110 ns a tensor in a Python loop), else in torch's C++ check (CUDA builds),
    else that loop."""
    from gemslib.runtime import native

    built = native.module()
    if built is not None:
        packed = packed_pairs(indices, pointers)
        return lambda args: built.same_data_ptrs(args, packed)
    checker = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if checker is not None:  # its pointers are indexed by the input's index, as args are
        by_input: list[int | None] = [None] * (max(indices, default=-1) + 1)
        for index, pointer in zip(indices, pointers):
            by_input[index] = pointer
        return lambda args: checker(list(args), by_input, indices)
    return lambda args: all(args[i].data_ptr() == pointer
                            for i, pointer in zip(indices, pointers))


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.storage_offset()


class StepGraph:
    """``compiled`` (a compiled graph's callable, called with its inputs as positional
    arguments) replayed from one CUDA graph, as the module docstring says, for calls whose
    number inputs (dynamic sizes) have one set of values: :class:`StepGraphs` keys them."""

    def __init__(self, compiled: Callable):
        self.compiled = compiled
        self.calls = 0
        self.warmup_pointers: list[int | None] | None = None
        self.graph = None
        self.static_indices: list[int] = []
        self.static_pointers: list[int] = []
        self.static_check: Callable[[Sequence[Any]], bool] = lambda args: True
        self.moving_indices: list[int] = []
        self.twins: list[torch.Tensor] = []
        self.twin_layouts: list[tuple] = []
        self.outputs: Any = None
        self.recaptures = 0
        self.stream = None  # the capture's stream, warmed up by the last warm-up call
        self.written: set[int] = set()  # inputs the step writes (their versions moved)
        self.unsafe: str | None = None  # why the step runs without a graph

    def __call__(self, *args):
        if self.unsafe is not None:
            return self.compiled(*args)
        self.calls += 1
        if self.graph is None:
            reason = self._why_not_capturable(args)
            if reason is not None:
                return self._give_up(reason, args)
            if self.calls <= WARMUP_CALLS:
                self.warmup_pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else None
                                        for a in args]
                versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
                if self.calls < WARMUP_CALLS:
                    outputs = self.compiled(*args)
                else:  # the last warm-up on the stream the capture will use
                    self.stream = _side_stream()
                    outputs = _on_stream(self.stream, lambda: self.compiled(*args))
                self.written |= {i for i, (a, version) in enumerate(zip(args, versions))
                                 if version is not None and a._version != version}
                return outputs
            return self._capture(args)
        if not self.static_check(args):
            return self._recapture(args)
        if not self._moving_layouts_match(args):
            return self.compiled(*args)
        if self.moving_indices:
            torch._foreach_copy_(self.twins, [args[i] for i in self.moving_indices])
        self.graph.replay()
        return self._copied_outputs()

    def _why_not_capturable(self, args) -> str | None:
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                if not _on_gpu(arg):
                    return f"input {index} is on {arg.device}, not a CUDA device"
            elif isinstance(arg, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return f"input {index} is a symbolic size (a dynamic shape)"
        return None

    def _give_up(self, reason: str, args):
        self.unsafe = reason
        log.warning("gemslib step_graphs: this step runs without a CUDA graph: %s", reason)
        return self.compiled(*args)

    def _capture(self, args):
        """Capture the step for ``args``, replay it once (a capture computes nothing) and
        return copies of its outputs."""
        pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.static_indices = [i for i in tensors if pointers[i] == self.warmup_pointers[i]]
        self.moving_indices = [i for i in tensors if pointers[i] != self.warmup_pointers[i]]
        self.static_pointers = [pointers[i] for i in self.static_indices]
        self.static_check = _pointer_check(self.static_indices, self.static_pointers)
        written_moving = sorted(self.written.intersection(self.moving_indices))
        if written_moving:  # its twin would take the write, not the caller's tensor
            return self._give_up(f"input {written_moving[0]} is written by the step and comes "
                                 f"at another address each call", args)
        self.twins = [args[i].clone() for i in self.moving_indices]
        self.twin_layouts = [_layout(args[i]) for i in self.moving_indices]
        graph_args = list(args)
        for i, twin in zip(self.moving_indices, self.twins):
            graph_args[i] = twin
        torch.cuda.synchronize()
        graph = _new_graph()
        try:
            outputs = _record(graph, self.stream, lambda: self.compiled(*graph_args))
        except Exception as err:  # what the graph cannot hold (a sync, a host read): no graph
            return self._give_up(f"the capture failed: {type(err).__name__}: {err}", args)
        inputs = {t.untyped_storage().data_ptr() for t in graph_args
                  if isinstance(t, torch.Tensor)}
        if any(isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in inputs
               for out in _flat(outputs)):
            return self._give_up("an output aliases an input", args)
        self.graph, self.outputs = graph, outputs
        self.graph.replay()
        return self._copied_outputs()

    def _recapture(self, args):
        """A static input came at another address: capture again with it moving."""
        if self.recaptures >= RECAPTURES:
            return self._give_up(f"static inputs moved again after {RECAPTURES} recaptures",
                                 args)
        self.recaptures += 1
        moved = {i for i, pointer in zip(self.static_indices, self.static_pointers)
                 if args[i].data_ptr() != pointer}
        # the addresses as the capture compares them: the moved inputs (and those that
        # moved before) differ, every other input is where it was
        self.warmup_pointers = [None if i in moved or i in self.moving_indices else
                                (a.data_ptr() if isinstance(a, torch.Tensor) else None)
                                for i, a in enumerate(args)]
        self.graph, self.outputs = None, None
        return self._capture(args)

    def _moving_layouts_match(self, args) -> bool:
        return all(isinstance(args[i], torch.Tensor) and _layout(args[i]) == layout
                   for i, layout in zip(self.moving_indices, self.twin_layouts))

    def _copied_outputs(self):
        return _map(lambda out: out.clone() if isinstance(out, torch.Tensor) else out,
                    self.outputs)


def _flat(outputs) -> list:
    if isinstance(outputs, (list, tuple)):
        return [leaf for item in outputs for leaf in _flat(item)]
    return [outputs]


def _map(fn, outputs):
    if isinstance(outputs, list):
        return [_map(fn, item) for item in outputs]
    if isinstance(outputs, tuple):
        return tuple(_map(fn, item) for item in outputs)
    return fn(outputs)


class StepGraphs:
    """The backend's wrapper of ``compiled``: a :class:`StepGraph` for each set of values of
    its number inputs (a dynamic size's value at run time; none for a step of static
    shapes), ``SIZES`` at most. What makes one StepGraph refuse its step (a capture that
    fails, an output aliasing an input, ...) is the step's, so every size then runs without
    a graph."""

    def __init__(self, compiled: Callable):
        self.compiled = compiled
        self.value_indices: list[int] | None = None
        self.by_sizes: dict[tuple, StepGraph] = {}
        self.unsafe: str | None = None
        self.told_too_many = False

    def __call__(self, *args):
        if self.unsafe is not None:
            return self.compiled(*args)
        if self.value_indices is None:
            self.value_indices = [i for i, a in enumerate(args)
                                  if not isinstance(a, torch.Tensor)]
        sizes = tuple(args[i] for i in self.value_indices)
        runner = self.by_sizes.get(sizes)
        if runner is None:
            if len(self.by_sizes) >= SIZES:
                if not self.told_too_many:
                    self.told_too_many = True
                    log.warning("gemslib step_graphs: more than %d sizes of one step; the "
                                "others run without a CUDA graph", SIZES)
                return self.compiled(*args)
            runner = self.by_sizes[sizes] = StepGraph(self.compiled)
        outputs = runner(*args)
        self.unsafe = runner.unsafe
        return outputs
