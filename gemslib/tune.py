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
to fill Triton's on-disk cache.

Exit codes: 0 every operator tuned, 1 the job was not done here (no CUDA GPU: nothing is
written) or an operator could not be tuned (the file is written, that operator keeps its
entries), 2 bad arguments (argparse's usage error, e.g. an unknown operator).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from gemslib import registry, runtime

QUICK_CANDIDATES = 4  # leading candidates a --quick run tries, beside the configs in use
KEEP_MARGIN = 0.01  # a candidate replaces default.yaml's config if it is faster by more
NO_GPU_EXIT = 1  # exit code without a CUDA GPU, as python -m benchmark's


class TuneError(RuntimeError):
    """A declared tune space does not fit its kernel (a problem that does not launch the
    kernel or lands in another bucket; no candidate that runs right)."""


@dataclass
class Timing:
    config: runtime.LaunchConfig
    ms: float | None = None  # None: rejected
    why: str = ""


@dataclass
class BucketResult:
    """The outcome for one bucket: the fastest right candidate and the reference's time."""
    op: str
    kernel: str
    index: int
    bucket: registry.TuneBucket
    shape: tuple[int, ...]
    reference: runtime.LaunchConfig
    reference_ms: float
    timings: list[Timing] = field(default_factory=list)
    kept: runtime.LaunchConfig | None = None  # the config to keep at a tie (None: reference)

    @property
    def best(self) -> Timing:
        """The fastest right candidate; the kept config (default.yaml's, or for a model the
        file in use's) if it is within KEEP_MARGIN of that (a change must gain more than the
        timings' noise)."""
        timed = [t for t in self.timings if t.ms is not None]
        fastest = min(timed, key=lambda t: t.ms)
        kept = self.kept or self.reference
        reference = next((t for t in timed if t.config == kept), None)
        if reference is not None and reference.ms <= fastest.ms * (1 + KEEP_MARGIN):
            return reference
        return fastest


def tune_spaces(ops: Iterable[str] | None = None) -> list[tuple[str, registry.TuneSpace]]:
    """(operator, space) for every declared kernel of ``ops``, in their order (default: every
    operator)."""
    operators = registry.operators()
    unknown = sorted(set(ops or ()) - {name for name, op in operators.items() if op.tuning})
    if unknown:
        raise ValueError(f"gemslib.tune: unknown operator(s) {unknown}; tunable: "
                         f"{sorted(name for name, op in operators.items() if op.tuning)}")
    return [(name, space) for name in (ops or operators) for space in operators[name].tuning]


def launch_config(raw) -> runtime.LaunchConfig:
    """A TUNING candidate as the config the tune-config files would give (validated alike)."""
    return runtime.parse_launch_config(Path("<TUNING candidates>"), "candidate", raw)


def _bucket_config(config_file: runtime.TuneConfigFile, kernel, shape) -> runtime.LaunchConfig | None:
    """The config ``config_file`` gives ``kernel`` at ``shape`` (None if it has no entry)."""
    buckets = config_file.ops.get(kernel.op, {}).get(kernel.name)
    if buckets is None:
        return None
    named = dict(zip(kernel.shape_keys, shape))
    return next(b for b in buckets if b.matches(named)).configs[0]


def _bucket_index(space: registry.TuneSpace, shape) -> int:
    named = dict(zip(space.kernel.shape_keys, shape))
    return next(i for i, b in enumerate(space.buckets) if b.matches(named))


def _tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _tensors(item)]
    return []


def disagreement(actual, expected) -> str | None:
    """Why the candidate's outputs differ from the reference's (None: they agree): NaNs in
    other places, or a norm-wise relative error past the rounding of the outputs' dtype
    (2e-2 for 16-bit outputs, 1e-4 for fp32; two right configs differ by their summation
    order only)."""
    actual, expected = _tensors(actual), _tensors(expected)
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, the reference has {len(expected)}"
    for index, (got, want) in enumerate(zip(actual, expected)):
        if got.shape != want.shape:
            return f"output {index}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        got, want = got.double(), want.double()
        if not torch.equal(torch.isnan(got), torch.isnan(want)):
            return f"output {index}: NaN in other places"
        infinite = torch.isinf(want)
        if not torch.equal(torch.isinf(got), infinite) or \
                not torch.equal(got[infinite], want[infinite]):
            return f"output {index}: other infinities"
        finite = torch.isfinite(want)
        diff = (got[finite] - want[finite]).norm()
        scale = want[finite].norm()
        tolerance = 1e-4 if expected[index].dtype == torch.float32 else 2e-2
        if diff > tolerance * scale or not math.isfinite(float(diff)):
            return f"output {index}: relative error {float(diff / max(scale, 1e-300)):.2e}"
    return None


def do_bench_ms(quick: bool) -> Callable[[Callable], float]:
    """A timer of a problem's GPU time in ms: one call captured in a CUDA graph and its
    replays timed by ``triton.testing.do_bench`` (L2 flushed before each). Timed directly, a
    decode-sized kernel measures the host instead: a forced config's launch costs more host
    time than the flush before it takes on the GPU. A problem that cannot be captured is
    timed directly."""
    import triton.testing

    # 50 ms of repetitions: ~1000 runs of a 50 us kernel, ~20 of a 2.5 ms one
    warmup, rep = (5, 20) if quick else (10, 50)

    def timer(fn: Callable[[], object]) -> float:
        try:  # one warm-up call compiles, and leaves nothing for the capture to compile
            graph, _ = runtime.captured(fn, warmup_calls=1)
        except Exception:  # e.g. a host synchronisation: not capturable
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep,
                                       return_mode="median")

    return timer


def candidates_for(space: registry.TuneSpace, in_use: runtime.LaunchConfig | None,
                   reference: runtime.LaunchConfig, quick: bool) -> list[runtime.LaunchConfig]:
    """Every candidate and the configs in use (the reference, default.yaml's, and the file in
    use's), or (quick) those two and the first few candidates."""
    every = [launch_config(raw) for raw in space.candidates]
    if not quick:  # the configs in use too: the tuned file never loses to the one it replaces
        return list(dict.fromkeys(every + [c for c in (reference, in_use) if c is not None]))
    return list(dict.fromkeys([c for c in (in_use, reference) if c is not None]
                              + every[:QUICK_CANDIDATES]))


def problem_shape(space: registry.TuneSpace, run: Callable[[], object]) -> tuple[int, ...] | None:
    """The shape (in the kernel's ``shape_keys`` order) of ``run``'s last call of the kernel;
    None if it makes none. The kernel records a call's shape before it runs, so even a first
    candidate that cannot run here tells it."""
    with space.kernel.forced(launch_config(space.candidates[0])) as shapes:
        try:
            run()
        except Exception:
            pass
    return tuple(int(s) for s in shapes[-1]) if shapes else None


def tune_bucket(op: str, space: registry.TuneSpace, index: int, device: torch.device,
                timer: Callable[[Callable], float], quick: bool = False,
                progress: Callable[[str], None] = functools.partial(print, flush=True)
                ) -> BucketResult:
    """Check and time the candidates on bucket ``index``'s problem; see the module docstring."""
    kernel, bucket = space.kernel, space.buckets[index]
    run = bucket.make(device)
    shape = problem_shape(space, run)
    if shape is None:
        raise TuneError(f"{op}.{kernel.name}: the problem {bucket.label} does not launch it")
    landed = _bucket_index(space, shape)
    if landed != index:
        raise TuneError(f"{op}.{kernel.name}: the problem {bucket.label} (shape "
                        f"{dict(zip(kernel.shape_keys, shape))}) lands in bucket {landed}, "
                        f"not {index}")
    return time_candidates(op, space, index, bucket, run, shape, timer, quick, progress,
                           f"[{index + 1}/{len(space.buckets)}] {bucket.label}")


def time_candidates(op: str, space: registry.TuneSpace, index: int, bucket: registry.TuneBucket,
                    run: Callable[[], object], shape: tuple[int, ...],
                    timer: Callable[[Callable], float], quick: bool,
                    progress: Callable[[str], None], where: str,
                    keep_in_use: bool = False) -> BucketResult:
    """Check and time the candidates on ``run`` (a problem whose launches of the kernel have
    ``shape``), against default.yaml's config for that shape; ``where`` names the problem in
    the progress line. ``keep_in_use``: at a tie the file in use's config stays."""
    kernel = space.kernel
    selected, default = runtime.active_configs()
    reference = _bucket_config(default, kernel, shape) or launch_config(space.candidates[0])
    with kernel.forced(reference):
        try:
            expected = run()
        except Exception as err:
            raise TuneError(f"{op}.{kernel.name} {bucket.label}: the reference config "
                            f"{_flow(reference)} does not run ({type(err).__name__}: {err})")
    # the reference is timed among the candidates (one pass, one state of the GPU), so the
    # tuned config is never slower than it by the run's own measure
    result = BucketResult(op, kernel.name, index, bucket, shape, reference, math.nan)
    in_use = _bucket_config(selected, kernel, shape)
    if keep_in_use:
        result.kept = in_use
    for config in candidates_for(space, in_use, reference, quick):
        timing = Timing(config)
        with kernel.forced(config):
            try:
                timing.why = disagreement(run(), expected) or ""
                if not timing.why:
                    timing.ms = timer(run)
            except Exception as err:  # e.g. out of shared memory: not a candidate here
                timing.why = f"does not run ({type(err).__name__}: {str(err)[:80]})"
        result.timings.append(timing)
    if not any(t.ms is not None for t in result.timings):
        raise TuneError(f"{op}.{kernel.name} {bucket.label}: no candidate runs right (the "
                        f"first: {result.timings[0].why})")
    timed_reference = next(t for t in result.timings if t.config == reference)
    if timed_reference.ms is None:  # it disagreed with its own earlier output
        raise TuneError(f"{op}.{kernel.name} {bucket.label}: the reference config "
                        f"{_flow(reference)} is not reproducible ({timed_reference.why})")
    result.reference_ms = timed_reference.ms
    best = result.best
    rejected = [t for t in result.timings if t.ms is None]
    compared, compared_ms = "default.yaml's", timed_reference.ms
    if keep_in_use:
        compared = "the file in use's"
        compared_ms = next((t.ms for t in result.timings if t.config == (in_use or reference)),
                           None) or timed_reference.ms
    progress(f"{op}.{kernel.name} {where}: "
             f"best {_flow(best.config)} {best.ms * 1e3:.1f} us; {compared} "
             f"{compared_ms * 1e3:.1f} us ({compared_ms / best.ms:.2f}x); "
             f"{len(result.timings) - len(rejected)} timed"
             + (f", {len(rejected)} rejected ({rejected[0].why})" if rejected else ""))
    return result


def tune_all(spaces, device: torch.device, timer: Callable[[Callable], float], quick: bool = False,
             progress: Callable[[str], None] = functools.partial(print, flush=True)
             ) -> tuple[list[BucketResult], dict[str, str]]:
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
            except TuneError as err:
                failed[op] = str(err)
                progress(f"FAILED: {err}")
    return [r for r in results if r.op not in failed], failed


def _flow(config: runtime.LaunchConfig) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in config.launch_kwargs.items()) + "}"


def _bound(bound) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in bound.items()) + "}"


def render_yaml(results: list[BucketResult], kept: runtime.TuneConfigFile | None,
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
    by_kernel: dict[tuple[str, str], list[BucketResult]] = {}
    for result in results:
        by_kernel.setdefault((result.op, result.kernel), []).append(result)
    ops = list(dict.fromkeys([op for op, _ in by_kernel]
                             + [op for op in (kept.ops if kept else {}) if op not in tuned_ops]))
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
                    if result.bucket.max is not None:
                        lines.append(f"      - max: {_bound(result.bucket.max)}")
                        lines.append(f"        config: {_flow(best.config)}{note}")
                    else:
                        lines.append(f"      - config: {_flow(best.config)}{note}")
        else:
            lines[-1] += f"  # not tuned in this run: the entries of {kept.path.name}"
            for kernel, buckets in kept.ops[op].items():
                lines.append(f"    {kernel}:")
                for bucket in buckets:
                    lines += bucket_lines(bucket)
    return "\n".join(lines) + "\n"


def bucket_lines(bucket: runtime.Bucket) -> list[str]:
    """A loaded bucket as the YAML lines of a kernel's list that give it back."""
    lines, head = [], "      - "
    if bucket.max is not None:
        lines.append(f"{head}max: {_bound(bucket.max)}")
        head = "        "
    if bucket.autotune:
        lines.append(f"{head}autotune:")
        lines += [f"          - {_flow(c)}" for c in bucket.configs]
    else:
        lines.append(f"{head}config: {_flow(bucket.configs[0])}")
    return lines


def _compile_candidate(ops: list[str] | None, space_number: int, candidate: int) -> int:
    """Worker: run candidate ``candidate`` of tune space ``space_number`` on each of its
    buckets' problems once, so that its kernels land in Triton's on-disk cache. One task per
    (space, candidate): buckets that share a specialization then compile it once. Returns how
    many buckets ran it."""
    device = torch.device(runtime.device_type())
    _, space = tune_spaces(ops)[space_number]
    config, ran = launch_config(space.candidates[candidate]), 0
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
    next (space, candidate) task as it finishes one (compile times differ by 10x between
    kernels)."""
    spaces = tune_spaces(ops)
    tasks = [(number, candidate) for number, (_, space) in enumerate(spaces)
             for candidate in range(min(len(space.candidates), QUICK_CANDIDATES) if quick
                                    else len(space.candidates))]
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


def timings_record(results: list[BucketResult], tuned: dict) -> dict:
    """Every candidate's time (or why it was rejected) per bucket, for ``--timings``: what a
    later pruning of the candidate lists goes by."""
    return {"tuned": tuned, "buckets": [
        {"op": r.op, "kernel": r.kernel, "bucket": r.bucket.label, "shape": list(r.shape),
         "reference": r.reference.launch_kwargs, "best": r.best.config.launch_kwargs,
         "candidates": [{"config": t.config.launch_kwargs, "ms": t.ms, "rejected": t.why or None}
                        for t in r.timings]} for r in results]}


def gpu_available() -> bool:
    return not runtime.INTERPRETER and torch.cuda.is_available()


def environment() -> dict[str, str]:
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def summary(results: list[BucketResult]) -> list[str]:
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
    from gemslib.__main__ import doc_summary

    parser = argparse.ArgumentParser(
        prog="python -m gemslib.tune", description=doc_summary(__doc__),
        epilog="exit codes: 0 every operator tuned; 1 not done: no CUDA GPU here (nothing "
               "written), or an operator could not be tuned (reported); 2 bad arguments")
    parser.add_argument("--ops", nargs="+", help="operators to tune (default: all)")
    parser.add_argument("--out", type=Path, help="file to write (default: ./<device>.yaml)")
    parser.add_argument("--quick", action="store_true",
                        help=f"per bucket only the configs in use and the first "
                             f"{QUICK_CANDIDATES} candidates, shorter timings")
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
        spaces = tune_spaces(args.ops)  # unknown names fail before anything runs
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
    tuned = {**environment(), "quick": args.quick}
    print(f"tuning {len(spaces)} kernels ({sum(len(s.buckets) for _, s in spaces)} buckets) on "
          f"{tuned['gpu']}, torch {tuned['torch']}, Triton {tuned['triton']}", flush=True)
    timer, device = do_bench_ms(args.quick), torch.device(runtime.device_type())
    kept = runtime.active_configs()[0]
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
        tuned["ops"] = [o for o in ops if o in done]
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
    print(f"wrote {out} in {tuned['seconds']} s; use it with GEMSLIB_TUNE_CONFIG={out}, or ship "
          f"it as tune_configs/{device_name}.yaml", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
