"""Experiment: how much of a compiled prefill forward is the host's, and what the direct
launch changes in it.

    python -m benchmark.experiments.prefill_host [--model qwen2-7b] [--way gemslib]

Builds the benchmark's real-config model (random weights, bf16, B1 S4096, the last position's
logits), compiles it the way ``python -m benchmark --models`` does, and prints, with the direct
launch on and off (``runtime.DIRECT_LAUNCH``): the median time until the call returns
(``enqueue``: the host's work, the GPU running behind it) and until the GPU is done (``wall``).
Where enqueue is a large part of wall, the GPU waits on the host at the start of the forward
(until the first large GEMM is queued), and host time per call shows in the forward's time.
Then torch.profiler's CPU view: the ops with the most host time. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import argparse
import time

import torch


def measure(runner, ids, reps: int = 10) -> tuple[float, float]:
    """(median enqueue ms, median wall ms) of ``reps`` calls, each from an idle GPU."""
    enqueue, wall = [], []
    with torch.no_grad():
        for _ in range(3):
            runner(input_ids=ids, logits_to_keep=1, use_cache=False)
        for _ in range(reps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            runner(input_ids=ids, logits_to_keep=1, use_cache=False)
            returned = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            enqueue.append((returned - started) * 1e3)
            wall.append((done - started) * 1e3)
    return sorted(enqueue)[reps // 2], sorted(wall)[reps // 2]


def main(model_name: str, way: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmark import models
    from gemslib import runtime

    spec = models.model_spec(model_name)
    model = models.build_model(spec, "cuda", torch.bfloat16)
    model, _, _ = models._prepare_way(way, model)
    runner = models._compiled(way, model) if way in models.COMPILED_WAYS else model
    ids = models.input_ids(spec, 1, 4096, "cuda")
    for label, switched_off in (("direct launch", False), ("Triton's binding", True)):
        if switched_off:
            with runtime.DIRECT_LAUNCH.switched_off():
                enqueue, wall = measure(runner, ids)
        else:
            enqueue, wall = measure(runner, ids)
        print(f"{model_name} {way}, {label}: enqueue {enqueue:.2f} ms, wall {wall:.2f} ms",
              flush=True)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(3):
            runner(input_ids=ids, logits_to_keep=1, use_cache=False)
        torch.cuda.synchronize()
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                     max_name_column_width=60))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-7b")
    parser.add_argument("--way", default="gemslib")
    arguments = parser.parse_args()
    main(arguments.model, arguments.way)
