"""The benchmark harness's bookkeeping (timings are GPU work and live in benchmark/, not here)."""

import json

import torch

from benchmark import __main__ as bench_main
from benchmark import harness
from benchmark.harness import Ceilings, Result


def _results():
    return [
        Result("silu", "4096x14336", "bf16", "gemslib", 60.0, 3900.0, None, 91.8),
        Result("silu", "4096x14336", "bf16", "torch eager", 75.0, 3120.0, None, 73.4),
        Result("silu", "4096x14336", "bf16", "torch.compile", 66.0, 3545.0, None, 83.4),
        Result("silu", "4096x14336", "bf16", "FlagGems", None, None, None, None, error="boom"),
    ]


def test_summary_picks_the_best_peer_and_the_speedup():
    (row,) = harness.summarize(_results())
    assert row["best_peer"] == "torch.compile" and row["best_peer_us"] == 66.0
    assert abs(row["speedup"] - 1.1) < 1e-9
    assert row["peers"]["FlagGems"] is None


def test_gemslib_variants_and_bounds_are_shown_but_never_the_peer_to_beat():
    results = _results() + [Result("silu", "4096x14336", "bf16", "gemslib in place", 50.0, 4680.0,
                                   None, 110.1),
                            Result("silu", "4096x14336", "bf16", "memcpy (bound)", 40.0, 5000.0,
                                   None, 120.0)]
    (row,) = harness.summarize(results)
    assert row["peers"]["gemslib in place"] == 50.0 and row["peers"]["memcpy (bound)"] == 40.0
    assert row["best_peer"] == "torch.compile" and abs(row["speedup"] - 1.1) < 1e-9


def test_table_and_json(tmp_path, monkeypatch):
    ceilings = Ceilings(copy_gbps=4250.0)
    rows = harness.summarize(_results())
    table = harness.format_table(rows, ceilings)
    assert "copy 4250 GB/s" in table and "torch.compile" in table and "1.10x" in table
    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "test"})
    harness.write_json(tmp_path / "r.json", _results(), rows, ceilings)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"][0]["best_peer"] == "torch.compile"
    assert len(data["results"]) == 4 and data["ceilings"]["copy_gbps"] == 4250.0


def test_without_a_gpu_the_runner_says_so_and_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["--quick"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_every_benchmark_module_is_discovered():
    assert "bench_silu" in bench_main.bench_modules()


def test_a_failing_case_is_reported_and_does_not_stop_the_run(monkeypatch):
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())

    def broken_check():
        raise RuntimeError("kernel does not compile")

    case = harness.Case("softmax", "8x8", "bf16", bytes_moved=1000,
                        impls={"gemslib": lambda: 0.5, "torch eager": lambda: 1.0},
                        outputs_agree=broken_check)
    results = harness.run_case(case, Ceilings(copy_gbps=4250.0))
    (row,) = harness.summarize(results)
    assert row["error"].startswith("output check failed: RuntimeError: kernel does not compile")
    assert row["peers"]["torch eager"] == 1000.0 and row["gemslib_us"] == 500.0
