"""softmax / log_softmax: accuracy, any dim, special values, gradients, aten overrides."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import gemslib
from helpers import DEVICE, DTYPES, ON_GPU, random_tensor, opcheck_overloads
from gemslib import runtime
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import softmax as softmax_ops

FUNCTIONS = {"softmax": (gemslib.softmax, torch.softmax),
             "log_softmax": (gemslib.log_softmax, torch.log_softmax)}

# (shape, dim): one-block rows, rows wider than the block (online pass), non-last dims, 1-wide,
# 1-long, 0-d and empty tensors
CASES = [((3, 7), -1), ((17, 128), 1), ((5, 1000), -1), ((2, 3, 600), 1), ((4, 5, 6), 0),
         ((1, 9000), -1), ((3, 20000), 1), ((6, 1), -1), ((1, 9), 0), ((), 0), ((0, 5), -1),
         ((4, 0), 1)]
if ON_GPU:
    CASES += [((4096, 4096), -1), ((64, 131072), -1), ((8, 262144), -1), ((2048, 50257), -1),
              ((1024, 3, 64), 0)]


@contextlib.contextmanager
def _split_rows(chunk: int):
    """Force rows wider than ``chunk`` to be split over programs (0: never split), the Triton
    kernels serving every call."""
    with _cluster_rows(0), softmax_ops.SOFTMAX_SPLIT_FWD.forced(
            runtime.LaunchConfig((("CHUNK", chunk),), 4, 1)):
        yield


def _cluster_rows(cluster: int, num_warps: int = 8):
    """Force the Hopper path's CLUSTER CTAs a row (0: the Triton kernels)."""
    return softmax_ops.SOFTMAX_CLUSTER_FWD.forced(
        runtime.LaunchConfig((("CLUSTER", cluster),), num_warps, 1))


# rows split over programs (shape, last dim, chunk): several pieces per row, a last piece that
# is partly masked, a single short row
SPLIT_CASES = [((3, 1000), -1, 256), ((2, 1030), -1, 128), ((1, 70), -1, 32),
               ((4, 5, 300), -1, 64)]
if ON_GPU:
    SPLIT_CASES += [((1024, 131072), -1, 16384), ((512, 262144), -1, 32768),
                    ((64, 50257), -1, 4096)]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,chunk", [(*case, 0) for case in CASES] + SPLIT_CASES)
def test_matches_reference(shape, dim, chunk, dtype, name):
    ours, reference = FUNCTIONS[name]
    x = random_tensor(shape, dtype, scale=4.0)
    with _split_rows(chunk):  # chunk 0: one program per row, whatever the shipped configs say
        assert softmax_ops._split_chunk(x.numel() // max(shape[dim], 1) if x.dim() else 1,
                                        shape[dim] if x.dim() else 1) == chunk
        result = ours(x, dim)
    assert result.shape == x.shape and result.dtype == dtype
    width = x.shape[dim] if x.dim() else 1
    assert_close_to_reference(result, reference(x.double(), dim), dtype, reduction_len=width)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_views(name):
    ours, reference = FUNCTIONS[name]
    base = random_tensor((8, 300), torch.float32, scale=4.0)
    for view in (base[:, 20:220], base.t(), base[::2, ::3], base.view(2, 4, 300).transpose(0, 1)):
        for dim in range(view.dim()):
            assert_close_to_reference(ours(view, dim), reference(view.double(), dim),
                                      torch.float32, reduction_len=view.shape[dim])


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("width", [50, 9000])  # one block, and the online pass
def test_special_values_behave_as_in_torch(name, width):
    ours, reference = FUNCTIONS[name]
    x = random_tensor((5, width), torch.float32)
    x[1, 5] = float("nan")          # a NaN row is all NaN
    x[2] = -float("inf")            # an all -inf row is NaN (torch divides 0 by 0)
    x[3, 7] = float("inf")          # +inf: inf - inf is NaN
    x[4, : width // 2] = -float("inf")  # -inf entries are just zero probability
    result, expected = ours(x, -1), reference(x.double(), -1)
    assert torch.equal(torch.isnan(result), torch.isnan(expected))
    assert_close_to_reference(result, expected, torch.float32, reduction_len=width)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_m", [1, 2])
@pytest.mark.parametrize("base_width,expected_align", [(1003, "vector"), (1011, "vector"),
                                                       (1010, 1), (1008, 1)])
def test_looped_rows_that_start_off_alignment(name, dtype, block_m, base_width, expected_align):
    """Rows of 1003 columns looped over 64-wide blocks, forward and backward: rows that start
    off a 16-byte boundary are walked from the boundary before them (ALIGN > 1) when every
    tensor shares the offset (equal strides modulo the vector: 1003 and 1011 against the
    outputs' 1003), else column by column."""
    ours, reference = FUNCTIONS[name]
    x = random_tensor((7, base_width), dtype, scale=4.0)[:, :1003]
    x[2, 500] = float("nan")  # special values in the masked first and last blocks too
    x[3] = -float("inf")
    x[4, 1] = float("inf")
    x[5, 1000] = float("inf")
    per_vector = 16 // x.element_size()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert softmax_ops._row_alignment([(x, x.stride(0)), (out, 1003)]) == (
        per_vector if expected_align == "vector" else expected_align)
    config = runtime.LaunchConfig((("BLOCK_M", block_m), ("BLOCK_N", 64)), 4, 1)
    x_leaf = x.detach().requires_grad_()
    with softmax_ops.SOFTMAX_FWD.forced(config), softmax_ops.SOFTMAX_BWD.forced(config):
        result = ours(x_leaf, -1)
        grad = random_tensor(x.shape, dtype)
        (dx,) = torch.autograd.grad(result, x_leaf, grad)
    expected = reference(x.double(), -1)
    # the backward works from the forward's output, rounded to the dtype, as torch's does
    backward = (softmax_ops.log_softmax_backward_reference if name == "log_softmax"
                else softmax_ops.softmax_backward_reference)
    expected_dx = backward(grad.double(), result.detach().double(), -1)
    assert torch.equal(torch.isnan(result), torch.isnan(expected))
    assert_close_to_reference(result, expected, dtype, reduction_len=1003)
    assert torch.equal(torch.isnan(dx), torch.isnan(expected_dx))
    assert_close_to_reference(dx, expected_dx, dtype, reduction_len=1003)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_rows_split_over_programs_keep_special_values(name):
    ours, reference = FUNCTIONS[name]
    x = random_tensor((5, 1000), torch.float32)
    x[1, 5] = float("nan")
    x[2] = -float("inf")
    x[3, 700] = float("inf")
    x[4, :600] = -float("inf")  # whole pieces of -inf next to finite ones
    with _split_rows(128):
        result = ours(x, -1)
    expected = reference(x.double(), -1)
    assert torch.equal(torch.isnan(result), torch.isnan(expected))
    assert_close_to_reference(result, expected, torch.float32, reduction_len=1000)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_split_rows_again_and_again_leave_their_counters_at_zero(name):
    """The one-launch split form reuses its counters and statistics (runtime.split_scratch):
    call after call of one size, each on a fresh input, gives that input's result, and the
    counters are back at zero after each."""
    ours, reference = FUNCTIONS[name]
    for _ in range(3):
        x = random_tensor((6, 1000), torch.float32, scale=4.0)
        with _split_rows(128):
            result = ours(x, -1)
        assert_close_to_reference(result, reference(x.double(), -1), torch.float32,
                                  reduction_len=1000)
        counters, _ = runtime.split_scratch(x.device, 6 + 2, 6 * 8 * 2)
        assert counters.tolist() == [0] * 8


def test_rows_are_split_only_where_it_pays():
    with _split_rows(256):
        assert softmax_ops._split_chunk(8, 256) == 0           # one piece: nothing to split
        assert softmax_ops._split_chunk(8, 257) == 256
        assert softmax_ops._split_chunk(8, 256 * 300) == 0     # more pieces than one block combines
    with _split_rows(0):
        assert softmax_ops._split_chunk(8, 1 << 20) == 0       # CHUNK 0: never split


def test_one_launch_form_with_a_single_piece():
    """PHASE 0 (tickets, the wait, the counters put back) with one piece per row is the one
    form the interpreter can run: nothing to wait for. The GPU suite runs it with several
    pieces. The counters end as they began, zero (they are reused)."""
    x = random_tensor((3, 100), torch.float32)
    y = torch.empty_like(x)
    stats = torch.empty(3, 1, 2, device=x.device)
    counters = torch.zeros(5, dtype=torch.int32, device=x.device)
    for _ in range(2):
        softmax_ops._softmax_split_fwd_kernel[(3,)](
            x, y, stats, counters, 3, 100, 1, x.stride(0), y.stride(0), False, 0, CHUNK=128,
            MAX_CHUNKS=2)
        assert counters.tolist() == [0, 0, 0, 0, 0]
    assert_close_to_reference(y, torch.softmax(x.double(), -1), torch.float32, reduction_len=100)


# rows held across a Hopper cluster (shape, CLUSTER, num_warps): odd widths whose rows start at
# every offset from a 16-byte boundary, a single row, more CTAs than the row needs, a row
# shorter than two vectors (never the Hopper path), 3-d input
CLUSTER_CASES = [((9, 1003), 2, 4), ((1, 4099), 4, 4), ((3, 300), 8, 4), ((5, 7), 2, 4),
                 ((2, 3, 2051), 1, 4)]
if ON_GPU:
    CLUSTER_CASES += [((8192, 32000), 1, 8), ((1024, 131072), 4, 8), ((64, 262144), 8, 8),
                      ((256, 152064), 8, 8), ((2048, 50257), 2, 8), ((3, 151936), 4, 16),
                      ((2, 256000), 8, 4), ((1024, 128256), 4, 8)]


def _hopper_launches(monkeypatch) -> list:
    """The Hopper path's launches from here on, as (CLUSTER, num_warps)."""
    launches = []
    forward = softmax_ops._softmax_hopper.forward

    def counted(kernel, x_rows, out_rows, log, cluster, num_warps):
        launches.append((cluster, num_warps))
        forward(kernel, x_rows, out_rows, log, cluster, num_warps)

    monkeypatch.setattr(softmax_ops._softmax_hopper, "forward", counted)
    return launches


def _takes_hopper_path(x: torch.Tensor, cluster: int, num_warps: int) -> bool:
    return (ON_GPU and torch.cuda.get_device_capability()[0] >= 9
            and softmax_ops._softmax_hopper.fits(x.shape[-1], x.element_size(), cluster,
                                                 num_warps))


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,cluster,num_warps", CLUSTER_CASES)
def test_rows_held_across_a_cluster(monkeypatch, shape, cluster, num_warps, dtype, name):
    """On Hopper the configured CLUSTER CTAs hold each row (the kernel reads it once); where
    the path cannot run (the interpreter, a row of fewer than two vectors, a slice over the
    shared memory) the Triton kernels answer the same call."""
    ours, reference = FUNCTIONS[name]
    x = random_tensor(shape, dtype, scale=4.0)
    launches = _hopper_launches(monkeypatch)
    with _cluster_rows(cluster, num_warps):
        result = ours(x, -1)
    assert launches == ([(cluster, num_warps)] if _takes_hopper_path(x, cluster, num_warps)
                        else [])
    assert result.shape == x.shape and result.dtype == dtype
    assert_close_to_reference(result, reference(x.double(), -1), dtype,
                              reduction_len=shape[-1])


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("cluster", [1, 4])
def test_rows_held_across_a_cluster_keep_special_values(monkeypatch, name, cluster):
    """NaN, +inf and rows of only -inf as in torch, wherever in the row (in a partial vector at
    either end, or in another CTA's slice than the first)."""
    ours, reference = FUNCTIONS[name]
    x = random_tensor((7, 5003), torch.bfloat16)
    x[1, 4998] = float("nan")   # in the row's last partial vector (rows start off alignment)
    x[2] = -float("inf")
    x[3, 4000] = float("inf")  # past the first CTA's slice
    x[4, :4500] = -float("inf")  # whole slices of -inf next to finite ones
    x[5, 0] = float("nan")      # in the row's first partial vector
    launches = _hopper_launches(monkeypatch)
    with _cluster_rows(cluster, 4):
        result = ours(x, -1)
    assert len(launches) == (1 if _takes_hopper_path(x, cluster, 4) else 0)
    expected = reference(x.double(), -1)
    assert torch.equal(torch.isnan(result), torch.isnan(expected))
    assert_close_to_reference(result, expected, torch.bfloat16, reduction_len=5003)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_rows_held_across_a_cluster_from_strided_views(monkeypatch, name):
    """Views whose rows start where the output's do modulo 16 bytes take the Hopper path;
    others (a base off 16 bytes, row strides that differ modulo it) the Triton kernels. Each
    gives torch's answer."""
    ours, reference = FUNCTIONS[name]
    base = random_tensor((6, 5013), torch.bfloat16, scale=4.0)
    launches = _hopper_launches(monkeypatch)
    views = [(base[:, :5005], True),    # row stride 5013 against the output's 5005: 8 apart
             (base[:, :5000], False),   # 13 apart
             (base[:, 1:5006], False)]  # a base 2 bytes past the allocation's
    for view, eligible in views:
        launches.clear()
        with _cluster_rows(2, 4):
            result = ours(view, -1)
        assert launches == ([(2, 4)] if eligible and _takes_hopper_path(view, 2, 4) else [])
        assert_close_to_reference(result, reference(view.double(), -1), torch.bfloat16,
                                  reduction_len=view.shape[-1])


class _RecordedLaunch:
    """Stands for a TunedKernel: records what a cluster launcher hands to ``launch``."""

    def __init__(self):
        self.launches = []

    def launch(self, grid, *args, shape):
        self.launches.append((tuple(grid({})), args, tuple(shape)))


@pytest.mark.parametrize("log", [False, True])
def test_cluster_launchers_pass_every_kernel_parameter_by_position(log):
    """The Hopper launchers go through TunedKernel.launch (kept and planned like Triton's
    launches), which binds arguments by position: each one must land on its parameter."""
    hopper = softmax_ops._softmax_hopper
    x = torch.empty(5, 3011, dtype=torch.bfloat16)[:, :3003]  # rows 3011 apart
    out = torch.empty(5, 3003, dtype=torch.bfloat16)
    recorder = _RecordedLaunch()
    hopper.forward(recorder, x, out, log, 2, 4)
    hopper.backward(recorder, x, out, out, log, 4, 8)
    for (grid, args, shape), kernel, (cluster, warps) in zip(
            recorder.launches, (hopper._softmax_cluster_fwd_kernel,
                                hopper._softmax_cluster_bwd_kernel), ((2, 4), (4, 8))):
        named = dict(zip(kernel.arg_names, args))
        assert len(args) == len(kernel.arg_names) and grid == (5,) and shape == (5, 3003)
        assert named["n_cols"] == 3003 and named["LOG"] is log and named["VEC"] == 8
        assert named["N_CHUNKS"] == hopper.n_chunks(3003, 2, cluster, warps)
        assert named["y_ptr"] is out and named[kernel.arg_names[0]] is x
        assert named["partial_ptr"].dtype == torch.float32
        assert named["partial_ptr"].numel() >= 5 * cluster
        strides = [value for name, value in named.items() if name.startswith("stride_")]
        assert strides[0] == 3011 and set(strides[1:]) == {3003}


def test_cluster_knob_becomes_the_kernels_num_ctas():
    for kernel in (softmax_ops.SOFTMAX_CLUSTER_FWD, softmax_ops.SOFTMAX_CLUSTER_BWD):
        kwargs = kernel.kernel_kwargs(runtime.LaunchConfig((("CLUSTER", 4),), 8, 1))
        assert kwargs == {"num_warps": 8, "num_stages": 1, "num_ctas": 4}
    with pytest.raises(ValueError, match="cluster_knob 'CTAS' must be one of the launcher_knobs"):
        runtime.TunedKernel("softmax", "nope", None, tunables=(), shape_keys=("rows",),
                            cluster_knob="CTAS")


def _cluster_backward_rows(cluster: int, num_warps: int = 8):
    """Force the backward's Hopper path (0: the Triton kernel)."""
    return softmax_ops.SOFTMAX_CLUSTER_BWD.forced(
        runtime.LaunchConfig((("CLUSTER", cluster),), num_warps, 1))


def _hopper_backward_launches(monkeypatch) -> list:
    launches = []
    backward = softmax_ops._softmax_hopper.backward

    def counted(kernel, grad_rows, y_rows, dx_rows, log, cluster, num_warps):
        launches.append((cluster, num_warps))
        backward(kernel, grad_rows, y_rows, dx_rows, log, cluster, num_warps)

    monkeypatch.setattr(softmax_ops._softmax_hopper, "backward", counted)
    return launches


def _takes_hopper_backward(y: torch.Tensor, cluster: int, num_warps: int) -> bool:
    return (ON_GPU and torch.cuda.get_device_capability()[0] >= 9
            and softmax_ops._softmax_hopper.fits(y.shape[-1], y.element_size(), cluster,
                                                 num_warps, slices=2))


def _backward_reference(name):
    return (softmax_ops.log_softmax_backward_reference if name == "log_softmax"
            else softmax_ops.softmax_backward_reference)


BACKWARD_CLUSTER_CASES = [((9, 1003), 2, 4), ((1, 4099), 4, 4), ((3, 300), 8, 4), ((5, 7), 2, 4),
                          ((2, 3, 2051), 1, 4)]
if ON_GPU:  # the H200 buckets' configs at their widths, a few rows each
    BACKWARD_CLUSTER_CASES += [((16, 32000), 1, 8), ((8, 131072), 8, 4), ((33, 50257), 4, 4),
                               ((5, 152064), 8, 8), ((3, 151936), 8, 8), ((2, 262144), 8, 8),
                               ((4, 128256), 8, 4), ((2, 256000), 8, 16)]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,cluster,num_warps", BACKWARD_CLUSTER_CASES)
def test_backward_rows_held_across_a_cluster(monkeypatch, shape, cluster, num_warps, dtype,
                                             name):
    """On Hopper the backward's configured CLUSTER CTAs hold dy and y of each row; where the
    path cannot run (the interpreter, short rows, two slices over the shared memory) the
    Triton kernel answers the same call."""
    ours, _ = FUNCTIONS[name]
    x = random_tensor(shape, dtype, scale=4.0).requires_grad_()
    grad = random_tensor(shape, dtype)
    launches = _hopper_backward_launches(monkeypatch)
    y = ours(x, -1)
    with _cluster_backward_rows(cluster, num_warps):
        y.backward(grad)
    assert launches == ([(cluster, num_warps)]
                        if _takes_hopper_backward(y, cluster, num_warps) else [])
    expected = _backward_reference(name)(grad.double(), y.detach().double(), -1)
    assert x.grad.dtype == dtype
    assert_close_to_reference(x.grad, expected, dtype, reduction_len=shape[-1])


@pytest.mark.parametrize("name", FUNCTIONS)
def test_backward_rows_held_across_a_cluster_keep_special_values(monkeypatch, name):
    """A NaN or infinity in dy makes its row's dx NaN (as in torch), wherever it is; zeros of
    y (from -inf inputs) and the rows' partial vectors at both ends are exact."""
    x = random_tensor((6, 5003), torch.bfloat16, scale=4.0)
    x[1, :4500] = -float("inf")
    y = FUNCTIONS[name][0](x, -1)
    grad = random_tensor(x.shape, torch.bfloat16)
    grad[2, 5001] = float("nan")   # in the row's last partial vector
    grad[3, 4000] = float("inf")   # past the first CTA's slice
    grad[4, 0] = float("nan")      # in the row's first partial vector
    launches = _hopper_backward_launches(monkeypatch)
    with _cluster_backward_rows(4, 4):
        dx = softmax_ops._backward(grad, y, -1, name == "log_softmax", torch.bfloat16)
    assert len(launches) == (1 if _takes_hopper_backward(y, 4, 4) else 0)
    expected = _backward_reference(name)(grad.double(), y.double(), -1)
    assert torch.equal(torch.isnan(dx), torch.isnan(expected))
    assert_close_to_reference(dx, expected, torch.bfloat16, reduction_len=5003)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_backward_rows_held_across_a_cluster_from_strided_views(monkeypatch, name):
    """dy views whose rows start where y's and dx's do modulo 16 bytes take the Hopper path,
    others the Triton kernel; each gives torch's answer."""
    y = FUNCTIONS[name][0](random_tensor((6, 5005), torch.bfloat16, scale=4.0), -1)
    base = random_tensor((6, 5013), torch.bfloat16)
    launches = _hopper_backward_launches(monkeypatch)
    for grad, eligible in ((base[:, :5005], True), (base[:, 3:5008], False)):
        launches.clear()
        with _cluster_backward_rows(2, 4):
            dx = softmax_ops._backward(grad, y, -1, name == "log_softmax", torch.bfloat16)
        assert launches == ([(2, 4)] if eligible and _takes_hopper_backward(y, 2, 4) else [])
        assert_close_to_reference(dx, _backward_reference(name)(grad.double(), y.double(), -1),
                                  torch.bfloat16, reduction_len=5005)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((3, 7), -1), ((5, 1000), 1), ((2, 30, 4), 1),
                                       ((2, 9000), -1), ((), 0)])
def test_gradients(shape, dim, dtype, name):
    ours, _ = FUNCTIONS[name]
    x = random_tensor(shape, dtype, scale=2.0).requires_grad_()
    grad = random_tensor(shape, dtype)
    y = ours(x, dim)
    y.backward(grad)
    # the backward works from the forward's output, rounded to the dtype, as torch's does
    backward = (softmax_ops.log_softmax_backward_reference if name == "log_softmax"
                else softmax_ops.softmax_backward_reference)
    expected = backward(grad.double(), y.detach().double(), dim if shape else 0)
    width = shape[dim] if shape else 1
    assert_close_to_reference(x.grad, expected, dtype, reduction_len=width)


def test_bad_input_names_the_argument():
    x = random_tensor((3, 4), torch.float32)
    with pytest.raises(IndexError, match="dim 2 is out of range for a tensor of 2 dims"):
        gemslib.softmax(x, 2)
    with pytest.raises(TypeError, match="argument 'dim' must be int, not float"):
        gemslib.log_softmax(x, 1.0)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        gemslib.softmax(torch.ones(3, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("dim,type_name", [(1.0, "float"), (True, "bool"), ("1", "str"),
                                           (None, "NoneType"),
                                           (torch.tensor(1.0), "Tensor"),
                                           (torch.tensor([1]), "Tensor")])
def test_dim_must_be_an_int_as_in_torch(name, dim, type_name):
    ours, theirs = FUNCTIONS[name]
    x = random_tensor((3, 4), torch.float32)
    with pytest.raises(TypeError, match=f"^gemslib.{name}\\(\\): argument 'dim' must be int, "
                                        f"not {type_name}$"):
        ours(x, dim)
    with pytest.raises((TypeError, RuntimeError)):  # torch refuses it too (in its own words,
        theirs(x, dim)                               # which differ between versions)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_dim_may_be_a_0d_integer_tensor_as_in_torch(name):
    ours, theirs = FUNCTIONS[name]
    x = random_tensor((3, 4), torch.float32)
    for dim in (torch.tensor(0), torch.tensor(-1, dtype=torch.int32)):
        assert_close_to_reference(ours(x, dim), theirs(x.double(), int(dim)), torch.float32,
                                  reduction_len=x.shape[int(dim)])


def _extreme_rows(width: int, dtype=torch.float32) -> torch.Tensor:
    """Rows that make the interpreter's numpy warn: -inf entries, a row of only -inf, values
    whose shifted exp underflows or overflows, NaN and +inf."""
    x = random_tensor((6, width), torch.float32)
    x[0, : width // 2] = -float("inf")
    x[1] = -float("inf")
    x[2, 3], x[2, 4] = 3e38, -3e38
    x[3, 1] = float("nan")
    x[4, 2] = float("inf")
    x[5] = x[5] * 1e6
    return x.to(dtype)


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize("width,chunk", [(50, 0), (9000, 0), (1000, 128)])
def test_no_floating_point_warnings_reach_the_caller(name, width, chunk):
    """The interpreter computes in numpy, which warns at -inf - -inf, exp overflow and log2(0);
    none of that may reach user code (pytest's filterwarnings hides it in the suite only:
    simplefilter('always') overrides those filters inside the block)."""
    import warnings

    ours, reference = FUNCTIONS[name]
    x = _extreme_rows(width)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _split_rows(chunk):
            leaf = x.clone().requires_grad_()
            y = ours(leaf, -1)
            y.backward(random_tensor(x.shape, torch.float32))
            with gemslib.enable(ops=["softmax"]):
                functional = (F.log_softmax if name == "log_softmax" else F.softmax)(x, -1)
        bf16 = ours(_extreme_rows(width, torch.bfloat16), -1)
    leaked = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
              if issubclass(w.category, RuntimeWarning)]
    assert not leaked, leaked
    expected = reference(x.double(), -1)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))  # the values are still right
    assert torch.equal(torch.isnan(functional), torch.isnan(expected))
    assert bf16.shape == x.shape


def test_float64_falls_back_to_torch():
    x = torch.randn(4, 9, dtype=torch.float64, device=DEVICE)
    assert torch.equal(gemslib.softmax(x, 0), torch.softmax(x, 0))


# ---------------------------------------------------------------------------------------------
# aten overrides
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_calls_run_gemslib_both_ways(dtype):
    x = random_tensor((6, 70), dtype, scale=3.0).requires_grad_()
    grad = random_tensor((6, 70), dtype)
    with gemslib.enable(ops=["softmax"], record=True) as activation:
        log_last = F.log_softmax(x.detach().requires_grad_(), dim=-1)
        log_last.backward(grad)
        y = F.softmax(x, dim=-1)
        (y * grad).sum().backward()
        log_y = F.log_softmax(x.detach().requires_grad_(), dim=0)
        log_y.backward(grad)
    assert activation.calls == {"aten::_softmax": 1, "aten::_softmax_backward_data": 1,
                                "aten::_log_softmax": 1, "aten::_log_softmax_backward_data": 1}
    # a reduction over a non-last dim stays with torch (gemslib would need a copy)
    assert activation.fallbacks == {"aten::_log_softmax": 1, "aten::_log_softmax_backward_data": 1}
    x64 = x.detach().double()
    assert_close_to_reference(y, torch.softmax(x64, -1), dtype, reduction_len=70)
    # the backward works from the forward's output, rounded to the dtype
    expected_grad = softmax_ops.softmax_backward_reference(grad.double(), y.detach().double(), -1)
    assert_close_to_reference(x.grad, expected_grad, dtype, reduction_len=70)
    assert_close_to_reference(log_y, torch.log_softmax(x64, 0), dtype, reduction_len=6)
    assert_close_to_reference(log_last, torch.log_softmax(x64, -1), dtype, reduction_len=70)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_to_float(dtype):
    """16-bit input, fp32 output: the kernel writes fp32 directly. Under enable() on a GPU the
    half_to_float forms run it; on the CPU torch's kernel refuses them, and so does gemslib's
    override (torch's error, not a result torch would not give)."""
    x = random_tensor((5, 33), dtype, scale=3.0)
    for log, reference in ((False, torch.softmax), (True, torch.log_softmax)):
        direct = softmax_ops._forward(x, 1, log, torch.float32)
        assert direct.dtype == torch.float32
        assert_close_to_reference(direct, reference(x.double(), 1), torch.float32,
                                  reduction_len=33)
    with gemslib.enable(record=True) as activation:
        y = F.softmax(x, dim=-1, dtype=torch.float32)
        if ON_GPU:
            z = torch.ops.aten._softmax(x, 1, True)
            w = torch.ops.aten._log_softmax(x, 1, True)
        else:
            for op in (torch.ops.aten._softmax, torch.ops.aten._log_softmax):
                with pytest.raises(RuntimeError, match="not supported on CPU"):
                    op(x, 1, True)
    assert y.dtype == torch.float32
    assert_close_to_reference(y, torch.softmax(x.double(), 1), torch.float32, reduction_len=33)
    if ON_GPU:
        assert z.dtype == torch.float32 and w.dtype == torch.float32
        assert activation.calls["aten::_softmax"] >= 1 and activation.calls["aten::_log_softmax"] == 1
        assert_close_to_reference(z, torch.softmax(x.double(), 1), torch.float32, reduction_len=33)
        assert_close_to_reference(w, torch.log_softmax(x.double(), 1), torch.float32,
                                  reduction_len=33)
    else:
        assert activation.fallbacks["aten::_softmax"] == 1
        assert activation.fallbacks["aten::_log_softmax"] == 1


def test_out_variants_and_fallbacks():
    x = random_tensor((4, 12), torch.float32)
    out = torch.full((4, 12), float("nan"), device=DEVICE)
    grad_input = torch.full((4, 12), float("nan"), device=DEVICE)
    with gemslib.enable(record=True) as activation:
        torch.ops.aten._softmax.out(x, 1, False, out=out)
        torch.ops.aten._softmax_backward_data.out(x, out, 1, torch.float32, grad_input=grad_input)
        torch.ops.aten._log_softmax(x.double(), 1, False)   # float64: torch's kernel
        with pytest.raises(RuntimeError):                    # torch's own error is kept
            torch.ops.aten._softmax(x, 1, True)
    assert activation.calls == {"aten::_softmax.out": 1, "aten::_softmax_backward_data.out": 1}
    assert activation.fallbacks == {"aten::_log_softmax": 1, "aten::_softmax": 1}
    expected = torch.softmax(x.double(), 1)
    assert_close_to_reference(out, expected, torch.float32, reduction_len=12)
    assert_close_to_reference(grad_input, softmax_ops.softmax_backward_reference(
        x.double(), expected, 1), torch.float32, reduction_len=12)


def test_custom_ops_pass_opcheck():
    x = random_tensor((3, 5, 40), torch.float32).requires_grad_()
    for dim in (1, 2):
        for log in (False, True):
            opcheck_overloads(torch.ops.gemslib.softmax, (x, dim, log))


def test_traces_under_torch_compile_fullgraph():
    def scores(x):
        return gemslib.softmax(x, -1) * 2.0 + gemslib.log_softmax(x, 0)

    compiled = torch.compile(scores, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    x = random_tensor((6, 32), torch.float32).requires_grad_()
    result = compiled(x)
    x64 = x.detach().double().requires_grad_()
    expected = torch.softmax(x64, -1) * 2.0 + torch.log_softmax(x64, 0)
    assert_close_to_reference(result, expected, torch.float32, reduction_len=32)
    result.sum().backward()
    expected.sum().backward()
    assert_close_to_reference(x.grad, x64.grad, torch.float32, reduction_len=32)


def test_half_to_float_backward_follows_the_backend():
    """_softmax_backward_data with an fp16 input dtype and fp32 gradients (the backward of a
    half_to_float forward): torch's CUDA kernel computes it, its CPU kernel refuses; gemslib's
    override does the same on each."""
    y = torch.softmax(random_tensor((4, 9), torch.float32), -1)
    grad = random_tensor((4, 9), torch.float32)
    with gemslib.enable(ops=["softmax"], record=True) as activation:
        if ON_GPU:
            result = torch.ops.aten._softmax_backward_data(grad, y, -1, torch.float16)
        else:
            with pytest.raises(RuntimeError):
                torch.ops.aten._softmax_backward_data(grad, y, -1, torch.float16)
    if ON_GPU:
        assert activation.calls == {"aten::_softmax_backward_data": 1}
        assert result.dtype == torch.float16
        assert_close_to_reference(result, softmax_ops.softmax_backward_reference(
            grad.double(), y.double(), -1), torch.float16, reduction_len=9)
    else:
        assert activation.fallbacks == {"aten::_softmax_backward_data": 1}
