"""``python -m benchmark --models --decode``: the real-model decode benchmark's path, at tiny
sizes (the times mean nothing here; no test asserts one)."""

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from benchmark import decode  # noqa: E402
from benchmark import realmodels  # noqa: E402
from benchmark.realmodels import model_spec  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_decode_runs_each_way_in_its_own_process_with_the_gemslib_fusions(tmp_path):
    ways = ("eager", "static-gemslib")
    done = subprocess.run(
        [sys.executable, "-m", "benchmark", "--models", "--decode", "--tiny", "--model-names",
         "llama3-8b", "--ways", *ways, "--cases", "2x12+3of32", "--warmup", "0", "--reps", "1",
         "--out", str(tmp_path)],
        cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "decode.json").read_text())
    case = report["models"]["llama3-8b"]["cases"]["B2 12+3 of 32"]
    rows = {row["way"]: row for row in case["rows"]}
    assert set(rows) == set(ways)
    for way, row in rows.items():
        assert row["status"] == "ok", (way, row)
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["vs_floor"] > 0
        if torch.cuda.is_available() and way == "eager":
            # transformers' mask check reads a bool off the GPU every eager step: the step
            # waits for the GPU, and its GPU part cannot be told from its host part
            assert row["gpu_ms"] is None and row["gpu_vs_floor"] is None
        elif torch.cuda.is_available():  # the GPU's work alone, under the call's time
            assert 0 < row["gpu_ms"] and row["gpu_vs_floor"] > 0
        else:
            assert row["gpu_ms"] is None and row["gpu_vs_floor"] is None
        # the step's bf16 logits against the float32 model's
        assert math.isfinite(row["rel_error"]) and row["rel_error"] < 3e-2, row
        assert 0 <= row["top1"] <= 1
    fusions = rows["static-gemslib"]["fusion_report"]
    # the decode step of both layers on gemslib's fusions, attention through its key mask
    assert fusions["attention"] == 2 and fusions["merged_linear"] == 4, fusions
    assert case["floor"]["ms"] > 0 and case["floor"]["cache"] > 0
    assert rows["eager"]["eager_step_ms"] is None  # only the enable way times eager too
    # a static way counts its compiles that run without CUDA graphs (on the CPU: all of them)
    assert rows["eager"]["cudagraph_skips"] is None
    skips = rows["static-gemslib"]["cudagraph_skips"]
    assert (skips == 0) if torch.cuda.is_available() else (skips >= 1)
    markdown = (tmp_path / "decode.md").read_text()
    assert "## Llama-3-8B (tiny), 2 layers, decode B2 12+3 of 32" in markdown
    # what decides the gemslib row besides the code: the file in use, the decode defaults
    from gemslib import runtime

    assert f"- static-gemslib: tune config {runtime.config_path().name}; decode_gemv " \
        in markdown and f"- static-gemslib: {decode.gemslib_settings()}" in markdown, markdown
    assert markdown.count("\n| static-gemslib | ") == 1


@pytest.mark.parametrize("value, said", [("1", "on"), ("0", "off"), (None, "auto")])
def test_the_gemslib_row_says_the_step_graphs_default(value, said, monkeypatch):
    if value is None:
        monkeypatch.delenv("GEMSLIB_STEP_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("GEMSLIB_STEP_GRAPHS", value)
    assert decode.gemslib_settings().endswith(f"; step graphs {said}")


def test_static_ways_without_module_guards_compute_what_the_guarded_ones_do():
    """--no-module-guards: the static ways compile with dynamo's guards on the model's modules
    dropped; torch takes the guard filter only in options, and options not beside a mode, so
    CUDA graphs come as their option. The step's logits are eager's (the guarded step's are
    checked by the tiny decode run above), and generate() takes the same arguments through
    transformers' CompileConfig."""
    import transformers

    guarded = decode.static_compile_arguments("static-gemslib")
    unguarded = decode.static_compile_arguments("static-gemslib", module_guards=False)
    assert guarded == {"backend": "gemslib", "fullgraph": True, "mode": "reduce-overhead"}
    assert unguarded["mode"] is None and unguarded["options"] == {
        "triton.cudagraphs": True,
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    assert decode.static_compile_arguments("static-inductor")["backend"] == "inductor"
    spec = model_spec("llama3-8b", tiny=True, layers=None)
    model = realmodels.build_model(spec, "cpu", torch.float32).eval()
    ids = realmodels.input_ids(spec, 1, 12, torch.device("cpu"))
    with torch.no_grad():
        expected = decode._step_runner("eager", model, ids, 16)[0]()
        without = decode._step_runner("static-gemslib", model, ids, 16, module_guards=False)[0]()
        torch.testing.assert_close(without, expected, rtol=1e-4, atol=1e-4)
        tokens_per_s, _ = decode._generate("static-gemslib", model, ids, 2, 16,
                                           untimed_first=False, timed=1, module_guards=False)
    assert tokens_per_s > 0
    config = model.generation_config.compile_config
    assert isinstance(config, transformers.CompileConfig) and config.mode is None
    assert config.options["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe


def test_the_static_ways_generate_calls_share_one_cache_and_the_same_tokens(monkeypatch):
    """A static way's timed generate() calls reuse one StaticCache, reset before each (its
    tensors are the step's static inputs: new ones would make the CUDA-graph trees record the
    step again every call), and each call generates the tokens a fresh cache gives."""
    spec = model_spec("llama3-8b", tiny=True, layers=None)
    model = realmodels.build_model(spec, "cpu", torch.float32).eval()
    ids = realmodels.input_ids(spec, 1, 12, torch.device("cpu"))
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                  min_new_tokens=3, do_sample=False, pad_token_id=0)
    calls = []
    generate = model.generate

    def recorded(*args, **kwargs):
        calls.append((kwargs["past_key_values"], generate(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(model, "generate", recorded)
    with torch.no_grad():
        decode._generate("static-gemslib", model, ids, 3, 16, untimed_first=True, timed=2)
    assert len(calls) == 3
    assert all(cache is calls[0][0] for cache, _ in calls)
    for _, tokens in calls:
        assert torch.equal(tokens, expected)


def test_a_run_cut_short_keeps_the_ways_it_finished(tmp_path, monkeypatch):
    """The report is written after every way: a run stopped during its second way (Ctrl-C, a
    SIGTERM) leaves the first way's rows in decode.json and decode.md."""
    key = decode.case_key(2, 12, 3, 32)

    def fake_run_job(job, work_dir, timeout, **kwargs):
        if job["way"] == "static-gemslib":
            raise KeyboardInterrupt
        if job["way"] == "floor":
            return {"way": "floor", "status": "ok", "copy_gbps": 1000.0}
        return {"way": job["way"], "status": "ok",
                "shapes": {key: {"step_ms": 2.5, "tokens_per_s": 400.0}}}

    monkeypatch.setattr(realmodels, "run_job", fake_run_job)
    with pytest.raises(KeyboardInterrupt):
        decode.main(["--tiny", "--model-names", "llama3-8b", "--ways", "eager",
                     "static-gemslib", "--cases", "2x12+3of32", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "decode.json").read_text())
    rows = report["models"]["llama3-8b"]["cases"][key]["rows"]
    assert [(row["way"], row["step_ms"]) for row in rows] == [("eager", 2.5)]
    assert "| eager | 2.500 |" in (tmp_path / "decode.md").read_text()


def test_the_enable_way_times_eager_beside_itself_in_alternating_blocks(monkeypatch):
    """Blocks of steps under enable() (the caller's activation closed first, a new one per
    block) alternate with blocks of eager steps, and generate() likewise, its first call of
    each untimed; the figures are the medians (steps) and the faster (generate) of each."""
    import gemslib

    timeline = []

    def step():
        timeline.append("enable" if gemslib.is_enabled() else "eager")

    def fake_generate(way, model, ids, new, cache_len, untimed_first=True, timed=3):
        assert timed == 1  # the alternation is the repetition
        timeline.append(("generate", way, gemslib.is_enabled(), untimed_first))
        return (200.0 if way == "enable" else 100.0) + (0 if untimed_first else 1), 0.5

    monkeypatch.setattr(decode, "_generate", fake_generate)
    figures = {}
    scope = gemslib.enable()
    decode._time_beside_eager(figures, scope, step, lambda: None, None, None, 3, 15,
                              torch.device("cpu"), reps=8)
    assert not gemslib.is_enabled() and not scope.active
    steps = [t for t in timeline if isinstance(t, str)]
    assert steps == ["enable", "enable", "eager", "eager"] * decode.ALTERNATIONS
    assert [t for t in timeline if not isinstance(t, str)] == [
        ("generate", "enable", True, True), ("generate", "eager", False, True),
        ("generate", "enable", True, False), ("generate", "eager", False, False)]
    assert figures["step_ms"] > 0 and figures["eager_step_ms"] > 0
    assert figures["tokens_per_s"] == 201.0 and figures["eager_tokens_per_s"] == 101.0


def test_the_enable_row_says_how_it_compares_with_eager_in_one_process():
    row = {"way": "enable", "status": "ok", "step_ms": 2.0, "tokens_per_s": 300.0,
           "first_call_s": 1.0, "rel_error": 1e-2, "top1": 1.0, "fusion_report": None,
           "eager_step_ms": 3.0, "eager_tokens_per_s": 200.0, "vs_floor": 2.0}
    report = {"command": "c", "copy_gbps": 1000.0, "models": {"m": {
        "title": "M", "layers": 1, "cases": {"B1 1+1": {
            "floor": {"ms": 1.0, "bytes": 1e9, "weights": 1e9, "cache": 0.0},
            "rows": [row]}}}}}
    markdown = decode.format_markdown(report)
    assert ("- enable beside eager in one process (alternating): step 2.000 ms against 3.000 "
            "(1.50x), 300 tok/s against 200 (1.50x)") in markdown
    assert "without CUDA graphs" not in markdown


def test_a_step_run_without_its_cuda_graph_is_said_so():
    """A static way whose compile fell back to no CUDA graph launches every kernel from the
    host each step: its row says so, beside the figures that hide it (GPU ms)."""
    row = {"way": "static-gemslib", "status": "ok", "step_ms": 2.0, "tokens_per_s": 300.0,
           "first_call_s": 1.0, "rel_error": 1e-2, "top1": 1.0, "fusion_report": {},
           "cudagraph_skips": 2, "vs_floor": 2.0}
    report = {"command": "c", "copy_gbps": 1000.0, "models": {"m": {
        "title": "M", "layers": 1, "cases": {"B1 1+1": {
            "floor": {"ms": 1.0, "bytes": 1e9, "weights": 1e9, "cache": 0.0},
            "rows": [row, {**row, "way": "static-inductor", "cudagraph_skips": 0}]}}}}}
    markdown = decode.format_markdown(report)
    assert ("- static-gemslib: 2 of its compiles ran without CUDA graphs (`TORCH_LOGS="
            "cudagraphs` says why)") in markdown
    assert "- static-inductor: 0" not in markdown


@pytest.mark.parametrize("text, case", [("16x128+64", (16, 128, 64, 192)),
                                        ("1x2048+32of4096", (1, 2048, 32, 4096))])
def test_cases_read_batch_prompt_new_tokens_and_cache_length(text, case):
    assert decode.parse_case(text) == case
    assert decode.case_key(*case) == ("B16 128+64" if case[3] == 192 else "B1 2048+32 of 4096")


@pytest.mark.parametrize("text", ["16x128", "0x1+1", "1x2048+32of100", "axb+c"])
def test_a_case_that_is_not_one_names_the_form(text):
    with pytest.raises(argparse.ArgumentTypeError, match="BxP\\+N"):
        decode.parse_case(text)


def test_a_step_reads_every_weight_once_and_the_valid_cache():
    """Llama-3-8B, 8 layers, B16 at 2048 valid positions: per layer 218.1 M parameters
    (q, k, v, o, gate, up, down and two norms), the lm_head 525.3 M, in bf16; K and V of 8 KV
    heads of 128 at 2048 positions per sequence and layer."""
    spec = model_spec("llama3-8b")
    need = decode.step_bytes(spec, 16, 2048)
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    assert per_layer == 218_112_000
    assert need["weights"] == 2 * (8 * per_layer + 4096 * 128256 + 4096 + 16 * 4096)
    assert need["cache"] == 2 * 8 * 16 * 1024 * 2048 * 2
    assert need["total"] == need["weights"] + need["cache"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host and device are one on the CPU")
def test_the_gpu_time_of_a_call_leaves_its_host_part_out():
    """A call that spends 20 ms on the host before it queues ~0.02 ms of GPU work: its events
    around the call see the host's 20 ms; the GPU time sees the kernel alone."""
    import time

    x = torch.randn(1 << 22, device="cuda")

    def call():
        time.sleep(0.02)
        x.mul_(1.0)

    device = torch.device("cuda")
    plain = realmodels.time_calls(call, device, 5)
    gpu = realmodels.time_gpu_work(call, device, 5)
    assert len(gpu) == 5 and min(plain) >= 20.0
    # the least of them, well under the host's part: under pytest-xdist other processes'
    # kernels share the GPU, time-sliced in between the call's events
    assert min(gpu) < 10.0, gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host and device are one on the CPU")
def test_a_call_that_waits_for_the_gpu_gets_no_gpu_time():
    """Its host part outlasts any sleep ahead of it: None, after a bounded number of tries,
    not a figure with the host inside (nor sleeps doubling without end)."""
    x = torch.randn(1 << 20, device="cuda")

    def call():
        x.mul_(1.0)
        torch.cuda.synchronize()

    assert realmodels.time_gpu_work(call, torch.device("cuda"), 3) is None


class _SimulatedGpu:
    """One stream and the host, in simulated milliseconds, for ``_time_gpu_work``'s logic on
    the CPU: queued work runs in order; an event completes when the stream reaches it; the
    sleep spins cycles at ``cycles_per_ms``, which a test may change between calls."""

    def __init__(self, cycles_per_ms: float):
        self.host = self.stream = 0.0
        self.cycles_per_ms = cycles_per_ms
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.queue(0.0)

            def synchronize(self):
                gpu.host = max(gpu.host, self.at)

            def elapsed_time(self, end):
                return end.at - self.at

        self.Event = Event

    def queue(self, ms: float) -> float:
        """Queue ``ms`` of GPU work now; when it ends."""
        self.stream = max(self.stream, self.host) + ms
        return self.stream

    def sleep(self, cycles: int) -> None:
        self.queue(cycles / self.cycles_per_ms)

    def host_work(self, ms: float) -> None:
        self.host += ms

    def synchronize(self) -> None:
        self.host = max(self.host, self.stream)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep)
        monkeypatch.setattr(realmodels, "time", type("Clock", (), {
            "perf_counter": staticmethod(lambda: self.host / 1e3)}))


def test_the_gpu_time_sees_the_kernels_whatever_the_clock_did_since_the_calibration(
        monkeypatch):
    """The sleep was calibrated at a slow clock and runs at one twice as fast, so a nominal 2
    ms sleep lasts 1: a call with 1.5 ms of host work must still be timed at its 0.1 ms of
    kernels (its sleep lengthened), never at the host's 1.5 ms."""
    gpu = _SimulatedGpu(cycles_per_ms=1000.0)
    gpu.install(monkeypatch)
    calibrated = []
    real_sleep = gpu.sleep

    def sleep(cycles):
        real_sleep(cycles)
        calibrated.append(cycles)
        if len(calibrated) == 3:  # the clock speeds up after the calibration's three sleeps
            gpu.cycles_per_ms = 2000.0
    monkeypatch.setattr(torch.cuda, "_sleep", sleep)

    def call():
        gpu.host_work(1.5)
        gpu.queue(0.1)

    times = realmodels.time_gpu_work(call, torch.device("cuda"), 4)
    assert times == pytest.approx([0.1] * 4)


def test_a_call_that_waits_for_the_stream_is_given_up_on_after_a_bounded_sleep(monkeypatch):
    gpu = _SimulatedGpu(cycles_per_ms=1000.0)
    gpu.install(monkeypatch)
    sleeps = []
    real_sleep = gpu.sleep
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: (sleeps.append(cycles),
                                                               real_sleep(cycles)))

    def call():
        gpu.queue(0.1)
        gpu.synchronize()  # a .item(): the host waits for the stream, sleep included
        gpu.host_work(0.2)

    assert realmodels.time_gpu_work(call, torch.device("cuda"), 3) is None
    # past the calibration's three sleeps, each try's sleep, doubled up to the bound
    assert sleeps[3:] == [ms * 1000 for ms in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)]


def test_the_gpu_time_is_none_on_the_cpu():
    assert realmodels.time_gpu_work(lambda: None, torch.device("cpu"), 3) is None
