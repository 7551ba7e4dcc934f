"""Real-model prefill: transformers models at real sizes (random weights), run six ways.

    python -m benchmark --models [--model-names llama3-8b qwen2-7b] [--shapes 1x4096]
                                 [--ways eager gemslib inductor] [--layers N] [--tiny]
    python -m benchmark.models ...       (the same)

Each model of :data:`MODELS` is built from its config with random weights (nothing is
downloaded), seeded and built on the target device in float32 and cast to bf16, so every
process holds the same weights and the float32 model is the reference. Prefill of B sequences
of S tokens (``--shapes``, default B1 S4096 and B4 S2048) computes the logits of the last
position only (``logits_to_keep=1``, ``use_cache=False``), under ``torch.no_grad()``, with
``attn_implementation="sdpa"`` (``"eager"`` for a spec that says so: Gemma-2 with its logit
cap). The ways (``--ways``):

- ``eager``: the bf16 model as transformers runs it (the baseline of every ratio);
- ``enable``: the same under ``with gemslib.enable():`` (aten overrides);
- ``gemslib``: ``torch.compile(model, backend="gemslib", fullgraph=True)`` (inductor plus
  gemslib's graph passes; ``gemslib.fusion_report()`` is recorded per shape);
- ``inductor``: ``torch.compile(model, fullgraph=True)``;
- ``gemslib-cudagraphs`` and ``inductor-cudagraphs`` (only when named in ``--ways``): the two
  compiled ways with ``mode="reduce-overhead"`` (the forward replayed as a CUDA graph);
- ``liger``: Liger-Kernel's ``_apply_liger_kernel_to_instance(model=model)``, then eager;
- ``flaggems``: eager under FlagGems' ``with flag_gems.use_gems():``.

Every way runs in its own process (one per model and way, doing every shape; compiled ways
compile once per shape, ``dynamic=False``, with fresh inductor and Triton caches so the compile
times are cold ones), so a crash, a hang (``--timeout``) or a missing package is a row of the
table, not the end of the run. Two more processes per run: ``reference`` (the float32 logits,
saved as ``<out>/models/<model>/reference.pt`` and read by every way for its error) and
``floor`` (the machine's rates, measured in the same run).

Figures: median of ``--reps`` calls timed with CUDA events after ``--warmup`` calls; "compile s"
is the first call's wall time (for compiled ways the compile; for the others the kernels' JIT
and warm-up); rel. error is ||logits - ref|| / ||ref|| in float32 over the last positions, top-1
the fraction of positions whose argmax is the reference's (bf16 eager's own figures are the
baseline). The floor is the matmuls of one forward (q, k, v, o, gate, up and down per layer,
the lm_head on the last positions) at the bf16 matmul rate of cuBLAS at 8192^3, plus causal
attention's 2 * 2 * B * H * S^2 * D / 2 FLOPs per layer at the best rate torch's SDPA (cuDNN or
flash) reaches at that shape, both measured in this run: a bound no way can beat.

Writes ``<out>/models.json`` (everything, each way's raw result included) and
``<out>/models.md`` (a table per model and shape), workers' logs under ``<out>/models/``.
Without a CUDA GPU only ``--tiny`` runs (hidden 64, 2 layers, vocabulary 512; the kernels in
the Triton interpreter): the path is the same, the times mean nothing.

Exit codes: 0 every gemslib way ran (a peer's failure is reported, not fatal), 1 a gemslib way
(enable, gemslib) failed or there is no GPU without ``--tiny``, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmark import realmodels, stacks
from benchmark.realmodels import fmt, input_ids, model_spec, shape_key
from gemslib.models import (FAMILIES, MODELS, SEED, ModelSpec, build_model,  # noqa: F401
                            hf_config)  # (re-exported)


# ---- the models (gemslib.models) and the ways ----

DEFAULT_WAYS = ("eager", "enable", "gemslib", "inductor", "liger", "flaggems")
WAYS = DEFAULT_WAYS + ("gemslib-cudagraphs", "inductor-cudagraphs")
# their failure is the run's failure (exit 1)
GEMSLIB_WAYS = ("enable", "gemslib", "gemslib-cudagraphs")
COMPILED_WAYS = ("gemslib", "inductor", "gemslib-cudagraphs", "inductor-cudagraphs")
SHAPES = ((1, 4096), (4, 2048))
TINY_SHAPES = ((1, 32), (2, 16))


def matmul_flops(spec: ModelSpec, batch: int, seq: int) -> int:
    """FLOPs of one forward's matmuls: per layer q, k, v, o, gate, up, down over B * S tokens;
    the lm_head over the B last positions."""
    tokens = batch * seq
    q_width, kv_width = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    per_token = (spec.hidden * (q_width + 2 * kv_width) + q_width * spec.hidden
                 + 3 * spec.hidden * spec.intermediate)
    return 2 * tokens * per_token * spec.layers + 2 * batch * spec.hidden * spec.vocab


def attention_flops(spec: ModelSpec, batch: int, seq: int) -> int:
    """Causal attention over every layer: 2 * 2 * B * H * S^2 * D / 2 per layer."""
    return 2 * batch * spec.heads * seq * seq * spec.head_dim * spec.layers


# ---- the worker side: one process per job ----

def _compiled(way: str, model):
    """The compiled model for one shape (a fresh compile: dynamo's caches dropped first)."""
    import torch

    torch._dynamo.reset()
    mode = "reduce-overhead" if way.endswith("-cudagraphs") else None
    if way.startswith("gemslib"):
        import gemslib

        gemslib.reset_fusion_report()
        return torch.compile(model, backend="gemslib", fullgraph=True, dynamic=False, mode=mode)
    return torch.compile(model, fullgraph=True, dynamic=False, mode=mode)


def run_way(job: dict) -> dict:
    """Build the bf16 model, run ``job["way"]`` at each shape, compare with the reference."""
    import torch

    device = realmodels.target_device()
    spec = ModelSpec(**job["spec"])
    result = {"model": job["model"], "way": job["way"], "status": "ok", "shapes": {}}
    references = {}
    if job.get("reference") and Path(job["reference"]).exists():
        references = torch.load(job["reference"])
    started = time.perf_counter()
    model = build_model(spec, device, torch.bfloat16)
    result["build_s"] = time.perf_counter() - started
    realmodels.free_memory(device)  # the float32 build's memory back, the peak counter from here
    try:
        model, context, note = realmodels.prepare_way(job["way"], model,
                                                      ("eager",) + COMPILED_WAYS)
    except realmodels.NotInstalled as missing:
        result.update(status=realmodels.NOT_INSTALLED, error=f"{missing} is not installed")
        return result
    except Exception as err:  # e.g. a peer that does not know this transformers version
        result.update(status=f"setup failed: {realmodels.error_text(err)}")
        return result
    if note:
        result["note"] = note
    for batch, seq in job["shapes"]:
        key = shape_key(batch, seq)
        figures = result["shapes"].setdefault(key, {})
        realmodels.say(f"{job['model']} {job['way']} {key}: first call")
        try:
            ids = input_ids(spec, batch, seq, device)
            runner = _compiled(job["way"], model) if job["way"] in COMPILED_WAYS else model

            def forward():
                if job["way"].endswith("-cudagraphs"):  # a new replay; earlier outputs may go
                    torch.compiler.cudagraph_mark_step_begin()
                return runner(input_ids=ids, logits_to_keep=1, use_cache=False).logits

            with torch.no_grad(), context() as scope:
                started = time.perf_counter()
                logits = forward()
                realmodels.synchronize(device)
                figures["first_call_s"] = time.perf_counter() - started
                if job["way"].startswith("gemslib"):
                    import gemslib

                    figures["fusion_report"] = gemslib.fusion_report()
                for _ in range(job["warmup"]):
                    logits = forward()
                realmodels.synchronize(device)
                times = realmodels.time_calls(forward, device, job["reps"])
                logits = forward()  # a CUDA graph's replays overwrote the earlier output
            figures["times_ms"] = times
            figures["time_ms"] = statistics.median(times)
            if job["way"] == "enable":  # scope: gemslib.enable(record=True)
                figures["overrides"] = {name.replace("aten::", ""): count
                                        for name, count in sorted(scope.calls.items())}
                figures["fallbacks"] = {name.replace("aten::", ""): count
                                        for name, count in sorted(scope.fallbacks.items())}
            if device.type == "cuda":
                figures["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if key in references:
                figures.update(realmodels.accuracy(logits, references[key]))
            realmodels.say(f"{job['model']} {job['way']} {key}: {figures['time_ms']:.3f} ms, "
                           f"first call {figures['first_call_s']:.1f} s")
            del logits
        except Exception as err:  # this shape failed; the next may still run (an OOM frees)
            figures["error"] = realmodels.error_text(err)
            result["status"] = "error"
            realmodels.say(f"{job['model']} {job['way']} {key}: FAILED {figures['error']}")
        runner = None
        realmodels.free_memory(device)
        realmodels.write_result(job["result"], result)
    return result


def run_reference(job: dict) -> dict:
    """The float32 model's last-position logits at each shape, saved to ``job["reference"]``."""
    import torch

    device = realmodels.target_device()
    spec = ModelSpec(**job["spec"])
    model = realmodels.reference_model(spec, device)
    saved, result = {}, {"model": job["model"], "way": "reference", "status": "ok", "shapes": {}}
    for batch, seq in job["shapes"]:
        key = shape_key(batch, seq)
        with torch.no_grad():
            started = time.perf_counter()
            logits = model(input_ids=input_ids(spec, batch, seq, device), logits_to_keep=1,
                           use_cache=False).logits
            realmodels.synchronize(device)
        saved[key] = logits[:, -1].float().cpu()
        result["shapes"][key] = {"time_s": time.perf_counter() - started}
        torch.save(saved, job["reference"])
        realmodels.say(f"{job['model']} reference {key}: done")
        del logits
        realmodels.free_memory(device)
    return result


def _sdpa_ms(batch: int, heads: int, seq: int, dim: int, device) -> tuple[float, str]:
    """The best causal SDPA time at (B, H, S, D) in bf16 among torch's cuDNN and flash
    backends (on the CPU: torch's own choice), and which backend gave it."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)
               for _ in range(3))
    if device.type != "cuda":
        return realmodels.median_call_ms(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device), "default"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (math.inf, "none")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        try:
            best = min(best, (realmodels.median_call_ms(call, device), backend.name.lower()))
        except Exception:  # a backend that does not take the shape: the other one counts
            continue
    return best


def run_floor(job: dict) -> dict:
    """The machine's bf16 matmul rate (8192^3; 512^3 on the CPU) and torch SDPA's rate at each
    model's attention shape, and the environment of the run."""
    import torch

    from benchmark import harness

    device = realmodels.target_device()
    result = {"way": "floor", "status": "ok", "problems": {}}
    if device.type == "cuda":
        result["environment"] = harness.environment()
    n = 8192 if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = realmodels.median_call_ms(lambda: a @ b, device)
    result["matmul"] = {"n": n, "ms": mm_ms, "tflops": 2 * n**3 / mm_ms / 1e9}
    del a, b
    realmodels.say(f"floor: bf16 matmul {n}^3 {result['matmul']['tflops']:.1f} TFLOP/s")
    for problem in job["attention"]:
        batch, heads, seq, dim = problem
        ms, backend = _sdpa_ms(batch, heads, seq, dim, device)
        flops = 2 * batch * heads * seq * seq * dim
        result["problems"][f"B{batch} H{heads} S{seq} D{dim}"] = {
            "ms": ms, "backend": backend, "tflops": flops / ms / 1e9 if ms < math.inf else None}
        realmodels.say(f"floor: SDPA causal B{batch} H{heads} S{seq} D{dim} {ms:.3f} ms ({backend})")
        realmodels.free_memory(device)
        realmodels.write_result(job["result"], result)
    realmodels.write_result(job["result"], result)
    return result


def worker_main(job_path: str) -> int:
    stacks.answer_stack_requests()
    job = json.loads(Path(job_path).read_text())
    kind = job["kind"]
    if kind == "floor":
        result = run_floor(job)
    elif kind == "reference":
        result = run_reference(job)
    else:
        result = run_way(job)
    realmodels.write_result(job["result"], result)
    return 0


# ---- the orchestrating side ----

def worker_command(job: dict, job_path: Path) -> list[str]:
    """The command line of one worker process (tests replace it to fake a crash)."""
    return [sys.executable, "-m", "benchmark.models", "--worker", str(job_path)]


def _ratio(base, value) -> str:
    return "-" if not base or not value else f"{base / value:.2f}x"


def shape_rows(results: dict, model: str, key: str, floor_ms: float | None) -> list[dict]:
    """One row per way at (model, shape), with its speed-ups over eager, inductor, liger."""
    rows = []
    for way, result in results.items():
        figures = result.get("shapes", {}).get(key, {})
        status = result.get("status", "?")
        if figures.get("error"):
            status = figures["error"]
        elif status == "error":
            status = "ok"  # another shape failed, this one ran
        rows.append({"model": model, "shape": key, "way": way, "status": status,
                     "time_ms": figures.get("time_ms"),
                     "first_call_s": figures.get("first_call_s"),
                     "rel_error": figures.get("rel_error"), "top1": figures.get("top1"),
                     "finite": figures.get("finite"), "peak_gib": figures.get("peak_gib"),
                     "fusion_report": figures.get("fusion_report"),
                     "overrides": figures.get("overrides"),
                     "fallbacks": figures.get("fallbacks")})
    times = {row["way"]: row["time_ms"] for row in rows}
    for row in rows:
        for peer in ("eager", "inductor", "liger"):
            base, mine = times.get(peer), row["time_ms"]
            row[f"vs_{peer}"] = base / mine if base and mine else None
        row["floor_ms"] = floor_ms
        row["vs_floor"] = row["time_ms"] / floor_ms if row["time_ms"] and floor_ms else None
    return rows


def format_markdown(report: dict) -> str:
    """The run as markdown: a header, then per model and shape the floor and a table."""
    env = report.get("environment") or {}
    lines = ["# Real-model prefill", ""]
    where = env.get("gpu") or "CPU (Triton interpreter; times mean nothing)"
    software = ", ".join(f"{k} {v}" for k, v in (
        ("torch", env.get("torch")), ("Triton", env.get("triton")),
        ("transformers", env.get("transformers"))) if v)
    peers = ", ".join(f"{k} {v}" for k, v in (env.get("peers") or {}).items())
    lines.append(f"**{where}; {software}{'; ' + peers if peers else ''}; {env.get('date', '')}; "
                 f"`{report.get('command', '')}`.**")
    lines += ["", "bf16, random weights (transformers' init, seeded), sdpa attention (eager where "
              "a title says so), "
              "`logits_to_keep=1`, no KV cache. Time: median of CUDA-event timed calls. "
              "Speed-ups: the other way's time over this way's. time/floor: over the matmuls "
              "at the run's cuBLAS rate plus attention at torch SDPA's rate. compile s: the "
              "first call's wall time. rel. error and top-1: last-position logits against the "
              "float32 model.", ""]
    floor = report.get("floor") or {}
    if floor.get("matmul"):
        lines.append(f"Rates this run: bf16 matmul {floor['matmul']['n']}^3 "
                     f"{floor['matmul']['tflops']:.1f} TFLOP/s.")
        lines.append("")
    for model, entry in report["models"].items():
        spec = entry["spec"]
        for key, shape in entry["shapes"].items():
            lines.append(f"## {spec['title']}, {spec['layers']} layers, prefill {key}")
            lines.append("")
            fl = shape.get("floor") or {}
            if fl.get("floor_ms"):
                lines.append(f"Floor {fl['floor_ms']:.3g} ms: matmuls {fl['matmul_tflop']:.3g} "
                             f"TFLOP in {fl['matmul_ms']:.3g} ms, attention "
                             f"{fl['attention_tflop']:.3g} TFLOP in {fl['attention_ms']:.3g} ms "
                             f"(SDPA {fl.get('attention_backend')} "
                             f"{fl.get('attention_tflops') or 0:.3g} TFLOP/s).")
            else:
                lines.append("Floor: not measured.")
            lines.append("")
            head = ["way", "time ms", "vs eager", "vs inductor", "vs liger", "time/floor",
                    "compile s", "rel. error", "top-1", "status"]
            lines += ["| " + " | ".join(head) + " |",
                      "| --- | " + " | ".join(["---:"] * (len(head) - 2)) + " | --- |"]
            for row in shape["rows"]:
                cells = [row["way"], fmt(row["time_ms"], ".2f"),
                         fmt(row["vs_eager"], ".2f") + ("x" if row["vs_eager"] else ""),
                         fmt(row["vs_inductor"], ".2f") + ("x" if row["vs_inductor"] else ""),
                         fmt(row["vs_liger"], ".2f") + ("x" if row["vs_liger"] else ""),
                         fmt(row["vs_floor"], ".2f"), fmt(row["first_call_s"], ".1f"),
                         fmt(row["rel_error"], ".2e"), fmt(row["top1"], ".2f"),
                         str(row["status"]).replace("|", "\\|")]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
            for row in shape["rows"]:
                if row.get("fusion_report") is not None:
                    fusions = ", ".join(f"{k} {v}" for k, v in sorted(row["fusion_report"].items()))
                    lines.append(f"- {row['way']} fusions: {fusions or 'none'}")
                if row.get("overrides") is not None:
                    ran = ", ".join(sorted(row["overrides"])) or "none"
                    fell = ", ".join(sorted(row["fallbacks"] or {})) or "none"
                    lines.append(f"- {row['way']} overrides that ran: {ran}; fell back: {fell}")
            ratio = shape.get("compile_ratio")
            if ratio:
                lines.append(f"- compile (first call): gemslib {ratio['gemslib_s']:.1f} s, "
                             f"inductor {ratio['inductor_s']:.1f} s: "
                             f"{ratio['ratio']:.2f}x inductor's")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _progress_line(result: dict, keys: list[str]) -> str:
    parts = []
    for key in keys:
        figures = result.get("shapes", {}).get(key, {})
        if figures.get("time_ms") is not None:
            part = f"{key} {figures['time_ms']:.2f} ms"
            if figures.get("rel_error") is not None:
                part += f" err {figures['rel_error']:.1e} top1 {figures['top1']:.2f}"
            part += f" 1st {figures.get('first_call_s', 0):.1f} s"
        else:
            part = f"{key} {figures.get('error') or result.get('status')}"
        parts.append(part)
    return " | ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    from gemslib.cli import doc_summary, positive_int, size_pair

    parser = argparse.ArgumentParser(
        prog="python -m benchmark --models", description=doc_summary(__doc__),
        epilog="exit codes: 0 every gemslib way ran; 1 a gemslib way failed, or no CUDA GPU "
               "without --tiny; 2 bad arguments")
    parser.add_argument("--model-names", nargs="+", choices=list(MODELS), default=list(MODELS),
                        metavar="NAME", help=f"models to run (default: all: {', '.join(MODELS)})")
    parser.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(DEFAULT_WAYS),
                        metavar="WAY", help=f"ways to run, of {', '.join(WAYS)} (default: "
                                            f"{', '.join(DEFAULT_WAYS)})")
    parser.add_argument("--shapes", nargs="+", type=size_pair("BxS"), default=None,
                        metavar="BxS", help="prefill shapes (default: 1x4096 4x2048; "
                                            "1x32 2x16 with --tiny)")
    parser.add_argument("--layers", type=positive_int, default=None, metavar="N",
                        help="decoder layers (default: 8 for Llama and Mistral, 4 for Qwen2; "
                             "2 with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="each family at hidden 64, 2 layers (runs on the CPU)")
    parser.add_argument("--timeout", type=positive_int, default=300, metavar="S",
                        help="seconds one process (one model and way, every shape) may take "
                             "(default 300)")
    parser.add_argument("--budget", type=positive_int, default=None, metavar="S",
                        help="seconds for the whole run: processes get at most what is left, "
                             "and none starts once it is spent (default: no limit)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="calls after the first one before timing (default 3; 1 on the CPU)")
    parser.add_argument("--reps", type=positive_int, default=None, metavar="N",
                        help="timed calls, the median is reported (default 20; 3 on the CPU)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="let workers share inductor's and Triton's on-disk caches (default: "
                             "each starts cold, so compile times are first compiles)")
    parser.add_argument("--out", type=Path, default=realmodels.BENCH_DIR / "results",
                        help="folder for models.json, models.md and models/ (default: "
                             "benchmark/results)")
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if importlib.util.find_spec("transformers") is None:
        print("python -m benchmark --models: needs transformers (pip install -e '.[models]'); "
              "nothing was run.", file=sys.stderr)
        return 1
    gpu = realmodels.has_gpu()
    if not gpu and not args.tiny:
        print("python -m benchmark --models: needs a CUDA GPU at real sizes and there is none "
              "here; --tiny runs the same path on the CPU (times mean nothing). Nothing was run.",
              file=sys.stderr)
        return 1
    shapes = [tuple(s) for s in (args.shapes or (SHAPES if not args.tiny else TINY_SHAPES))]
    keys = [shape_key(*s) for s in shapes]
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    reps = args.reps or (20 if gpu else 3)
    out = args.out.resolve()
    work = out / "models"
    work.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmark", "--models",
                          *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()

    def left() -> float:
        return math.inf if args.budget is None else args.budget - (time.perf_counter() - started)

    def run(job: dict, directory: Path) -> dict:
        seconds = min(args.timeout, left())
        if seconds < 1:
            return {"model": job.get("model"), "way": job["way"], "shapes": {},
                    "status": "skipped: --budget spent"}
        return realmodels.run_job(job, directory, seconds, command=worker_command,
                                  cold_cache=not args.warm_cache)

    specs = {name: model_spec(name, args.tiny, args.layers) for name in args.model_names}
    print(f"real-model prefill: {', '.join(args.model_names)} x {', '.join(keys)} x "
          f"{', '.join(args.ways)} on {'the GPU' if gpu else 'the CPU (interpreter)'}; "
          f"logs in {work}", flush=True)

    # the floor first, on an idle GPU: the matmul rate and SDPA at every model's shapes
    problems = sorted({(b, spec.heads, s, spec.head_dim) for spec in specs.values()
                       for b, s in shapes})
    floor = run({"kind": "floor", "way": "floor", "attention": problems}, work)
    matmul = (floor.get("matmul") or {}).get("tflops")
    print(f"[{time.perf_counter() - started:5.0f} s] floor: {floor.get('status')}"
          + (f", bf16 matmul {matmul:.1f} TFLOP/s" if matmul else ""), flush=True)

    report = {"environment": floor.get("environment") or realmodels.cpu_environment(),
              "command": command, "settings": {"shapes": keys, "ways": args.ways,
                                               "warmup": warmup, "reps": reps, "tiny": args.tiny,
                                               "timeout_s": args.timeout,
                                               "cold_cache": not args.warm_cache},
              "floor": floor, "models": {}}
    report["environment"]["transformers"] = _version("transformers")
    failed_gemslib = []
    for name, spec in specs.items():
        directory = work / name
        directory.mkdir(parents=True, exist_ok=True)
        common = {"model": name, "spec": dataclasses.asdict(spec),
                  "shapes": [list(s) for s in shapes]}
        reference_path = directory / "reference.pt"
        reference_path.unlink(missing_ok=True)
        reference = run(dict(common, kind="reference", way="reference",
                             reference=str(reference_path)), directory)
        print(f"[{time.perf_counter() - started:5.0f} s] {name} reference (float32): "
              f"{reference.get('status')}", flush=True)
        results = {}
        for way in args.ways:
            peer = realmodels.PEER_MODULES.get(way)
            if peer is not None and importlib.util.find_spec(peer) is None:
                results[way] = {"way": way, "status": realmodels.NOT_INSTALLED, "shapes": {}}
            else:
                results[way] = run(dict(common, kind="way", way=way, warmup=warmup, reps=reps,
                                        reference=str(reference_path)), directory)
            result = results[way]
            if way in GEMSLIB_WAYS and (result.get("status") != "ok"):
                failed_gemslib.append(f"{name} {way}: {result.get('status')}")
            line = result["status"] if result["status"] in (realmodels.NOT_INSTALLED,) or \
                result["status"].startswith("skipped") else _progress_line(result, keys)
            print(f"[{time.perf_counter() - started:5.0f} s] {name} {way:<8} {line}"
                  + (f"  ({result['wall_s']:.0f} s)" if result.get("wall_s") else ""),
                  flush=True)
        entry = {"spec": dataclasses.asdict(spec), "reference": reference, "ways": results,
                 "shapes": {}}
        for (batch, seq), key in zip(shapes, keys):
            shape_floor = _floor(spec, batch, seq, floor)
            rows = shape_rows(results, name, key, shape_floor.get("floor_ms"))
            shape_entry = {"floor": shape_floor, "rows": rows}
            compile_s = {row["way"]: row["first_call_s"] for row in rows
                         if row["way"] in COMPILED_WAYS and row["time_ms"] is not None}
            if "gemslib" in compile_s and "inductor" in compile_s:
                shape_entry["compile_ratio"] = {
                    "gemslib_s": compile_s["gemslib"], "inductor_s": compile_s["inductor"],
                    "ratio": compile_s["gemslib"] / compile_s["inductor"]}
            entry["shapes"][key] = shape_entry
        report["models"][name] = entry
        # after each model: a cut run keeps what it finished
        realmodels.write_report(out, report, "models", format_markdown)

    report["wall_s"] = time.perf_counter() - started
    markdown = realmodels.write_report(out, report, "models", format_markdown)
    print()
    print(markdown)
    print(f"wrote models.json and models.md to {out} ({report['wall_s']:.0f} s)")
    for failure in failed_gemslib:
        print(f"gemslib FAILED: {failure}")
    return 1 if failed_gemslib else 0


def _floor(spec: ModelSpec, batch: int, seq: int, floor: dict) -> dict:
    """The floor of one forward at (B, S) from the run's measured rates."""
    mm_flops, attn_flops = matmul_flops(spec, batch, seq), attention_flops(spec, batch, seq)
    entry = {"matmul_tflop": mm_flops / 1e12, "attention_tflop": attn_flops / 1e12}
    matmul = (floor.get("matmul") or {}).get("tflops")
    sdpa = (floor.get("problems") or {}).get(f"B{batch} H{spec.heads} S{seq} D{spec.head_dim}")
    if matmul and sdpa and sdpa.get("tflops"):
        entry.update(matmul_ms=mm_flops / matmul / 1e9,
                     attention_ms=attn_flops / sdpa["tflops"] / 1e9,
                     attention_backend=sdpa["backend"], attention_tflops=sdpa["tflops"])
        entry["floor_ms"] = entry["matmul_ms"] + entry["attention_ms"]
    return entry


def _version(distribution: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
