"""``python -m gemslib.tune``: the declared tune spaces, and the tuner on a toy kernel (the
interpreter runs it; the timings are scripted, since nothing is timed in tests)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
import yaml

from helpers import DEVICE
from gemslib import registry, runtime, tune, tune_search
from gemslib.runtime import custom_op


def test_every_kernel_has_one_tune_space_that_fits_it():
    spaces = [space for _, space in tune_search.tune_spaces()]
    names = [f"{space.kernel.op}.{space.kernel.name}" for space in spaces]
    assert sorted(names) == sorted(runtime.KERNELS) and len(set(names)) == len(names)
    for space in spaces:
        kernel = space.kernel
        assert space.candidates and space.buckets, kernel.name
        configs = [tune_search.launch_config(raw) for raw in space.candidates]
        assert len(set(configs)) == len(configs), f"{kernel.name}: repeated candidates"
        for config in configs:  # every tunable given, launch options valid
            assert set(config.meta_dict) == kernel.tunables, (kernel.name, config)
            assert config.num_warps in (1, 2, 4, 8, 16, 32) and config.num_stages >= 1
        assert space.buckets[-1].max is None, f"{kernel.name}: the last bucket must be open"
        for bucket in space.buckets[:-1]:
            assert bucket.max and set(bucket.max) <= set(kernel.shape_keys), (kernel.name, bucket)
        assert len({b.label for b in space.buckets}) == len(space.buckets), kernel.name


@triton.jit
def _toy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, x * 2 + SHIFT, mask=offsets < n)  # SHIFT != 0: a wrong config


def _toy(monkeypatch):
    """A toy TunedKernel (kept out of runtime.KERNELS), its problem and a scripted timer."""
    kernel = runtime.TunedKernel("toy", "toy_double", _toy_kernel, tunables=("BLOCK", "SHIFT"),
                                 shape_keys=("numel",))
    runtime.KERNELS.pop("toy.toy_double")

    def problem(numel):
        def make(device):
            x = torch.randn(numel, device=device)

            def run():
                out = torch.empty_like(x)
                kernel.launch(lambda meta: (triton.cdiv(numel, meta["BLOCK"]),), x, out, numel,
                              shape=(numel,))
                return out
            return run
        return make

    space = registry.TuneSpace(kernel, (
        {"BLOCK": 16, "SHIFT": 0},                  # candidate 0: the reference (no default)
        {"BLOCK": 32, "SHIFT": 1},                  # fastest, but wrong
        {"BLOCK": 64, "SHIFT": 0, "num_warps": 2},  # the fastest right one
        {"BLOCK": 24, "SHIFT": 0},                  # does not compile (not a power of two)
    ), (registry.TuneBucket({"numel": 100}, "n 77", problem(77)),
        registry.TuneBucket(None, "n 300", problem(300))))
    times_ms = {16: 3.0, 32: 1.0, 64: 2.0, 24: 0.5}
    def timer(run):  # the forced config's scripted time
        return times_ms[kernel.config_for((0,)).meta_dict["BLOCK"]]
    return kernel, space, problem, timer


def test_tuner_takes_the_fastest_right_candidate_and_writes_a_file_that_loads(monkeypatch):
    kernel, space, _, timer = _toy(monkeypatch)
    lines = []
    results = [tune.tune_bucket("toy", space, index, torch.device(DEVICE), timer,
                                progress=lines.append) for index in range(2)]
    for result in results:
        assert result.best.config == tune_search.launch_config(space.candidates[2])
        assert result.reference == tune_search.launch_config(space.candidates[0])
        assert result.reference_ms == 3.0 and result.best.ms == 2.0
        why = {t.config.meta_dict["BLOCK"]: t.why for t in result.timings if t.ms is None}
        assert why[32].startswith("output 0: relative error"), why
        assert why[24].startswith("does not run"), why
    assert results[0].shape == (77,) and results[1].shape == (300,)
    assert "best {BLOCK: 64, SHIFT: 0, num_warps: 2, num_stages: 1} 2000.0 us" in lines[0]
    assert "(1.50x)" in lines[0] and "2 rejected" in lines[0]

    record = json.loads(json.dumps(tune.timings_record(results, {"gpu": "Toy GPU"})))
    first = record["buckets"][0]
    assert (first["op"], first["bucket"], first["shape"]) == ("toy", "n 77", [77])
    assert first["best"]["BLOCK"] == 64 and len(first["candidates"]) == 4
    times = {c["config"]["BLOCK"]: (c["ms"], c["rejected"]) for c in first["candidates"]}
    assert times[16] == (3.0, None) and times[64] == (2.0, None)
    assert times[32][0] is None and times[32][1].startswith("output 0")

    kept = runtime.load_tune_config(runtime.shipped_configs_dir() / "default.yaml")
    tuned = {"gpu": "Toy GPU", "torch": "2.x", "triton": "3.6.0", "date": "2026-11-30 10:00 UTC",
             "quick": False}
    text = tune.render_yaml(results, kept, "toy_gpu", tuned, {"toy"})
    data = yaml.safe_load(text)
    assert "  silu:  # not tuned in this run: the entries of default.yaml\n" in text
    assert "  toy:\n" in text
    loaded = runtime.parse_tune_config(runtime.shipped_configs_dir() / "toy.yaml", data)
    assert data["tuned"] == tuned and loaded.device == "toy_gpu"
    buckets = loaded.ops["toy"]["toy_double"]
    assert [b.max for b in buckets] == [{"numel": 100}, None]
    assert all(b.configs == (tune_search.launch_config(space.candidates[2]),) for b in buckets)
    # operators not tuned in the run keep the kept file's entries, autotune lists included
    assert set(loaded.ops) == set(kept.ops) | {"toy"}
    for op, kernels in kept.ops.items():
        for name, kept_buckets in kernels.items():
            assert [(b.max, b.configs, b.autotune) for b in loaded.ops[op][name]] == \
                [(b.max, b.configs, b.autotune) for b in kept_buckets], (op, name)


def test_a_candidate_within_the_noise_margin_does_not_replace_the_reference(monkeypatch):
    kernel, space, _, _ = _toy(monkeypatch)
    times_ms = {16: 2.0 * (1 + tune_search.KEEP_MARGIN / 2), 64: 2.0}

    def timer(run):
        return times_ms[kernel.config_for((0,)).meta_dict["BLOCK"]]
    result = tune.tune_bucket("toy", space, 0, torch.device(DEVICE), timer, progress=print)
    assert result.best.config == tune_search.launch_config(space.candidates[0])
    times_ms[16] = 2.0 * (1 + tune_search.KEEP_MARGIN * 2)
    result = tune.tune_bucket("toy", space, 0, torch.device(DEVICE), timer, progress=print)
    assert result.best.config == tune_search.launch_config(space.candidates[2])


def test_tuner_refuses_a_problem_outside_its_bucket_or_not_launching_the_kernel(monkeypatch):
    kernel, space, problem, timer = _toy(monkeypatch)
    misplaced = registry.TuneSpace(kernel, space.candidates, (
        registry.TuneBucket({"numel": 100}, "n 500", problem(500)),
        registry.TuneBucket(None, "n 300", problem(300))))
    with pytest.raises(tune_search.TuneError, match="n 500 .* lands in bucket 1, not 0"):
        tune.tune_bucket("toy", misplaced, 0, torch.device(DEVICE), timer)
    idle = registry.TuneSpace(kernel, space.candidates, (
        registry.TuneBucket(None, "nothing", lambda device: lambda: torch.zeros(3)),))
    with pytest.raises(tune_search.TuneError, match="does not launch it"):
        tune.tune_bucket("toy", idle, 0, torch.device(DEVICE), timer)
    wrong_only = registry.TuneSpace(kernel, ({"BLOCK": 32, "SHIFT": 1},),
                                    (registry.TuneBucket(None, "n 300", problem(300)),))
    # the reference is candidate 0 itself here, so it agrees with itself: a space whose only
    # candidate does not run has nothing to offer
    broken_only = registry.TuneSpace(kernel, ({"BLOCK": 24, "SHIFT": 0},),
                                     (registry.TuneBucket(None, "n 300", problem(300)),))
    assert tune.tune_bucket("toy", wrong_only, 0, torch.device(DEVICE), timer).best.ms == 1.0
    with pytest.raises(tune_search.TuneError, match="the reference config .* does not run"):
        tune.tune_bucket("toy", broken_only, 0, torch.device(DEVICE), timer)


def test_an_operator_that_cannot_be_tuned_is_left_out_and_the_others_still_are(monkeypatch):
    kernel, space, problem, timer = _toy(monkeypatch)
    idle = registry.TuneSpace(kernel, space.candidates, (
        registry.TuneBucket({"numel": 100}, "n 77", problem(77)),
        registry.TuneBucket(None, "nothing", lambda device: lambda: torch.zeros(3))))
    lines = []
    results, failed = tune.tune_all([("broken", idle), ("toy", space)], torch.device(DEVICE),
                                    timer, progress=lines.append)
    assert list(failed) == ["broken"] and "does not launch it" in failed["broken"]
    assert [(r.op, r.index) for r in results] == [("toy", 0), ("toy", 1)]
    assert any(line.startswith("FAILED: broken.toy_double") for line in lines), lines


def test_a_run_writes_the_file_after_each_operator_and_reports_one_it_cannot_tune(
        monkeypatch, tmp_path):
    """main, on the toy: the file is rewritten after each operator (a run cut short keeps what
    it finished), an operator whose bucket cannot be tuned is left out, and the run exits 1."""
    kernel, space, problem, timer = _toy(monkeypatch)
    idle = registry.TuneSpace(kernel, space.candidates, (
        registry.TuneBucket(None, "nothing", lambda device: lambda: torch.zeros(3)),))
    spaces = [("toy", space), ("broken", idle)]
    monkeypatch.setattr(tune_search, "tune_spaces", lambda ops=None: spaces)
    monkeypatch.setattr(tune, "gpu_available", lambda: True)
    monkeypatch.setattr(tune_search, "environment", lambda: {"gpu": "Toy GPU", "torch": "2.x",
                                                      "triton": "3.6.0", "date": "today"})
    monkeypatch.setattr(tune_search, "do_bench_ms", lambda quick: timer)
    # the file in use default.yaml, whatever GPU runs the test: a GPU's own shipped file
    # would add the operators it records as tuned to the run's list
    default = runtime.load_tune_config(runtime.shipped_configs_dir() / "default.yaml")
    monkeypatch.setattr(runtime, "active_configs", lambda: (default, default))
    out = tmp_path / "toy.yaml"
    written = []
    real_load = runtime.load_tune_config
    monkeypatch.setattr(runtime, "load_tune_config",
                        lambda path: written.append(yaml.safe_load(path.read_text()))
                        or real_load(path))
    assert tune.main(["--out", str(out), "--jobs", "1"]) == 1
    assert [w["tuned"]["complete"] for w in written] == [False, True]
    assert [w["tuned"]["ops"] for w in written] == [["toy"], ["toy"]]
    assert "broken" not in written[-1]["ops"] and "toy" in written[-1]["ops"]
    assert written[-1] == yaml.safe_load(out.read_text())


def test_a_compile_task_runs_its_candidate_on_every_bucket_of_its_space(monkeypatch):
    """A task is (space number, candidate number): the worker runs that candidate, forced,
    once on each bucket's problem of that space, and nothing else; a failing one is passed."""
    kernel, space, problem, _ = _toy(monkeypatch)
    ran = []

    def recording(numel):
        make = problem(numel)
        return lambda device: (lambda run: lambda: ran.append(
            (numel, kernel.config_for((0,)).meta_dict["BLOCK"])) or run())(make(device))

    spaces = [("toy", registry.TuneSpace(kernel, space.candidates[:1], (
                  registry.TuneBucket(None, "n 5", recording(5)),))),
              ("toy", registry.TuneSpace(kernel, space.candidates, (
                  registry.TuneBucket({"numel": 100}, "n 77", recording(77)),
                  registry.TuneBucket(None, "n 300", recording(300)))))]
    monkeypatch.setattr(tune_search, "tune_spaces", lambda ops=None: spaces)
    assert tune._compile_candidate(None, 1, 2) == 2
    assert ran == [(77, 64), (300, 64)]
    ran.clear()
    assert tune._compile_candidate(None, 1, 3) == 0  # BLOCK 24 does not compile
    assert ran == [(77, 24), (300, 24)]


def test_a_compile_task_skips_a_problem_the_memory_cannot_hold(monkeypatch):
    """Compile workers build their problems side by side: one that runs out of memory is left
    to the timing pass, and the task goes on with the next bucket."""
    kernel, space, problem, _ = _toy(monkeypatch)

    def out_of_memory(device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 224.00 MiB")

    spaces = [("toy", registry.TuneSpace(kernel, space.candidates, (
        registry.TuneBucket({"numel": 100}, "n 77", out_of_memory),
        registry.TuneBucket(None, "n 300", problem(300)))))]
    monkeypatch.setattr(tune_search, "tune_spaces", lambda ops=None: spaces)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert tune._compile_candidate(None, 0, 2) == 1


def test_quick_runs_try_the_configs_in_use_and_the_first_candidates():
    search = tune_search
    space = next(s for _, s in search.tune_spaces(["rms_norm"]) if s.kernel.name == "rms_norm_fwd")
    in_use = search.launch_config({"BLOCK_M": 1, "BLOCK_N": 16384, "num_warps": 16})
    reference = search.launch_config({"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8})
    quick = search.candidates_for(space, in_use, reference, quick=True)
    assert quick[:2] == [in_use, reference]
    assert quick[2:] == [search.launch_config(raw)
                         for raw in space.candidates[:search.QUICK_CANDIDATES]
                         if search.launch_config(raw) not in (in_use, reference)]
    full = search.candidates_for(space, in_use, reference, quick=False)
    assert set(full) == {search.launch_config(raw) for raw in space.candidates} | {in_use, reference}
    outsider = search.launch_config({"BLOCK_M": 3, "BLOCK_N": 16384, "num_warps": 16})
    assert outsider in search.candidates_for(space, outsider, reference, quick=False)  # in use


def test_disagreement_names_what_differs():
    want = torch.tensor([1.0, float("nan"), float("inf")])
    assert tune_search.disagreement([want.clone()], [want]) is None
    assert "NaN" in tune_search.disagreement([torch.tensor([1.0, 2.0, float("inf")])], [want])
    assert "infinities" in tune_search.disagreement(
        [torch.tensor([1.0, float("nan"), -float("inf")])], [want])
    assert "shape" in tune_search.disagreement([torch.ones(2)], [torch.ones(3)])
    assert "2 outputs" in tune_search.disagreement([torch.ones(2), torch.ones(2)], [torch.ones(2)])
    close = torch.tensor([1.0, 2.0]).to(torch.bfloat16)
    assert tune_search.disagreement([close * 1.01], [close]) is None  # 16-bit rounding
    assert tune_search.disagreement([torch.tensor([1.0, 2.0]) * 1.01], [torch.tensor([1.0, 2.0])])


def test_command_line_needs_a_gpu_and_known_operators(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "gemslib.tune", "--quick"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "no CUDA GPU" in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())  # nothing written
    done = subprocess.run([sys.executable, "-m", "gemslib.tune", "--ops", "silu", "nope"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown operator(s) ['nope']" in done.stderr, done.stderr


def test_every_declared_problem_lands_in_its_own_bucket(monkeypatch):
    """Each bucket's problem, built at its full size, launches its kernel with a shape the
    bucket (and no earlier one) admits. The kernels are not run (launches are recorded only):
    on the CPU the sizes are far past what the interpreter can run, and the inputs are left
    unfilled, since only their shapes matter here)."""
    # on a GPU a launch goes to the compiled kernel directly (past TunedKernel.run), and the
    # Hopper attention forward through its KeptKernel: neither runs either (each would compile
    # and run on the unfilled full-size inputs)
    monkeypatch.setattr(runtime.TunedKernel, "run", lambda self, config, grid, args: None)
    monkeypatch.setattr(runtime.TunedKernel, "replay", lambda self, *args: None)
    monkeypatch.setattr(runtime.KeptKernel, "launch", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(custom_op, "interpret_bf16_dots", True)  # bf16 problems reach the kernels

    class NotRun:  # the attention backward's delta kernel is launched directly
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    from gemslib.fused import attention as attention_ops
    monkeypatch.setattr(attention_ops, "_attention_bwd_delta_kernel", NotRun())
    for name, like in (("randn", torch.empty), ("rand", torch.empty),
                       ("randn_like", torch.empty_like)):
        monkeypatch.setattr(torch, name, like)
    for op, space in tune_search.tune_spaces():
        for index, bucket in enumerate(space.buckets):
            shape = tune_search.problem_shape(space, bucket.make(torch.device(DEVICE)))
            assert shape is not None, (op, space.kernel.name, bucket.label)
            assert tune_search.bucket_index(space, shape) == index, (op, space.kernel.name,
                                                               bucket.label, shape)


KEPT_FILE = """\
# an earlier run's file
schema: 1
device: toy_gpu
tuned:
  gpu: 'Toy GPU'
  ops: ['silu', 'gone_op']
ops:
  silu:
    silu_fwd:
      - max: {numel: 4096}
        config: {BLOCK: 256, num_warps: 2}  # n 4096: 3.0 us, default.yaml's 4.0 us
      - config: {BLOCK: 1024, num_warps: 4}  # n 65536: 9.0 us, default.yaml's 9.5 us
  rms_norm:  # not tuned in this run: the entries of other_gpu.yaml
    rms_norm_fwd:
      - config: {BLOCK_M: 1, BLOCK_N: 4096, num_warps: 8}
verdicts:
  rms_norm:
    # gemslib / inductor us at cols x rows: 4096x1 6.0/6.2
    - max: {rows: 4}
      use: inductor
    - use: gemslib
"""


def test_a_run_over_an_earlier_file_keeps_its_lines_and_what_it_tuned(tmp_path):
    """Operators a run leaves out keep the file in use's lines, comments included (what each
    config was timed at, which file it came from), its verdicts keep their timings, and when
    it is this GPU's own file, ``tuned: ops`` keeps the operators it had tuned."""
    path = tmp_path / "toy_gpu.yaml"
    path.write_text(KEPT_FILE)
    kept = runtime.load_tune_config(path)
    text = tune.render_yaml([], kept, "toy_gpu", {"gpu": "Toy GPU"}, set())
    assert "config: {BLOCK: 256, num_warps: 2}  # n 4096: 3.0 us, default.yaml's 4.0 us\n" in text
    assert "  silu:  # not tuned in this run: the entries of toy_gpu.yaml\n" in text
    assert "  rms_norm:  # not tuned in this run: the entries of other_gpu.yaml\n" in text
    assert "    # gemslib / inductor us at cols x rows: 4096x1 6.0/6.2\n" in text
    written = tmp_path / "written.yaml"
    written.write_text(text)
    reloaded = runtime.load_tune_config(written)
    assert entries(reloaded) == entries(kept) and reloaded.verdicts == kept.verdicts
    assert tune.earlier_tuned_ops(kept, "toy_gpu") == ["silu", "gone_op"]
    assert tune.earlier_tuned_ops(kept, "another_gpu") == []


def test_a_kept_block_that_does_not_stand_alone_is_rendered_from_its_entries(tmp_path):
    """A layout gemslib does not write (here an anchor its block refers to from outside)
    still keeps every entry: rendered from the loaded file, without its comments."""
    path = tmp_path / "toy_gpu.yaml"
    path.write_text(KEPT_FILE.replace(
        "      - config: {BLOCK: 1024, num_warps: 4}  # n 65536",
        "      - config: *big  # n 65536").replace(
        "tuned:\n", "tuned:\n  big: &big {BLOCK: 1024, num_warps: 4}\n"))
    kept = runtime.load_tune_config(path)
    blocks, verdicts = tune_search.kept_text(kept)
    assert "*big" not in "\n".join(blocks["silu"]) and "# n 4096" not in "\n".join(blocks["silu"])
    text = tune.render_yaml([], kept, "toy_gpu", {"gpu": "Toy GPU"}, set())
    written = tmp_path / "written.yaml"
    written.write_text(text)
    assert entries(runtime.load_tune_config(written)) == entries(kept)
    assert "4096x1 6.0/6.2" in "\n".join(verdicts)


def entries(config_file: runtime.TuneConfigFile) -> dict:
    """A loaded file's buckets without where each was read from."""
    return {op: {kernel: [(b.max, b.configs, b.autotune) for b in buckets]
                 for kernel, buckets in kernels.items()}
            for op, kernels in config_file.ops.items()}


def test_the_graph_timer_times_its_calls_in_one_replay_and_divides(monkeypatch):
    """``do_bench_ms(quick, calls=n)``: n calls captured in one graph, whose replay is timed
    and divided by n; a problem that cannot be captured is timed call by call."""
    import triton.testing

    captured_calls = []

    class Graph:
        def replay(self):
            pass

    def capture(fn, warmup_calls):
        fn()  # the warm-up
        captured_calls.append(len(fn()))
        return Graph(), None

    monkeypatch.setattr(runtime, "captured", capture)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: 8.0)
    ran = []
    assert tune_search.do_bench_ms(True, calls=4)(lambda: ran.append(1)) == 2.0
    assert captured_calls == [4] and len(ran) == 8
    assert tune_search.do_bench_ms(True)(lambda: None) == 8.0

    def refuse(fn, warmup_calls):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runtime, "captured", refuse)
    assert tune_search.do_bench_ms(True, calls=4)(lambda: None) == 8.0


def test_every_model_s_head_dim_is_tuned_on_a_16_bit_problem():
    """A 16-bit prefill at each head dim of gemslib.models falls in an attention-forward
    bucket of 16-bit problems, not in the last one (fp32's small tiles, which at D256 ran
    without wgmma at 4.3x SDPA's time)."""
    from gemslib.fused import attention as attention_ops
    from gemslib.models import MODELS

    space = next(s for s in attention_ops.TUNING if s.kernel is attention_ops.ATTENTION_FWD)
    for spec in MODELS.values():
        shape = {"head_dim": spec.head_dim, "causal": 1, "elem_bytes": 2, "seq_q": 4096,
                 "seq_kv": 4096}
        bucket = next(b for b in space.buckets if b.matches(shape))
        assert bucket.max is not None and bucket.max.get("elem_bytes") == 2, \
            (spec.title, bucket.label)
        assert bucket.max["head_dim"] >= spec.head_dim
