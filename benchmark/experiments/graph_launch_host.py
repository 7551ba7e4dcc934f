"""Experiment: what a CUDA graph's launch costs the host, and how much of it the GPU waits for,
by the graph's kernel count and kind.

    python -m benchmark.experiments.graph_launch_host [--kernels 16 64 256] [--samples 30]

The question it answers (docs/notes/decode.md, the step's host part): a B1 decode step's host
part grows with its layers, and cProfile puts a large share of it inside
``CUDAGraph.replay``. If the launch's host time grows with the graph's kernel nodes, and the
GPU waits for the whole graph to be submitted before its first kernel, then fewer, fuller
kernels a layer cut the step's call time twice (launch and boundaries), and splitting the
step's graph would overlap the submission with the GPU's work.

Graphs of N launches of one kind (also split into ``--parts`` graphs replayed one after
another), each kernel touching one element (so the GPU's work is the launches alone):
torch's ``add_`` (an aten elementwise kernel), a Triton kernel, the same Triton kernel
launched dependent (``launch_pdl``, waiting in ``griddepcontrol.wait``: the programmatic
edges gemslib's step kernels have), and cuBLAS's 1x256 @ 256x256 ``mm``.
Printed per kind and N, us (least and median over the samples):
- host: ``graph.replay()``'s wall time with the stream held busy (a sleep kernel queued
  first), so the launch never waits for the GPU;
- GPU, busy: CUDA events around the replay queued behind the sleep (the graph's execution
  alone, its submission hidden);
- GPU, idle: the same events on an idle stream (the submission exposed): idle - busy is what
  the GPU waits for the host's launch.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

SLEEP_CYCLES = 5_000_000  # ~3 ms at Hopper's clocks: longer than any launch timed here


@triton.jit
def _bump(x_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _launches(kind: str, count: int):
    """``fn(part, parts)``: that part's share of ``count`` launches of ``kind`` on the
    current stream."""
    x = torch.zeros(1, device="cuda")
    if kind == "torch add_":
        def launch():
            x.add_(1)
    elif kind in ("triton", "triton, dependent"):
        dependent = kind == "triton, dependent"

        def launch():
            _bump[(1,)](x, PDL=dependent, launch_pdl=dependent)
    elif kind == "cuBLAS mm":
        a = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, 256, device="cuda", dtype=torch.bfloat16)

        def launch():
            torch.mm(a, b, out=out)
    else:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")

    def share(part: int, parts: int):
        for _ in range(count * (part + 1) // parts - count * part // parts):
            launch()
    return share


KINDS = ("torch add_", "triton", "triton, dependent", "cuBLAS mm")


def _captured(fn, parts: int = 1):
    """The launches of ``fn`` captured into ``parts`` graphs (``fn(part, parts)`` makes that
    part's share); returns a function replaying them one after another."""
    for part in range(parts):
        fn(part, parts)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graphs = []
    for part in range(parts):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            fn(part, parts)

    def replay():
        for graph in graphs:
            graph.replay()
    replay()
    torch.cuda.synchronize()
    return replay


def _timed(replay, samples: int) -> dict[str, list[float]]:
    """{"host", "GPU, busy", "GPU, idle"}: us of each sample."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    figures = {"host": [], "GPU, busy": [], "GPU, idle": []}
    for _ in range(samples):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        began = time.perf_counter()
        replay()
        figures["host"].append((time.perf_counter() - began) * 1e6)
        end.record()
        torch.cuda.synchronize()
        figures["GPU, busy"].append(start.elapsed_time(end) * 1e3)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        figures["GPU, idle"].append(start.elapsed_time(end) * 1e3)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.graph_launch_host")
    parser.add_argument("--kernels", type=int, nargs="+", default=[16, 64, 256],
                        help="kernel launches a graph")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2],
                        help="graphs the launches are split into, replayed one after another "
                             "(does the second's submission hide under the first's work?)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch_host: needs a CUDA GPU; nothing was run.")
        return 1
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton "
          f"{triton.__version__}; us per replay, least / median of {args.samples}")
    print(f"{'kind':<20} {'kernels':>7} {'graphs':>6} {'host':>15} {'GPU, busy':>15} "
          f"{'GPU, idle':>15} {'idle - busy':>11}")
    for kind in args.kinds:
        for count in args.kernels:
            for parts in args.parts:
                try:
                    figures = _timed(_captured(_launches(kind, count), parts), args.samples)
                except Exception as err:  # a kind this torch or driver cannot capture
                    print(f"{kind:<20} {count:>7} {parts:>6} failed: {type(err).__name__}: "
                          f"{str(err)[:120]}")
                    continue
                least = {name: min(values) for name, values in figures.items()}
                median = {name: statistics.median(values) for name, values in figures.items()}
                cells = " ".join(f"{least[name]:7.1f} /{median[name]:6.1f}" for name in figures)
                print(f"{kind:<20} {count:>7} {parts:>6} {cells} "
                      f"{median['GPU, idle'] - median['GPU, busy']:>11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
