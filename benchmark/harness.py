"""Shared benchmark machinery: ceilings, peers, timing, the report table, JSON and plots.

Every figure is a ``triton.testing.do_bench`` median (after warm-up) in one process, so
gemslib, the peers and the machine's ceilings are measured side by side in the same run.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

GEMSLIB = "gemslib"
BOUND = "(bound)"  # an impl named "... (bound)" is a lower bound shown beside the peers


@dataclass
class Case:
    """One operator at one shape: the implementations to time on the same inputs.

    ``bytes_moved`` is the fewest bytes the operation must move (inputs read once, outputs
    written once); ``flops`` its arithmetic. ``impls`` maps a name to a zero-argument callable;
    the key ``"gemslib"`` is ours, every other key is a peer. ``outputs_agree`` compares
    gemslib's output with torch eager's on these inputs (``None`` when not checkable).
    """

    op: str
    shape: str
    dtype: str
    bytes_moved: int
    impls: dict[str, Callable]
    flops: int = 0
    outputs_agree: Callable[[], bool] | None = None


@dataclass
class Result:
    op: str
    shape: str
    dtype: str
    impl: str
    time_us: float | None
    gbps: float | None
    tflops: float | None
    pct_of_ceiling: float | None
    error: str | None = None


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float | None = None
    details: dict = field(default_factory=dict)


def median_ms(fn: Callable, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    fn()  # first call: compilation, autotuning, allocator warm-up
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def measure_ceilings(matmul: bool = False, copy_bytes: int = 2 * 2**30) -> Ceilings:
    """Device-to-device copy bandwidth (bytes read + written) and optionally the bf16 matmul
    rate at 8192^3 on random data."""
    src = torch.randn(copy_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    ceilings = Ceilings(copy_gbps=2 * copy_bytes / copy_ms / 1e6,
                        details={"copy_bytes": copy_bytes, "copy_us": copy_ms * 1e3})
    del src, dst
    if matmul:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        mm_ms = median_ms(lambda: a @ b)
        ceilings.matmul_tflops = 2 * n**3 / mm_ms / 1e9
        ceilings.details["matmul_us"] = mm_ms * 1e3
    return ceilings


def optional_peer(module: str):
    """Import a peer library if it is installed; ``None`` otherwise (or if its import fails)."""
    try:
        return importlib.import_module(module)
    except Exception:  # a broken optional peer must not stop the benchmark
        return None


def compiled(fn: Callable) -> Callable:
    """``torch.compile`` of ``fn`` with static shapes: the peer a user gets for free."""
    return torch.compile(fn, dynamic=False)


def roofline(gbps: float | None, tflops: float | None, ceilings: Ceilings) -> str | None:
    """The ceiling a figure is judged against: ``"matmul"`` (TFLOP/s over the run's bf16 matmul
    rate) when the case counts FLOPs and the run measured that rate, else ``"copy"`` (GB/s over
    the copy bandwidth) when it counts bytes; ``None`` when neither applies."""
    if tflops is not None and ceilings.matmul_tflops:
        return "matmul"
    return "copy" if gbps is not None else None


def graphed(fn: Callable) -> Callable:
    """The replay of ``fn``'s call captured in a CUDA graph (:func:`gemslib.runtime.captured`):
    it launches the call's kernels with no host code between them, so a timing of it is the
    GPU's time alone, what a captured decode step pays. Raises what the capture raises."""
    from gemslib import runtime

    graph, out = runtime.captured(fn)

    def replay():
        graph.replay()
        return out  # kept with the graph, whose replays write it
    return replay


def run_case(case: Case, ceilings: Ceilings, rounds: int = 3,
             cuda_graphs: bool = False) -> list[Result]:
    """Time every implementation ``rounds`` times, round-robin, and keep each one's best
    median: a transient slowdown of the GPU then hits one round, not one implementation.
    ``cuda_graphs``: time each one's call replayed from a CUDA graph (:func:`graphed`); one
    that cannot be captured is reported as failed."""
    best: dict[str, float] = {}
    failed: dict[str, str] = {}
    fns = dict(case.impls)
    if cuda_graphs:
        for impl, fn in case.impls.items():
            try:
                fns[impl] = graphed(fn)
            except Exception as err:
                failed[impl] = (f"no CUDA graph: {type(err).__name__}: "
                                f"{str(err).splitlines()[0][:80]}")
    for _ in range(rounds):
        for impl, fn in fns.items():
            if impl in failed:
                continue
            try:
                ms = median_ms(fn)
            except Exception as err:  # a peer that fails at a shape is reported, not fatal
                failed[impl] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
                continue
            best[impl] = min(ms, best.get(impl, float("inf")))
    results = []
    for impl in case.impls:
        if impl in failed:
            results.append(Result(case.op, case.shape, case.dtype, impl, None, None, None, None,
                                  error=failed[impl]))
            continue
        ms = best[impl]
        gbps = case.bytes_moved / ms / 1e6 if case.bytes_moved else None
        tflops = case.flops / ms / 1e9 if case.flops else None
        basis = roofline(gbps, tflops, ceilings)
        pct = (100 * tflops / ceilings.matmul_tflops if basis == "matmul"
               else 100 * gbps / ceilings.copy_gbps if basis == "copy" else None)
        results.append(Result(case.op, case.shape, case.dtype, impl, ms * 1e3, gbps, tflops, pct))
    if case.outputs_agree is not None and GEMSLIB not in failed:
        try:
            problem = None if case.outputs_agree() else "output differs from the fp32 reference"
        except Exception as err:  # reported in the table; the other cases still run
            problem = f"output check failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        if problem:
            for result in results:
                if result.impl == GEMSLIB:
                    result.error = problem
    return results


def summarize(results: list[Result]) -> list[dict]:
    """One row per (op, shape): gemslib's figures, each peer's time, speedup over the best peer."""
    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault((r.op, r.shape, r.dtype),
                              {"op": r.op, "shape": r.shape, "dtype": r.dtype, "peers": {}})
        if r.impl == GEMSLIB:
            row.update(gemslib_us=r.time_us, gbps=r.gbps, tflops=r.tflops,
                       pct_of_ceiling=r.pct_of_ceiling, error=r.error)
        else:
            row["peers"][r.impl] = r.time_us
    for row in rows.values():
        # gemslib's own variants (in place) and lower bounds (a matmul alone) are columns,
        # never the peer to beat
        timed = {k: v for k, v in row["peers"].items()
                 if v is not None and not k.startswith(GEMSLIB) and not k.endswith(BOUND)}
        if timed:
            best = min(timed, key=timed.get)
            row["best_peer"], row["best_peer_us"] = best, timed[best]
            if row.get("gemslib_us"):
                row["speedup"] = timed[best] / row["gemslib_us"]
    return list(rows.values())


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def format_table(rows: list[dict], ceilings: Ceilings) -> str:
    peers = sorted({p for row in rows for p in row["peers"]})
    head = ["op", "shape", "gemslib us", "GB/s", "TFLOP/s", "% ceil"] + \
           [f"{p} us" for p in peers] + ["best peer", "speedup", "note"]
    body = []
    for row in rows:
        body.append([row["op"], f"{row['shape']} {row['dtype']}", _fmt(row.get("gemslib_us"), ".1f"),
                     _fmt(row.get("gbps"), ".0f"), _fmt(row.get("tflops"), ".0f"),
                     _fmt(row.get("pct_of_ceiling"), ".1f")]
                    + [_fmt(row["peers"].get(p), ".1f") for p in peers]
                    + [row.get("best_peer", "-"), _fmt(row.get("speedup"), ".2f") + "x"
                       if row.get("speedup") else "-", row.get("error") or ""])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).rjust(w) if i > 1 else str(x).ljust(w)
                       for i, (x, w) in enumerate(zip(line, widths))) for line in [head] + body]
    lines.insert(1, "-" * len(lines[0]))
    ceiling = f"ceilings this run: copy {ceilings.copy_gbps:.0f} GB/s (read + write)"
    if ceilings.matmul_tflops:
        ceiling += f", bf16 matmul 8192^3 {ceilings.matmul_tflops:.0f} TFLOP/s"
    return "\n".join([ceiling, *lines])


PEER_DISTRIBUTIONS = {"Liger-Kernel": "liger-kernel", "FlagGems": "flag-gems",
                      "quack": "quack-kernels"}


def environment() -> dict:
    """This machine and its software, read once at the start of a run: GPU name and SM count,
    torch (and the CUDA it was built with), Triton, Python, the installed peers' versions and
    the UTC date. Queries the CUDA device, so only a GPU run calls it; reports and plots read the
    dict back from results.json."""
    import triton

    props = torch.cuda.get_device_properties(0)
    peers = {}
    for name, distribution in PEER_DISTRIBUTIONS.items():
        try:
            peers[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "peers": peers,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_json(path: Path, results: list[Result], rows: list[dict], ceilings: Ceilings,
               env: dict, command: str | None = None) -> dict:
    """Write the run to ``path`` and return what was written: ``environment`` (``env``, as
    :func:`environment` gave it at the start of the run), ``command`` (the command line),
    ``ceilings``, ``summary`` (:func:`summarize`'s rows) and ``results`` (every timing)."""
    report = {"environment": env, "command": command, "ceilings": asdict(ceilings),
              "summary": rows, "results": [asdict(r) for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return report


def load_json(path: Path) -> tuple[list[Result], Ceilings, dict]:
    """A results.json back as the run's results, ceilings and environment (to draw the plots
    on another machine)."""
    report = json.loads(Path(path).read_text())
    return ([Result(**r) for r in report["results"]], Ceilings(**report["ceilings"]),
            report["environment"])


@dataclass
class PlotSpec:
    """What one operator's chart shows, before any drawing.

    ``values[impl][i]`` is ``impl``'s figure at ``shapes[i]`` in ``unit`` ("TFLOP/s", "GB/s" or
    "us"), ``None`` where it failed. ``ceiling`` is the run's roofline in that unit (the bf16
    matmul rate for TFLOP/s, the copy bandwidth for GB/s; ``None`` for time or when the run did
    not measure it). ``log_scale`` when the figures span more than ``LOG_SPAN``x, as they do
    between a one-row decode shape and a prefill shape.
    """

    op: str
    title: str
    unit: str
    shapes: list[str]
    values: dict[str, list[float | None]]
    ceiling: float | None
    ceiling_label: str | None
    log_scale: bool


LOG_SPAN = 30.0


def plot_specs(results: list[Result], ceilings: Ceilings, gpu: str) -> list[PlotSpec]:
    """One :class:`PlotSpec` per operator, in name order. An operator that counts FLOPs is shown
    in TFLOP/s against the matmul rate, one that counts only bytes in GB/s against the copy
    bandwidth, one that counts neither in microseconds (lower is better)."""
    specs = []
    for op in sorted({r.op for r in results}):
        mine = [r for r in results if r.op == op]
        if any(r.tflops is not None for r in mine):
            unit, figure, ceiling = "TFLOP/s", "tflops", ceilings.matmul_tflops
            label = f"bf16 matmul {ceiling:.0f} TFLOP/s" if ceiling else None
        elif any(r.gbps is not None for r in mine):
            unit, figure, ceiling = "GB/s", "gbps", ceilings.copy_gbps
            label = f"copy {ceiling:.0f} GB/s"
        else:
            unit, figure, ceiling, label = "us", "time_us", None, None
        shapes = list(dict.fromkeys(r.shape for r in mine))
        values = {}
        for impl in dict.fromkeys(r.impl for r in mine):
            at = {r.shape: getattr(r, figure) for r in mine if r.impl == impl}
            series = [at.get(shape) for shape in shapes]
            if any(v is not None for v in series):  # an impl that failed everywhere: no bars
                values[impl] = series
        positive = [v for series in values.values() for v in series if v]
        log_scale = bool(positive) and max(positive) > LOG_SPAN * min(positive)
        better = "lower" if unit == "us" else "higher"
        specs.append(PlotSpec(op, f"{op}: {unit}, {better} is better ({gpu})", unit, shapes,
                              values, ceiling, label, log_scale))
    return specs


def draw(spec: PlotSpec, path: Path) -> None:
    """A grouped bar chart of ``spec`` (one group per shape, one bar per implementation, the
    ceiling as a dashed line) saved as a PNG at ``path``. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(spec.values)
    fig, ax = plt.subplots(figsize=(max(7, 1.8 * len(spec.shapes) + 2.5), 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        drawn = [(x, v) for x, v in enumerate(spec.values[impl]) if v is not None]
        ax.bar([x + i * width for x, _ in drawn], [v for _, v in drawn], width, label=impl)
    if spec.ceiling:
        ax.axhline(spec.ceiling, color="black", linestyle="--", linewidth=1,
                   label=spec.ceiling_label)
    if spec.log_scale:
        ax.set_yscale("log")
    ax.set_xticks([x + width * (len(impls) - 1) / 2 for x in range(len(spec.shapes))],
                  spec.shapes, fontsize=8)
    ax.set_ylabel(spec.unit)
    ax.set_title(spec.title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(results: list[Result], ceilings: Ceilings, out_dir: Path, gpu: str) -> list[Path]:
    """One PNG per operator, ``<out_dir>/<op>.png`` (see :func:`plot_specs`); none when
    matplotlib is not installed (it is the optional ``bench`` extra)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in plot_specs(results, ceilings, gpu):
        path = out_dir / f"{spec.op}.png"
        draw(spec, path)
        written.append(path)
    return written


def outputs_close(ours: Callable, reference: Callable, rtol: float = 2e-2,
                  normwise: bool = False) -> Callable[[], bool]:
    """A check that gemslib's output matches ``reference`` (computed in fp32 from the same
    inputs: a bf16 eager composition rounds after every op and drifts further than gemslib):
    elementwise (allclose, atol 1e-2), or with ``normwise`` the relative error of the whole
    output, ||a - b|| <= rtol ||b||, for products over a long K, where a few of a million
    16-bit outputs always stray past an elementwise bound."""

    def check() -> bool:
        a, b = ours(), reference()
        a, b = (a if isinstance(a, torch.Tensor) else a[0]), (b if isinstance(b, torch.Tensor) else b[0])
        a, b = a.float(), b.float()
        if normwise:
            return bool(torch.isfinite(a).all()) and \
                (a - b).norm().item() <= rtol * b.norm().item()
        return bool(torch.allclose(a, b, rtol=rtol, atol=1e-2))

    return check
