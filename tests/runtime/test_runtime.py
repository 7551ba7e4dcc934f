"""Runtime: device naming, config files (shipped and malformed), bucket selection, overrides."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemslib
from helpers import DEVICE, random_tensor
from gemslib import runtime
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import rms_norm as rms_norm_ops
from gemslib.ops import rotary as rotary_ops
from gemslib.ops import silu as silu_ops
from gemslib.runtime import TuneConfigError, cuda, env, plans
from gemslib.runtime.launch import MapOn


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H200", "nvidia_h200"),
    ("NVIDIA H100 80GB HBM3", "nvidia_h100_80gb_hbm3"),
    ("  AMD Instinct MI300X ", "amd_instinct_mi300x"),
])
def test_device_names_normalize(name, expected):
    assert runtime.normalize_device_name(name) == expected


SHIPPED_FILES = sorted(p.name for p in runtime.shipped_configs_dir().glob("*.yaml"))


def test_the_shipped_files_are_the_defaults_and_the_tuned_gpus():
    assert {"default.yaml", "nvidia_h100_80gb_hbm3.yaml", "nvidia_h200.yaml"} <= set(SHIPPED_FILES)


@pytest.mark.parametrize("filename", SHIPPED_FILES)
def test_shipped_configs_cover_every_kernel_with_matching_tunables(filename):
    path = runtime.shipped_configs_dir() / filename
    config = runtime.load_tune_config(path)
    assert config.device == filename.removesuffix(".yaml")
    declared = {(k.op, k.name): k for k in runtime.KERNELS.values()}
    listed = {(op, kernel) for op, kernels in config.ops.items() for kernel in kernels}
    assert listed <= set(declared), f"{filename} configures kernels that do not exist"
    if filename == "default.yaml":
        assert listed == set(declared), "default.yaml must configure every kernel"
    for op, kernel in listed:
        for bucket in config.ops[op][kernel]:
            declared[op, kernel]._check_bucket(bucket)
            # a shipped file fixes one config per bucket: no operator times candidates on its
            # first call
            assert not bucket.autotune, f"{bucket.where} autotunes"


@pytest.mark.parametrize("filename", SHIPPED_FILES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_every_shipped_file_runs_16_bit_attention_on_16_bit_tiles(filename, head_dim):
    """A 16-bit prefill at each model head dim reaches an attention-forward bucket bounded to
    16-bit inputs, never the catch-all of fp32's small tiles (at D256 those compile without
    wgmma and ran at 4.3x SDPA's time on the H100)."""
    config = runtime.load_tune_config(runtime.shipped_configs_dir() / filename)
    shape = {"head_dim": head_dim, "causal": 1, "elem_bytes": 2, "seq_q": 4096, "seq_kv": 4096}
    bucket = next(b for b in config.ops["attention"]["attention_fwd"] if b.matches(shape))
    assert bucket.max is not None and head_dim <= bucket.max["head_dim"], bucket.where
    if filename != "default.yaml":  # default.yaml's D64/D128 rows serve any dtype
        assert bucket.max.get("elem_bytes") == 2, bucket.where


def test_config_file_follows_the_device_name():
    path, why = runtime.config_choice()
    own = runtime.shipped_configs_dir() / f"{runtime.device_name()}.yaml"
    if runtime.INTERPRETER:
        assert path.name == "default.yaml"
    elif own.is_file() and not (runtime.user_configs_dir() / own.name).is_file():
        assert path == own
    else:  # tuned here, the nearest of its architecture, or the defaults: said which
        assert "tuned on this machine" in why or "python -m gemslib.tune --user" in why


def test_environment_variable_selects_the_file_and_buckets_apply(config_file):
    path = config_file("""
        schema: 1
        device: test
        ops:
          silu:
            silu_fwd:
              - max: {numel: 100}
                config: {BLOCK: 32, num_warps: 1}
              - config: {BLOCK: 128, num_warps: 2, num_stages: 2}
    """)
    assert runtime.config_path() == path
    index, bucket = silu_ops.SILU_FWD.select((100,))
    assert index == 0 and bucket.configs[0].meta_dict == {"BLOCK": 32}
    index, bucket = silu_ops.SILU_FWD.select((101,))
    assert index == 1 and bucket.configs[0].launch_kwargs == {"BLOCK": 128, "num_warps": 2,
                                                         "num_stages": 2}
    # kernels the file leaves out come from default.yaml
    default = runtime.load_tune_config(runtime.shipped_configs_dir() / "default.yaml")
    assert silu_ops.SILU_BWD.buckets() == default.ops["silu"]["silu_bwd"]
    # and the operator still computes the right thing with these configs
    for numel in (100, 1000):
        x = random_tensor((numel,), torch.float32)
        assert_close_to_reference(gemslib.silu(x), silu_ops.silu_reference(x.double()),
                                  torch.float32)
        assert silu_ops.SILU_FWD.config_for((numel,)).meta_dict["BLOCK"] == (32 if numel <= 100 else 128)


AUTOTUNE_SILU = """
    schema: 1
    device: test
    ops:
      silu:
        silu_fwd:
          - autotune:
              - {BLOCK: 64, num_warps: 2}
              - {BLOCK: 256, num_warps: 4}
"""


def test_autotune_buckets_time_candidates_on_a_gpu_only(config_file, monkeypatch):
    """Under the interpreter the first candidate is used untimed; on a GPU the fastest wins."""
    import triton.testing

    timed = []

    def scripted_timings(fn, **kwargs):  # stands in for the timer: candidate 2 "wins"
        timed.append(fn)
        return 2.0 if len(timed) == 1 else 1.0

    monkeypatch.setattr(triton.testing, "do_bench", scripted_timings)
    config_file(AUTOTUNE_SILU)
    x = random_tensor((300,), torch.float32)
    assert_close_to_reference(gemslib.silu(x), silu_ops.silu_reference(x.double()), torch.float32)
    chosen = silu_ops.SILU_FWD.config_for((300,)).meta_dict
    if runtime.INTERPRETER:
        assert timed == [] and chosen == {"BLOCK": 64}
    else:
        assert len(timed) == 2 and chosen == {"BLOCK": 256}


def test_autotune_restores_in_place_operands(config_file):
    """Candidates are timed on the real arguments; an in-place call must still apply once."""
    config_file(AUTOTUNE_SILU)
    x = random_tensor((1000,), torch.float32)
    expected = silu_ops.silu_reference(x.double())
    gemslib.silu(x, out=x)
    assert_close_to_reference(x, expected, torch.float32)


MALFORMED = {
    "not a mapping": ("- 1\n- 2\n", r"<top level>: expected a mapping"),
    "missing schema": ("device: x\nops: {}\n", r": schema: missing"),
    "wrong schema": ("schema: 2\ndevice: x\nops: {}\n", r"schema: expected 1, got 2"),
    "unknown top key": ("schema: 1\ndevice: x\nops: {}\nextra: 1\n", r"unknown keys \['extra'\]"),
    "kernel not a list": ("schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd: {BLOCK: 1}\n",
                          r"ops\.silu\.silu_fwd: expected a non-empty list"),
    "both config and autotune": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n"
        "      - {config: {BLOCK: 64}, autotune: [{BLOCK: 64}]}\n",
        r"ops\.silu\.silu_fwd\[0\]: needs exactly one of"),
    "bad num_warps": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n      - config: {BLOCK: 64, num_warps: 3}\n",
        r"ops\.silu\.silu_fwd\[0\]\.config\.num_warps: expected a power of two"),
    "negative block": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n      - config: {BLOCK: -64}\n",
        r"ops\.silu\.silu_fwd\[0\]\.config\.BLOCK: expected an integer >= 0, got -64"),
    "zero warps": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n      - config: {BLOCK: 64, num_stages: 0}\n",
        r"ops\.silu\.silu_fwd\[0\]\.config\.num_stages: expected a positive integer, got 0"),
    "negative bound": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n"
        "      - {max: {numel: -1}, config: {BLOCK: 64}}\n      - config: {BLOCK: 64}\n",
        r"ops\.silu\.silu_fwd\[0\]\.max\.numel: expected an integer >= 0, got -1"),
    "no catch-all bucket": (
        "schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n"
        "      - {max: {numel: 10}, config: {BLOCK: 64}}\n",
        r"ops\.silu\.silu_fwd\[0\]: the last bucket must have no 'max'"),
    "invalid yaml": ("schema: [1\n", r"not valid YAML"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_files_name_the_file_and_the_key(tmp_path, case):
    text, message = MALFORMED[case]
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(TuneConfigError, match=message) as info:
        runtime.load_tune_config(path)
    assert str(path) in str(info.value)


def test_malformed_file_named_by_the_environment_is_an_error_at_first_use(config_file):
    path = config_file("schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd: []\n")
    with pytest.raises(TuneConfigError, match=rf"{path}: ops\.silu\.silu_fwd: expected a non-empty"):
        gemslib.silu(random_tensor((4,), torch.float32))


def test_missing_file_named_by_the_environment_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.CONFIG_ENV, str(tmp_path / "nope.yaml"))
    runtime.reload_configs()
    try:
        with pytest.raises(TuneConfigError, match="nope.yaml: cannot read"):
            gemslib.silu(random_tensor((4,), torch.float32))
    finally:
        monkeypatch.delenv(runtime.CONFIG_ENV)
        runtime.reload_configs()


def test_parameters_that_do_not_fit_the_kernel_are_errors(config_file):
    path = config_file("""
        schema: 1
        device: test
        ops:
          silu:
            silu_fwd:
              - config: {BLOCK_SIZE: 64}
            silu_and_mul_fwd:
              - max: {width: 64}
                config: {BLOCK_N: 64}
              - config: {BLOCK_N: 64}
    """)
    with pytest.raises(TuneConfigError, match=rf"{path}: ops\.silu\.silu_fwd\[0\]: parameters "
                                              r"\['BLOCK_SIZE'\] do not match .*\['BLOCK'\]"):
        gemslib.silu(random_tensor((4,), torch.float32))
    with pytest.raises(TuneConfigError, match=r"silu_and_mul_fwd\[0\]\.max: unknown shape keys "
                                              r"\['width'\]"):
        gemslib.silu_and_mul(random_tensor((4, 8), torch.float32))


def test_forced_config_checks_its_parameters():
    with pytest.raises(ValueError, match="do not match"):
        with silu_ops.SILU_FWD.forced(runtime.LaunchConfig((("BLOCK_N", 64),))):
            pass



@triton.jit
def _scale_kernel(x_ptr, n_elements, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


def test_launcher_knobs_reach_the_grid_but_not_the_kernel():
    """A config key declared as a launcher knob is the launcher's alone: grid(meta) sees it, the
    kernel (which has no such parameter) is launched without it, and forced() still checks
    that a config holds it; the shapes launched inside forced() are collected in order."""
    kernel = runtime.TunedKernel("test_runtime", "scale", _scale_kernel, tunables=("BLOCK",),
                                 launcher_knobs=("WAVES",), shape_keys=("numel",))
    try:
        x = torch.ones(100, device=DEVICE)
        seen = []

        def grid(meta):
            seen.append(meta["WAVES"])
            return (meta["WAVES"] * runtime.cdiv(x.numel(), meta["BLOCK"] * meta["WAVES"]),)
        for waves in (1, 2):
            config = runtime.LaunchConfig((("BLOCK", 16), ("WAVES", waves)), 1, 1)
            assert kernel.kernel_kwargs(config) == {"BLOCK": 16, "num_warps": 1, "num_stages": 1}
            with kernel.forced(config) as shapes:
                kernel.launch(grid, x, x.numel(), 2.0, shape=(x.numel(),))
                kernel.planned_config((7,))
            assert shapes == [(100,), (7,)]
        assert seen == [1, 2]
        assert torch.equal(x.cpu(), torch.full((100,), 4.0))
        with pytest.raises(ValueError, match="do not match"):
            with kernel.forced(runtime.LaunchConfig((("BLOCK", 16),))):
                pass
    finally:
        del runtime.KERNELS["test_runtime.scale"]


class _FakeJit(triton.runtime.KernelInterface):
    """Stands for a Triton kernel (x_ptr, n_elements, factor, BLOCK[, EVEN]): records which
    launches went through Triton's binding (``kernel[grid](...)``) and which straight to the
    compiled kernel it returned (``compiled.run(grid0, grid1, grid2, stream, ...)``)."""

    def __init__(self, arg_names=("x_ptr", "n_elements", "factor", "BLOCK")):
        self.arg_names = list(arg_names)
        self.bound, self.direct = [], []

    def run(self, *args, grid, warmup, **kwargs):
        self.bound.append((grid, args[1:], kwargs))
        return _FakeCompiled(self.direct)


class _FakeCompiled:
    """A compiled kernel whose launcher (``run``, as Triton's CudaLauncher) records the direct
    launches: the grid and the kernel arguments after the first (x's data pointer)."""
    function, packed_metadata = "function", "metadata"

    def __init__(self, direct):
        self.run = _FakeLauncher(direct)

    def _init_handles(self):
        pass


class _FakeLauncher:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, direct):
        self.direct = direct

    def launch(self, grid0, grid1, grid2, stream, function, cooperative, pdl, global_scratch,
               profile_scratch, metadata, launch_metadata, enter_hook, exit_hook, *args):
        assert (stream, function, cooperative, pdl, metadata) == (7, "function", False, True,
                                                                  "metadata")
        assert isinstance(args[0], int)  # the tensor's data pointer
        self.direct.append(((grid0, grid1, grid2), args[1:]))


@pytest.fixture
def off_the_interpreter(monkeypatch):
    """The launch path as on a GPU (device 0, stream 7), with fake kernels."""
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    monkeypatch.setattr(env, "INTERPRETER", False)  # what the runtime's modules read
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    yield
    for name in [name for name in runtime.KERNELS if name.startswith("test_runtime.fake")]:
        del runtime.KERNELS[name]


def _fake_launcher(fn, name="fake"):
    kernel = runtime.TunedKernel("test_runtime", name, fn, tunables=("BLOCK",),
                                 shape_keys=("numel",))
    config = runtime.LaunchConfig((("BLOCK", 16),), 1, 1)

    def launch(x, n, factor=2.0):
        with kernel.forced(config):
            kernel.launch(lambda meta: (runtime.cdiv(n, meta["BLOCK"]),), x, n, factor,
                          shape=(n,))
    return launch


def test_a_repeated_launch_goes_straight_to_its_compiled_kernel(off_the_interpreter):
    """Off the interpreter, a launch with the config, grid, scalar values, tensor dtypes and
    alignment of an earlier one skips Triton's binding; another integer (Triton specialises
    them), a misaligned tensor, an argument that is no plain number, or DIRECT_LAUNCH
    switched off goes through Triton."""
    fake = _FakeJit()
    launch = _fake_launcher(fake)
    storage = torch.zeros(64)
    aligned, misaligned = storage[:32], storage[1:33]  # 4-byte floats: offset 4 bytes

    launch(aligned, 32)
    launch(aligned, 32)
    launch(storage[32:], 32)         # another tensor, same dtype and alignment: direct
    launch(aligned, 31)              # another integer: Triton again
    launch(misaligned, 32)           # another alignment: Triton again
    launch(aligned, 32, factor=object())  # not a plain number: Triton every time
    launch(aligned, 32, factor=2)    # 2 == 2.0, but an int: Triton
    with runtime.DIRECT_LAUNCH.switched_off():
        launch(aligned, 32)
    assert [(grid, args[0]) for grid, args, _ in fake.bound] == [
        ((2,), 32), ((2,), 31), ((2,), 32), ((2,), 32), ((2,), 32), ((2,), 32)]
    assert fake.direct == [((2, 1, 1), (32, 2.0, 16)), ((2, 1, 1), (32, 2.0, 16))]


def test_a_repeated_launch_with_a_tma_descriptor_goes_straight_to_its_compiled_kernel(
        off_the_interpreter):
    """A host TMA descriptor among a tuned kernel's arguments is keyed by what Triton compiles
    for it (dtype, block, padding, base alignment): a repeat with another tensor of the same
    kind goes to the compiled launcher with the descriptor itself (the launcher makes its
    tensor map); another block shape or dtype goes through Triton."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    fake = _FakeJit()
    launch = _fake_launcher(fake)
    storage = torch.zeros(64)
    first = TensorDescriptor.from_tensor(storage[:32], [16])
    again = TensorDescriptor.from_tensor(storage[32:], [16])
    launch(storage[:32], 32, factor=first)
    launch(storage[:32], 32, factor=again)  # direct
    other_block = TensorDescriptor.from_tensor(storage[:32], [8])
    other_dtype = TensorDescriptor.from_tensor(storage.double()[:32], [16])
    launch(storage[:32], 32, factor=other_block)
    launch(storage[:32], 32, factor=other_dtype)
    assert [args[1] for _, args, _ in fake.bound] == [first, other_block, other_dtype]
    assert fake.direct == [((2, 1, 1), (32, again, 16))]


def test_a_launch_hook_sees_every_launch(off_the_interpreter, monkeypatch):
    """With a launch hook installed (a profiler), every launch goes through Triton's own."""
    fake = _FakeJit()
    launch = _fake_launcher(fake)
    launch(torch.zeros(32), 32)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launch(torch.zeros(32), 32)
    assert len(fake.bound) == 2 and fake.direct == []


def test_heuristics_of_the_key_replay_and_heuristics_of_a_tensor_do_not(off_the_interpreter):
    """A kernel under ``triton.heuristics`` replays with the heuristic's value when the
    heuristic reads only the key's scalars and the config; one that reads a tensor (its
    shape, say) depends on more than the key, and goes through Triton every time."""
    names = ("x_ptr", "n_elements", "factor", "BLOCK", "EVEN")
    of_scalars = _FakeJit(names)
    launch = _fake_launcher(triton.runtime.Heuristics(
        of_scalars, names, {"EVEN": lambda args: args["n_elements"] % args["BLOCK"] == 0}))
    for n in (32, 32, 31, 31):
        launch(torch.zeros(32), n)
    assert [kwargs["EVEN"] for _, _, kwargs in of_scalars.bound] == [True, False]
    assert of_scalars.direct == [((2, 1, 1), (32, 2.0, 16, True)),
                                 ((2, 1, 1), (31, 2.0, 16, False))]

    of_a_tensor = _FakeJit(names)
    launch = _fake_launcher(triton.runtime.Heuristics(
        of_a_tensor, names, {"EVEN": lambda args: args["x_ptr"].shape[0] % 16 == 0}),
        name="fake_tensor")
    launch(torch.zeros(32), 32)
    launch(torch.zeros(33), 32)
    assert [kwargs["EVEN"] for _, _, kwargs in of_a_tensor.bound] == [True, False]
    assert of_a_tensor.direct == []


class _PlannedOp:
    """An operator as gemslib writes one: ``x * factor`` into a fresh tensor through a fake
    kernel (x_ptr, out_ptr, n_elements, factor, BLOCK), planned per signature. ``before``
    runs on the call's own path before the launch (to make it compute, or allocate for
    itself); ``own_paths`` counts the calls that took it."""

    def __init__(self, name, before=None):
        self.fake = _FakeJit(("x_ptr", "out_ptr", "n_elements", "factor", "BLOCK"))
        self.kernel = runtime.TunedKernel("test_runtime", f"fake_{name}", self.fake,
                                          tunables=("BLOCK",), shape_keys=("numel",))
        self.calls = runtime.CallPlans(f"test_runtime.{name}")
        self.before, self.own_paths = before, 0

    def __call__(self, x, factor=2.0):
        key = self.calls.signature(x, factor)
        plan = self.calls.get(key)
        if plan is not None:
            return plan(x, factor)
        return self.calls.plan(key, (x, factor), lambda: self._own_path(x, factor))

    def _own_path(self, x, factor):
        self.own_paths += 1
        out = torch.empty_like(x)
        target = self.before(x, out) if self.before is not None else out
        n = x.numel()
        self.kernel._chosen.setdefault((n,), runtime.LaunchConfig((("BLOCK", 16),), 1, 1))
        self.kernel.launch(lambda meta: (runtime.cdiv(n, meta["BLOCK"]),), x, target, n, factor,
                           shape=(n,))
        return out


def test_a_repeated_call_is_planned_once_and_replayed_with_the_new_tensors(off_the_interpreter):
    """The first call binds through Triton, the second launches the kept kernel directly and
    is planned; later calls of that signature skip the operator's own path: a fresh output of
    the same layout, both pointers in the launch. Another signature (shape, dtype, alignment,
    a scalar) is planned apart."""
    op = _PlannedOp("planned")
    xs = [torch.randn(32) for _ in range(4)]
    outs = [op(x) for x in xs]
    assert op.own_paths == 2 and len(op.fake.bound) == 1 and len(op.fake.direct) == 3
    for x, out in zip(xs[2:], outs[2:]):
        assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == x.dtype
    assert len({out.data_ptr() for out in outs}) == 4
    assert op.fake.direct[-1] == ((2, 1, 1), (outs[-1].data_ptr(), 32, 2.0, 16))
    op(torch.randn(48))
    op(torch.randn(32, dtype=torch.float64))
    op(torch.zeros(33)[1:])
    op(xs[0], factor=3.0)
    assert op.own_paths == 6


def test_no_plan_where_the_call_must_run_its_own_path(off_the_interpreter, monkeypatch):
    """Autograd needs the call, a config is forced, the direct launch is off, a launch hook
    is installed: every call runs the operator's own path."""
    op = _PlannedOp("unplanned")
    for _ in range(3):
        op(torch.randn(32, requires_grad=True))
    with op.kernel.forced(runtime.LaunchConfig((("BLOCK", 16),), 1, 1)):
        for _ in range(3):
            op(torch.randn(32))
    with runtime.DIRECT_LAUNCH.switched_off():
        for _ in range(3):
            op(torch.randn(32))
    assert op.own_paths == 9
    for _ in range(3):
        op(torch.randn(32))
    assert op.own_paths == 11  # a signature's first call runs alone, its second is planned
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    op(torch.randn(32))
    assert op.own_paths == 12


@pytest.mark.parametrize("before", ["computes", "own buffer", "zeroes its input"])
def test_a_call_that_does_more_than_launch_is_never_planned(off_the_interpreter, before):
    """A plan replays only kernel launches into fresh outputs: a call that also computes with
    torch (a copy here, or zeroing memory that is no output of its own) or launches into a
    tensor it made for itself runs its own path every time, watched on its second and third
    calls only."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    watched = []

    def more_than_a_launch(x, out):
        watched.append(_get_current_dispatch_mode() is not None)
        if before == "zeroes its input":
            x.zero_()
            return out
        return out.copy_(x) if before == "computes" else torch.empty_like(out)

    op = _PlannedOp(before.replace(" ", "_"), before=more_than_a_launch)
    for _ in range(5):
        op(torch.randn(32))
    assert op.own_paths == 5
    assert watched == [False, True, True, False, False]  # two tries, then left alone


def test_a_planned_call_inside_a_call_being_planned_runs_its_own_launches(off_the_interpreter):
    """An operator whose call makes another planned operator's call (and returns its result
    too): while the outer call is planned the inner one launches through the kernels, so the
    outer plan records both launches, instead of replaying its own plan unseen."""
    inner, outer = _PlannedOp("inner"), _PlannedOp("outer")
    for _ in range(3):
        inner(torch.randn(32))  # the inner call has its plan

    def outer_call(x):
        middle = inner(x)
        return outer._own_path(middle, 2.0), middle

    for _ in range(4):
        x = torch.randn(32)
        key = outer.calls.signature(x)
        plan = outer.calls.get(key)
        out, middle = plan(x) if plan is not None else outer.calls.plan(key, (x,),
                                                                          lambda: outer_call(x))
    assert outer.own_paths == 2 and inner.own_paths == 3  # the inner path ran when planned
    assert inner.fake.direct[-1][1][0] == middle.data_ptr()
    assert outer.fake.direct[-1][1][0] == out.data_ptr()


def test_a_plan_fetches_its_split_scratch_again_at_each_call(off_the_interpreter):
    """Launch arguments inside a kept split_scratch pair (counters, partial results, a slice
    of them) are planned as that pair's place: each replay fetches the pair again (another
    stream's, or a new one after the cache let the old go) and passes the same offset."""
    op = _PlannedOp("scratch", before=lambda x, out: runtime.split_scratch(x.device, 4, 64)[1][8:])
    for _ in range(3):
        op(torch.randn(32))
    assert op.own_paths == 2
    parts = runtime.split_scratch(torch.device("cpu"), 4, 64)[1]
    assert op.fake.direct[-1][1][0] == parts.data_ptr() + 32
    cuda._split_scratch_cache.clear()
    op(torch.randn(32))
    fresh = runtime.split_scratch(torch.device("cpu"), 4, 64)[1]
    assert op.own_paths == 2 and op.fake.direct[-1][1][0] == fresh.data_ptr() + 32


def test_a_plan_returns_zeroed_and_empty_outputs_numbers_and_nones_as_the_call_did(
        off_the_interpreter):
    """An override's outputs as torch's SDPA kernels give them: the kernel's output, a
    number, None, a zeroed tensor (placeholders the call zeroed) and an empty one; the plan
    allocates the zeroed one zeroed again and returns the rest as the call did."""
    op = _PlannedOp("sdpa_like")

    def call(x):
        out = op._own_path(x, 2.0)
        return out, x.shape[0], None, torch.zeros(2, dtype=torch.int64), torch.empty(0)

    results = []
    for _ in range(4):
        x = torch.randn(32)
        key = op.calls.signature(x)
        plan = op.calls.get(key)
        results.append(plan(x) if plan is not None else op.calls.plan(key, (x,), lambda: call(x)))
        results[-1][3].fill_(5)  # a later call's zeroed output must not see this
    assert op.own_paths == 2
    for out, n, nothing, zeroed, empty in results[2:]:
        assert out.shape == (32,) and n == 32 and nothing is None and empty.shape == (0,)
        assert zeroed.dtype == torch.int64 and zeroed.shape == (2,)
    assert op.fake.direct[-1][1][0] == results[-1][0].data_ptr()
    plan = op.calls.get(op.calls.signature(torch.randn(32)))
    assert plan is not None and torch.equal(plan(torch.randn(32))[3], torch.zeros(2, dtype=torch.int64))


def test_inputs_that_start_together_are_planned_apart(off_the_interpreter):
    """Which input a launch's pointer is cannot be told when two start at one address: which
    tensors start together is part of the key, so a call with (x, x) replays only for calls
    that pass one tensor twice, and (a, b) is another signature."""
    op = _PlannedOp("aliased")
    own_path = []

    def call(x, y):
        own_path.append(y is x)
        return op._own_path(x, 2.0)

    def planned(x, y):
        key = op.calls.signature(x, y)
        plan = op.calls.get(key)
        return plan(x, y) if plan is not None else op.calls.plan(key, (x, y), lambda: call(x, y))

    outputs = []  # kept: a freed output's address could come back as the new x's below
    for _ in range(3):
        x = torch.randn(32)
        outputs.append(planned(x, x))
    for _ in range(3):
        outputs.append(planned(torch.randn(32), torch.randn(32)))
    assert own_path == [True, True, False, False]
    x = torch.randn(32)
    assert op.fake.direct[-1][1][0] != x.data_ptr()
    out = planned(x, x)
    assert op.fake.direct[-1][1][0] == out.data_ptr() and own_path == [True, True, False, False]


def test_a_call_that_launches_outside_plans_is_never_planned(off_the_interpreter):
    """An operator that launches a kernel itself says so, and its calls keep their own path."""
    inside = _PlannedOp("inside")
    outside = _PlannedOp("outside", before=lambda x, out: runtime.launched_outside_plans() or out)
    for _ in range(5):
        inside(torch.randn(32))
        outside(torch.randn(32))
    assert inside.own_paths == 2 and outside.own_paths == 5


def test_an_override_plans_its_calls_below_autograd(off_the_interpreter):
    """enable()'s wrapper plans the calls it serves like an operator does, also for tensors
    that require grad (autograd ran before the wrapper), and still counts them as served."""
    from gemslib import registry

    op = _PlannedOp("override")
    override = registry.AtenOverride("aten::test_runtime_fake", lambda x: op._own_path(x, 2.0),
                                     lambda x: None)
    wrapper = registry._make_wrapper(override, None)
    activation = type("Recording", (), {"record": True, "calls": Counter(),
                                        "fallbacks": Counter()})()
    registry._activations.append(activation)
    try:
        outs = [wrapper(None, torch.randn(32, requires_grad=True)) for _ in range(4)]
    finally:
        registry._activations.remove(activation)
        registry._override_plans.pop("aten::test_runtime_fake")
    assert op.own_paths == 2 and len(op.fake.direct) == 3
    assert op.fake.direct[-1][1][0] == outs[-1].data_ptr()
    assert activation.calls["aten::test_runtime_fake"] == 4


def test_a_graph_overload_plans_its_calls_below_autograd(off_the_interpreter):
    """An operator's ``graph`` overload (what compiled graphs call) has no autograd kernel and
    plans its calls through the dispatcher like an override: from the third call of a
    signature on, a call is its allocation and its launch, with the new call's pointers."""
    from gemslib.runtime.custom_op import define_graph_overload

    op = _PlannedOp("graph_overload")

    def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
        return op._own_path(x, factor)

    overload = define_graph_overload("test_runtime_graph_probe", scaled,
                                     lambda x, factor: torch.empty_like(x))
    assert overload._schema.overload_name == "graph"
    xs = [torch.randn(32, requires_grad=True) for _ in range(4)]
    outs = [overload(x, 2.0) for x in xs]
    assert op.own_paths == 2 and len(op.fake.direct) == 3
    assert op.fake.direct[-1][1][:1] == (outs[-1].data_ptr(),)
    overload(torch.randn(48), 2.0)  # another signature: its own path again
    assert op.own_paths == 3


def test_a_graph_overload_over_a_list_of_tensors_runs_its_own_path_each_call():
    """A list of tensors has no plan key: such an overload calls its function directly,
    every call, with no plans kept for it, and gives each call's own result."""
    from gemslib.runtime.custom_op import GRAPH_PLANS, define_graph_overload

    calls = []

    def summed(x: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(parts))
        return x + sum(parts)

    overload = define_graph_overload("test_runtime_list_probe", summed,
                                     lambda x, parts: torch.empty_like(x))
    assert "gemslib::test_runtime_list_probe.graph" not in GRAPH_PLANS
    for n in (1, 2, 2, 2):
        x, parts = torch.randn(8), [torch.randn(8) for _ in range(n)]
        torch.testing.assert_close(overload(x, parts), x + sum(parts))
    assert calls == [1, 2, 2, 2]


def test_repeated_calls_of_every_planned_operator_stay_right():
    """Each operator called again and again on fresh inputs of one signature (on a GPU the
    later calls replay their plan) gives each input's own result."""
    weight = random_tensor((256,), torch.float16)
    f16 = torch.float16
    for _ in range(4):
        x = random_tensor((5, 256), f16)
        residual = random_tensor((5, 256), f16)
        assert_close_to_reference(gemslib.silu(x), silu_ops.silu_reference(x.double()), f16)
        assert_close_to_reference(gemslib.silu_and_mul(x),
                                  silu_ops.silu_and_mul_reference(x.double()), f16)
        assert_close_to_reference(
            gemslib.rms_norm(x, weight, 1e-5),
            rms_norm_ops.rms_norm_reference(x.double(), weight.double(), 1e-5), f16, 256)
        normed, total = gemslib.add_rms_norm(x, residual, weight, 1e-5)
        expected_normed, expected_total = rms_norm_ops.add_rms_norm_reference(
            x.double(), residual.double(), weight.double(), 1e-5)
        assert_close_to_reference(normed, expected_normed, f16, 256)
        assert_close_to_reference(total, expected_total, f16)
        assert_close_to_reference(gemslib.softmax(x, 0), torch.softmax(x.double(), 0), f16, 5)
        assert_close_to_reference(gemslib.log_softmax(x), torch.log_softmax(x.double(), -1),
                                  f16, 256)
        q, k = random_tensor((2, 3, 4, 16), f16), random_tensor((2, 3, 2, 16), f16)
        angles = torch.rand(3, 8, device=DEVICE, dtype=torch.float64) * 6.3
        cos, sin = angles.cos().to(f16), angles.sin().to(f16)
        for ours, expected in zip(gemslib.apply_rotary(q, k, cos, sin), rotary_ops.rotary_reference(
                q.double(), k.double(), cos.double(), sin.double())):
            assert_close_to_reference(ours, expected, f16)
        with gemslib.enable():
            assert_close_to_reference(F.silu(x), silu_ops.silu_reference(x.double()), f16)
            assert_close_to_reference(
                F.rms_norm(x, (256,), weight, 1e-5),
                rms_norm_ops.rms_norm_reference(x.double(), weight.double(), 1e-5), f16, 256)
            assert_close_to_reference(torch.softmax(x, 0), torch.softmax(x.double(), 0), f16, 5)


def test_a_zero_bound_admits_only_zero(tmp_path):
    """A shape key that is a flag (0 or 1) can be bounded by 0: that bucket is for the 0s."""
    path = tmp_path / "flags.yaml"
    path.write_text("schema: 1\ndevice: x\nops:\n  silu:\n    silu_fwd:\n"
                    "      - {max: {numel: 0}, config: {BLOCK: 64}}\n      - config: {BLOCK: 128}\n")
    first, rest = runtime.load_tune_config(path).ops["silu"]["silu_fwd"]
    assert first.matches({"numel": 0}) and not first.matches({"numel": 1})
    assert rest.matches({"numel": 1})


def test_interpreted_launches_leak_no_numpy_warnings():
    """Under the interpreter (numpy arithmetic) extreme inputs make numpy warn inside the
    kernels; no such warning may reach the caller, for any operator (on a GPU there are none
    to leak, and the same calls must not warn either)."""
    import warnings

    big = random_tensor((3, 40), torch.float32) * 1e30
    big[0, 0], big[1, 1] = float("inf"), float("-inf")
    q = random_tensor((1, 2, 5, 16), torch.float32)
    angles = random_tensor((5, 8), torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gemslib.silu(big)
        gemslib.silu_and_mul(big)
        gemslib.rms_norm(big, eps=0.0)
        gemslib.rms_norm(torch.zeros_like(big), eps=0.0)
        gemslib.add_rms_norm(big, big)
        gemslib.softmax(big)
        gemslib.apply_rotary(q.transpose(1, 2) * float("inf"), q.transpose(1, 2), angles.cos(),
                             angles.sin())
        gemslib.attention(q, q * 1e30, q)
        gemslib.decode_attention(q[:, :, 0], q * 1e30, q)
        gemslib.rms_norm_linear_silu(big, big[0], big[:7])
        leaf = big.clone().requires_grad_()
        gemslib.rms_norm(leaf).sum().backward()
    leaked = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
              if issubclass(w.category, (RuntimeWarning, DeprecationWarning))]
    assert not leaked, leaked


def test_a_kernel_path_is_switched_off_only_inside_its_block():
    """KernelPath: on by default, off inside (nested) switched_off() blocks, on again after,
    also when a block raises."""
    path = runtime.KernelPath("op", "a path")
    assert path.on
    with path.switched_off():
        with path.switched_off():
            assert not path.on
        assert not path.on
    assert path.on
    with pytest.raises(ZeroDivisionError), path.switched_off():
        1 / 0
    assert path.on


@pytest.mark.parametrize("value,on", [(None, False), ("1", True), ("0", False)])
def test_an_opt_in_path_follows_its_variable_and_switches_on_inside_its_block(monkeypatch,
                                                                               value, on):
    """A path off by default is on where its environment variable says so at construction,
    and on inside switched_on() (nested in switched_off() too), back as it was after."""
    if value is None:
        monkeypatch.delenv("GEMSLIB_TEST_PATH", raising=False)
    else:
        monkeypatch.setenv("GEMSLIB_TEST_PATH", value)
    path = runtime.KernelPath("op", "a path", environment="GEMSLIB_TEST_PATH", default=False)
    assert path.on is on
    with path.switched_off(), path.switched_on():
        assert path.on
    with pytest.raises(ZeroDivisionError), path.switched_on():
        1 / 0
    assert path.on is on


class _FakeDescriptorJit(triton.runtime.KernelInterface):
    """Stands for a Gluon kernel (x_desc, out_ptr, n, BLOCK): records the launches Triton binds
    and those straight to its compiled kernel (the descriptor as the launcher gets it)."""
    arg_names = ["x_desc", "out_ptr", "n", "BLOCK"]

    def __init__(self):
        self.bound, self.direct = [], []

    def run(self, *args, grid, warmup, **kwargs):
        self.bound.append(args)
        direct = self.direct

        class Launcher:
            global_scratch_size = profile_scratch_size = 0
            launch_cooperative_grid = launch_pdl = False

            def launch(self, grid0, grid1, grid2, stream, function, cooperative, pdl, gs, ps,
                       metadata, launch_metadata, enter, exit_, *launch_args):
                direct.append(launch_args)

        compiled = type("Compiled", (), {"function": 5, "packed_metadata": (4, 1, 0),
                                         "_init_handles": lambda self: None})()
        compiled.run = Launcher()
        return compiled


def _descriptor(t, block=(1, 32)):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(list(block), gl.float32)
    return TensorDescriptor.from_tensor(t, list(block), layout)


def test_a_kept_kernel_with_descriptors_is_launched_directly_and_planned(off_the_interpreter):
    """KeptKernel: the first launch of a key binds through Triton, the next go to the compiled
    kernel with the descriptor itself (Triton's launcher makes its tensor map); another
    block shape is another key. A call planned over such launches replays with the
    descriptor on its new tensor: the map's base is the new input's pointer, its shape and
    strides the planned ones."""
    fake = _FakeDescriptorJit()
    kept = runtime.KeptKernel(fake)

    def double(x):
        out = torch.empty_like(x)
        kept.launch((2,), (_descriptor(x), out, x.numel()), {"BLOCK": 32})
        return out

    x = torch.randn(4, 32)
    double(x)
    double(x)
    assert len(fake.bound) == 1 and len(fake.direct) == 1
    assert isinstance(fake.direct[0][0], type(_descriptor(x)))
    kept.launch((2,), (_descriptor(x, (2, 32)), torch.empty_like(x), x.numel()), {"BLOCK": 32})
    assert len(fake.bound) == 2

    plans = runtime.CallPlans("test_runtime.kept")

    def planned(x):
        key, out = plans.replayed(x)
        return out if out is not None else plans.plan(key, (x,), lambda: double(x))

    for _ in range(3):
        planned(torch.randn(4, 32))
    (plan,) = plans._plans.values()
    y = torch.randn(4, 32)
    before = len(fake.direct)
    out = planned(y)
    mapped, pointer, n, block = fake.direct[-1]  # the constexpr after the arguments
    assert len(fake.direct) == before + 1
    assert mapped.base.data_ptr() == y.data_ptr() and pointer == out.data_ptr() and n == 128
    assert block == 32
    assert tuple(mapped.shape) == (4, 32) and tuple(mapped.strides) == (32, 1)
    assert mapped.padding == "zero"


def test_a_tensor_map_parameter_is_passed_as_tritons_launcher_expands_it():
    """native_spec of a launch with a descriptor: a tensor-map parameter on its base's slot
    and the map's fixed part (host element type, element bytes, swizzle, box, shape, strides,
    padding), then the shape as i32 and the strides as i64 constants; no native plan where
    Triton did not lower the descriptor to a tensor map."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 64],
            "fp4_padded": False}
    fixed = MapOn(None, (256, 128), (128, 1), "zero")

    def plan_with(maps_meta):
        compiled = (lambda *a: None, (3, 1, 1), 99, False, False, (4, 1, 0), (), (
            "tensordesc<bf16[1, 64]>", "*bf16", "i32"), maps_meta)
        return plans._Plan(torch.device("cuda", 0), (0,),
                           (((8,), (1,), torch.float32, False),), (), 0,
                           ((compiled, (fixed, None, 7), ((0, 0), (1, 1))),))

    spec = runtime.native_spec(plan_with([meta]))
    (launch,) = spec[4]
    assert launch[-1] == ((3, 0, 0), (2, 0, 256), (2, 0, 128), (2, 0, 128), (2, 0, 1),
                          (0, 1, 0), (2, 0, 7))
    assert spec[6] == ((TMA_DTYPE_DEVICE_TO_HOST[9], 2, 3, (1, 64), (256, 128), (128, 1), 0),)
    assert runtime.native_spec(plan_with(None)) is None
    assert runtime.native_spec(plan_with([{**meta, "fp4_padded": True}])) is None


DEPENDENT_KERNELS = ("rms_norm.rms_norm_fwd", "silu.silu_and_mul_fwd", "rotary.rotary",
                     "decode_attention.decode_attention", "decode_gemv.decode_gemv",
                     "decode_gemv.decode_gemv_rotary")


def _fresh_launches():
    """Forget the kernels' launch options and kept launches (they follow the switch)."""
    for kernel in runtime.KERNELS.values():
        kernel.clear_cache()


@pytest.mark.parametrize("here, early", [(False, False), (True, False), (True, True)],
                         ids=["plain", "dependent", "early"])
def test_kernels_built_for_dependent_launch_are_launched_so_where_it_is_on(here, early,
                                                                          monkeypatch):
    """The decode step's kernels (norm, silu * mul, rotary, decode attention, GEMV) take PDL
    and Triton's launch_pdl exactly where dependent launch is on here (sm_90, GEMSLIB_PDL not 0),
    and PDL_EARLY where GEMSLIB_PDL_EARLY is on too; the other kernels never do. On a GPU, under
    it a CUDA graph of GEMM -> rms_norm -> GEMM -> silu_and_mul -> GEMV -> GEMV (each reading
    its predecessor's output at once, the GEMVs' weights prefetched before their wait where
    early) gives the eager result exactly, and torch's within bf16 rounding, on new inputs
    each replay."""
    monkeypatch.setattr(env, "dependent_launch_here", lambda: here)
    monkeypatch.setattr(env, "early_dependents_here", lambda: here and early)
    _fresh_launches()
    try:
        for name, kernel in runtime.KERNELS.items():
            built = name in DEPENDENT_KERNELS
            assert kernel.dependent_launch == built, name
            kwargs = kernel.kernel_kwargs(kernel.buckets()[-1].configs[0])
            assert kwargs.get("PDL", False) == (built and here), name
            assert kwargs.get("launch_pdl", False) == (built and here), name
            assert kwargs.get("PDL_EARLY", False) == (built and here and early), name
        if not torch.cuda.is_available() or runtime.INTERPRETER:
            return
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(16, 4096, **bf16)
        w_in, w_gate_up = (torch.randn(4096, 4096, **bf16) * 0.02 for _ in range(2))
        w_down, w_out = (torch.randn(4096, 2048, **bf16) * 0.02,
                         torch.randn(1024, 4096, **bf16) * 0.02)
        weight = torch.randn(4096, **bf16)

        def step():
            normed = gemslib.rms_norm(x @ w_in.t(), weight)
            down = gemslib.decode_gemv(gemslib.silu_and_mul(normed @ w_gate_up.t()), w_down)
            return gemslib.decode_gemv(down, w_out, norm_weight=weight)

        expected = step()
        graph = torch.cuda.CUDAGraph()
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, step())
            gate, up = (F.rms_norm((x @ w_in.t()).float(), (4096,), weight.float(), 1e-6)
                        .to(torch.bfloat16) @ w_gate_up.t()).float().chunk(2, dim=-1)
            down = ((F.silu(gate) * up).to(torch.bfloat16).float() @ w_down.float().t()).to(
                torch.bfloat16).float()
            expected_out = (F.rms_norm(down, (4096,), weight.float(), 1e-6).to(torch.bfloat16)
                            .float() @ w_out.float().t())
            torch.testing.assert_close(out.float(), expected_out, rtol=5e-2, atol=8e-2)
        assert not torch.equal(out, expected)  # the replays saw the new inputs
    finally:
        monkeypatch.undo()
        _fresh_launches()
