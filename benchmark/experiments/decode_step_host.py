"""Experiment: the host part of one static-cache decode step, and where it goes.

    python -m benchmark.experiments.decode_step_host [--model llama3.2-1b] [--layers 16]
                                                    [--batch 1] [--prompt 128] [--cache 192]
                                                    [--backend gemslib] [--calls 200]

The question it answers (docs/notes/decode.md, the step's host part): what the CPU spends on a
compiled step before and after its CUDA graph's replay, which at B1 the GPU waits for every
token. The step is ``benchmark.decode``'s (same model, cache and compiled step). The stream is
held busy (``torch.cuda._sleep``) for longer than the calls take, so no call waits on the GPU
and the wall time of a call is its host part alone. Printed, us a call: the host part; the same
with dynamo's guards skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``);
``cudagraph_mark_step_begin`` alone (``--no-trees``: inductor's plain cudagraphify instead of
its trees); then a cProfile of the calls, by own time and by
cumulative time (the guards and the replay's C++ are inside the calls that run them).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import time

import torch
import torch._inductor.config

from benchmark import decode
from benchmark.models import MODELS, build_model, input_ids


def _host_us(fn, calls: int) -> float:
    """Median of five blocks of ``calls`` calls, us a call, with the stream held busy ahead of
    each block so that no call waits for the GPU."""
    blocks = []
    for _ in range(5):
        torch.cuda._sleep(int(2e9))  # ~1 s at Hopper's clocks: far longer than the block
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        blocks.append((time.perf_counter() - started) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(blocks)[2]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.decode_step_host")
    parser.add_argument("--model", choices=list(MODELS), default="llama3.2-1b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--cache", type=int, default=192)
    parser.add_argument("--backend", choices=["gemslib", "inductor"], default="gemslib")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--no-trees", action="store_true",
                        help="inductor's plain cudagraphify instead of its CUDA-graph trees")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    if args.no_trees:
        torch._inductor.config.triton.cudagraph_trees = False
    spec = dataclasses.replace(MODELS[args.model], layers=args.layers)
    model = build_model(spec, "cuda", torch.bfloat16).eval()
    ids = input_ids(spec, args.batch, args.prompt, torch.device("cuda"))
    with torch.no_grad():
        step, rewind = decode._step_runner(f"static-{args.backend}", model, ids, args.cache)
        for _ in range(5):
            rewind()
            step()
        torch.cuda.synchronize()
        rewind()

        def call():  # every step at the same fill, as benchmark.decode times it
            rewind()
            step()

        rewinding = _host_us(rewind, args.calls)
        host = _host_us(call, args.calls) - rewinding
        print(f"{spec.title} {args.layers}L B{args.batch} {args.prompt} of {args.cache}, "
              f"backend={args.backend}{' (no trees)' if args.no_trees else ''}: host part {host:.1f} us a call "
              f"(the rewind's {rewinding:.1f} us taken off)")
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                unguarded = _host_us(call, args.calls) - rewinding
            print(f"  with dynamo's guards skipped: {unguarded:.1f} us "
                  f"(guards ~{host - unguarded:.1f} us)")
        except (TypeError, RuntimeError) as err:
            print(f"  guards not skippable here: {err}")
        mark = _host_us(torch.compiler.cudagraph_mark_step_begin, args.calls)
        print(f"  cudagraph_mark_step_begin alone: {mark:.1f} us")
        profiler = cProfile.Profile()
        torch.cuda._sleep(int(2e9))
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
