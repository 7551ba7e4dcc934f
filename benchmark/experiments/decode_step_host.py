"""Experiment: the host's part of one static-cache decode step in its CUDA graph.

    python -m benchmark.experiments.decode_step_host [--model llama3-8b] [--layers 8]
                                                    [--batch 16] [--prompt 128] [--cache 192]
                                                    [--backend gemslib]

``decode_step_kernels`` found the GPU idle for ~320-360 us at the start of every step, between
the cudagraph tree's input copy (a ``multi_tensor_apply`` kernel) and the graph's first kernel,
under both backends: host time the step's CUDA events include, as transformers' loop (which
synchronises every step) pays it. Here the step is built as ``benchmark.decode`` builds it; it
prints the host time of a call (wall clock around ``step()`` alone, the GPU idle before it),
the same with the GPU time of the call (synchronised), and cProfile's top entries over 50
calls, by cumulative and by own time. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import statistics
import time

import torch

from benchmark import decode
from benchmark.models import MODELS, build_model, input_ids


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.decode_step_host")
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--cache", type=int, default=192)
    parser.add_argument("--backend", choices=["gemslib", "inductor"], default="gemslib")
    args = parser.parse_args(argv)
    spec = dataclasses.replace(MODELS[args.model], layers=args.layers)
    model = build_model(spec, "cuda", torch.bfloat16).eval()
    ids = input_ids(spec, args.batch, args.prompt, torch.device("cuda"))
    with torch.no_grad():
        step, rewind = decode._step_runner(f"static-{args.backend}", model, ids, args.cache)
        for _ in range(10):
            rewind()
            step()
        host, whole = [], []
        for _ in range(50):
            rewind()
            torch.cuda.synchronize()
            started = time.perf_counter()
            step()
            host.append((time.perf_counter() - started) * 1e6)
            torch.cuda.synchronize()
            whole.append((time.perf_counter() - started) * 1e6)
        profiler = cProfile.Profile()
        for _ in range(50):
            rewind()
            torch.cuda.synchronize()
            profiler.enable()
            step()
            profiler.disable()
            torch.cuda.synchronize()
    print(f"{spec.title} {args.layers}L B{args.batch} {args.prompt} of {args.cache}, "
          f"backend={args.backend}: host {statistics.median(host):.1f} us a call "
          f"(min {min(host):.1f}), call to synchronised {statistics.median(whole):.1f} us")
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(35)
        print(f"\ncProfile over 50 calls, by {order}:")
        print("\n".join(line[:160] for line in text.getvalue().splitlines()[6:]))


if __name__ == "__main__":
    main()
