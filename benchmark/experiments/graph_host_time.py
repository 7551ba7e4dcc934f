"""Experiment: where a compiled forward's host time goes, against its GPU time.

    python -m benchmark.experiments.graph_host_time [--model llama3.2-1b] [--shape 1x2048]
        [--layers N] [--backend gemslib|inductor] [--mode reduce-overhead] [--top 25] [--tiny]

One model of ``gemslib.models`` (random weights, bf16, prefill of B x S tokens, the logits of
the last position, no cache: what ``python -m benchmark --models`` times), compiled with
``fullgraph=True, dynamic=False``; run one backend per process, as the benchmark does. After
three warm-up calls it prints, per forward:

- ``wall``: CUDA events around 20 calls, median;
- ``host``: the call's return time with the GPU idle before it (nothing waits on the GPU, so
  this is the time to enqueue the forward; where it is above ``gpu``, the forward is
  host-bound and ``wall`` follows it);
- ``gpu``: the kernels' time in a torch.profiler trace of 5 calls, then its kernels by name
  (GPU us a forward, launches a forward);
- the profiler's rows by self CPU time a forward (dispatcher ops, gemslib's included, and the
  CUDA runtime's launch calls), then cProfile's Python functions by own time over 5 calls
  (cProfile's own cost inflates them; compare rows with each other, not with ``host``);
- per graph overload, the signatures planned and those not (yet), and its calls a forward
  that the C++ replay served.

Without a CUDA GPU it runs ``--tiny`` in the Triton interpreter: the path is the same, the
times mean nothing. Findings: docs/notes/host-path.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time


def main(argv=None) -> int:
    import torch

    from gemslib import models
    from gemslib.cli import size_pair

    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.graph_host_time")
    parser.add_argument("--model", choices=list(models.MODELS), default="llama3.2-1b")
    parser.add_argument("--shape", type=size_pair("BxS"), default=(1, 2048), metavar="BxS")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--backend", choices=("gemslib", "inductor"), default="gemslib")
    parser.add_argument("--mode", default=None, help="torch.compile's mode")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tiny", action="store_true", help="the model at interpreter size")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    spec = models.MODELS[args.model]
    if args.tiny or not on_gpu:
        spec = spec.tiny()
    if args.layers is not None:
        import dataclasses
        spec = dataclasses.replace(spec, layers=args.layers)
    device = "cuda" if on_gpu else "cpu"
    import gemslib  # noqa: F401  (registers the "gemslib" backend)

    model = models.build_model(spec, device, torch.bfloat16 if on_gpu else torch.float32)
    batch, seq = args.shape if on_gpu and not args.tiny else (1, 16)
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=generator).to(device)
    compiled = torch.compile(model, backend=args.backend, mode=args.mode, fullgraph=True,
                             dynamic=False)

    def forward():
        return compiled(input_ids=ids, use_cache=False, logits_to_keep=1)

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            forward()
        sync()
        print(f"{spec.title}, {spec.layers} layers, B{batch} S{seq}, backend={args.backend}"
              f"{', mode=' + args.mode if args.mode else ''}, {device}")
        if on_gpu:
            walls = []
            for _ in range(20):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                forward()
                end.record()
                end.synchronize()
                walls.append(start.elapsed_time(end))
            print(f"wall {statistics.median(walls):.3f} ms")
        hosts = []
        for _ in range(10):
            sync()
            started = time.perf_counter()
            forward()
            hosts.append((time.perf_counter() - started) * 1e3)
        sync()
        print(f"host {statistics.median(hosts):.3f} ms (enqueue, GPU idle before)")
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
        with torch.profiler.profile(activities=activities) as trace:
            for _ in range(5):
                forward()
            sync()
        rows = trace.key_averages()
        if on_gpu:
            gpu_us = sum(row.self_device_time_total for row in rows
                         if row.device_type == torch.autograd.DeviceType.CUDA)
            print(f"gpu  {gpu_us / 5 / 1e3:.3f} ms (kernels, profiler)")
            print(f"\nkernels by GPU time a forward (top {args.top}):")
            print(f"{'us/forward':>11} {'calls/fwd':>9} {'us/call':>8}  name")
            gpu_rows = sorted((row for row in rows if row.self_device_time_total > 0 and
                               row.device_type == torch.autograd.DeviceType.CUDA),
                              key=lambda row: -row.self_device_time_total)
            for row in gpu_rows[:args.top]:
                print(f"{row.self_device_time_total / 5:11.1f} {row.count / 5:9.1f} "
                      f"{row.self_device_time_total / max(row.count, 1):8.2f}  {row.key[:90]}")
        print(f"\nprofiler rows by self CPU time a forward (top {args.top}):")
        print(f"{'us/forward':>11} {'calls/fwd':>9} {'us/call':>8}  name")
        cpu_rows = sorted((row for row in rows if row.self_cpu_time_total > 0),
                          key=lambda row: -row.self_cpu_time_total)
        for row in cpu_rows[:args.top]:
            print(f"{row.self_cpu_time_total / 5:11.1f} {row.count / 5:9.1f} "
                  f"{row.self_cpu_time_total / max(row.count, 1):8.2f}  {row.key[:90]}")
        from gemslib.runtime.custom_op import GRAPH_PLANS

        replays_before = {name: _native_replays(plans) for name, plans in GRAPH_PLANS.items()}
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            forward()
        profile.disable()
        sync()
        print("\ngraph overloads' call plans: signatures planned / left unplanned, native "
              "replays a forward")
        for name, plans in sorted(GRAPH_PLANS.items()):
            if plans._plans or plans._tries:
                replays = (_native_replays(plans) - replays_before[name]) / 5
                print(f"  {name:<44} {len(plans._plans):3d} / {len(plans._tries):3d}  "
                      f"{replays:6.1f}")
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\ncProfile, 5 forwards, by own time:")
        print("\n".join(line for line in text.getvalue().splitlines()
                        if line.strip() and not line.startswith(("   Ordered", "         "))))
    return 0


def _native_replays(plans) -> int:
    return getattr(plans._native, "replays", 0) if plans._native is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
