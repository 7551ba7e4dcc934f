"""The benchmark report, from a synthetic run on the CPU: plots per operator and the README
tables rendered from results.json. No GPU, no timing: the "times" are made up."""

import json

import pytest

from benchmark import harness
from benchmark.harness import Case, Ceilings

CEILINGS = Ceilings(copy_gbps=4000.0, matmul_tflops=700.0)
ENV = {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.11.0+cu130", "cuda": "13.0",
       "triton": "3.6.0", "python": "3.12.3", "peers": {"Liger-Kernel": "0.8.5"},
       "date": "2026-12-01 10:00 UTC"}
COMMAND = "python -m benchmark --quick"


def _ms(ms):
    """An implementation whose "median" is ``ms`` (run_case's median_ms is patched to call it)."""
    return lambda: ms


def _fails():
    raise RuntimeError("no kernel for this shape")


def _cases():
    silu_bytes = 2 * 4096 * 14336 * 2
    return [
        # memory-bound, gemslib ahead (1.10x torch.compile); FlagGems errors
        Case("silu", "4096x14336", "bf16", silu_bytes,
             {"gemslib": _ms(0.060), "torch eager": _ms(0.075), "torch.compile": _ms(0.066),
              "FlagGems": _fails}),
        # gemslib behind: torch.compile 20.0 us against gemslib's 23.0 (0.87x)
        Case("rms_norm", "4096x4096", "bf16", 2 * 4096 * 4096 * 2,
             {"gemslib": _ms(0.023), "torch.compile": _ms(0.020), "Liger-Kernel": _ms(0.025)}),
        # Liger-Kernel not run at this shape; 16 KB in 4 us is ~700x below the row above
        Case("rms_norm", "1x4096", "bf16", 2 * 4096 * 2,
             {"gemslib": _ms(0.004), "torch.compile": _ms(0.006)}),
        # compute-bound: FLOPs only, so TFLOP/s against the matmul rate
        Case("attention", "B1 H32 S8192 D128", "bf16", 0,
             {"gemslib": _ms(1.8256), "SDPA cuDNN": _ms(1.7801), "FA2": _ms(3.1321)},
             flops=4 * 32 * 8192 * 8192 * 128),
    ]


@pytest.fixture
def run(monkeypatch, tmp_path):
    """A synthetic run through the harness's own path: run_case, summarize, write_json."""
    monkeypatch.setattr(harness, "median_ms", lambda fn: fn())
    results = [r for case in _cases() for r in harness.run_case(case, CEILINGS, rounds=1)]
    rows = harness.summarize(results)
    path = tmp_path / "results.json"
    harness.write_json(path, results, rows, CEILINGS, ENV, COMMAND)
    return path


def test_plot_specs_pick_each_operators_unit_and_ceiling(run):
    results, ceilings, env = harness.load_json(run)
    specs = {spec.op: spec for spec in harness.plot_specs(results, ceilings, env["gpu"])}
    assert list(specs) == ["attention", "rms_norm", "silu"]

    attention = specs["attention"]
    assert attention.unit == "TFLOP/s" and attention.ceiling == 700.0
    assert attention.ceiling_label == "bf16 matmul 700 TFLOP/s"
    assert attention.title == "attention: TFLOP/s, higher is better (NVIDIA H200)"
    tflops = 4 * 32 * 8192 * 8192 * 128 / 1.8256 / 1e9
    assert attention.values["gemslib"] == [pytest.approx(tflops)]
    assert set(attention.values) == {"gemslib", "SDPA cuDNN", "FA2"}

    silu = specs["silu"]
    assert silu.unit == "GB/s" and silu.ceiling == 4000.0 and silu.ceiling_label == "copy 4000 GB/s"
    assert "FlagGems" not in silu.values  # failed at every shape: no bars, no legend entry
    assert silu.values["gemslib"] == [pytest.approx(2 * 4096 * 14336 * 2 / 0.060 / 1e6)]
    assert not silu.log_scale

    rms_norm = specs["rms_norm"]
    assert rms_norm.shapes == ["4096x4096", "1x4096"]
    assert rms_norm.values["Liger-Kernel"] == [pytest.approx(4096 * 4096 * 4 / 0.025 / 1e6), None]
    assert rms_norm.log_scale  # one row and 4096 rows differ ~700x


def test_an_operator_without_bytes_or_flops_is_plotted_as_time():
    results = [harness.Result("noop", "1", "bf16", "gemslib", 3.0, None, None, None),
               harness.Result("noop", "1", "bf16", "torch eager", 5.0, None, None, None)]
    (spec,) = harness.plot_specs(results, Ceilings(copy_gbps=4000.0), "GPU")
    assert spec.unit == "us" and spec.ceiling is None and "lower is better" in spec.title
    assert spec.values == {"gemslib": [3.0], "torch eager": [5.0]}


def test_without_a_matmul_ceiling_tflops_are_plotted_without_a_line(run):
    results, _, _ = harness.load_json(run)
    specs = harness.plot_specs(results, Ceilings(copy_gbps=4000.0), "GPU")
    (attention,) = [s for s in specs if s.op == "attention"]
    assert attention.unit == "TFLOP/s" and attention.ceiling is None
    assert attention.ceiling_label is None


def test_plots_are_drawn_from_results_json_one_png_per_operator(run, tmp_path):
    """From the JSON alone (no CUDA): one PNG per operator, the TFLOP/s-only one included.
    matplotlib is in the ``test`` extra."""
    results, ceilings, env = harness.load_json(run)
    written = harness.plot(results, ceilings, tmp_path / "plots", env["gpu"])
    assert sorted(p.name for p in written) == ["attention.png", "rms_norm.png", "silu.png"]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG")


def test_run_case_judges_flops_against_matmul_and_bytes_against_copy(run):
    data = json.loads(run.read_text())
    pct = {(r["op"], r["shape"]): r["pct_of_ceiling"] for r in data["summary"]}
    assert pct[("attention", "B1 H32 S8192 D128")] == pytest.approx(
        100 * 4 * 32 * 8192 * 8192 * 128 / 1.8256 / 1e9 / 700.0)
    assert pct[("silu", "4096x14336")] == pytest.approx(
        100 * 2 * 4096 * 14336 * 2 / 0.060 / 1e6 / 4000.0)
