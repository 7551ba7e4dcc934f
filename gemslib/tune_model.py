"""``python -m gemslib.tune --model CONFIG``: tune the kernel launches one model makes.

    python -m gemslib.tune --model qwen2-7b [--shapes 1x4096 16x1 ...] [--layers 2] [--out PATH]
    python -m gemslib.tune --model path/to/config.json ...

CONFIG is a name of gemslib.models' table or a transformers config.json (a file, or a folder
holding one). The model is built from it with random weights (bf16, ``--layers`` decoder
layers: every layer makes the same calls), compiled with ``backend="gemslib"`` and run once per
``--shapes`` entry (batch x sequence, no cache), while runtime.recording_calls() keeps the
first call that launches each (tuned kernel, shape). Each recorded call is then the problem:
every candidate of the kernel's TuneSpace, default.yaml's config and the file in use's are
checked against default.yaml's output and timed on it (as ``python -m gemslib.tune`` does a
bucket's problem). The file written is the file in use with, for each recorded shape, a bucket
bounded by exactly that shape, placed before the bucket of the file in use that held it, with
the fastest config: a recorded shape runs with it, and at a tie (within KEEP_MARGIN) with the
file in use's, so at every recorded shape the tuned file is at least as fast as the one in use
by the run's own timings. Other shapes keep the file in use's configs, except those inside the
same bucket and no larger than a recorded shape in every key. Apply it with
``GEMSLIB_TUNE_CONFIG=PATH``. Kernels the model launches only inside CUDA graphs, and the
Hopper (Gluon) matmuls and attention, whose tiles are fixed, are not tuned here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from gemslib import models, registry, runtime, tune_search


def model_spec(config: str, layers: int) -> tuple[str, object]:
    """(title, transformers config) for a table name or a config.json path, with ``layers``
    decoder layers and SDPA attention."""
    import transformers

    if config in models.MODELS:
        spec = dataclasses.replace(models.MODELS[config], layers=layers)
        return spec.title, models.hf_config(spec)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"gemslib.tune --model: {config!r} is neither a model of the built-in "
                         f"table ({', '.join(models.MODELS)}) nor a config.json")
    raw = json.loads(path.read_text())
    if "model_type" not in raw:
        raise ValueError(f"gemslib.tune --model: {path} has no model_type (not a transformers "
                         "config.json)")
    hf = transformers.AutoConfig.for_model(**raw)
    hf.num_hidden_layers = layers
    hf._attn_implementation = "sdpa"
    return raw.get("_name_or_path") or path.parent.name or raw["model_type"], hf


def record_calls(hf_config, shapes: Iterable[tuple[int, int]], device, dtype=torch.bfloat16,
                 progress: Callable[[str], None] = functools.partial(print, flush=True)
                 ) -> dict[tuple[str, tuple[int, ...]], runtime.RecordedCall]:
    """The calls a forward of the model makes through ``backend="gemslib"`` at each (batch,
    sequence) shape: {(kernel, shape): the first call that launched it}."""
    import transformers

    torch.manual_seed(models.SEED)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model = model.to(dtype).eval()
    compiled = torch.compile(model, backend="gemslib")
    calls: dict = {}
    with torch.no_grad():
        for batch, seq in shapes:
            ids = torch.randint(0, hf_config.vocab_size, (batch, seq), device=device)
            started = time.perf_counter()
            with runtime.recording_calls() as recorded:
                compiled(ids, use_cache=False)
            new = {key: call for key, call in recorded.items() if key not in calls}
            calls.update(new)
            progress(f"recorded B{batch} S{seq}: {len(recorded)} kernel shapes, {len(new)} new "
                     f"({time.perf_counter() - started:.1f} s, the compile included)")
    return calls


def _spaces_by_kernel() -> dict[str, tuple[str, registry.TuneSpace]]:
    return {f"{space.kernel.op}.{space.kernel.name}": (op, space)
            for op, space in tune_search.tune_spaces()}


def tune_calls(calls: dict, timer: Callable[[Callable], float], quick: bool = False,
               progress: Callable[[str], None] = functools.partial(print, flush=True)
               ) -> tuple[list[tune_search.BucketResult], dict[str, str]]:
    """A result per recorded (kernel, shape) whose kernel has a TuneSpace (in the order the
    model made them); {kernel shape: why not} for the others."""
    spaces = _spaces_by_kernel()
    results, skipped = [], {}
    for number, ((kernel_name, shape), call) in enumerate(calls.items()):
        label = f"{kernel_name} {dict(zip(call.kernel.shape_keys, shape))}"
        if kernel_name not in spaces:
            skipped[label] = "no tune space"
            continue
        op, space = spaces[kernel_name]
        bound = dict(zip(space.kernel.shape_keys, shape))
        bucket = registry.TuneBucket(bound, f"{call.op} at {tune_search.bound_flow(bound)}",
                                     lambda device, call=call: call.run)
        try:
            results.append(tune_search.time_candidates(
                op, space, number, bucket, call.run, shape, timer, quick, progress,
                f"[{number + 1}/{len(calls)}] {call.op} {tune_search.bound_flow(bound)}",
                keep_in_use=True))
        except tune_search.TuneError as err:
            skipped[label] = str(err)
            progress(f"FAILED: {err}")
    return results, skipped


def render_yaml(results: list[tune_search.BucketResult], device: str, tuned: dict) -> str:
    """The file in use, with each result's exact-shape bucket before the bucket that held it."""
    lines = ["# Launch configurations written by `python -m gemslib.tune --model`; do not edit "
             "by hand:", "# re-run the tuner. Schema: tune_configs/README.md.",
             "schema: 1", f"device: {device}",
             f"source: python -m gemslib.tune --model {tuned['model']} on {tuned['gpu']}",
             "tuned:"]
    lines += [f"  {key}: {json.dumps(value)}" for key, value in tuned.items()]
    lines.append("ops:")
    by_kernel: dict[tuple[str, str], list[tune_search.BucketResult]] = {}
    for result in results:
        by_kernel.setdefault((result.op, result.kernel), []).append(result)
    registry.operators()  # every operator file imported: every kernel known
    by_op: dict[str, list[runtime.TunedKernel]] = {}
    for kernel in runtime.KERNELS.values():
        by_op.setdefault(kernel.op, []).append(kernel)
    for op_name, kernels in by_op.items():
        lines.append(f"  {op_name}:")
        for kernel in kernels:
            lines.append(f"    {kernel.name}:")
            pending = sorted(by_kernel.get((op_name, kernel.name), []),
                             key=lambda r: (sum(r.shape), r.shape))
            for bucket in kernel.buckets():
                here = [r for r in pending if bucket.matches(dict(zip(kernel.shape_keys, r.shape)))]
                pending = [r for r in pending if r not in here]
                for result in here:
                    best = result.best
                    kept_ms = next((t.ms for t in result.timings
                                    if t.config == (result.kept or result.reference)), None)
                    note = f"  # {result.bucket.label}: {best.ms * 1e3:.1f} us" + (
                        f", the file in use's {kept_ms * 1e3:.1f} us" if kept_ms else "")
                    lines.append(f"      - max: {tune_search.bound_flow(result.bucket.max)}")
                    lines.append(f"        config: {tune_search.config_flow(best.config)}{note}")
                lines += tune_search.bucket_lines(bucket)
    lines += tune_search.kept_text(runtime.active_configs()[0])[1]  # the verdicts stay
    return "\n".join(lines) + "\n"


def main(args) -> int:
    """The ``--model`` run of ``python -m gemslib.tune`` (arguments parsed there)."""
    started = time.perf_counter()
    try:
        title, hf_config = model_spec(args.model, args.layers)
    except ValueError as err:
        print(err, flush=True)
        return 2
    device_name = runtime.device_name()
    out = args.out or Path(f"{device_name}-{Path(args.model).stem}.yaml")
    if getattr(args, "user", False):
        out = runtime.user_configs_dir() / f"{device_name}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
    tuned = {"model": args.model, **tune_search.environment(), "quick": args.quick,
             "shapes": [f"{b}x{s}" for b, s in args.shapes], "layers": args.layers}
    print(f"tuning for {title} ({args.layers} layers) on {tuned['gpu']}, torch "
          f"{tuned['torch']}, Triton {tuned['triton']}: recording its calls", flush=True)
    calls = record_calls(hf_config, args.shapes, torch.device(runtime.device_type()))
    results, skipped = tune_calls(calls, tune_search.do_bench_ms(args.quick), args.quick)
    tuned["seconds"] = round(time.perf_counter() - started)
    out.write_text(render_yaml(results, device_name, tuned))
    runtime.load_tune_config(out)  # what was written must load
    print("tuned configs against the file in use's, at the model's shapes:")
    for result in results:
        kept = result.kept or result.reference
        kept_ms = next(t.ms for t in result.timings if t.config == kept)
        print(f"  {result.kernel:<22} {result.bucket.label}: {kept_ms / result.best.ms:.2f}x")
    for label, why in skipped.items():
        print(f"  {label}: not tuned ({why})")
    print(f"wrote {out} in {tuned['seconds']} s; " + (
        "gemslib uses it on this machine from now on" if getattr(args, "user", False)
        else f"use it with GEMSLIB_TUNE_CONFIG={out}"), flush=True)
    return 1 if any(why != "no tune space" for why in skipped.values()) else 0
