"""Tensor parallelism: a transformers model sharded over the GPUs of one host, TP 2 against TP 1.

    python -m benchmark.tensor_parallel [--model-names llama3-8b] [--layers 8]
        [--ways eager inductor gemslib] [--tp 1 2] [--prefill 1x4096] [--decode 16x128]
        [--tiny] [--timeout S] [--out DIR]

Each (way, TP degree) runs as its own ``torchrun --standalone --nproc-per-node TP`` launch (a
crash or a hang is a row of the table, not the end of the run). Every rank builds the same
bf16 model (``gemslib.models``, seeded) and, at TP > 1, shards each decoder layer with torch's
tensor-parallel styles: q, k, v, gate and up column-parallel, o and down row-parallel (their
outputs all-reduced), the embeddings, norms and lm_head replicated; NCCL on GPUs, one GPU per
rank; gloo on the CPU, where the kernels run in the Triton interpreter and the times mean
nothing. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``).

- prefill B x S (``--prefill``): one forward, no cache, the last position's logits; ways
  ``eager``, ``inductor`` (``torch.compile(fullgraph=True)``) and ``gemslib``
  (``backend="gemslib"``); time per forward.
- decode B x P (``--decode``): one decode step at P cached positions; ``eager`` with a dynamic
  cache, ``inductor`` and ``gemslib`` over a static cache with ``mode="reduce-overhead"`` (the
  step replayed as a CUDA graph, the all-reduces captured in it); time per step.

Figures per way: the median time on rank 0 (CUDA events), the scaling efficiency TP 1 time /
(TP x TP time), the last logits' relative error against the unsharded float32 model (one more
process, ``reference``) beside bf16 eager's at TP 1, top-1 agreement, and the backend's fusion
report on rank 0. Writes ``<out>/tensor_parallel.json`` and ``.md``, the launches' logs under
``<out>/tensor_parallel/``. A TP degree above the machine's GPU count is reported, not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmark import decode, realmodels
from benchmark.realmodels import fmt
from gemslib.models import MODELS, ModelSpec, build_model

BENCH_DIR = Path(__file__).resolve().parent
WAYS = ("eager", "inductor", "gemslib")
DECODE_WAYS = {"eager": "eager", "inductor": "static-inductor", "gemslib": "static-gemslib"}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def decode_key(batch: int, prompt: int) -> str:
    return f"B{batch} P{prompt}"


def cache_len(prompt: int) -> int:
    """The static cache's length for a step at ``prompt`` cached positions."""
    return prompt + 16


def shard(model, device) -> None:
    """Shard every decoder layer of ``model`` over all ranks (q, k, v, gate, up by columns;
    o and down by rows, their outputs all-reduced)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


# ---- the worker side: every rank of one launch, or the reference ----

def _rank_device():
    import torch

    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _prefill_runner(way: str, model):
    import torch

    if way == "eager":
        return model
    torch._dynamo.reset()
    if way == "gemslib":
        import gemslib

        gemslib.reset_fusion_report()
        return torch.compile(model, backend="gemslib", fullgraph=True, dynamic=False)
    return torch.compile(model, fullgraph=True, dynamic=False)


def _timed(figures: dict, run, device, job, before=None):
    """First call (its wall time; its output returned), warm-up, then the median of ``reps``
    timed calls, ``before()`` ahead of each of those (a decode step's cache rewind)."""
    started = time.perf_counter()
    logits = run()
    realmodels.synchronize(device)
    figures["first_call_s"] = time.perf_counter() - started
    realmodels.time_calls(run, device, job["warmup"], before=before)
    figures["time_ms"] = statistics.median(realmodels.time_calls(run, device, job["reps"],
                                                                 before=before))
    return logits


def run_rank(job: dict) -> dict:
    """One rank of a (way, TP) launch; rank 0's result is the launch's."""
    import torch
    import torch.distributed as dist

    device = _rank_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    way = job["way"]
    result = {"way": way, "tp": world, "status": "ok", "prefill": {}, "decode": {}}
    try:
        spec = ModelSpec(**job["spec"])
        references = torch.load(job["reference"]) if Path(job["reference"]).exists() else {}
        model = build_model(spec, device, torch.bfloat16)
        if world > 1:
            shard(model, device)
        realmodels.free_memory(device)
        with torch.no_grad():
            for batch, seq in job["prefill"]:
                key = realmodels.shape_key(batch, seq)
                figures = result["prefill"][key] = {}
                ids = realmodels.input_ids(spec, batch, seq, device)
                runner = _prefill_runner(way, model)
                logits = _timed(figures, lambda: runner(input_ids=ids, use_cache=False,
                                                        logits_to_keep=1).logits[:, -1],
                                device, job)
                _finish(figures, way, logits, references.get(("prefill", key)))
                realmodels.say(f"rank {rank}: {way} TP{world} prefill {key} "
                               f"{figures['time_ms']:.2f} ms")
            for batch, prompt in job["decode"]:
                key = decode_key(batch, prompt)
                figures = result["decode"][key] = {}
                ids = realmodels.input_ids(spec, batch, prompt, device)
                step, rewind = decode._step_runner(DECODE_WAYS[way], model, ids,
                                                   cache_len(prompt))
                logits = _timed(figures, step, device, job, before=rewind)
                _finish(figures, way, logits, references.get(("decode", key)))
                realmodels.say(f"rank {rank}: {way} TP{world} decode {key} "
                               f"{figures['time_ms']:.3f} ms")
    except Exception as err:
        result["status"] = f"error: {realmodels.error_text(err)}"
        realmodels.say(f"rank {rank}: {result['status']}")
        raise
    finally:
        if rank == 0:
            realmodels.write_result(job["result"], result)
        dist.destroy_process_group()
    return result


def _finish(figures: dict, way: str, logits, reference) -> None:
    if way == "gemslib":
        import gemslib

        figures["fusion_report"] = gemslib.fusion_report()
    if reference is not None:
        figures.update(realmodels.accuracy(logits, reference))


def run_reference(job: dict) -> dict:
    """The unsharded float32 model's last logits for every prefill shape and decode step."""
    import torch

    device = realmodels.target_device()
    spec = ModelSpec(**job["spec"])
    model = realmodels.reference_model(spec, device)
    saved = {}
    with torch.no_grad():
        for batch, seq in job["prefill"]:
            ids = realmodels.input_ids(spec, batch, seq, device)
            saved[("prefill", realmodels.shape_key(batch, seq))] = model(
                input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float().cpu()
        for batch, prompt in job["decode"]:
            step, _ = decode._step_runner("eager", model,
                                          realmodels.input_ids(spec, batch, prompt, device),
                                          cache_len(prompt))
            saved[("decode", decode_key(batch, prompt))] = step().float().cpu()
    torch.save(saved, job["reference"])
    return {"way": "reference", "status": "ok"}


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    if job["way"] == "reference":
        realmodels.write_result(job["result"], run_reference(job))
    else:
        run_rank(job)
        leave_without_teardown()
    return 0


def leave_without_teardown() -> None:
    """Exit 0 now, once a rank's results are written and its process group destroyed: the
    interpreter's teardown beside gloo's threads aborts now and then on the CPU ("terminate
    called without an active exception", exit -6, after every figure was written), which
    would fail a launch that did all it had to."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the orchestrating side ----

def launch_command(job: dict, job_path: Path) -> list[str]:
    """The reference runs as one process; a (way, TP) launch under torchrun."""
    worker = ["-m", "benchmark.tensor_parallel", "--worker", str(job_path)]
    if job["way"] == "reference":
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={job['tp']}", *worker]


def build_parser() -> argparse.ArgumentParser:
    from gemslib.cli import positive_int, size_pair

    parser = argparse.ArgumentParser(prog="python -m benchmark.tensor_parallel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-names", nargs="+", choices=list(MODELS), default=["llama3-8b"],
                        metavar="MODEL", help=f"of {', '.join(MODELS)} (default: llama3-8b)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), metavar="WAY",
                        help=f"of {', '.join(WAYS)} (default: all)")
    parser.add_argument("--tp", nargs="+", type=positive_int, default=[1, 2], metavar="N",
                        help="tensor-parallel degrees (default: 1 2)")
    parser.add_argument("--prefill", nargs="*", type=size_pair("BxS"), default=None,
                        metavar="BxS", help="prefill shapes (default: 1x4096; 1x16 with --tiny)")
    parser.add_argument("--decode", nargs="*", type=size_pair("BxP"), default=None,
                        metavar="BxP", help="decode steps at P cached positions (default: "
                                            "16x128; 2x8 with --tiny)")
    parser.add_argument("--layers", type=positive_int, default=None, metavar="N",
                        help="decoder layers built (default: the model table's)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny configs (the path on the CPU; times mean nothing)")
    parser.add_argument("--timeout", type=positive_int, default=600, metavar="S",
                        help="seconds per launch before it is killed (default: 600)")
    parser.add_argument("--warmup", type=int, default=None, metavar="N")
    parser.add_argument("--reps", type=positive_int, default=None, metavar="N")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results", metavar="DIR")
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    import torch

    gpus = torch.cuda.device_count()
    if not gpus and not args.tiny:
        print("benchmark.tensor_parallel: no CUDA GPU here; --tiny runs the path on the CPU",
              file=sys.stderr)
        return 1
    prefill_shapes = args.prefill if args.prefill is not None else \
        ([(1, 16)] if args.tiny else [(1, 4096)])
    decode_steps = args.decode if args.decode is not None else \
        ([(2, 8)] if args.tiny else [(16, 128)])
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    reps = args.reps or (2 if args.tiny else 20)
    work_dir = args.out / "tensor_parallel"
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"environment": realmodels.cpu_environment(), "gpus": gpus, "models": {},
              "command": "python -m benchmark.tensor_parallel " + " ".join(argv or sys.argv[1:])}
    failed = False
    for name in args.model_names:
        spec = realmodels.model_spec(name, args.tiny, args.layers)
        base = {"model": name, "spec": spec.__dict__, "prefill": prefill_shapes,
                "decode": decode_steps, "warmup": warmup, "reps": reps,
                "reference": str(work_dir / f"{name}_reference.pt")}
        runs = {"reference": _launch(dict(base, way="reference"), work_dir, args.timeout)}
        for tp in args.tp:
            for way in args.ways:
                label = f"{way} TP{tp}"
                if 0 < gpus < tp:  # one GPU per rank (NCCL refuses two ranks on one)
                    runs[label] = {"way": way, "tp": tp, "prefill": {}, "decode": {},
                                   "status": f"needs {tp} GPUs (this machine has {gpus})"}
                else:
                    runs[label] = _launch(dict(base, way=way, tp=tp), work_dir, args.timeout)
                    failed |= way == "gemslib" and runs[label]["status"] != "ok"
                realmodels.say(f"[{time.perf_counter() - started:5.0f} s] {name} {label}: "
                               f"{runs[label]['status']}")
        report["models"][name] = {"title": spec.title, "layers": spec.layers, "runs": runs}
    markdown = format_markdown(report, args.ways, args.tp)
    (args.out / "tensor_parallel.json").write_text(json.dumps(report, indent=2))
    (args.out / "tensor_parallel.md").write_text(markdown)
    print(markdown)
    return 1 if failed else 0


def _launch(job: dict, work_dir: Path, timeout: float) -> dict:
    env = {**NO_MULTICAST, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    name = realmodels.job_name(job) + (f"_tp{job['tp']}" if "tp" in job else "")
    with _environment(env):
        result = realmodels.run_job(job, work_dir, timeout, name=name, command=launch_command)
    return {"way": job["way"], "tp": job.get("tp"), "prefill": result.get("prefill", {}),
            "decode": result.get("decode", {}), "status": result.get("status", "?"),
            "wall_s": result.get("wall_s"), "log": result.get("log")}


@contextlib.contextmanager
def _environment(values: dict):
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def efficiency(tp1_ms: float | None, tp_ms: float | None, tp: int) -> float | None:
    """TP 1 time / (TP x TP time): 1.0 is perfect scaling."""
    if not tp1_ms or not tp_ms:
        return None
    return tp1_ms / (tp * tp_ms)


def format_markdown(report: dict, ways, tps) -> str:
    lines = [f"# Tensor parallelism ({report['gpus']} GPUs)", "",
             f"`{report['command']}`", ""]
    for name, entry in report["models"].items():
        runs = entry["runs"]
        for phase in ("prefill", "decode"):
            keys = sorted({key for run in runs.values() for key in run.get(phase, {})})
            for key in keys:
                baseline = runs.get("eager TP1", {}).get(phase, {}).get(key, {})
                lines += [f"## {entry['title']}, {entry['layers']} layers: {phase} {key}", "",
                          "bf16 eager at TP 1: rel. error "
                          f"{fmt(baseline.get('rel_error'), '.2e')}", "",
                          "| way | TP | time ms | scaling efficiency | rel. error | top-1 | "
                          "fusions | status |", "| --- | ---: | ---: | ---: | ---: | ---: | --- "
                          "| --- |"]
                for way in ways:
                    tp1 = runs.get(f"{way} TP1", {}).get(phase, {}).get(key, {})
                    for tp in tps:
                        run = runs.get(f"{way} TP{tp}", {})
                        figures = run.get(phase, {}).get(key, {})
                        fusions = figures.get("fusion_report")
                        lines.append(
                            f"| {way} | {tp} | {fmt(figures.get('time_ms'), '.3f')} | "
                            f"{fmt(efficiency(tp1.get('time_ms'), figures.get('time_ms'), tp), '.2f')} | "
                            f"{fmt(figures.get('rel_error'), '.2e')} | "
                            f"{fmt(figures.get('top1'), '.2f')} | "
                            f"{', '.join(f'{k} {v}' for k, v in sorted(fusions.items())) if fusions else '-'} | "
                            f"{run.get('status', 'not run')} |")
                lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
