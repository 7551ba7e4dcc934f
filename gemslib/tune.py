"""``python -m gemslib.tune``: tune every kernel's launch configs on this GPU; write its YAML.

    python -m gemslib.tune [--ops NAME ...] [--out PATH] [--quick] [--timings JSON] [--jobs N]

Each operator file declares ``TUNING``: per kernel, candidate configs and, per bucket of its
tune-config entry, a representative problem (registry.TuneSpace / TuneBucket). For every
bucket the tuner runs the problem with default.yaml's config for it (the reference), then
forces each candidate on the kernel, checks its output against the reference (a candidate
that fails to run or disagrees is reported and dropped) and times it with
``triton.testing.do_bench`` (median). The fastest right candidate becomes the bucket's config,
unless the reference is within KEEP_MARGIN of it; the file in use's configs are candidates too.
The file written has the schema of tune_configs/README.md and records the GPU, the torch and
Triton versions, the date and the operators tuned under ``tuned``; operators left out by
``--ops``, and any whose bucket cannot be tuned (reported; the run exits 1), keep their entries
from the file in use. The file is rewritten after each operator, so a run that is stopped keeps
what it finished. ``--quick`` tries, per bucket, the config in use, default.yaml's and the first
few candidates, with shorter timings. Compiling dominates a run, so before each operator is
timed, ``--jobs`` worker processes run each of its candidates once on every bucket's problem
to fill Triton's on-disk cache. Checking and timing the candidates on one problem is
gemslib/tune_search.py's, shared with the ``--model`` run (gemslib/tune_model.py).

Exit codes: 0 every operator tuned, 1 the job was not done here (no CUDA GPU: nothing is
written) or an operator could not be tuned (the file is written, that operator keeps its
entries), 2 bad arguments (argparse's usage error, e.g. an unknown operator).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from gemslib import registry, runtime, tune_search
from gemslib.cli import doc_summary

NO_GPU_EXIT = 1  # exit code without a CUDA GPU, as python -m benchmark's


def tune_bucket(op: str, space: registry.TuneSpace, index: int, device: torch.device,
                timer: Callable[[Callable], float], quick: bool = False,
                progress: Callable[[str], None] = functools.partial(print, flush=True)
                ) -> tune_search.BucketResult:
    """Check and time the candidates on bucket ``index``'s problem; see the module docstring."""
    kernel, bucket = space.kernel, space.buckets[index]
    run = bucket.make(device)
    shape = tune_search.problem_shape(space, run)
    if shape is None:
        raise tune_search.TuneError(f"{op}.{kernel.name}: the problem {bucket.label} does not "
                                    "launch it")
    landed = tune_search.bucket_index(space, shape)
    if landed != index:
        raise tune_search.TuneError(f"{op}.{kernel.name}: the problem {bucket.label} (shape "
                                    f"{dict(zip(kernel.shape_keys, shape))}) lands in bucket "
                                    f"{landed}, not {index}")
    return tune_search.time_candidates(op, space, index, bucket, run, shape, timer, quick,
                                       progress, f"[{index + 1}/{len(space.buckets)}] "
                                                 f"{bucket.label}")


def tune_all(spaces, device: torch.device, timer: Callable[[Callable], float], quick: bool = False,
             progress: Callable[[str], None] = functools.partial(print, flush=True)
             ) -> tuple[list[tune_search.BucketResult], dict[str, str]]:
    """Tune every bucket of ``spaces``. An operator with a bucket that cannot be tuned
    (TuneError) is reported and left out whole, so that the run still writes the others
    (its entries then come from the file in use). Returns the results and, per operator
    left out, why."""
    results, failed = [], {}
    for op, space in spaces:
        for index in range(len(space.buckets)):
            if op in failed:
                break
            try:
                results.append(tune_bucket(op, space, index, device, timer, quick, progress))
            except tune_search.TuneError as err:
                failed[op] = str(err)
                progress(f"FAILED: {err}")
    return [r for r in results if r.op not in failed], failed


def render_yaml(results: list[tune_search.BucketResult], kept: runtime.TuneConfigFile | None,
                device: str, tuned: dict[str, str], tuned_ops: set[str]) -> str:
    """The tune-config file: the tuned buckets (in the declared order, each with the problem it
    was tuned on and its time), and ``kept``'s entries for operators not tuned in this run."""
    lines = ["# Launch configurations written by `python -m gemslib.tune`; do not edit by hand:",
             "# re-run the tuner. Schema: tune_configs/README.md.",
             "schema: 1", f"device: {device}",
             f"source: python -m gemslib.tune on {tuned['gpu']}", "tuned:"]
    lines += [f"  {key}: " + (f"{value!r}" if isinstance(value, str) else
                              str(value).lower() if isinstance(value, bool) else str(value))
              for key, value in tuned.items()]
    lines.append("ops:")
    by_kernel: dict[tuple[str, str], list[tune_search.BucketResult]] = {}
    for result in results:
        by_kernel.setdefault((result.op, result.kernel), []).append(result)
    ops = list(dict.fromkeys([op for op, _ in by_kernel]
                             + [op for op in (kept.ops if kept else {}) if op not in tuned_ops]))
    kept_blocks, kept_verdicts = tune_search.kept_text(kept) if kept is not None else ({}, [])
    for op in ops:
        lines.append(f"  {op}:")
        if op in tuned_ops:
            for (result_op, kernel), buckets in by_kernel.items():
                if result_op != op:
                    continue
                lines.append(f"    {kernel}:")
                for result in sorted(buckets, key=lambda r: r.index):
                    best = result.best
                    note = (f"  # {result.bucket.label}: {best.ms * 1e3:.1f} us, default.yaml's "
                            f"{result.reference_ms * 1e3:.1f} us")
                    config = tune_search.config_flow(best.config)
                    if result.bucket.max is not None:
                        lines.append(f"      - max: {tune_search.bound_flow(result.bucket.max)}")
                        lines.append(f"        config: {config}{note}")
                    else:
                        lines.append(f"      - config: {config}{note}")
        else:  # the kept file's own lines: its comments say where each config came from
            header, *rest = kept_blocks[op]
            if "#" not in header:
                header += f"  # not tuned in this run: the entries of {kept.path.name}"
            lines[-1:] = [header, *rest]
    if kept is not None:  # the verdicts (python -m gemslib.tune --verdicts) stay
        lines += kept_verdicts
    return "\n".join(lines) + "\n"


def earlier_tuned_ops(kept: runtime.TuneConfigFile | None, device: str) -> list[str]:
    """The operators ``kept`` says were tuned, when it is this GPU's own file (a run with
    ``--ops`` over an earlier run's file keeps what that run tuned): its ``tuned: ops``."""
    if kept is None or kept.device != device:
        return []
    import yaml

    try:
        recorded = (yaml.safe_load(kept.path.read_text()).get("tuned") or {}).get("ops") or []
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    return [op for op in recorded if isinstance(op, str)]


def _compile_candidate(ops: list[str] | None, space_number: int, candidate: int) -> int:
    """Worker: run candidate ``candidate`` of tune space ``space_number`` on each of its
    buckets' problems once, so that its kernels land in Triton's on-disk cache. One task per
    (space, candidate): buckets that share a specialization then compile it once. Returns how
    many buckets ran it."""
    device = torch.device(runtime.device_type())
    _, space = tune_search.tune_spaces(ops)[space_number]
    config, ran = tune_search.launch_config(space.candidates[candidate]), 0
    for bucket in space.buckets:
        try:
            run = bucket.make(device)
        except torch.OutOfMemoryError:
            # the other workers' problems fill the GPU: the timing pass compiles this one
            torch.cuda.empty_cache()
            continue
        with space.kernel.forced(config):
            try:
                run()
                ran += 1
            except Exception:  # reported by the timing pass
                pass
        del run
    if device.type == "cuda":
        torch.cuda.synchronize()
        # an idle worker holds no GPU memory: a dozen workers, each keeping its largest
        # problem's memory cached, would fill the GPU and starve the timing process
        torch.cuda.empty_cache()
    return ran


def precompile(pool, ops: list[str] | None, quick: bool) -> None:
    """Compile every candidate the run will time, in ``pool``'s processes, each taking the
    next (space, candidate) task as it finishes one (compile times differ widely between
    kernels)."""
    spaces = tune_search.tune_spaces(ops)
    tasks = [(number, candidate) for number, (_, space) in enumerate(spaces)
             for candidate in range(min(len(space.candidates), tune_search.QUICK_CANDIDATES)
                                    if quick else len(space.candidates))]
    n_pairs = sum(len(spaces[number][1].buckets) for number, _ in tasks)
    started, ran, done, shown = time.perf_counter(), 0, 0, 0
    for count in pool.imap_unordered(_compile_task, [(ops, *task) for task in tasks]):
        ran, done = ran + count, done + 1
        if done * 4 // len(tasks) > shown:
            shown = done * 4 // len(tasks)
            print(f"  compiling {', '.join(ops or ['everything'])}: {done}/{len(tasks)} "
                  f"candidates ({time.perf_counter() - started:.0f} s)", flush=True)
    print(f"compiled {ran} of {n_pairs} (bucket, candidate) pairs "
          f"({time.perf_counter() - started:.0f} s)", flush=True)


def _compile_task(task: tuple) -> int:
    return _compile_candidate(*task)


def timings_record(results: list[tune_search.BucketResult], tuned: dict) -> dict:
    """Every candidate's time (or why it was rejected) per bucket, for ``--timings``: what a
    later pruning of the candidate lists goes by."""
    return {"tuned": tuned, "buckets": [
        {"op": r.op, "kernel": r.kernel, "bucket": r.bucket.label, "shape": list(r.shape),
         "reference": r.reference.launch_kwargs, "best": r.best.config.launch_kwargs,
         "candidates": [{"config": t.config.launch_kwargs, "ms": t.ms, "rejected": t.why or None}
                        for t in r.timings]} for r in results]}


def gpu_available() -> bool:
    return not runtime.INTERPRETER and torch.cuda.is_available()


def summary(results: list[tune_search.BucketResult]) -> list[str]:
    """Per operator: how much faster the tuned configs are than default.yaml's (geometric mean
    over its buckets) and the range."""
    lines = []
    for op in dict.fromkeys(r.op for r in results):
        ratios = [r.reference_ms / r.best.ms for r in results if r.op == op]
        mean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines.append(f"  {op:<22} {mean:.2f}x default.yaml (geometric mean of {len(ratios)} "
                     f"buckets; {min(ratios):.2f}-{max(ratios):.2f}x)")
    return lines


def _model_names() -> list[str]:
    from gemslib import models
    return list(models.MODELS)


def _batch_by_seq(text: str) -> tuple[int, int]:
    batch, _, seq = text.partition("x")
    if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
        raise argparse.ArgumentTypeError(f"expected BxS with positive integers, got {text!r}")
    return int(batch), int(seq)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gemslib.tune", description=doc_summary(__doc__),
        epilog="exit codes: 0 every operator tuned; 1 not done: no CUDA GPU here (nothing "
               "written), or an operator could not be tuned (reported); 2 bad arguments")
    parser.add_argument("--ops", nargs="+", help="operators to tune (default: all); with "
                        "--verdicts, the fusions to time (default: all)")
    parser.add_argument("--out", type=Path, help="file to write (default: ./<device>.yaml)")
    parser.add_argument("--verdicts", action="store_true",
                        help="instead: time each fusion of the graph passes against inductor's "
                             "path at the models' widths (decode_gemv: a stack of decoder "
                             "layers with and without it) and write where each is used (the "
                             "file in use's configs kept)")
    parser.add_argument("--user", action="store_true",
                        help="write <device>.yaml into gemslib's cache on this machine "
                             "($GEMSLIB_CACHE_DIR/tune_configs), where gemslib picks it up")
    parser.add_argument("--quick", action="store_true",
                        help=f"per bucket only the configs in use and the first "
                             f"{tune_search.QUICK_CANDIDATES} candidates, shorter timings")
    parser.add_argument("--timings", type=Path,
                        help="also write every candidate's time to this JSON file")
    parser.add_argument("--jobs", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes that compile the candidates first (1: compile while timing)")
    parser.add_argument("--model", metavar="CONFIG",
                        help="tune the calls one model makes instead: a name of the built-in "
                             "table (" + ", ".join(_model_names()) + ") or a transformers "
                             "config.json (see gemslib/tune_model.py)")
    parser.add_argument("--shapes", nargs="+", type=_batch_by_seq, default=[(1, 4096)],
                        metavar="BxS", help="with --model: the forwards recorded (default 1x4096)")
    parser.add_argument("--layers", type=int, default=2,
                        help="with --model: decoder layers built (default 2; they repeat)")
    args = parser.parse_args(argv)
    if args.user and args.out is not None:
        parser.error("--user and --out: --user writes into gemslib's cache, --out elsewhere")
    if args.verdicts:
        from gemslib import tune_verdicts

        if args.model is not None:
            parser.error("--verdicts times the fusions at every model's widths: without "
                         "--model")
        unknown = sorted(set(args.ops or ()) - set(tune_verdicts.FUSIONS))
        if unknown:
            parser.error(f"--verdicts --ops names fusions: unknown {unknown}; they are "
                         f"{list(tune_verdicts.FUSIONS)}")
        if not gpu_available():
            print("python -m gemslib.tune: needs a CUDA GPU and there is no CUDA GPU here; "
                  "nothing was written.", file=sys.stderr)
            return NO_GPU_EXIT
        name = runtime.device_name()
        out = runtime.user_configs_dir() / f"{name}.yaml" if args.user else \
            args.out or Path(f"{name}.yaml")
        out.parent.mkdir(parents=True, exist_ok=True)
        return tune_verdicts.main(out, args.quick, fusions=args.ops)
    if args.model is not None:
        if args.ops:
            parser.error("--ops and --model: --model tunes the kernels the model launches")
        if args.layers < 1:
            parser.error(f"--layers must be at least 1, got {args.layers}")
        if not gpu_available():
            print("python -m gemslib.tune: needs a CUDA GPU and there is no CUDA GPU here; "
                  "nothing was written.", file=sys.stderr)
            return NO_GPU_EXIT
        from gemslib import tune_model
        return tune_model.main(args)
    try:
        spaces = tune_search.tune_spaces(args.ops)  # unknown names fail before anything runs
    except ValueError as err:
        parser.error(str(err))
    if not gpu_available():
        print("python -m gemslib.tune: needs a CUDA GPU and there is no CUDA GPU here (it times "
              "kernels on the GPU it writes the configs for); nothing was written.",
              file=sys.stderr)
        return NO_GPU_EXIT
    started = time.perf_counter()
    device_name = runtime.device_name()
    out = args.out or Path(f"{device_name}.yaml")
    if args.user:
        out = runtime.user_configs_dir() / f"{device_name}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
    tuned = {**tune_search.environment(), "quick": args.quick}
    print(f"tuning {len(spaces)} kernels ({sum(len(s.buckets) for _, s in spaces)} buckets) on "
          f"{tuned['gpu']}, torch {tuned['torch']}, Triton {tuned['triton']}", flush=True)
    timer, device = tune_search.do_bench_ms(args.quick), torch.device(runtime.device_type())
    kept = runtime.active_configs()[0]
    earlier = earlier_tuned_ops(kept, device_name)
    results, failed = [], {}
    ops = list(dict.fromkeys(op for op, _ in spaces))
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    for number, op in enumerate(ops):
        if pool is not None:
            precompile(pool, [op], args.quick)
        op_results, op_failed = tune_all([(o, s) for o, s in spaces if o == op], device, timer,
                                         args.quick)
        results += op_results
        failed.update(op_failed)
        # written after each operator, so a run cut short keeps what it finished (the others
        # keep the entries of the file in use until then)
        tuned["seconds"] = round(time.perf_counter() - started)
        tuned["complete"] = number == len(ops) - 1
        done = {o for o in ops[:number + 1] if o not in failed}
        tuned["ops"] = [o for o in dict.fromkeys(earlier + ops) if o in done or o in earlier]
        out.write_text(render_yaml(results, kept, device_name, tuned, done))
        runtime.load_tune_config(out)  # what was written must load
        if args.timings:
            args.timings.write_text(json.dumps(timings_record(results, tuned), indent=1))
    if pool is not None:
        pool.close()
    print("tuned configs against default.yaml's:")
    print("\n".join(summary(results)))
    for op, why in failed.items():
        print(f"  {op:<22} NOT TUNED, keeps the entries of the file in use: {why}")
    if args.user:
        print(f"wrote {out} in {tuned['seconds']} s; gemslib uses it on this machine from now on",
              flush=True)
    else:
        print(f"wrote {out} in {tuned['seconds']} s; use it with GEMSLIB_TUNE_CONFIG={out}, "
              f"put it in {runtime.user_configs_dir()}, or ship it as "
              f"tune_configs/{device_name}.yaml", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
