"""Experiment: the host part of one static-cache decode step, and where it goes.

    python -m benchmark.experiments.decode_step_host [--model llama3.2-1b] [--layers 16]
                                                    [--batch 1] [--prompt 128] [--cache 192]
                                                    [--backend gemslib] [--calls 8 --rounds 15]

The question it answers (docs/notes/decode.md, the step's host part): what the CPU spends on a
compiled step before and after its CUDA graph's replay, which at B1 the GPU waits for every
token. The step is ``benchmark.decode``'s (same model, cache and compiled step). The stream is
held busy (``torch.cuda._sleep``) for longer than a block of calls takes, so no call waits on
the GPU and the wall time of a call is its host part alone; the blocks of each figure
alternate, the least kept. Printed, us a call: the host part; the same with dynamo's guards
skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``);
``cudagraph_mark_step_begin`` alone (``--no-trees``: inductor's plain cudagraphify instead of
its trees); the host time of the step's CUDA graph launch inside real calls
(``CUDAGraph.replay`` timed: the driver's part); then a cProfile of one block, by own time
and by cumulative time (the guards and the replay's C++ are inside the calls that run
them). The graph is not replayed alone: on the H100 a lone replay of gemslib's step tripped
an embedding's index check (its inputs' memory is the trees' to reuse between calls).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import time

import torch
import torch._inductor.config

from benchmark.experiments.decode_step_kernels import add_step_arguments, warmed_step


def _least_host_us(timed: dict, calls: int, rounds: int) -> dict:
    """{name: us a call}: each of ``timed`` ({name: (fn, context factory)}) run in blocks of
    ``calls`` calls, the blocks of the names alternating for ``rounds`` rounds, the least block
    kept (the host's speed drifts by more than the parts differ). The stream is held busy
    ahead of each block so that no call waits for the GPU, and a block is short enough (a few
    dozen launches) that the launch queue never fills."""
    least = {name: float("inf") for name in timed}
    for _ in range(rounds):
        for name, (fn, context) in timed.items():
            with context():
                torch.cuda._sleep(int(1e8))  # ~60 ms at Hopper's clocks: longer than a block
                started = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = time.perf_counter() - started
            torch.cuda.synchronize()
            least[name] = min(least[name], elapsed / calls * 1e6)
    return least


def _graph_launch_us(call, calls: int, rounds: int) -> float | None:
    """Host us a call spends in ``CUDAGraph.replay`` (the driver's ``cudaGraphLaunch``), the
    least block of ``rounds`` (the stream held busy as in :func:`_least_host_us`, so the
    launch never waits for the GPU); None where no graph was replayed. Timed by wrapping the
    method, not by torch.profiler: CUPTI's tracing of the graph's kernels inflates the launch
    (it read more than the whole call)."""
    replay = torch.cuda.CUDAGraph.replay
    spent = [0.0, 0]

    def timed_replay(graph, *args, **kwargs):
        started = time.perf_counter()
        try:
            return replay(graph, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started
            spent[1] += 1

    least = float("inf")
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        for _ in range(rounds):
            spent[:] = [0.0, 0]
            torch.cuda._sleep(int(1e8))
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
            if spent[1]:
                least = min(least, spent[0] / calls * 1e6)
    finally:
        torch.cuda.CUDAGraph.replay = replay
    return None if least == float("inf") else least


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.decode_step_host")
    add_step_arguments(parser, model="llama3.2-1b", layers=16, batch=1)
    parser.add_argument("--calls", type=int, default=8, help="calls a timed block")
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds of blocks")
    parser.add_argument("--no-trees", action="store_true",
                        help="inductor's plain cudagraphify instead of its CUDA-graph trees")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if args.no_trees:
        torch._inductor.config.triton.cudagraph_trees = False
    with torch.no_grad():
        spec, step, rewind = warmed_step(args)

        def call():  # every step at the same fill, as benchmark.decode times it
            rewind()
            step()

        timed = {"call": (call, contextlib.nullcontext), "rewind": (rewind, contextlib.nullcontext),
                 "mark_step": (torch.compiler.cudagraph_mark_step_begin, contextlib.nullcontext)}
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                call()
            timed["unguarded"] = (call, lambda: torch.compiler.set_stance(
                "default", skip_guard_eval_unsafe=True))
        except (TypeError, RuntimeError) as err:
            print(f"  guards not skippable here: {err}")
        least = _least_host_us(timed, args.calls, args.rounds)
        host = least["call"] - least["rewind"]
        print(f"{spec.title} {args.layers}L B{args.batch} {args.prompt} of {args.cache}, "
              f"backend={args.backend}{' (no trees)' if args.no_trees else ''}: host part "
              f"{host:.1f} us a call (least of {args.rounds} rounds of {args.calls} calls; the "
              f"rewind's {least['rewind']:.1f} us taken off)")
        if "unguarded" in least:
            unguarded = least["unguarded"] - least["rewind"]
            print(f"  with dynamo's guards skipped: {unguarded:.1f} us "
                  f"(guards ~{host - unguarded:.1f} us)")
        print(f"  cudagraph_mark_step_begin alone: {least['mark_step']:.1f} us")
        launch = _graph_launch_us(call, args.calls, args.rounds)
        if launch is None:
            print("  no CUDA graph replayed in a call (the step is not CUDA-graphed)")
        else:
            print(f"  the step's CUDA graph launch (CUDAGraph.replay inside a call): "
                  f"{launch:.1f} us")
        profiler = cProfile.Profile()
        torch.cuda._sleep(int(1e8))
        profiler.enable()
        for _ in range(args.calls):
            call()
        profiler.disable()
        torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.top)
        print(f"\ncProfile over {args.calls} calls, by {order}:")
        print("\n".join(line[:200] for line in text.getvalue().splitlines()
                        if line.strip())[:12000])


if __name__ == "__main__":
    main()
