"""Run the benchmark suite: ``python -m benchmark [--quick] [--ops NAME ...] [--forward-only]``.

``python -m benchmark --models [...]`` runs the real-model prefill benchmark instead
(transformers models at real sizes, each way in its own process; ``benchmark/models.py``,
``python -m benchmark --models --help`` lists its options; ``--models --decode`` the decode
one, ``--models --tensor-parallel`` the tensor-parallel one).

Discovers ``benchmark/bench_*.py``, measures the machine's ceilings, times gemslib and every
importable peer on the same inputs, forward and backward kernels, prints one table, writes
``<out>/results.json``, ``<out>/results.md`` (the README's tables, see ``benchmark.readme``)
and ``<out>/<op>.png``, one plot per operator (when matplotlib is installed). Needs a CUDA GPU;
without one it says so in one line and exits 1, as ``python -m gemslib.tune`` does.

Exit codes: 0 every case ran, 1 not done: no CUDA GPU here (nothing run) or gemslib failed on
a case (reported), 2 bad arguments (argparse's usage error, e.g. an unknown operator).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shlex
import sys
import time
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
NO_GPU_EXIT = 1  # exit code without a CUDA GPU, as python -m gemslib.tune's


def bench_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(BENCH_DIR)])
                  if m.name.startswith("bench_"))


def module_ops() -> dict[str, tuple[str, ...]]:
    """Each benchmark module's operator names (its ``OPS``: the Case names it yields)."""
    return {name: tuple(importlib.import_module(f"benchmark.{name}").OPS)
            for name in bench_modules()}


def main(argv: list[str] | None = None) -> int:
    from gemslib.cli import doc_summary

    arguments = sys.argv[1:] if argv is None else list(argv)
    if "--models" in arguments and "--tensor-parallel" in arguments:  # sharded over GPUs
        from benchmark import tensor_parallel

        return tensor_parallel.main([a for a in arguments
                                     if a not in ("--models", "--tensor-parallel")])
    if "--models" in arguments and "--decode" in arguments:  # the real-model decode one
        from benchmark import decode

        return decode.main([a for a in arguments if a not in ("--models", "--decode")])
    if "--models" in arguments:  # the real-model benchmark has its own options
        from benchmark import models

        arguments.remove("--models")
        return models.main(arguments)

    parser = argparse.ArgumentParser(
        prog="python -m benchmark", description=doc_summary(__doc__),
        epilog="exit codes: 0 every case ran; 1 not done: no CUDA GPU here (nothing run), or "
               "gemslib failed on a case (reported); 2 bad arguments")
    parser.add_argument("--quick", action="store_true", help="only the headline shapes (minutes)")
    parser.add_argument("--models", action="store_true",
                        help="the real-model prefill benchmark instead (benchmark/models.py; "
                             "--models --help lists its options)")
    parser.add_argument("--decode", action="store_true",
                        help="with --models: the real-model decode benchmark "
                             "(benchmark/decode.py; --models --decode --help lists its options)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="with --models: TP 2 against TP 1 under torchrun "
                             "(benchmark/tensor_parallel.py; --models --tensor-parallel --help)")
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--forward-only", action="store_true",
                           help="skip the backward kernels (timed by default)")
    # accepted for old command lines, not shown: the backward kernels are timed by default
    direction.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ops", nargs="+", help="operators to run (default: all)")
    parser.add_argument("--shapes", nargs="+", metavar="SHAPE",
                        help="only the cases of these shapes, as the tables write them "
                             "(e.g. 1024x131072; default: all)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="time each call replayed from a CUDA graph: the GPU's time without "
                             "the host's, as in a captured decode step (a way that cannot be "
                             "captured is reported as failed)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results",
                        help="folder for results.json, results.md and the plots "
                             "(default: benchmark/results)")
    parser.add_argument("--no-plot", action="store_true",
                        help="skip the plots (python -m benchmark.readme --plots draws them "
                             "from results.json later)")
    args = parser.parse_args(argv)
    ops_by_module = module_ops()
    known = sorted({op for ops in ops_by_module.values() for op in ops})
    unknown = sorted(set(args.ops or ()) - set(known))
    if unknown:
        parser.error(f"unknown operator(s) {', '.join(unknown)}; known: {', '.join(known)}")

    if not torch.cuda.is_available():
        print("python -m benchmark: needs a CUDA GPU and there is no CUDA GPU here (the "
              "benchmarks time GPU kernels); nothing was run.", file=sys.stderr)
        return NO_GPU_EXIT

    from benchmark import harness, readme

    started = time.perf_counter()
    env = harness.environment()  # once: the date is the run's start, plots need no GPU
    ceilings = harness.measure_ceilings(matmul=True)  # attention reports % of the matmul rate
    print(env, flush=True)
    results = []
    for name, ops in ops_by_module.items():
        if args.ops and not set(args.ops) & set(ops):
            continue  # building a module's cases allocates inputs (and compiles torch peers)
        module = importlib.import_module(f"benchmark.{name}")
        for case in module.cases(quick=args.quick, backward=not args.forward_only):
            if case.op not in ops:  # --ops would skip it without a word
                raise RuntimeError(f"{name} yields {case.op}, which its OPS does not list")
            if (args.ops and case.op not in args.ops) or (args.shapes
                                                          and case.shape not in args.shapes):
                continue
            print(f"  {case.op} {case.shape} ...", flush=True)
            results.extend(harness.run_case(case, ceilings, cuda_graphs=args.cuda_graphs))
            torch.cuda.empty_cache()
    unmatched = sorted(set(args.shapes or ()) - {result.shape for result in results})
    if unmatched:
        print(f"no case has shape(s) {', '.join(unmatched)}", file=sys.stderr)
    rows = harness.summarize(results)
    print()
    print(harness.format_table(rows, ceilings))
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmark", *(sys.argv[1:] if argv is None else argv)])
    report = harness.write_json(args.out / "results.json", results, rows, ceilings, env, command)
    written = ["results.json"]
    if rows:  # the markdown python -m benchmark.readme renders from results.json for the README
        (args.out / "results.md").write_text(readme.render(report))
        written.append("results.md")
    plots = [] if args.no_plot else harness.plot(results, ceilings, args.out, env["gpu"])
    written += [f"{len(plots)} plot(s)"] if plots else []
    print(f"\nwrote {', '.join(written)} to {args.out} "
          f"({time.perf_counter() - started:.0f} s)")
    failures = [row for row in rows if row.get("error")]
    for row in failures:
        print(f"gemslib FAILED at {row['op']} {row['shape']}: {row['error']}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
