"""Real-model decode: transformers models at real sizes (random weights), one token per step.

    python -m benchmark --models --decode [--model-names llama3-8b] [--cases 16x128+64 ...]
                                          [--ways eager static-gemslib ...] [--tiny]
    python -m benchmark.decode ...       (the same)

The models are :mod:`benchmark.models`' (same configs, weights and token ids). A case is B
sequences of a P-token prompt followed by N greedy new tokens, in a cache of L positions
(``BxP+N`` or ``BxP+NofL``; L defaults to P + N): defaults B1 and B16 at 128 + 64 tokens, and
at 2048 valid positions of a 4096-long cache. The ways (``--ways``):

- ``eager``: transformers' dynamic cache;
- ``enable``: the same under ``with gemslib.enable():``, its process also timing eager's steps
  and ``generate()`` in alternation with its own (both host-bound: the host's speed drifts
  between processes by more than the overrides change);
- ``static-inductor``: a static cache, the step compiled by transformers' default
  ``CompileConfig`` (inductor, ``mode="reduce-overhead"``: CUDA graphs);
- ``static-gemslib``: the same with ``CompileConfig(backend="gemslib")``;
- ``liger``: Liger-Kernel's patch, dynamic cache.

Per case and way: **step ms**, one decode forward of one token per sequence at P valid
positions (timed alone with CUDA events, the compiled ways through ``torch.compile(model,
backend=..., mode="reduce-overhead", fullgraph=True)`` on a static cache, i.e. in their CUDA
graph; the host's part of the call, dynamo's guards and the cudagraph tree's bookkeeping, is
in it, the GPU idle meanwhile), **GPU ms**, the same step's GPU work alone (the stream held
busy past the call's host part, so the events see its kernels back to back; the ways not in a
CUDA graph have none: transformers' mask check reads a bool off the GPU every eager step),
**tok/s** of ``model.generate(max_new_tokens=N)`` (prefill included, transformers' own loop),
the step's logits against the float32 model's (relative error, top-1), and the
floor: the bytes one step must read (every weight once, K and V at the valid positions) at the
run's copy bandwidth. Each way runs in its own process, as in :mod:`benchmark.models`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmark import realmodels, stacks
from benchmark.realmodels import fmt
from gemslib.models import MODELS, ModelSpec, build_model

DECODE_WAYS = ("eager", "enable", "static-inductor", "static-gemslib", "liger")
GEMSLIB_WAYS = ("enable", "static-gemslib")
DECODE_CASES = ((1, 128, 64, 192), (16, 128, 64, 192), (1, 2048, 32, 4096),
                (16, 2048, 32, 4096))
TINY_DECODE_CASES = ((1, 12, 3, 15), (2, 12, 3, 32))
_CASE = re.compile(r"^(\d+)x(\d+)\+(\d+)(?:of(\d+))?$")


def case_key(batch: int, prompt: int, new: int, cache_len: int) -> str:
    return f"B{batch} {prompt}+{new}" + ("" if cache_len == prompt + new else f" of {cache_len}")


def parse_case(text: str) -> tuple[int, int, int, int]:
    """``BxP+N`` or ``BxP+NofL`` -> (B, P, N, L), L at least P + N."""
    found = _CASE.match(text)
    if not found:
        raise argparse.ArgumentTypeError(f"expected BxP+N or BxP+NofL (e.g. 16x2048+32of4096), "
                                         f"got {text!r}")
    batch, prompt, new = (int(found.group(i)) for i in (1, 2, 3))
    cache_len = int(found.group(4) or prompt + new)
    if min(batch, prompt, new) < 1 or cache_len < prompt + new:
        raise argparse.ArgumentTypeError(f"{text!r} (BxP+NofL): B, P and N must be positive "
                                         f"and L at least P + N")
    return batch, prompt, new, cache_len


def step_bytes(spec: ModelSpec, batch: int, valid: int, elem_bytes: int = 2) -> dict:
    """Bytes one decode step reads at least: every weight once (the embedding's B rows only)
    and K and V of every layer at ``valid`` positions."""
    q_width, kv_width = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    per_layer = (spec.hidden * (q_width + 2 * kv_width) + q_width * spec.hidden
                 + 3 * spec.hidden * spec.intermediate + 2 * spec.hidden)
    weights = (per_layer * spec.layers + spec.hidden * spec.vocab + spec.hidden
               + batch * spec.hidden) * elem_bytes
    cache = 2 * spec.layers * batch * kv_width * valid * elem_bytes
    return {"weights": weights, "cache": cache, "total": weights + cache}


# ---- the worker side ----

def _step_inputs(batch: int, prompt: int, device):
    """The token of the first decode step (fixed) and its attention mask over the prompt."""
    import torch

    token = torch.full((batch, 1), 7, dtype=torch.long, device=device)
    return token, torch.ones(batch, prompt + 1, dtype=torch.long, device=device)


def _prefilled_cache(model, ids, static: bool, cache_len: int):
    import torch
    import transformers

    cache = (transformers.StaticCache(config=model.config, max_cache_len=cache_len) if static
             else transformers.DynamicCache(config=model.config))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
              use_cache=True, logits_to_keep=1)
    return cache


def static_compile_arguments(way: str, module_guards: bool = True) -> dict:
    """``torch.compile``'s (and ``transformers.CompileConfig``'s) arguments for a static way:
    its backend, one graph, CUDA graphs. ``module_guards=False``: dynamo's guards on the
    model's modules dropped (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``; safe for
    a loop that never changes the model's modules or config), which torch takes only in
    ``options``, and then not beside a ``mode``: CUDA graphs as their option."""
    import torch

    arguments = {"backend": "gemslib" if way == "static-gemslib" else "inductor",
                 "fullgraph": True}
    if module_guards:
        return dict(arguments, mode="reduce-overhead")
    return dict(arguments, mode=None, options={
        "triton.cudagraphs": True,
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def gemslib_settings() -> str:
    """What decides a gemslib step besides the code, for its row: the tune-config file in use
    and the defaults the environment gives the decode fusions and the step graphs."""
    from gemslib import runtime
    from gemslib.passes import manager
    from gemslib.passes.backend import step_graphs_default

    step_graphs = {True: "on", False: "off", "auto": "auto"}[step_graphs_default()]
    return (f"tune config {runtime.config_path().name}; decode_gemv "
            f"{manager.fusion_default('decode_gemv')}; step graphs {step_graphs}")


def _step_runner(way: str, model, ids, cache_len: int, module_guards: bool = True):
    """(step, rewind): ``step()`` runs one decode step at P valid positions and returns its
    last logits; ``rewind()`` takes the cache back to the prompt, so that every step sees the
    same fill (transformers' static layers count their own length). ``module_guards``: as in
    :func:`static_compile_arguments`."""
    import torch

    static = way.startswith("static")
    batch, prompt = ids.shape
    token, mask = _step_inputs(batch, prompt, ids.device)
    position = torch.tensor([prompt], device=ids.device)
    cache = _prefilled_cache(model, ids, static, cache_len)
    runner = model
    if static:
        torch._dynamo.reset()
        if way == "static-gemslib":
            import gemslib

            gemslib.reset_fusion_report()
        runner = torch.compile(model, **static_compile_arguments(way, module_guards))

    def step():
        if static:  # a new CUDA graph replay: the previous step's outputs may go
            torch.compiler.cudagraph_mark_step_begin()
        return runner(input_ids=token, attention_mask=mask, past_key_values=cache,
                      cache_position=position, use_cache=True).logits[:, -1]

    def rewind():
        if static:
            for layer in cache.layers:
                layer.cumulative_length.fill_(prompt)
        else:
            cache.crop(-1)

    return step, rewind


def run_decode_way(job: dict) -> dict:
    import torch

    device = realmodels.target_device()
    spec = ModelSpec(**job["spec"])
    result = {"model": job["model"], "way": job["way"], "status": "ok", "shapes": {}}
    references = {}
    if job.get("reference") and Path(job["reference"]).exists():
        references = torch.load(job["reference"])
    model = build_model(spec, device, torch.bfloat16)
    realmodels.free_memory(device)
    way = job["way"]
    module_guards = job.get("module_guards", True)
    try:
        if way in ("liger", "enable"):
            model, context, _ = realmodels.prepare_way(way, model)
        else:
            context = contextlib.nullcontext
    except realmodels.NotInstalled as missing:
        result.update(status=realmodels.NOT_INSTALLED, error=f"{missing} is not installed")
        return result
    except Exception as err:
        result.update(status=f"setup failed: {realmodels.error_text(err)}")
        return result
    for batch, prompt, new, cache_len in job["cases"]:
        key = case_key(batch, prompt, new, cache_len)
        figures = result["shapes"].setdefault(key, {})
        try:
            ids = realmodels.input_ids(spec, batch, prompt, device)
            with torch.no_grad(), context() as scope:
                started = time.perf_counter()
                skips_before = _cudagraph_skips()
                step, rewind = _step_runner(way, model, ids, cache_len, module_guards)
                logits = step().float()
                realmodels.synchronize(device)
                figures["first_call_s"] = time.perf_counter() - started
                if way == "static-gemslib":
                    import gemslib

                    figures["fusion_report"] = gemslib.fusion_report()
                    figures["gemslib_settings"] = gemslib_settings()
                # every step at the same fill: the rewind before it, untimed
                realmodels.time_calls(step, device, job["warmup"], before=rewind)
                if way == "enable":
                    _time_beside_eager(figures, scope, step, rewind, model, ids, new,
                                       cache_len, device, job["reps"])
                else:
                    times = realmodels.time_calls(step, device, job["reps"], before=rewind)
                    figures["step_ms"] = statistics.median(times)
                    gpu_times = realmodels.time_gpu_work(step, device, job["reps"], before=rewind)
                    figures["gpu_ms"] = statistics.median(gpu_times) if gpu_times else None
                    if way.startswith("static"):  # the step's compiles left without CUDA graphs
                        figures["cudagraph_skips"] = _cudagraph_skips() - skips_before
                    rewind()
                    figures["tokens_per_s"], figures["generate_s"] = _generate(
                        way, model, ids, new, cache_len, module_guards=module_guards)
            if key in references:
                figures.update(realmodels.accuracy(logits, references[key]))
            realmodels.say(f"{job['model']} {way} {key}: step {figures['step_ms']:.3f} ms, "
                           f"{figures['tokens_per_s']:.0f} tok/s")
        except Exception as err:
            figures["error"] = realmodels.error_text(err)
            result["status"] = "error"
            realmodels.say(f"{job['model']} {way} {key}: FAILED {figures['error']}")
        realmodels.free_memory(device)
        realmodels.write_result(job["result"], result)
    return result


def _cudagraph_skips() -> int:
    """Inductor's count of compiles that asked for CUDA graphs and run without them (a skip
    is logged only under ``TORCH_LOGS=cudagraphs``; the step's host then launches every
    kernel, which its "step ms" shows and its "GPU ms" hides)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


ALTERNATIONS = 4  # enable()'s blocks of steps, each followed by a block of eager steps


def _time_beside_eager(figures: dict, scope, step, rewind, model, ids, new: int,
                       cache_len: int, device, reps: int) -> None:
    """The ``enable`` way's figures, and eager's in the same process, alternately: blocks of
    steps under ``enable()`` (``scope``, the caller's activation, is closed and opened again
    per block), each followed by as many eager steps, then ``generate()`` likewise twice each
    (the faster of each kept). Both are host-bound, and the host's speed drifts between
    processes by more than the overrides change; in one process it drifts for both alike."""
    import gemslib

    scope.close()
    ours, eager = [], []
    block = max(1, reps // ALTERNATIONS)
    for _ in range(ALTERNATIONS):
        with gemslib.enable(scope.ops):
            ours += realmodels.time_calls(step, device, block, before=rewind)
        eager += realmodels.time_calls(step, device, block, before=rewind)
    rewind()
    generated, generated_eager = [], []
    for first in (True, False):  # one untimed call of each before its first timed one
        with gemslib.enable(scope.ops):
            generated.append(_generate("enable", model, ids, new, cache_len, first, timed=1))
        generated_eager.append(_generate("eager", model, ids, new, cache_len, first, timed=1))
    figures["step_ms"] = statistics.median(ours)
    figures["eager_step_ms"] = statistics.median(eager)
    figures["tokens_per_s"], figures["generate_s"] = max(generated)
    figures["eager_tokens_per_s"] = max(generated_eager)[0]


def _generate(way: str, model, ids, new: int, cache_len: int,
              untimed_first: bool = True, timed: int = 3,
              module_guards: bool = True) -> tuple[float, float]:
    """(tokens/s, seconds) of a greedy ``generate`` of ``new`` tokens, the fastest of ``timed``
    calls (one call is mostly host time, which jumps on a busy host), after one untimed call
    (the static ways compile and record their step in it) unless ``untimed_first`` is False.
    The static ways' calls share one cache, reset before each."""
    import torch
    import transformers

    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)
    if way.startswith("static"):
        config = transformers.CompileConfig(**static_compile_arguments(way, module_guards))
        config._compile_all_devices = True  # transformers compiles on GPUs only by default
        model.generation_config.compile_config = config
        # one cache for every call, emptied before each, as a serving loop keeps its cache: its
        # tensors are the step's static inputs, and new ones would make the CUDA-graph trees
        # record the step again in every call
        cache = transformers.StaticCache(config=model.config, max_cache_len=cache_len)

        def call():
            cache.reset()
            return model.generate(ids, past_key_values=cache, **kwargs)
    else:
        def call():
            return model.generate(ids, **kwargs)
    if untimed_first:
        call()
    timings = []
    for _ in range(timed):
        realmodels.synchronize(ids.device)
        started = time.perf_counter()
        call()
        realmodels.synchronize(ids.device)
        timings.append(time.perf_counter() - started)
    seconds = min(timings)
    return ids.shape[0] * new / seconds, seconds


def run_decode_reference(job: dict) -> dict:
    """The float32 model's logits of the first decode step of each case (dynamic cache)."""
    import torch

    device = realmodels.target_device()
    spec = ModelSpec(**job["spec"])
    model = realmodels.reference_model(spec, device)
    saved, result = {}, {"model": job["model"], "way": "reference", "status": "ok", "shapes": {}}
    for batch, prompt, new, cache_len in job["cases"]:
        key = case_key(batch, prompt, new, cache_len)
        with torch.no_grad():
            ids = realmodels.input_ids(spec, batch, prompt, device)
            step, _ = _step_runner("eager", model, ids, cache_len)
            saved[key] = step().float().cpu()
        result["shapes"][key] = {}
        torch.save(saved, job["reference"])
        realmodels.free_memory(device)
    return result


def run_decode_floor(job: dict) -> dict:
    """The copy bandwidth of the run (bytes read + written per second)."""
    import torch

    device = realmodels.target_device()
    result = {"way": "floor", "status": "ok"}
    if device.type == "cuda":
        from benchmark import harness

        result["environment"] = harness.environment()
        result["copy_gbps"] = harness.measure_ceilings().copy_gbps
    else:
        src = torch.randn(1 << 22)
        dst = torch.empty_like(src)
        ms = realmodels.median_call_ms(lambda: dst.copy_(src), device)
        result["copy_gbps"] = 2 * src.numel() * 4 / ms / 1e6
    return result


def worker_main(job_path: str) -> int:
    """Run one job (the floor, a model's reference, or a way) in this process."""
    stacks.answer_stack_requests()
    job = json.loads(Path(job_path).read_text())
    run = {"decode_floor": run_decode_floor, "decode_reference": run_decode_reference,
           "decode_way": run_decode_way}[job["kind"]]
    realmodels.write_result(job["result"], run(job))
    return 0


# ---- the orchestrating side ----

def worker_command(job: dict, job_path: Path) -> list[str]:
    """The command line of one worker process: this module, in a process of its own."""
    return [sys.executable, "-m", "benchmark.decode", "--worker", str(job_path)]


def build_parser() -> argparse.ArgumentParser:
    from gemslib.cli import positive_int

    parser = argparse.ArgumentParser(
        prog="python -m benchmark --models --decode",
        description="Real-model decode: each way in its own process (see the module's doc).")
    parser.add_argument("--model-names", nargs="+", choices=list(MODELS), default=list(MODELS),
                        metavar="NAME", help=f"models (default: all: {', '.join(MODELS)})")
    parser.add_argument("--ways", nargs="+", choices=list(DECODE_WAYS),
                        default=list(DECODE_WAYS), metavar="WAY",
                        help=f"ways (default: all: {', '.join(DECODE_WAYS)})")
    parser.add_argument("--cases", nargs="+", type=parse_case, default=None, metavar="CASE",
                        help="BxP+N or BxP+NofL: batch, prompt, new tokens, cache length "
                             "(default: 1x128+64 16x128+64 1x2048+32of4096 16x2048+32of4096)")
    parser.add_argument("--layers", type=positive_int, default=None, metavar="N",
                        help="decoder layers to build (default: the model table's)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny configs on the CPU (Triton interpreter; times mean nothing)")
    parser.add_argument("--timeout", type=positive_int, default=300, metavar="S",
                        help="seconds per process before it is stopped (default: 300)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N",
                        help="untimed steps before timing (default: 3 on a GPU, 1 on the CPU)")
    parser.add_argument("--reps", type=positive_int, default=None, metavar="N",
                        help="timed steps (default: 50 on a GPU, 3 on the CPU)")
    parser.add_argument("--out", type=Path, default=realmodels.BENCH_DIR / "results", metavar="DIR",
                        help="where decode.json and decode.md go (default: benchmark/results)")
    parser.add_argument("--no-module-guards", action="store_true",
                        help="compile the static ways with dynamo's guards on the model's "
                             "modules dropped (torch.compiler.skip_guard_on_all_nn_modules_unsafe"
                             ", CUDA graphs as an option): the step's host part without them")
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    return parser


def _row(result: dict, key: str, floor_ms: float | None) -> dict:
    figures = result.get("shapes", {}).get(key, {})
    status = figures.get("error") or ("ok" if result.get("status") == "error"
                                      else result.get("status", "?"))
    gpu_ms = figures.get("gpu_ms")
    return {"way": result["way"], "status": status, "step_ms": figures.get("step_ms"),
            "gpu_ms": gpu_ms, "gpu_vs_floor": gpu_ms / floor_ms if gpu_ms and floor_ms else None,
            "tokens_per_s": figures.get("tokens_per_s"),
            "first_call_s": figures.get("first_call_s"), "rel_error": figures.get("rel_error"),
            "top1": figures.get("top1"), "fusion_report": figures.get("fusion_report"),
            "gemslib_settings": figures.get("gemslib_settings"),
            "cudagraph_skips": figures.get("cudagraph_skips"),
            "eager_step_ms": figures.get("eager_step_ms"),
            "eager_tokens_per_s": figures.get("eager_tokens_per_s"),
            "vs_floor": figures["step_ms"] / floor_ms if figures.get("step_ms") and floor_ms
            else None}


def format_markdown(report: dict) -> str:
    lines = ["# Real-model decode", "",
             f"`{report['command']}`; copy bandwidth {report['copy_gbps']:.0f} GB/s.", ""]
    for model, entry in report["models"].items():
        for key, case in entry["cases"].items():
            floor = case["floor"]
            lines += [f"## {entry['title']}, {entry['layers']} layers, decode {key}", "",
                      f"Floor {floor['ms']:.3g} ms: {floor['bytes'] / 1e9:.3g} GB read per "
                      f"step (weights {floor['weights'] / 1e9:.3g}, K/V "
                      f"{floor['cache'] / 1e9:.3g}).", "",
                      "| way | step ms | step/floor | GPU ms | GPU/floor | tok/s | compile s "
                      "| rel. error | top-1 | status |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
            for row in case["rows"]:
                lines.append("| " + " | ".join([
                    row["way"], fmt(row["step_ms"], ".3f"),
                    fmt(row["vs_floor"], ".2f"), fmt(row.get("gpu_ms"), ".3f"),
                    fmt(row.get("gpu_vs_floor"), ".2f"),
                    fmt(row["tokens_per_s"], ".0f"),
                    fmt(row["first_call_s"], ".1f"), fmt(row["rel_error"], ".2e"),
                    fmt(row["top1"], ".2f"), str(row["status"]).replace("|", "\\|")])
                    + " |")
            for row in case["rows"]:
                if row.get("eager_step_ms") and row.get("step_ms"):
                    lines.append(
                        f"\n- {row['way']} beside eager in one process (alternating): step "
                        f"{row['step_ms']:.3f} ms against {row['eager_step_ms']:.3f} "
                        f"({row['eager_step_ms'] / row['step_ms']:.2f}x), "
                        f"{row['tokens_per_s']:.0f} tok/s against "
                        f"{row['eager_tokens_per_s']:.0f} "
                        f"({row['tokens_per_s'] / row['eager_tokens_per_s']:.2f}x)")
            for row in case["rows"]:
                if row.get("cudagraph_skips"):
                    lines.append(f"\n- {row['way']}: {row['cudagraph_skips']} of its compiles "
                                 f"ran without CUDA graphs (`TORCH_LOGS=cudagraphs` says why)")
            for row in case["rows"]:
                if row.get("fusion_report") is not None:
                    fusions = ", ".join(f"{k} {v}" for k, v in sorted(row["fusion_report"].items()))
                    lines.append(f"\n- {row['way']} fusions: {fusions or 'none'}")
                if row.get("gemslib_settings"):
                    lines.append(f"\n- {row['way']}: {row['gemslib_settings']}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if importlib.util.find_spec("transformers") is None:
        print("python -m benchmark --models --decode: needs transformers; nothing was run.",
              file=sys.stderr)
        return 1
    gpu = realmodels.has_gpu()
    if not gpu and not args.tiny:
        print("python -m benchmark --models --decode: needs a CUDA GPU at real sizes; --tiny "
              "runs the same path on the CPU. Nothing was run.", file=sys.stderr)
        return 1
    cases = [tuple(c) for c in (args.cases or (DECODE_CASES if not args.tiny
                                               else TINY_DECODE_CASES))]
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    reps = args.reps or (50 if gpu else 3)
    out = args.out.resolve()
    work = out / "decode"
    work.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmark", "--models", "--decode",
                          *(sys.argv[1:] if argv is None else argv)])
    floor = realmodels.run_job({"kind": "decode_floor", "way": "floor"}, work, args.timeout,
                               command=worker_command)
    copy_gbps = floor.get("copy_gbps") or math.nan
    report = {"command": command, "copy_gbps": copy_gbps, "floor": floor, "models": {}}
    markdown = realmodels.write_report(out, report, "decode", format_markdown)
    failed = []
    for name in args.model_names:
        spec = realmodels.model_spec(name, args.tiny, args.layers)
        directory = work / name
        directory.mkdir(parents=True, exist_ok=True)
        reference = directory / "reference.pt"
        reference.unlink(missing_ok=True)
        common = {"model": name, "spec": dataclasses.asdict(spec),
                  "cases": [list(c) for c in cases], "reference": str(reference)}
        realmodels.run_job(dict(common, kind="decode_reference", way="reference"), directory,
                           args.timeout, command=worker_command)
        results = {}
        for way in args.ways:
            if way in realmodels.PEER_MODULES and \
                    importlib.util.find_spec(realmodels.PEER_MODULES[way]) is None:
                results[way] = {"way": way, "status": realmodels.NOT_INSTALLED, "shapes": {}}
            else:
                results[way] = realmodels.run_job(dict(common, kind="decode_way", way=way,
                                                       warmup=warmup, reps=reps,
                                                       module_guards=not args.no_module_guards),
                                                  directory, args.timeout, command=worker_command)
            if way in GEMSLIB_WAYS and results[way].get("status") != "ok":
                failed.append(f"{name} {way}: {results[way].get('status')}")
            print(f"{name} {way}: {results[way].get('status')}", flush=True)
            # after every way, so that a run cut short keeps what it measured
            report["models"][name] = _model_entry(spec, cases, results, copy_gbps)
            markdown = realmodels.write_report(out, report, "decode", format_markdown)
    print()
    print(markdown)
    for failure in failed:
        print(f"gemslib FAILED: {failure}")
    return 1 if failed else 0


def _model_entry(spec, cases, results: dict, copy_gbps: float) -> dict:
    """One model's part of the report: per case its floor and a row per way run so far."""
    entry = {"title": spec.title, "layers": spec.layers, "cases": {}}
    for batch, prompt, new, cache_len in cases:
        key = case_key(batch, prompt, new, cache_len)
        need = step_bytes(spec, batch, prompt)
        floor_ms = need["total"] / copy_gbps / 1e6
        entry["cases"][key] = {
            "floor": {"bytes": need["total"], "weights": need["weights"],
                      "cache": need["cache"], "ms": floor_ms},
            "rows": [_row(result, key, floor_ms) for result in results.values()]}
    return entry


if __name__ == "__main__":
    sys.exit(main())
