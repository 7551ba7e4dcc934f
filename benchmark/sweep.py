"""Time candidate launch configs of one operator's kernels: ``python -m benchmark.sweep silu``.

Each ``bench_<op>.py`` may declare ``SWEEP_CANDIDATES`` (kernel name -> list of configs) and
``sweep_problems()``; every candidate is forced on the kernel and the public call timed. Prints
the best config per kernel and problem, and writes the table as JSON if ``--out`` is given.
Each candidate's output is compared with the shipped config's before it is timed; a candidate
that fails or disagrees is reported and left out. Compiling dominates a sweep, so ``--jobs``
worker processes first run every (problem, candidate) once to fill Triton's on-disk cache, and
the timing process then loads the kernels from it. ``--yaml PATH`` writes the config file in use
with each swept kernel's entry led by one bucket per problem (bounded by the problem's shape,
holding its best config), for ``GEMSLIB_TUNE_CONFIG=PATH python -m benchmark`` straight after.
This is the measurement behind the shipped ``tune_configs/<gpu>.yaml`` entries.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch


def _first_tensor(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def _config(raw: dict):
    from gemslib.runtime import LaunchConfig

    meta = tuple(sorted((k, v) for k, v in raw.items() if k not in ("num_warps", "num_stages")))
    return LaunchConfig(meta, raw.get("num_warps", 4), raw.get("num_stages", 1))


def _compile_share(op: str, share: list[tuple[int, int]]) -> int:
    """Worker: run the (problem index, candidate index) pairs of ``share`` once each, so their
    kernels are compiled into Triton's cache (``precompile`` left out the problems --only
    skips). Returns how many ran."""
    module = importlib.import_module(f"benchmark.bench_{op}")
    wanted = set(share)
    ran = 0
    for index, (kernel, _, _, fn) in enumerate(module.sweep_problems()):
        for candidate, raw in enumerate(module.SWEEP_CANDIDATES[kernel.name]):
            if (index, candidate) not in wanted:
                continue
            with kernel.forced(_config(raw)):
                try:
                    fn()
                    ran += 1
                except Exception:  # reported by the timing pass
                    pass
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return ran


def precompile(op: str, only: list[str] | None, jobs: int) -> None:
    """Compile every candidate of every problem in ``jobs`` processes (spawned: CUDA)."""
    module = importlib.import_module(f"benchmark.bench_{op}")
    sizes = [len(module.SWEEP_CANDIDATES[kernel.name]) if not only or label in only else 0
             for kernel, label in _problem_kernels(module)]
    pairs = [(index, candidate) for index, size in enumerate(sizes) for candidate in range(size)]
    shares = [pairs[start::jobs] for start in range(jobs)]
    context = multiprocessing.get_context("spawn")
    with context.Pool(jobs) as pool:
        ran = sum(pool.starmap(_compile_share, [(op, share) for share in shares if share]))
    print(f"precompiled {ran} of {len(pairs)} (problem, candidate) pairs in {jobs} processes",
          flush=True)


def _problem_kernels(module):
    """(kernel, label) of each sweep problem, without keeping the problems' tensors alive."""
    for kernel, label, *_ in module.sweep_problems():
        yield kernel, label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.sweep")
    parser.add_argument("op", help="operator file name, e.g. silu")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="+", help="problem labels to sweep (default: all)")
    parser.add_argument("--yaml", type=Path, help="write the config file in use with the best "
                        "config of each problem in front of the swept kernels' buckets")
    parser.add_argument("--jobs", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes that compile the candidates first (1: compile while "
                             "timing)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep: no CUDA GPU on this machine; nothing to time.")
        return 0

    from benchmark.harness import measure_ceilings, median_ms

    if args.jobs > 1:
        precompile(args.op, args.only, args.jobs)
    # also warms the GPU up from idle clocks, which otherwise skew the first problems
    print(f"copy bandwidth {measure_ceilings().copy_gbps:.0f} GB/s", flush=True)

    module = importlib.import_module(f"benchmark.bench_{args.op}")
    table = []
    best_by_kernel: dict = {}  # kernel -> [(shape, best config)]
    for kernel, label, bytes_moved, fn in module.sweep_problems():
        if args.only and label not in args.only:
            continue
        timings = []
        expected = _first_tensor(fn()).float()  # with the shipped config
        shape = tuple(int(size) for size in kernel.last_shape)
        for raw in module.SWEEP_CANDIDATES[kernel.name]:
            with kernel.forced(_config(raw)):
                try:
                    result = _first_tensor(fn()).float()
                except Exception as err:  # e.g. out of shared memory: not a candidate here
                    print(f"  {kernel.name} {label} {raw}: does not run ({type(err).__name__})")
                    continue
                if not torch.allclose(result, expected, rtol=1e-2, atol=1e-2, equal_nan=True):
                    print(f"  {kernel.name} {label} {raw}: WRONG RESULT, skipped", flush=True)
                    continue
                ms = median_ms(fn)
            timings.append((ms, raw))
            table.append({"kernel": kernel.name, "problem": label, "config": raw,
                          "us": ms * 1e3, "gbps": bytes_moved / ms / 1e6})
        timings.sort(key=lambda item: item[0])
        best_ms, best = timings[0]
        best_by_kernel.setdefault(kernel, []).append((shape, best))
        runner_up = ", ".join(f"{c} {ms * 1e3:.1f}" for ms, c in timings[1:4])
        print(f"{kernel.name:<20}{label:<14} best {best} {best_ms * 1e3:.1f} us "
              f"({bytes_moved / best_ms / 1e6:.0f} GB/s); next: {runner_up}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))
    if args.yaml:
        write_yaml(args.yaml, best_by_kernel, f"python -m benchmark.sweep {args.op}")
        print(f"wrote {args.yaml}")
    return 0


def write_yaml(path: Path, best_by_kernel: dict, source: str) -> None:
    """The config file in use, each kernel of ``best_by_kernel`` ({kernel: [(shape, config)]})
    led by a bucket per swept shape. Sorted by shape, every swept shape meets its own bucket
    first (a bucket admits the shapes <= its bound in every key, and one that admits a shape
    that sorts after it would have to equal it). Other shapes take the first swept bucket that
    bounds them, else the kernel's earlier buckets (from the file, else default.yaml): a file
    for benchmarking the swept shapes, to be edited into shipped buckets by hand."""
    import yaml

    from gemslib import runtime

    data = yaml.safe_load(runtime.config_path().read_text())
    default = yaml.safe_load((runtime.shipped_configs_dir() / "default.yaml").read_text())
    for kernel, entries in best_by_kernel.items():
        kept = data["ops"].get(kernel.op, {}).get(kernel.name) or \
            default["ops"][kernel.op][kernel.name]
        swept = [{"max": dict(zip(kernel.shape_keys, shape)), "config": config}
                 for shape, config in sorted(entries, key=lambda entry: entry[0])]
        data["ops"].setdefault(kernel.op, {})[kernel.name] = swept + kept
    data["source"] = f"{data.get('source', '')}; {source} (best per swept shape)"
    path.write_text(yaml.safe_dump(data, sort_keys=False))


if __name__ == "__main__":
    sys.exit(main())
