"""Experiment: the kernels of one static-cache decode step in its CUDA graph, and the gaps
between them.

    python -m benchmark.experiments.decode_step_kernels [--model llama3-8b] [--layers 8]
                                                       [--batch 16] [--prompt 128] [--cache 192]
                                                       [--backend gemslib]

The question it answers: what a static-cache step spends over its floor, kernel by kernel
(docs/notes/decode.md, open questions). The step is built as ``benchmark.decode`` builds it
(the same model, cache and compiled step), replayed a few times, then profiled over 5 replays
(torch.profiler, CUDA activity). It prints the kernels of one replay in order (name,
microseconds, the idle gap before it), the sums per kernel name, and the totals: busy time,
idle time between kernels, the step's wall time from the first kernel's start to the last
one's end.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark import decode
from benchmark.models import MODELS, build_model, input_ids


def _kernels(trace_events, copies: bool = False) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of the CUDA kernels (with ``copies``: of the memcpy and
    memset nodes instead), in start order."""
    kernels = [(event.name, event.time_range.start, event.time_range.elapsed_us())
               for event in trace_events if event.device_type == torch.autograd.DeviceType.CUDA
               and event.name.startswith(("Memcpy", "Memset")) == copies]
    return sorted(kernels, key=lambda kernel: kernel[1])


def add_step_arguments(parser: argparse.ArgumentParser, model: str, layers: int,
                       batch: int) -> None:
    """The step's arguments (model, layers, batch, prompt, cache, backend, module guards),
    shared with the other decode-step experiments."""
    parser.add_argument("--model", choices=list(MODELS), default=model)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--cache", type=int, default=192)
    parser.add_argument("--backend", choices=["gemslib", "inductor"], default="gemslib")
    parser.add_argument("--no-module-guards", action="store_true",
                        help="dynamo's guards on the model's modules dropped "
                             "(benchmark.decode.static_compile_arguments)")


def warmed_step(args: argparse.Namespace):
    """(spec, step, rewind): ``benchmark.decode``'s compiled step for ``args``, replayed five
    times and rewound, the GPU idle. Call it under ``torch.no_grad()``."""
    spec = dataclasses.replace(MODELS[args.model], layers=args.layers)
    model = build_model(spec, "cuda", torch.bfloat16).eval()
    ids = input_ids(spec, args.batch, args.prompt, torch.device("cuda"))
    step, rewind = decode._step_runner(f"static-{args.backend}", model, ids, args.cache,
                                       module_guards=not args.no_module_guards)
    for _ in range(5):
        rewind()
        step()
    torch.cuda.synchronize()
    rewind()
    torch.cuda.synchronize()
    return spec, step, rewind


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.decode_step_kernels")
    add_step_arguments(parser, model="llama3-8b", layers=8, batch=16)
    args = parser.parse_args(argv)
    with torch.no_grad():
        spec, step, rewind = warmed_step(args)
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            step()
            torch.cuda.synchronize()
    one = _kernels(trace.events())
    busy = sum(duration for _, _, duration in one)
    wall = one[-1][1] + one[-1][2] - one[0][1]
    gaps = [0.0] + [max(0.0, one[i][1] - (one[i - 1][1] + one[i - 1][2]))
                    for i in range(1, len(one))]
    print(f"{spec.title} {args.layers}L B{args.batch} {args.prompt} of {args.cache}, "
          f"backend={args.backend}: {len(one)} kernels a step")
    for (name, _, duration), gap in zip(one, gaps):
        print(f"  {gap:7.2f} gap  {duration:8.2f} us  {name[:90]}")
    by_name = collections.defaultdict(list)
    for name, _, duration in one:
        by_name[name[:90]].append(duration)
    print("\nper kernel name: count, sum us, median us")
    for name, durations in sorted(by_name.items(), key=lambda item: -sum(item[1])):
        print(f"  {len(durations):4d} {sum(durations):9.1f} {statistics.median(durations):8.2f}  "
              f"{name}")
    copies = _kernels(trace.events(), copies=True)
    print(f"\n{len(copies)} memcpy/memset nodes, {sum(c[2] for c in copies):.1f} us: "
          + ", ".join(sorted({name[:40] for name, _, _ in copies})))
    gap_after = collections.defaultdict(list)
    for i in range(1, len(one)):
        gap_after[one[i][0][:60]].append(gaps[i])
    print("\nidle before each kernel name: count, sum us, median us, max us")
    for name, before in sorted(gap_after.items(), key=lambda item: -sum(item[1])):
        print(f"  {len(before):4d} {sum(before):8.1f} {statistics.median(before):7.2f} "
              f"{max(before):7.2f}  {name}")
    print("\nthe 12 largest gaps: us, the kernel before -> the kernel after")
    for i in sorted(range(1, len(one)), key=lambda i: -gaps[i])[:12]:
        print(f"  {gaps[i]:7.2f}  {one[i - 1][0][:50]} -> {one[i][0][:50]}")
    print(f"\nbusy {busy:.1f} us, idle between kernels {sum(gaps):.1f} us "
          f"({len(one) - 1} boundaries, median gap {statistics.median(gaps[1:] or [0]):.2f}), "
          f"first start to last end {wall:.1f} us")


if __name__ == "__main__":
    main()
