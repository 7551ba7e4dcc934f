"""Host-side helpers for launches: the device's name and SM count, the current stream's raw
handle, CUDA-graph capture, kept scratch memory for split reductions, and integer helpers
that are cheaper than Triton's from Python."""

from __future__ import annotations

import functools
import re
import threading
from typing import Any, Callable

import torch

from gemslib.runtime import env


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device_index: int) -> int:
    """SMs of a CUDA device, for grids sized to fill it (1 under the interpreter, which runs
    one program at a time)."""
    if env.INTERPRETER:
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


def in_split_scratch(pointer: int) -> tuple[int, int, int, int] | None:
    """(n_counters, n_floats, which of the pair, byte offset) of a pointer into a kept
    :func:`split_scratch` pair, which a plan fetches again for the stream it runs on."""
    for (_, _, _, n_counters, n_floats), pair in _split_scratch_cache.items():
        for which, t in enumerate(pair):
            start = t.data_ptr()
            if start <= pointer < start + t.numel() * t.element_size():
                return n_counters, n_floats, which, pointer - start
    return None


def next_power_of_2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (Triton's is a constexpr function: slow from Python);
    1 for n <= 1."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division (``triton.cdiv`` is a jit function: slow to call from Python)."""
    return -(-a // b)


def normalize_device_name(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia_h200"``: lower case, runs of other characters -> ``_``."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def device_name() -> str:
    """Normalized name of the current device, ``"interpreter"``, or ``"no_gpu"``.

    Initialises CUDA, so it is only called when a kernel is about to run.
    """
    if env.INTERPRETER:
        return "interpreter"
    if not torch.cuda.is_available():
        return "no_gpu"
    return normalize_device_name(torch.cuda.get_device_name())
