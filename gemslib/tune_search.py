"""Checking and timing a kernel's candidate launch configs on one problem: the part of the
tuner that ``python -m gemslib.tune`` (a problem per bucket, see gemslib/tune.py) and its
``--model`` run (the calls one model makes, see gemslib/tune_model.py) share.

A candidate is forced on the kernel, its outputs are checked against those of default.yaml's
config for the problem's shape (the reference), and it is timed; the fastest right candidate
wins unless the config to keep is within KEEP_MARGIN of it. The YAML helpers write configs and
bucket bounds in the schema of tune_configs/README.md.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
import yaml

from gemslib import registry, runtime

QUICK_CANDIDATES = 4  # leading candidates a --quick run tries, beside the configs in use
KEEP_MARGIN = 0.01  # a candidate replaces default.yaml's config if it is faster by more


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


def bucket_config(config_file: runtime.TuneConfigFile, kernel, shape) -> runtime.LaunchConfig | None:
    """The config ``config_file`` gives ``kernel`` at ``shape`` (None if it has no entry)."""
    buckets = config_file.ops.get(kernel.op, {}).get(kernel.name)
    if buckets is None:
        return None
    named = dict(zip(kernel.shape_keys, shape))
    return next(b for b in buckets if b.matches(named)).configs[0]


def bucket_index(space: registry.TuneSpace, shape) -> int:
    named = dict(zip(space.kernel.shape_keys, shape))
    return next(i for i, b in enumerate(space.buckets) if b.matches(named))


def output_tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in output_tensors(item)]
    return []


def disagreement(actual, expected) -> str | None:
    """Why the candidate's outputs differ from the reference's (None: they agree): NaNs in
    other places, or a norm-wise relative error past the rounding of the outputs' dtype
    (2e-2 for 16-bit outputs, 1e-4 for fp32; two right configs differ by their summation
    order only)."""
    actual, expected = output_tensors(actual), output_tensors(expected)
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


def do_bench_ms(quick: bool, calls: int = 1) -> Callable[[Callable], float]:
    """A timer of a problem's GPU time in ms: ``calls`` calls captured in one CUDA graph and
    its replays timed by ``triton.testing.do_bench`` (L2 flushed before each), over
    ``calls``. Timed directly, a decode-sized kernel measures the host instead: a forced
    config's launch costs more host time than the flush before it takes on the GPU. One call
    a replay still carries the replay's own start (~5 us on an H100, as much as a 1-row
    kernel): several calls a replay leave mostly the kernels' time, each after the first
    with its input in L2, as in a model where the kernel before wrote it. A problem that
    cannot be captured is timed directly."""
    import triton.testing

    # 50 ms of repetitions: ~1000 runs of a 50 us kernel, ~20 of a 2.5 ms one
    warmup, rep = (5, 20) if quick else (10, 50)

    def timer(fn: Callable[[], object]) -> float:
        try:  # one warm-up call compiles, and leaves nothing for the capture to compile
            graph, _ = runtime.captured(lambda: [fn() for _ in range(calls)], warmup_calls=1)
        except Exception:  # e.g. a host synchronisation: not capturable
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
        return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep,
                                       return_mode="median") / calls

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
    reference = bucket_config(default, kernel, shape) or launch_config(space.candidates[0])
    with kernel.forced(reference):
        try:
            expected = run()
        except Exception as err:
            raise TuneError(f"{op}.{kernel.name} {bucket.label}: the reference config "
                            f"{config_flow(reference)} does not run ({type(err).__name__}: {err})")
    # the reference is timed among the candidates (one pass, one state of the GPU), so the
    # tuned config is never slower than it by the run's own measure
    result = BucketResult(op, kernel.name, index, bucket, shape, reference, math.nan)
    in_use = bucket_config(selected, kernel, shape)
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
                        f"{config_flow(reference)} is not reproducible ({timed_reference.why})")
    result.reference_ms = timed_reference.ms
    best = result.best
    rejected = [t for t in result.timings if t.ms is None]
    compared, compared_ms = "default.yaml's", timed_reference.ms
    if keep_in_use:
        compared = "the file in use's"
        compared_ms = next((t.ms for t in result.timings if t.config == (in_use or reference)),
                           None) or timed_reference.ms
    progress(f"{op}.{kernel.name} {where}: "
             f"best {config_flow(best.config)} {best.ms * 1e3:.1f} us; {compared} "
             f"{compared_ms * 1e3:.1f} us ({compared_ms / best.ms:.2f}x); "
             f"{len(result.timings) - len(rejected)} timed"
             + (f", {len(rejected)} rejected ({rejected[0].why})" if rejected else ""))
    return result


def config_flow(config: runtime.LaunchConfig) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in config.launch_kwargs.items()) + "}"


def bound_flow(bound) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in bound.items()) + "}"


def bucket_lines(bucket: runtime.Bucket) -> list[str]:
    """A loaded bucket as the YAML lines of a kernel's list that give it back."""
    lines, head = [], "      - "
    if bucket.max is not None:
        lines.append(f"{head}max: {bound_flow(bucket.max)}")
        head = "        "
    if bucket.autotune:
        lines.append(f"{head}autotune:")
        lines += [f"          - {config_flow(c)}" for c in bucket.configs]
    else:
        lines.append(f"{head}config: {config_flow(bucket.configs[0])}")
    return lines


def render_verdicts(verdicts: Mapping[str, Iterable[tuple[Mapping[str, int] | None, str]]],
                    notes: Mapping[str, Mapping[tuple[int, int], tuple[float, float]]] = {}
                    ) -> list[str]:
    """The ``verdicts:`` section's lines (none without verdicts); ``notes`` (per fusion, the
    timings) go in a comment under each fusion."""
    if not verdicts:
        return []
    lines = ["verdicts:"]
    for fusion, buckets in verdicts.items():
        lines.append(f"  {fusion}:")
        timings = notes.get(fusion)
        if timings:
            lines.append("    # gemslib / inductor us at cols x rows: " + ", ".join(
                f"{cols}x{rows} {ours * 1e3:.1f}/{theirs * 1e3:.1f}"
                for (cols, rows), (ours, theirs) in sorted(timings.items())))
        for bound, use in buckets:
            head = "    - " + (("max: {" + ", ".join(f"{k}: {v}" for k, v in bound.items())
                                + "}\n      ") if bound is not None else "")
            lines.append(f"{head}use: {use}")
    return lines


def kept_text(config_file: runtime.TuneConfigFile) -> tuple[dict[str, list[str]], list[str]]:
    """A tune-config file's own lines, to carry into a file a tuner writes: (per operator, its
    block under ``ops:``, from its header line on, comments included; the ``verdicts:``
    section's lines, none if it has none). An operator's block or the verdicts that do not
    read back as the loaded file's (a layout gemslib does not write) are rendered from the
    loaded entries instead, without comments."""
    lines = config_file.path.read_text().splitlines()
    ops_lines: list[str] = []
    verdicts: list[str] = []
    section = None
    for line in lines:
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.split(":", 1)[0]
            if section == "verdicts":
                verdicts.append(line)
            continue
        if section == "verdicts":
            verdicts.append(line)
        elif section == "ops":
            ops_lines.append(line)
    blocks = _named_blocks(ops_lines)
    for op, kernels in config_file.ops.items():
        block = blocks.get(op)
        if block is None or _reloaded_ops(config_file, block) != {op: kernels}:
            blocks[op] = [f"  {op}:"] + [line for kernel, buckets in kernels.items()
                                         for line in [f"    {kernel}:"] + [
                                             b for bucket in buckets
                                             for b in bucket_lines(bucket)]]
    if _reloaded_verdicts(config_file, verdicts) != config_file.verdicts:
        verdicts = render_verdicts(config_file.verdicts)
    return {op: blocks[op] for op in config_file.ops}, verdicts


def verdict_blocks(lines: list[str]) -> dict[str, list[str]]:
    """Per fusion, its lines of a ``verdicts:`` section's ``lines`` (as :func:`kept_text`
    gives them), from its header line on, comments included."""
    return _named_blocks(lines[1:])


def _named_blocks(lines: list[str]) -> dict[str, list[str]]:
    """A section's lines (without its header) per entry: from an entry's header line (two
    spaces, then its name) to the next's; lines before the first belong to none."""
    blocks: dict[str, list[str]] = {}
    name = None
    for line in lines:
        if line.startswith("  ") and line[2:3].isalnum():
            name = line.split(":", 1)[0].strip()
            blocks[name] = []
        if name is not None:
            blocks[name].append(line)
    return blocks


def _reloaded_ops(config_file: runtime.TuneConfigFile, block: list[str]):
    try:
        text = "\n".join(["schema: 1", "device: check", "ops:", *block]) + "\n"
        return dict(runtime.parse_tune_config(config_file.path, yaml.safe_load(text)).ops)
    except Exception:  # not a block that stands alone: rendered instead
        return None


def _reloaded_verdicts(config_file: runtime.TuneConfigFile, lines: list[str]):
    try:
        text = "\n".join(["schema: 1", "device: check", "ops: {}", *lines]) + "\n"
        return dict(runtime.parse_tune_config(config_file.path, yaml.safe_load(text)).verdicts)
    except Exception:
        return None


def environment() -> dict[str, str | int | float]:
    """The ``tuned:`` section's facts: the GPU and what decides which GPUs its file suits
    (``runtime.Hardware``), the versions, the date."""
    import triton

    from gemslib import runtime

    hardware = runtime.current_hardware()
    return {"gpu": torch.cuda.get_device_name(),
            "capability": "{}.{}".format(*hardware.capability),
            "multiprocessors": hardware.multiprocessors,
            "memory_gib": round(hardware.memory_gib, 1),
            "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
