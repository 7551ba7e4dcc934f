"""The benchmark harness's bookkeeping (timings are GPU work and live in benchmark/, not here)."""

import json

import pytest
import torch

from benchmark import __main__ as bench_main
from benchmark import harness, readme
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


def test_table_and_json(tmp_path):
    ceilings = Ceilings(copy_gbps=4250.0)
    rows = harness.summarize(_results())
    table = harness.format_table(rows, ceilings)
    assert "copy 4250 GB/s" in table and "torch.compile" in table and "1.10x" in table
    written = harness.write_json(tmp_path / "r.json", _results(), rows, ceilings, {"gpu": "test"},
                                 "python -m benchmark --quick")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data == written and data["environment"] == {"gpu": "test"}
    assert data["command"] == "python -m benchmark --quick"
    assert data["summary"][0]["best_peer"] == "torch.compile"
    assert len(data["results"]) == 4 and data["ceilings"]["copy_gbps"] == 4250.0
    results, loaded_ceilings, env = harness.load_json(tmp_path / "r.json")
    assert results == _results() and loaded_ceilings == ceilings and env == {"gpu": "test"}


def test_without_a_gpu_the_runner_says_so_and_exits_1_as_the_tuner_does(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_main.main(["--quick"]) == 1 == bench_main.NO_GPU_EXIT
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.fixture
def fake_gpu(monkeypatch):
    """The runner on the CPU: one fake benchmark module, CUDA "available", made-up ceilings and
    times (each implementation returns its "median" in ms). Records cases()'s arguments."""
    import sys
    import types

    calls = []

    def cases(quick=False, backward=False):
        calls.append({"quick": quick, "backward": backward})
        impls = {"gemslib": lambda: 0.010, "torch eager": lambda: 0.012}
        yield harness.Case("fake", "64x64", "bf16", 16384, impls)
        if backward:
            yield harness.Case("fake_backward", "64x64", "bf16", 24576, impls)

    module = types.SimpleNamespace(OPS=("fake", "fake_backward"), cases=cases)
    monkeypatch.setitem(sys.modules, "benchmark.bench_fake", module)
    monkeypatch.setattr(bench_main, "bench_modules", lambda: ["bench_fake"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(harness, "environment", lambda: {
        "gpu": "Fake GPU", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-01 10:00 UTC"})
    monkeypatch.setattr(harness, "measure_ceilings", lambda matmul: Ceilings(4000.0, 700.0))
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())
    return calls


def test_one_command_times_forward_and_backward_kernels(fake_gpu, tmp_path):
    assert bench_main.main(["--quick", "--no-plot", "--out", str(tmp_path)]) == 0
    assert fake_gpu == [{"quick": True, "backward": True}]
    data = json.loads((tmp_path / "results.json").read_text())
    assert [row["op"] for row in data["summary"]] == ["fake", "fake_backward"]
    assert data["environment"]["gpu"] == "Fake GPU"
    assert data["command"] == f"python -m benchmark --quick --no-plot --out {tmp_path}"
    # the README's markdown, written beside the JSON it is rendered from
    assert (tmp_path / "results.md").read_text() == readme.render(data)
    assert not list(tmp_path.glob("*.png"))


def test_the_runner_draws_one_plot_per_operator(fake_gpu, tmp_path):
    assert bench_main.main(["--quick", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["fake.png", "fake_backward.png"]


def test_forward_only_skips_the_backward_kernels_and_backward_is_still_accepted(fake_gpu,
                                                                                tmp_path, capsys):
    assert bench_main.main(["--forward-only", "--no-plot", "--out", str(tmp_path)]) == 0
    assert fake_gpu[-1] == {"quick": False, "backward": False}
    data = json.loads((tmp_path / "results.json").read_text())
    assert [row["op"] for row in data["summary"]] == ["fake"]
    assert bench_main.main(["--backward", "--no-plot", "--out", str(tmp_path)]) == 0
    assert fake_gpu[-1] == {"quick": False, "backward": True}
    with pytest.raises(SystemExit):
        bench_main.main(["--backward", "--forward-only"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_shapes_selects_cases_by_their_shape_and_names_the_unmatched(fake_gpu, tmp_path,
                                                                      capsys):
    assert bench_main.main(["--shapes", "64x64", "9x9", "--no-plot", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [row["op"] for row in data["summary"]] == ["fake", "fake_backward"]
    assert "no case has shape(s) 9x9" in capsys.readouterr().err
    assert bench_main.main(["--shapes", "9x9", "--no-plot", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == []


def test_every_benchmark_module_is_discovered():
    assert "bench_silu" in bench_main.bench_modules()


def test_ops_selects_modules_by_their_declared_names_and_rejects_unknown_ones(capsys):
    ops = bench_main.module_ops()
    assert set(ops) == set(bench_main.bench_modules())
    assert "attention_backward" in ops["bench_attention"] and "silu" in ops["bench_silu"]
    with pytest.raises(SystemExit):
        bench_main.main(["--ops", "attention_backwards"])
    assert "unknown operator(s) attention_backwards" in capsys.readouterr().err


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


def test_cuda_graphs_time_each_way_captured_and_report_one_that_cannot_be(monkeypatch):
    """--cuda-graphs: every way is captured once and its replay timed; a way whose capture
    raises is that way's error, and the others still run."""
    captured = []

    def fake_graphed(fn):
        if fn() == "sync":
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(fn)
        return lambda: fn() / 2  # the replay: a number the timing can tell from the call's

    monkeypatch.setattr(harness, "graphed", fake_graphed)
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())
    case = harness.Case("softmax", "8x8", "bf16", bytes_moved=1000,
                        impls={"gemslib": lambda: 0.5, "torch eager": lambda: 1.0,
                               "peer": lambda: "sync"})
    results = {r.impl: r for r in harness.run_case(case, Ceilings(copy_gbps=4250.0),
                                                   cuda_graphs=True)}
    assert len(captured) == 2
    assert results["gemslib"].time_us == 250.0 and results["torch eager"].time_us == 500.0
    assert results["peer"].time_us is None
    assert results["peer"].error.startswith("no CUDA graph: RuntimeError: operation not")


def test_the_command_line_asks_for_cuda_graphs(fake_gpu, tmp_path, monkeypatch):
    asked = []
    run_case = harness.run_case
    monkeypatch.setattr(harness, "run_case", lambda case, ceilings, cuda_graphs=False: (
        asked.append(cuda_graphs), run_case(case, ceilings))[1])
    assert bench_main.main(["--quick", "--no-plot", "--cuda-graphs", "--out", str(tmp_path)]) == 0
    assert asked and all(asked)
    data = json.loads((tmp_path / "results.json").read_text())
    assert "--cuda-graphs" in data["command"]


def test_outputs_close_compares_elements_or_the_whole_output():
    """Elementwise: one output off by 1 fails; normwise (products over a long K): the same
    output passes, one that is wrong throughout, or not finite, fails."""
    torch.manual_seed(0)
    reference = torch.randn(100_000)
    one_off = reference.clone()
    one_off[7] += 1.0
    assert not harness.outputs_close(lambda: one_off, lambda: reference)()
    assert harness.outputs_close(lambda: one_off, lambda: reference, rtol=1e-2, normwise=True)()
    assert not harness.outputs_close(lambda: reference * 1.02, lambda: reference, rtol=1e-2,
                                     normwise=True)()
    not_finite = reference.clone()
    not_finite[3] = float("nan")
    assert not harness.outputs_close(lambda: not_finite, lambda: reference, rtol=1e-2,
                                     normwise=True)()
