"""``python -m benchmark --models``: the real-model prefill benchmark's path, at tiny sizes.

The times mean nothing here (no test asserts one); what is checked is that every way runs in
its own process, reads the float32 reference, and lands in the table and the JSON, and that a
way that crashes, hangs or is not installed is a row that says so.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from benchmark import models, realmodels  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def _rows(report: dict, model: str) -> dict:
    return {(row["shape"], row["way"]): row
            for shape in report["models"][model]["shapes"].values() for row in shape["rows"]}


# the CUDA-graph way only where there are CUDA graphs (on the CPU it is the gemslib way again,
# in a process of its own: half a minute of the CPU suite)
_TINY_WAYS = ("eager", "enable", "gemslib") + (
    ("gemslib-cudagraphs",) if torch.cuda.is_available() else ())


# two shapes of 8 tokens (the default tiny ones are 32 and 16 x 2: the gemslib way's kernels
# run in the interpreter, about 3 s a call at 32 tokens), and one timed call after no warm-up
# (first call, timed call, final call: every figure is still there)
_SHAPES = ("B1 S8", "B2 S4")


def test_tiny_llama_runs_eager_enable_and_gemslib_each_in_its_own_process(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmark", "--models", "--tiny", "--model-names", "llama3-8b",
         "--ways", *_TINY_WAYS, "--shapes", "1x8", "2x4", "--warmup", "0", "--reps", "1",
         "--timeout", "240", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "models.json").read_text())
    markdown = (tmp_path / "models.md").read_text()
    rows = _rows(report, "llama3-8b")
    assert set(rows) == {(shape, way) for shape in _SHAPES for way in _TINY_WAYS}
    for (shape, way), row in rows.items():
        assert row["status"] == "ok", (shape, way, row)
        assert row["time_ms"] > 0 and row["first_call_s"] > 0
        # bf16 against the float32 model: eager's own rounding, and nothing worse than it
        assert row["finite"] and math.isfinite(row["rel_error"]), row
        assert row["rel_error"] < 3e-2, row
        assert 0 <= row["top1"] <= 1
        assert row["vs_eager"] and row["vs_floor"]
    for shape in _SHAPES:
        assert rows[(shape, "eager")]["vs_eager"] == 1
        for way in {"gemslib", "gemslib-cudagraphs"} & set(_TINY_WAYS):
            fusions = rows[(shape, way)]["fusion_report"]
            # per layer two norms, every one after the first behind a residual add; the final
            # norm
            assert sum(fusions.values()) >= 5 and "add_rms_norm" in fusions, fusions
        assert "silu" in rows[(shape, "enable")]["overrides"]
        assert f"## Llama-3-8B (tiny), 2 layers, prefill {shape}" in markdown
    for way in _TINY_WAYS:
        assert markdown.count(f"\n| {way} | ") == 2, markdown
    assert "gemslib fusions:" in markdown and "overrides that ran:" in markdown
    assert (tmp_path / "models" / "llama3-8b" / "reference.pt").exists()
    assert report["floor"]["status"] == "ok" and report["floor"]["matmul"]["tflops"] > 0
    # one progress line per finished way
    for way in _TINY_WAYS:
        assert sum(f"llama3-8b {way} " in line for line in done.stdout.splitlines()) == 1


_FAKE_OK = """
import json, sys
job = json.load(open(sys.argv[1]))
times = {"eager": 4.0, "gemslib": 2.0}
shapes = {f"B{b} S{s}": {"time_ms": times[job["way"]], "first_call_s": 1.5}
          for b, s in job["shapes"]}
json.dump({"status": "ok", "shapes": shapes}, open(job["result"], "w"))
"""


def _fake_workers(job, job_path):
    """Fake processes: the floor and the reference crash, eager and gemslib report times,
    enable dies with a message, inductor hangs."""
    if job["way"] in ("eager", "gemslib"):
        return [sys.executable, "-c", _FAKE_OK, str(job_path)]
    if job["way"] == "enable":
        return [sys.executable, "-c", "import sys; print('boom: a fake crash'); sys.exit(3)"]
    if job["way"] == "inductor":
        return [sys.executable, "-c", "import time; time.sleep(60)"]
    return [sys.executable, "-c", "raise SystemExit(7)"]


def test_a_crash_a_hang_and_a_missing_peer_are_rows_of_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "worker_command", _fake_workers)
    monkeypatch.setitem(realmodels.PEER_MODULES, "liger", "surely_no_such_module_installed")
    code = models.main(["--tiny", "--model-names", "llama3-8b", "--shapes", "1x8",
                        "--ways", "eager", "enable", "gemslib", "inductor", "liger",
                        "--timeout", "3", "--out", str(tmp_path)])
    assert code == 1  # a gemslib way (enable) failed
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "models.json").read_text())
    rows = _rows(report, "llama3-8b")
    assert rows[("B1 S8", "enable")]["status"].startswith("crashed (exit 3)")
    assert "boom: a fake crash" in rows[("B1 S8", "enable")]["status"]
    assert rows[("B1 S8", "inductor")]["status"] == "timeout after 3 s"
    assert rows[("B1 S8", "liger")]["status"] == realmodels.NOT_INSTALLED
    gemslib_row = rows[("B1 S8", "gemslib")]
    assert gemslib_row["status"] == "ok" and gemslib_row["vs_eager"] == 2.0
    assert gemslib_row["rel_error"] is None  # the reference process crashed: no error figure
    assert report["floor"]["status"].startswith("crashed (exit 7)")
    assert report["models"]["llama3-8b"]["reference"]["status"].startswith("crashed")
    assert "compile_ratio" not in report["models"]["llama3-8b"]["shapes"]["B1 S8"]
    markdown = (tmp_path / "models.md").read_text()
    assert "| inductor | - | - | - | - | - | - | - | - | timeout after 3 s |" in markdown
    assert "| gemslib | 2.00 | 2.00x |" in markdown and "Floor: not measured." in markdown
    assert "gemslib FAILED: llama3-8b enable" in printed


def test_the_budget_stops_starting_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "worker_command", _fake_workers)
    code = models.main(["--tiny", "--model-names", "llama3-8b", "--shapes", "1x8", "--ways",
                        "inductor", "gemslib", "--timeout", "2", "--budget", "3",
                        "--out", str(tmp_path)])
    rows = _rows(json.loads((tmp_path / "models.json").read_text()), "llama3-8b")
    # the floor and reference crash at once, inductor hangs to the end of the budget
    assert rows[("B1 S8", "inductor")]["status"].startswith("timeout after")
    assert rows[("B1 S8", "gemslib")]["status"] == "skipped: --budget spent"
    assert code == 1


_PARENT_OF_A_HANGING_WORKER = """
import sys
import time
from pathlib import Path
from benchmark import realmodels

work = Path(sys.argv[1])
hang = ("import os, sys, time; from pathlib import Path; "
        "Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(60)")
realmodels.run_job({"way": "hang"}, work, timeout=60, cold_cache=False,
                   command=lambda job, path: [sys.executable, "-c", hang, str(work / "pid")])
"""


def test_a_sigterm_to_the_runner_takes_its_worker_down_with_it(tmp_path):
    """``timeout 300 python -m benchmark ...`` ends the runner with SIGTERM: its worker (its
    own session) must not live on, holding the GPU under the next run."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_OF_A_HANGING_WORKER, str(tmp_path)],
                              cwd=Path(models.__file__).resolve().parent.parent)
    pid_file = tmp_path / "pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    for _ in range(100):  # SIGKILL is asynchronous; the orphan is reaped by init
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError(f"worker {worker} outlived its runner")


def test_without_a_gpu_only_tiny_runs(monkeypatch, capsys):
    monkeypatch.setattr(realmodels, "has_gpu", lambda: False)
    assert models.main(["--model-names", "llama3-8b"]) == 1
    assert "--tiny" in capsys.readouterr().err


def test_every_process_builds_the_same_model():
    """Seeded and built in float32 on the device, then cast: identical weights each time,
    the rotary tables left in float32 (as from_pretrained(dtype=bf16) leaves them)."""
    spec = realmodels.model_spec("qwen2-7b", tiny=True)
    first, second = (models.build_model(spec, "cpu", torch.bfloat16) for _ in range(2))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert first.lm_head.weight.dtype == torch.bfloat16
    assert first.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    assert first.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = models.build_model(spec, "cpu", torch.float32)
    assert torch.equal(reference.lm_head.weight.to(torch.bfloat16), first.lm_head.weight)
    ids = realmodels.input_ids(spec, 2, 8, "cpu")
    assert torch.equal(ids, realmodels.input_ids(spec, 2, 8, "cpu"))


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_of_the_table_builds_its_family(name):
    """Each entry's config is its family's (its transformers classes, its head dim), and its
    tiny form builds and runs a forward."""
    import transformers

    spec = models.MODELS[name]
    config = models.hf_config(spec)
    config_class, model_class, _ = models.FAMILIES[spec.family]
    assert type(config) is getattr(transformers, config_class)
    assert config._attn_implementation == spec.attention
    assert config.hidden_size // config.num_attention_heads == spec.head_dim or \
        config.head_dim == spec.head_dim
    tiny = models.build_model(realmodels.model_spec(name, tiny=True), "cpu", torch.float32)
    assert type(tiny) is getattr(transformers, model_class)
    with torch.no_grad():
        logits = tiny(realmodels.input_ids(spec.tiny(), 1, 5, "cpu")).logits
    assert logits.shape == (1, 5, spec.tiny().vocab) and torch.isfinite(logits).all()


def test_the_floor_counts_llama_3_8b_s_matmuls_and_attention():
    spec = models.MODELS["llama3-8b"]
    per_layer = 2 * 4096 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert models.matmul_flops(spec, 1, 4096) == 8 * per_layer + 2 * 4096 * 128256
    assert models.attention_flops(spec, 4, 2048) == 8 * 2 * 2 * 4 * 32 * 2048**2 * 128 // 2
    floor = models._floor(spec, 1, 4096, {
        "matmul": {"tflops": 700.0},
        "problems": {"B1 H32 S4096 D128": {"tflops": 500.0, "backend": "cudnn_attention"}}})
    assert floor["floor_ms"] == pytest.approx(
        models.matmul_flops(spec, 1, 4096) / 700e9 + models.attention_flops(spec, 1, 4096) / 500e9)


def test_a_hung_worker_leaves_its_stack_in_its_log(tmp_path):
    """A timeout row's log says where the worker was stuck: the stack of the call it hung in."""
    hang = ("import time\n"
            "def waiting_for_a_kernel_that_never_ends():\n"
            "    print('started', flush=True)\n"
            "    time.sleep(60)\n"
            "waiting_for_a_kernel_that_never_ends()\n")
    result = realmodels.run_job({"way": "stuck"}, tmp_path, timeout=3, cold_cache=False,
                                command=lambda job, path: [sys.executable, "-c", hang])
    assert result["status"] == "timeout after 3 s"
    log = (tmp_path / "stuck.log").read_text()
    assert "started" in log
    assert "in waiting_for_a_kernel_that_never_ends" in log


_DEEP_HANG = """
import time
from benchmark import stacks

def descend(depth):  # a recursion through two functions, as an IR string's is
    if depth == 0:
        print("started", flush=True)
        time.sleep(60)
    bounce(depth - 1)

def bounce(depth):
    descend(depth)

def the_outermost_caller():
    descend(300)

stacks.answer_stack_requests()
the_outermost_caller()
"""


def test_a_worker_hung_deep_in_a_recursion_names_its_outermost_callers(tmp_path):
    """faulthandler keeps a stack's innermost 100 frames: a worker stuck 600 frames deep also
    writes its own stack, outermost first, so the log names what started the recursion."""
    result = realmodels.run_job({"way": "deep"}, tmp_path, timeout=3, cold_cache=False,
                                command=lambda job, path: [sys.executable, "-c", _DEEP_HANG])
    assert result["status"] == "timeout after 3 s"
    log = (tmp_path / "deep.log").read_text()
    ours = log[log.index("outermost first"):]
    assert ours.index("in the_outermost_caller") < ours.index("in descend")
    assert " frames ...\n" in ours  # the middle of the recursion left out
    assert "in write_stacks" not in ours  # the stack that was interrupted, not the handler
    assert "Current thread" in log or "most recent call first" in log  # faulthandler's too


def test_a_crashed_worker_is_reported_by_its_exception_not_a_launcher_banner(tmp_path):
    """A worker under a launcher (torchrun) ends its log with the launcher's summary banner;
    the status names the exception that ended it, and a log without one its last line."""
    crash = ("import sys; print('starting'); print('[rank1]: RuntimeError: connect failed'); "
             "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError:'); "
             "print('=' * 40); sys.exit(1)")
    result = realmodels.run_job({"way": "crash"}, tmp_path, timeout=60, cold_cache=False,
                                command=lambda job, path: [sys.executable, "-c", crash])
    assert result["status"] == "crashed (exit 1): [rank1]: RuntimeError: connect failed"
    quiet = "import sys; print('last words'); sys.exit(3)"
    result = realmodels.run_job({"way": "quiet"}, tmp_path, timeout=60, cold_cache=False,
                                command=lambda job, path: [sys.executable, "-c", quiet])
    assert result["status"] == "crashed (exit 3): last words"
