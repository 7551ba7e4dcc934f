"""gemslib inside tensor parallelism: two gloo processes on the loopback (on the CPU, or both
on the one GPU where there is one), a tiny Llama sharded over them
(tests/benchmark/tensor_parallel_worker.py), each way's logits against the unsharded model's, and the
backend's fusions on each rank."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_sharded_llama_stays_right_eager_under_enable_and_through_the_backend(tmp_path, device):
    """The all-reduce after o_proj and down_proj is in the graph: the residual add and RMSNorm
    after it fuse (they read its full result), nothing fuses across it, and every rank makes
    the same fusions. Each rank merges its shards of q, k, v (and of gate, up), which are
    sharded alike (column-parallel), into one GEMM: the DTensor parameters reach the graph as
    their local shards, which the rewrite merges; a second compile of the model with its
    shards merged works too."""
    port = _free_port()
    processes, outs = [], []
    for rank in range(2):
        out = tmp_path / f"rank{rank}.json"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        processes.append(subprocess.Popen([sys.executable, str(WORKER), str(out), device.type],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out)
    try:
        logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    for p, log in zip(processes, logs):
        assert p.returncode == 0, log[-3000:]
    results = [json.loads(out.read_text()) for out in outs]
    for result in results:
        for way in ("eager", "enable", "backend"):
            assert result[way] <= 1e-5, (way, result)
        assert result["eager_unchanged"], result
        assert result["recompiled"] <= 1e-5, result
        assert result["fusions"] == {"rms_norm": 1, "add_rms_norm": 4, "rotary": 2,
                                     "attention": 2, "merged_linear": 4,
                                     "silu_and_mul": 2}, result["fusions"]
