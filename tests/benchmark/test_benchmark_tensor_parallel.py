"""``python -m benchmark.tensor_parallel``: the tensor-parallel benchmark's path at tiny sizes on
the CPU (two gloo ranks under torchrun; the times mean nothing here, no test asserts one). The
backend's correctness on sharded models is tests/benchmark/test_tensor_parallel.py's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmark import tensor_parallel  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_sharded_llama_runs_prefill_and_decode_under_torchrun(tmp_path):
    # the ranks on the CPU also on a one-GPU machine (NCCL takes one GPU a rank)
    done = subprocess.run(
        [sys.executable, "-m", "benchmark.tensor_parallel", "--tiny", "--ways", "eager",
         "--tp", "2", "--reps", "2", "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    run = report["models"]["llama3-8b"]["runs"]["eager TP2"]
    log = Path(run["log"]).read_text(errors="replace")[-4000:] if run.get("log") else ""
    if run["status"] != "ok":
        pytest.fail(f"{run['status']}\n{log}")  # in full: an assert's message is cut short
    assert run["tp"] == 2
    for phase, key in (("prefill", "B1 S16"), ("decode", "B2 P8")):
        figures = run[phase][key]
        assert figures["time_ms"] > 0
        # the sharded bf16 model's last logits against the unsharded float32 model's
        assert figures["rel_error"] < 3e-2 and figures["top1"] >= 0.5, (phase, figures)
    markdown = (tmp_path / "tensor_parallel.md").read_text()
    assert "| eager | 2 |" in markdown and "decode B2 P8" in markdown


def test_a_degree_above_the_gpu_count_is_reported_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    launched = []
    monkeypatch.setattr(tensor_parallel, "_launch",
                        lambda job, work_dir, timeout: launched.append(job["way"]) or
                        {"way": job["way"], "tp": job.get("tp"), "prefill": {}, "decode": {},
                         "status": "ok"})
    assert tensor_parallel.main(["--tiny", "--ways", "gemslib", "--tp", "1", "2", "--out",
                                 str(tmp_path)]) == 0
    runs = json.loads((tmp_path / "tensor_parallel.json").read_text())["models"]["llama3-8b"]["runs"]
    assert launched == ["reference", "gemslib"]  # TP 1 only
    assert runs["gemslib TP2"]["status"] == "needs 2 GPUs (this machine has 1)"


def test_scaling_efficiency_is_the_tp1_time_over_tp_times_the_tp_time():
    assert tensor_parallel.efficiency(10.0, 5.0, 2) == 1.0
    assert tensor_parallel.efficiency(10.0, 8.0, 2) == 0.625
    assert tensor_parallel.efficiency(None, 8.0, 2) is None
