"""rms_norm_linear_silu against float64 references: values, gradients, layouts, errors."""

import pytest
import torch

import gemslib
from helpers import ON_GPU, random_tensor, opcheck_overloads
from gemslib import runtime
from gemslib.runtime import cuda, env
from gemslib.fused import rms_norm_linear_silu as fused_ops

# interpreter: fp16/fp32 (bf16 tl.dot is wrong there); GPU: bf16 too
DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]
_UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}

# (x shape, N): one row (decode), odd sizes, several row tiles of both buckets, 3-d and 1-d x
CASES = [((1, 64), 48), ((5, 48), 24), ((40, 100), 70), ((130, 64), 130), ((2, 3, 40), 33),
         ((64,), 20)]
if ON_GPU:
    CASES += [((16, 4096), 14336), ((4096, 4096), 11008), ((300, 1000), 777), ((1, 4096), 4096)]


def _inputs(x_shape, n_out, dtype, with_bias=True):
    n_in = x_shape[-1]
    x = random_tensor(x_shape, dtype, scale=1.0)
    norm_weight = random_tensor((n_in,), dtype, scale=1.0)
    weight = random_tensor((n_out, n_in), dtype, scale=max(n_in, 1) ** -0.5)
    bias = random_tensor((n_out,), dtype, scale=1.0) if with_bias else None
    return x, norm_weight, weight, bias


def _assert_close(actual, x, norm_weight, weight, bias, eps=1e-6):
    """Within the rounding the fused form makes: x * g rounded to the input dtype (one unit
    roundoff u per product), fp32 accumulation over K, the output rounded once; bounded by
    the sums of absolute values, the standard error bound of a dot product (silu' <= 1.1)."""
    x64, g64, w64 = x.double(), norm_weight.double(), weight.double()
    b64 = bias.double() if bias is not None else None
    expected = fused_ops.rms_norm_linear_silu_reference(x64, g64, w64, b64, eps)
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g64
    bound = normed.abs() @ w64.abs().t() + (b64.abs() if b64 is not None else 0)
    u = _UNIT_ROUNDOFF[x.dtype]
    tolerance = 1.1 * (2 * u + x.shape[-1] * 2.0 ** -24) * bound + u * expected.abs() + 1e-30
    error = (actual.double() - expected).abs()
    assert actual.shape == expected.shape and actual.dtype == x.dtype
    assert bool((error <= tolerance).all()), \
        f"max error {error.max().item():.3g}, worst error / tolerance {(error / tolerance).max().item():.3g}"


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("x_shape,n_out", CASES)
def test_matches_reference(x_shape, n_out, dtype, with_bias):
    inputs = _inputs(x_shape, n_out, dtype, with_bias)
    _assert_close(gemslib.rms_norm_linear_silu(*inputs), *inputs)


@pytest.mark.parametrize("rows", [3, 100], ids=["decode-bucket", "matmul-bucket"])
def test_strided_inputs(rows):
    """x as a transposed view, the weight with a non-unit last stride (copied), a strided
    norm weight."""
    x = random_tensor((48, rows), torch.float32).t()
    norm_weight = random_tensor((96,), torch.float32)[::2]
    weight = random_tensor((40, 96), torch.float32, scale=0.2)[:, ::2]
    bias = random_tensor((40,), torch.float32)
    _assert_close(gemslib.rms_norm_linear_silu(x, norm_weight, weight, bias, eps=1e-5),
                  x, norm_weight, weight, bias, eps=1e-5)


def test_group_order_covers_every_tile():
    """Small tiles and groups of 3 row tiles over 7 row tiles and 5 column tiles: a partial
    last group, and each output tile written exactly once (NaN-filled output otherwise)."""
    inputs = _inputs((100, 32), 70, torch.float32)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 3), ("USE_TMA", 0), ("SPLIT_K", 1),
                                   ("VENDOR_GEMM", 0)), 4, 1)
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config):
        _assert_close(gemslib.rms_norm_linear_silu(*inputs), *inputs)


@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptor"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_both_weight_load_paths_match_reference(use_tma, dtype):
    """The weight through pointers or a tensor descriptor (TMA): ragged last row, column and
    K tiles (70 x 40 weight in 16 x 16 blocks)."""
    inputs = _inputs((37, 40), 70, dtype)
    assert fused_ops._tma_ready(inputs[2])  # so the descriptor case really uses one
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 2), ("USE_TMA", use_tma), ("SPLIT_K", 1),
                                   ("VENDOR_GEMM", 0)), 4, 1)
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config):
        _assert_close(gemslib.rms_norm_linear_silu(*inputs), *inputs)


@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptor"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("x_shape,n_out,split_k", [((1, 70), 45, 3), ((19, 70), 45, 3),
                                                   ((2, 3, 40), 33, 8)],
                         ids=["one-row", "two-row-tiles", "fewer-splits-than-asked"])
def test_split_k_matches_reference_and_leaves_its_counters_at_zero(x_shape, n_out, split_k,
                                                                   dtype, use_tma):
    """The decode form: K split into ranges of whole 16-wide steps (70 -> 32 + 32 + 6; 40 asked
    in 8 splits -> 16 + 16 + 8), partial tiles merged by the last program to arrive. Two calls
    give the same bits (the merge adds the splits in order, whatever the arrival order) and
    leave every arrival counter at 0 for the next launch."""
    inputs = _inputs(x_shape, n_out, dtype)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 1), ("USE_TMA", use_tma), ("SPLIT_K", split_k),
                                   ("VENDOR_GEMM", 0)),
                                  4, 1)
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config):
        first = gemslib.rms_norm_linear_silu(*inputs)
        second = gemslib.rms_norm_linear_silu(*inputs[:3])  # no bias: the same scratch
        third = gemslib.rms_norm_linear_silu(*inputs)
    _assert_close(first, *inputs)
    _assert_close(second, *inputs[:3], None)
    assert torch.equal(first, third)
    for counters, _ in cuda._split_scratch_cache.values():
        assert not counters.any()


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_a_vendor_gemm_config_runs_norm_matmul_and_silu(dtype, with_bias, monkeypatch):
    """VENDOR_GEMM 1: gemslib's rms_norm, torch's matmul (with the bias), gemslib's silu into
    the output; the fused kernel not launched. Within the fused form's bound."""
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 16),
                                   ("GROUP_M", 1), ("USE_TMA", 0), ("SPLIT_K", 1),
                                   ("VENDOR_GEMM", 1)), 4, 1)
    inputs = _inputs((3, 7, 40), 37, dtype, with_bias)
    matmuls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *args: matmuls.append(args[2] is not None) or linear(*args))
    monkeypatch.setattr(fused_ops.RMS_NORM_LINEAR_SILU, "launch",
                        lambda *args, **kwargs: pytest.fail("the fused kernel was launched"))
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config) as shapes:
        out = gemslib.rms_norm_linear_silu(*inputs)
    assert shapes == [(21, 37, 40, inputs[0].element_size())] and matmuls == [with_bias]
    _assert_close(out, *inputs)


def test_a_signature_decided_for_three_kernels_goes_straight_to_them(monkeypatch):
    """Where call plans apply (off the interpreter), the first call of a signature whose
    config says VENDOR_GEMM is checked and decided, and the next calls of that signature go
    to the three kernels with their own tensors, unchecked; another signature (no bias) is
    decided on its own."""
    monkeypatch.setattr(runtime, "INTERPRETER", False)
    monkeypatch.setattr(env, "INTERPRETER", False)  # what the call plans read
    monkeypatch.setattr(runtime, "dot_kernel_runs", lambda x: True)
    monkeypatch.setattr(fused_ops, "_takes_three_kernels", lambda x, w: True)
    checked, routed = [], []
    check = fused_ops._check
    monkeypatch.setattr(fused_ops, "_check", lambda *args: checked.append(1) or check(*args))
    monkeypatch.setattr(fused_ops, "_three_kernels", lambda *args: routed.append(args) or args[0])
    try:
        inputs = [_inputs((3, 40), 8, torch.float16, True) for _ in range(3)]
        outs = [gemslib.rms_norm_linear_silu(*args) for args in inputs]
        assert len(checked) == 1 and [out is args[0] for out, args in zip(outs, inputs)] == [True] * 3
        assert [len(args) for args in routed] == [5, 6, 6]
        assert [args[2] is inputs[i][2] for i, args in enumerate(routed)] == [True] * 3
        x, norm_weight, weight, _ = inputs[0]
        gemslib.rms_norm_linear_silu(x, norm_weight, weight)
        assert len(checked) == 2 and routed[-1][3] is None
    finally:
        fused_ops._CALLS.clear()


@pytest.mark.parametrize("rows", [1, 5, 40, 130])
def test_repeated_calls_of_one_signature_stay_right(rows):
    """Fresh inputs of one signature again and again (on a GPU the later calls replay: the
    split-K kernel's launch plan at decode rows, the three kernels' route at prefill rows;
    a TMA launch runs its own path) give each input's own result."""
    for _ in range(4):
        inputs = _inputs((rows, 256), 40, torch.float16)
        _assert_close(gemslib.rms_norm_linear_silu(*inputs), *inputs)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_the_three_kernel_form_computes_rms_norm_linear_silu(dtype, with_bias):
    inputs = _inputs((2, 9, 40), 37, dtype, with_bias)
    out = fused_ops._three_kernels(*inputs, 1e-6, True)
    assert out.shape == (2, 9, 37) and out.is_contiguous()
    _assert_close(out, *inputs)


def test_weight_descriptor_only_where_the_layout_allows():
    weight = random_tensor((8, 24), torch.float16)
    assert fused_ops._tma_ready(weight)
    assert not fused_ops._tma_ready(random_tensor((8, 12), torch.float16)[:, :4])  # 8 B wide
    assert not fused_ops._tma_ready(random_tensor((8, 13), torch.float16))  # 26 B rows
    assert not fused_ops._tma_ready(weight[:, 1:])  # base off 16 bytes


# on sm_90 (the H200) 16-bit inputs with >= 128 rows take the pre-pass + Gluon matmul path
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
# (x shape, N, x as a view of wider rows)
HOPPER_CASES = [((300, 256), 520, False), ((2, 150, 200), 300, False), ((4000, 1024), 2000, True),
                ((128, 64), 256, False)] if HOPPER else [((130, 64), 40, True)]


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("x_shape,n_out,view", HOPPER_CASES)
def test_hopper_path_takes_16_bit_row_blocks_and_matches_reference(x_shape, n_out, view, dtype,
                                                                   with_bias, monkeypatch):
    """On sm_90 each such call runs the two-launch path (counted; the products made small
    enough to test by asking for no waves of tiles): ragged row and column tiles, 3-d x, x
    rows with a stride; elsewhere the call's config gives the same answers."""
    monkeypatch.setattr(fused_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    x, norm_weight, weight, bias = _inputs(x_shape, n_out, dtype, with_bias)
    if view:  # rows of a wider tensor: the pre-pass reads them in place
        x = random_tensor((*x_shape[:-1], x_shape[-1] + 24), dtype, scale=1.0)[..., :x_shape[-1]]
    calls = []
    hopper_forward = fused_ops._rms_norm_linear_silu_hopper.forward
    monkeypatch.setattr(fused_ops._rms_norm_linear_silu_hopper, "forward",
                        lambda *args: calls.append(args) or hopper_forward(*args))
    out = gemslib.rms_norm_linear_silu(x, norm_weight, weight, bias)
    assert len(calls) == int(HOPPER)
    _assert_close(out, x, norm_weight, weight, bias)


def test_hopper_path_is_not_offered_what_it_cannot_take(monkeypatch):
    """Too few tiles to fill the GPU, too few rows, fp32, a weight TMA cannot address (rows of
    100 halves), CPU tensors."""
    hopper = fused_ops._rms_norm_linear_silu_hopper
    weight = random_tensor((64, 256), torch.bfloat16)
    rows = random_tensor((256, 256), torch.bfloat16)
    assert not hopper.eligible(rows, weight)  # 2 tiles
    monkeypatch.setattr(hopper, "MIN_WAVES", 0)
    assert hopper.eligible(rows, weight) == HOPPER
    assert not hopper.eligible(rows[:hopper.MIN_ROWS - 1], weight)
    assert not hopper.eligible(rows.float(), weight.float())
    assert not hopper.eligible(rows[:, :100], weight[:, :100].contiguous())
    assert not hopper.eligible(rows.cpu(), weight.cpu())


def test_empty_and_zero_width_inputs():
    x, norm_weight, weight, bias = _inputs((0, 16), 8, torch.float32)
    assert gemslib.rms_norm_linear_silu(x, norm_weight, weight, bias).shape == (0, 8)
    x, norm_weight, weight, bias = _inputs((3, 0), 5, torch.float32)
    torch.testing.assert_close(gemslib.rms_norm_linear_silu(x, norm_weight, weight, bias),
                               torch.nn.functional.silu(bias).expand(3, 5))


def test_float64_is_computed_by_torch():
    inputs = _inputs((4, 24), 10, torch.float64)
    expected = fused_ops.rms_norm_linear_silu_reference(*inputs)
    torch.testing.assert_close(gemslib.rms_norm_linear_silu(*inputs), expected)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_gradients_match_autograd_of_the_reference(with_bias):
    x, norm_weight, weight, bias = _inputs((2, 5, 24), 18, torch.float32, with_bias)
    leaves = [t.detach().requires_grad_() for t in (x, norm_weight, weight, bias) if t is not None]
    ours = gemslib.rms_norm_linear_silu(*leaves, None) if not with_bias else \
        gemslib.rms_norm_linear_silu(*leaves)
    grad = random_tensor(ours.shape, torch.float32)
    ours_grads = torch.autograd.grad(ours, leaves, grad)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    expected = fused_ops.rms_norm_linear_silu_reference(*leaves64, *([] if with_bias else [None]))
    expected_grads = torch.autograd.grad(expected, leaves64, grad.double())
    for name, a, b in zip(("x", "norm_weight", "weight", "bias"), ours_grads, expected_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_backward_is_exact_in_float64():
    """float64 runs torch's forward and this file's hand-written backward: gradcheck and
    gradgradcheck compare it with finite differences."""
    inputs = [t.requires_grad_() for t in _inputs((3, 6), 4, torch.float64)]
    assert torch.autograd.gradcheck(gemslib.rms_norm_linear_silu, inputs)
    assert torch.autograd.gradgradcheck(gemslib.rms_norm_linear_silu, inputs)


def test_custom_op_passes_opcheck():
    for with_bias in (True, False):
        x, norm_weight, weight, bias = _inputs((3, 16), 8, torch.float32, with_bias)
        opcheck_overloads(torch.ops.gemslib.rms_norm_linear_silu,
                          (x, norm_weight, weight, bias, 1e-6))


def test_traces_under_torch_compile_fullgraph():
    x, norm_weight, weight, bias = _inputs((4, 32), 16, torch.float32)

    def block(x, norm_weight, weight, bias):
        return gemslib.rms_norm_linear_silu(x, norm_weight, weight, bias) * 2

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    leaves = [t.detach().requires_grad_() for t in (x, norm_weight, weight, bias)]
    out = compiled(*leaves)
    torch.testing.assert_close(out, block(x, norm_weight, weight, bias))
    compiled_grads = torch.autograd.grad(out.sum(), leaves)
    eager_leaves = [t.detach().requires_grad_() for t in leaves]
    eager_grads = torch.autograd.grad(block(*eager_leaves).sum(), eager_leaves)
    for ours, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(ours, eager)


@pytest.mark.parametrize("args,error,match", [
    (lambda x, g, w, b: (x, g, w[:, :-1], b), ValueError, r"weight must be \(N, K\) with K = "),
    (lambda x, g, w, b: (x, g[:-1], w, b), ValueError, "norm_weight must be"),
    (lambda x, g, w, b: (x, g, w, b[:-1]), ValueError, "bias must be"),
    (lambda x, g, w, b: (x, g, w.double(), b), ValueError, "weight must be torch.float32"),
    (lambda x, g, w, b: (x, g, w, "b"), TypeError, "bias must be a torch.Tensor"),
    (lambda x, g, w, b: (x.to(torch.int32), g, w, b), TypeError, "x must be floating-point"),
    (lambda x, g, w, b: (x[0, 0], g, w, b), ValueError, "x must be"),
])
def test_bad_inputs_name_the_argument(args, error, match):
    inputs = _inputs((3, 8), 4, torch.float32)
    with pytest.raises(error, match=match):
        gemslib.rms_norm_linear_silu(*args(*inputs))


def test_bf16_is_right_everywhere():
    """bf16 runs the kernel on a GPU; under the interpreter (whose bf16 tl.dot is wrong) torch
    computes it, never a silently wrong kernel result."""
    inputs = _inputs((5, 48), 24, torch.bfloat16)
    _assert_close(gemslib.rms_norm_linear_silu(*inputs), *inputs)


@pytest.mark.parametrize("eps", ["1e-6", None, torch.ones(2)])
def test_eps_must_be_a_float_as_torch_requires(eps):
    with pytest.raises(TypeError, match="argument 'eps' must be float"):
        gemslib.rms_norm_linear_silu(*_inputs((3, 8), 4, torch.float32), eps=eps)


def test_eps_as_an_int_or_0d_tensor_is_accepted():
    inputs = _inputs((3, 8), 4, torch.float32)
    for eps in (1, torch.tensor(1.0)):
        _assert_close(gemslib.rms_norm_linear_silu(*inputs, eps=eps), *inputs, eps=1.0)
