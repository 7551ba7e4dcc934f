"""Compile time of ``backend="gemslib"`` against inductor's, cold and warm.

    python -m benchmark.compile_time [--model-name llama3-8b] [--shape 1x4096] [--layers N]
                                     [--backends inductor gemslib] [--tiny] [--out DIR]

For each backend: a fresh cache directory (inductor's and Triton's), then two processes one
after the other on the same model and input. The first compiles cold (empty caches); the second
is a user's next run, warm (the FX graph, AOTAutograd and Triton caches the first one left).
Each process builds the model (random weights, seeded), compiles it with
``torch.compile(model, backend=..., fullgraph=True)`` and reports the first call's wall time
(dynamo, AOTAutograd, inductor and the kernels' compiles, or their cache loads), a later call's
time, the cache hits inductor counted, and, for gemslib, ``gemslib.fusion_report()``.

The table ends with warm gemslib over warm inductor. Writes ``<out>/compile_time.json``.
Without a CUDA GPU only ``--tiny`` runs (the kernels in the Triton interpreter): the path is the
same, the times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMTHS = ("cold", "warm")


def _first_and_next_call(spec, batch: int, seq: int, backend: str) -> dict:
    """One process's measurement: build, compile, time the first call and a later one."""
    import torch

    import gemslib
    from gemslib.models import build_model

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    model = build_model(spec, device, torch.bfloat16 if on_gpu else torch.float32)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (batch, seq), generator=generator).to(device)

    def call():
        with torch.no_grad():
            out = compiled(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        if on_gpu:
            torch.cuda.synchronize()
        return out

    gemslib.reset_fusion_report()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    start = time.perf_counter()
    call()
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    call()
    next_s = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    attention = model.model.layers[0].self_attn
    # the merged q/k/v GEMM reads one buffer: the parameters were merged, cold or warm
    merged = attention.q_proj.weight.untyped_storage().data_ptr() == \
        attention.k_proj.weight.untyped_storage().data_ptr()
    return {"projections_merged": merged, "first_call_s": first_s, "next_call_s": next_s,
            "fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_autograd_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "fusions": gemslib.fusion_report() if backend == "gemslib" else {}}


def _run_worker(job: dict, cache_dir: Path, log: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
               TRITON_CACHE_DIR=str(cache_dir / "triton"))
    with open(log, "a") as log_file:
        done = subprocess.run([sys.executable, "-m", "benchmark.compile_time", "--worker",
                               json.dumps(job)], env=env, stdout=subprocess.PIPE,
                              stderr=log_file, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}, see {log}"}
    return json.loads(lines[-1])


def measure(model_name: str, batch: int, seq: int, layers: int | None, tiny: bool,
            backends: list[str], out: Path) -> dict:
    """{backend: {"cold": result, "warm": result}}, each result one process's."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for backend in backends:
        job = {"model": model_name, "batch": batch, "seq": seq, "layers": layers,
               "tiny": tiny, "backend": backend}
        results[backend] = {}
        with tempfile.TemporaryDirectory(prefix=f"gemslib_compile_{backend}_") as cache:
            for warmth in WARMTHS:
                result = _run_worker(job, Path(cache), out / f"compile_time_{backend}.log")
                results[backend][warmth] = result
                # each process's figures as they come, so a run cut short keeps them
                print(f"{backend} {warmth}: {json.dumps(result)}", flush=True)
                (out / "compile_time.json").write_text(json.dumps(results, indent=2))
    return results


def table(results: dict) -> str:
    rows = ["| backend | cache | first call s | next call s | FX graph hits / misses | fusions |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for backend, by_warmth in results.items():
        for warmth, result in by_warmth.items():
            if "error" in result:
                rows.append(f"| {backend} | {warmth} | {result['error']} | | | |")
                continue
            rows.append(f"| {backend} | {warmth} | {result['first_call_s']:.2f} | "
                        f"{result['next_call_s']:.3f} | {result['fx_graph_cache_hits']} / "
                        f"{result['fx_graph_cache_misses']} | "
                        f"{sum(result['fusions'].values())} |")
    warm = {backend: by_warmth["warm"].get("first_call_s") for backend, by_warmth in
            results.items()}
    if warm.get("gemslib") and warm.get("inductor"):
        rows.append(f"\nwarm gemslib / warm inductor: {warm['gemslib'] / warm['inductor']:.2f}x")
    return "\n".join(rows)


def _spec(job: dict):
    import dataclasses

    from gemslib.models import MODELS

    spec = MODELS[job["model"]]
    if job["tiny"]:
        spec = spec.tiny()
    if job["layers"]:
        spec = dataclasses.replace(spec, layers=job["layers"])
    return spec


def main(argv: list[str] | None = None) -> int:
    from gemslib.cli import size_pair
    from gemslib.models import MODELS

    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["--worker"]:
        job = json.loads(arguments[1])
        result = _first_and_next_call(_spec(job), job["batch"], job["seq"], job["backend"])
        print(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmark.compile_time",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--shape", type=size_pair("BxS"), default=(1, 4096))
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers built (default: the model's benchmark count)")
    parser.add_argument("--backends", nargs="+", choices=["inductor", "gemslib"],
                        default=["inductor", "gemslib"])
    parser.add_argument("--tiny", action="store_true",
                        help="the model at a size the Triton interpreter runs (no GPU needed)")
    parser.add_argument("--out", type=Path, default=Path("benchmark_results"))
    args = parser.parse_args(arguments)
    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("python -m benchmark.compile_time: no CUDA GPU here (only --tiny runs without "
              "one)")
        return 1
    batch, seq = args.shape
    results = measure(args.model_name, batch, seq, args.layers, args.tiny, args.backends,
                      args.out)
    (args.out / "compile_time.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0 if all("error" not in r for by in results.values() for r in by.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
