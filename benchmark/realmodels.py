"""What the real-model benchmarks share (prefill in benchmark/models.py, decode in
benchmark/decode.py, tensor parallel in benchmark/tensor_parallel.py).

Each job (a way, the float32 reference, the machine's floor) runs in a process of its own,
started by :func:`run_job` with the command line its module gives; the worker side times calls
(CUDA events, or the GPU's work alone), measures errors against the reference and writes its
result atomically. The model table itself is gemslib.models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmark.stacks import dump_stacks
from gemslib.models import MODELS, SEED, ModelSpec, build_model

BENCH_DIR = Path(__file__).resolve().parent


REPO_ROOT = BENCH_DIR.parent


# a peer way's package: its absence is "not installed", found without importing it
PEER_MODULES = {"liger": "liger_kernel", "flaggems": "flag_gems"}


NOT_INSTALLED = "not installed"


def shape_key(batch: int, seq: int) -> str:
    return f"B{batch} S{seq}"


def model_spec(name: str, tiny: bool = False, layers: int | None = None) -> ModelSpec:
    spec = MODELS[name].tiny() if tiny else MODELS[name]
    return dataclasses.replace(spec, layers=layers) if layers else spec


def input_ids(spec: ModelSpec, batch: int, seq: int, device):
    """Token ids drawn on the CPU from a fixed seed: the same in every process."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(SEED + 1000 * batch + seq)
    return torch.randint(0, spec.vocab, (batch, seq), generator=generator).to(device)


class NotInstalled(Exception):
    pass


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, device, reps: int, before=None) -> list[float]:
    """Milliseconds of each of ``reps`` calls: CUDA events on a GPU, wall clock on the CPU.
    ``before()``, if given, runs ahead of each call, untimed."""
    import torch

    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return times


def time_gpu_work(fn, device, reps: int, before=None) -> list[float] | None:
    """Milliseconds of the GPU's work of each of ``reps`` calls, the host's part left out: the
    stream is held busy (``torch.cuda._sleep``) for longer than a call's host part, so that the
    events around the call see its kernels only, back to back. A call whose host part outlasted
    the sleep (as the events around the sleep measured it) is timed again with a sleep twice as
    long, up to ``MAX_SLEEP_MS``: a call that waits for the GPU (a ``.item()``, a
    synchronize) outlasts every sleep, and gets None, as on the CPU, where host and device are
    one. ``before()``, if given, runs ahead of each call, untimed."""
    import torch

    if device.type != "cuda":
        return None

    def timing_event():
        return torch.cuda.Event(enable_timing=True)

    # the least of three: another process's kernels time-sliced in only lengthen a sleep
    calibrations = []
    for _ in range(3):
        start, end = timing_event(), timing_event()
        start.record()
        torch.cuda._sleep(1 << 20)
        end.record()
        end.synchronize()
        calibrations.append(start.elapsed_time(end))
    cycles_per_ms = (1 << 20) / min(calibrations)
    sleep_ms, times = 2.0, []
    while len(times) < reps:
        if before is not None:
            before()
        slept, start, end = timing_event(), timing_event(), timing_event()
        slept.record()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))
        queued = time.perf_counter()
        start.record()
        fn()
        end.record()
        host_ms = (time.perf_counter() - queued) * 1e3
        end.synchronize()
        if host_ms < 0.8 * slept.elapsed_time(start):
            times.append(start.elapsed_time(end))
        elif sleep_ms >= MAX_SLEEP_MS:
            return None
        else:
            sleep_ms *= 2
    return times


MAX_SLEEP_MS = 1024.0  # time_gpu_work's longest sleep: ~2 s in all before it gives up


def target_device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def free_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_result(path: str, data: dict) -> None:
    """Write a worker's result atomically (a kill mid-write leaves the previous one)."""
    temporary = Path(path).with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2))
    temporary.replace(path)


def say(text: str) -> None:
    print(text, flush=True)


def accuracy(logits, reference) -> dict:
    """Relative error (float32 norms) and top-1 agreement of the last positions' logits."""
    import torch

    got, ref = logits.float().reshape(reference.shape).cpu(), reference.float()
    return {"rel_error": float((got - ref).norm() / ref.norm()),
            "top1": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
            "finite": bool(torch.isfinite(got).all())}


def error_text(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def prepare_way(way: str, model, plain_ways: tuple[str, ...] = ("eager",)):
    """(model to call per shape, a context entered around each shape's calls, a note) for
    ``way``; raises :class:`NotInstalled` when its package is missing. ``plain_ways``: the
    caller's ways that call the model as built (a compiled way compiles it later, per shape)."""
    if way in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[way]) is None:
        raise NotInstalled(PEER_MODULES[way])
    if way == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        return model, contextlib.nullcontext, None
    if way == "flaggems":
        import flag_gems

        use = getattr(flag_gems, "use_gems", None)
        if use is None:  # an old FlagGems: enable() for the process
            flag_gems.enable()
            return model, contextlib.nullcontext, "flag_gems.enable() (no use_gems)"
        return model, use, None
    if way == "enable":
        import gemslib

        return model, lambda: gemslib.enable(record=True), None
    if way in plain_ways:
        return model, contextlib.nullcontext, None
    raise ValueError(f"unknown way {way!r}")


def reference_model(spec: ModelSpec, device):
    """The float32 model every way's error is measured against (TF32 off: float32 matmuls)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return build_model(spec, device, torch.float32)


def median_call_ms(fn, device) -> float:
    """The median time of ``fn``: ``triton.testing.do_bench`` on a GPU, a few calls on the CPU."""
    if device.type == "cuda":
        from benchmark.harness import median_ms

        return median_ms(fn)
    fn()
    return statistics.median(time_calls(fn, device, 5))


def worker_env(cache_root: Path | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a hung worker's stacks reach its log (dump_stacks)
    if not has_gpu():
        env["TRITON_INTERPRET"] = "1"
    if cache_root is not None:  # cold compiles: nothing reused from another way's process
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache_root / "triton")
    return env


def log_tail(path: Path, lines: int = 1) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " / ".join(text[-lines:])[-300:]


_RAISED = re.compile(r"^\s*(?:\[[^\]]*\]:?\s*)?[\w.]*(?:Error|Exception|Interrupt)\b.*")


def crash_reason(path: Path) -> str:
    """What a crashed worker's log says went wrong: its last exception line (a launcher such
    as torchrun ends the log with its own banner and ChildFailedError after it, which are
    skipped), else its last line."""
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    raised = [line.strip() for line in text
              if _RAISED.match(line) and "torch.distributed.elastic" not in line]
    return (raised[-1] if raised else (text[-1] if text else ""))[-300:]


def job_name(job: dict) -> str:
    """The stem of a job's files in the work directory."""
    return job["model"] + "_" + job["way"] if job.get("model") else job["way"]


def run_job(job: dict, work_dir: Path, timeout: float, *, command, cold_cache: bool = True,
            name: str | None = None) -> dict:
    """Run one job in its own process (its own session, so a timeout kills the whole group it
    started, inductor's compile workers included). Returns the worker's result, or a result
    whose status says what went wrong (timeout, crash with the exit code and the last line).
    ``command(job, job_path)``: its command line (each benchmark's ``worker_command``);
    ``name``: the stem of its files (default :func:`job_name`)."""
    name = name or job_name(job)
    job_path, log_path = work_dir / f"{name}.job.json", work_dir / f"{name}.log"
    job = dict(job, result=str(work_dir / f"{name}.result.json"))
    Path(job["result"]).unlink(missing_ok=True)
    job_path.write_text(json.dumps(job, indent=2))
    cache_root = Path(tempfile.mkdtemp(prefix=f"gemslib-{name}-")) if cold_cache else None
    started = time.perf_counter()
    status = None
    try:
        with open(log_path, "w") as log, sigterm_raises():
            process = subprocess.Popen(command(job, job_path), cwd=REPO_ROOT,
                                       env=worker_env(cache_root), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                returncode = process.wait(timeout=max(timeout, 1))
                kill_group(process)  # what it left behind (inductor's compile workers)
            except subprocess.TimeoutExpired:
                dump_stacks(process)
                kill_group(process)
                returncode, status = None, f"timeout after {timeout:.0f} s"
            except BaseException:  # Ctrl-C or a SIGTERM: take the worker down with us
                kill_group(process)
                raise
    finally:
        if cache_root is not None:
            shutil.rmtree(cache_root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    result = {}
    if Path(job["result"]).exists():
        try:
            result = json.loads(Path(job["result"]).read_text())
        except json.JSONDecodeError:
            result = {}
    result.setdefault("model", job.get("model"))
    result.setdefault("way", job["way"])
    result.setdefault("shapes", {})
    if status is None and returncode != 0:
        status = f"crashed (exit {returncode}): {crash_reason(log_path)}"
    elif status is None and not result.get("status"):
        status = f"no result written: {log_tail(log_path)}"
    if status is not None:
        result["status"] = status
        # the shapes it did not finish carry the process's fate
        for batch, seq in job.get("shapes", ()):
            figures = result["shapes"].setdefault(shape_key(batch, seq), {})
            if "time_ms" not in figures and "error" not in figures:
                figures["error"] = status
    result["wall_s"] = elapsed
    result["log"] = str(log_path)
    return result


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM (``timeout``, a scheduler) raises SystemExit while a worker runs, as Ctrl-C
    raises KeyboardInterrupt, so that the worker's group is killed before this process ends;
    left to the default action, the worker would outlive it and hold the GPU."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:  # None: a handler not set from Python, which cannot be put back; the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def kill_group(process: subprocess.Popen) -> None:
    """End the worker and what it started (its session's process group, by its id)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    process.wait()


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def write_report(out: Path, report: dict, stem: str, formatter) -> str:
    """``<stem>.json`` (the report) and ``<stem>.md`` (``formatter(report)``) in ``out``;
    returns the markdown."""
    markdown = formatter(report)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (out / f"{stem}.md").write_text(markdown)
    return markdown


def cpu_environment() -> dict:
    import datetime
    import platform

    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": None, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
