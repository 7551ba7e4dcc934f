"""Accuracy of rms_norm and add_rms_norm, forward and backward, against float64 references."""

import pytest
import torch

import gemslib
from conftest import DEVICE, DTYPES, ON_GPU, random_tensor
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import rms_norm as rms_ops

# one-block rows of several widths, rows looped over column blocks (> 8192), 3-d, size-1, empty
SHAPES = [(1, 1), (3, 7), (17, 128), (5, 100), (33, 513), (2, 3, 600), (1, 3000), (2, 9000),
          (0, 5), (4, 0)]
if ON_GPU:
    SHAPES += [(4096, 4096), (1000, 5120), (7, 65536), (2, 3, 14336)]


def _reference(x, weight, eps=1e-6):
    return rms_ops.rms_norm_reference(x.double(), weight.double() if weight is not None else None, eps)


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype, with_weight):
    x = random_tensor(shape, dtype)
    weight = random_tensor(shape[-1:], dtype, scale=1.0) if with_weight else None
    result = gemslib.rms_norm(x, weight)
    assert result.shape == x.shape and result.dtype == dtype
    assert_close_to_reference(result, _reference(x, weight), dtype, reduction_len=shape[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (33, 513), (2, 9000), (0, 4)])
def test_add_rms_norm_matches_reference(shape, dtype):
    x, residual = random_tensor(shape, dtype), random_tensor(shape, dtype)
    weight = random_tensor(shape[-1:], dtype, scale=1.0)
    normed, total = gemslib.add_rms_norm(x, residual, weight)
    expected_normed, expected_total = rms_ops.add_rms_norm_reference(
        x.double(), residual.double(), weight.double())
    assert_close_to_reference(total, expected_total, dtype)
    # the kernel normalises the rounded sum, as the reference computed in x's dtype would
    assert_close_to_reference(normed, _reference(total, weight), dtype, reduction_len=shape[-1])
    assert_close_to_reference(normed, expected_normed, dtype, reduction_len=shape[-1] * 64)


@pytest.mark.parametrize("shape", [(5, 100), (2, 9000)])
def test_add_rms_norm_in_place_writes_into_x_and_residual(shape):
    x, residual = random_tensor(shape, torch.float32), random_tensor(shape, torch.float32)
    weight = random_tensor(shape[-1:], torch.float32, scale=1.0)
    expected_normed, expected_total = gemslib.add_rms_norm(x, residual, weight)
    normed, total = gemslib.add_rms_norm(x, residual, weight, inplace=True)
    assert normed is x and total is residual
    torch.testing.assert_close(x, expected_normed, rtol=0, atol=0)
    torch.testing.assert_close(residual, expected_total, rtol=0, atol=0)


def test_strided_rows_and_views():
    wide = random_tensor((6, 300), torch.float32)
    weight = random_tensor((100,), torch.float32, scale=1.0)
    views = {
        "row stride 300": wide[:, 50:150],
        "leading dims that do not merge": wide.view(2, 3, 300)[..., :100].transpose(0, 1),
        "last stride 3": wide[:, ::3],
    }
    for name, x in views.items():
        assert_close_to_reference(gemslib.rms_norm(x, weight), _reference(x, weight),
                                  torch.float32, reduction_len=100, msg=name)
        residual = random_tensor(x.shape, torch.float32)
        normed, total = gemslib.add_rms_norm(x, residual, weight)
        assert_close_to_reference(total, x.double() + residual.double(), torch.float32, msg=name)


def test_in_place_on_views_that_the_kernel_cannot_write():
    x = random_tensor((4, 30), torch.float32)[:, ::3]
    residual = random_tensor((4, 10), torch.float32)
    expected_normed, expected_total = rms_ops.add_rms_norm_reference(x.double(), residual.double())
    normed, total = gemslib.add_rms_norm(x, residual, inplace=True)
    assert normed is x and total is residual
    assert_close_to_reference(residual, expected_total, torch.float32)
    assert_close_to_reference(x, expected_normed, torch.float32, reduction_len=10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_stay_in_their_row(dtype):
    x = random_tensor((4, 50), dtype)
    x[1, 7], x[2, 3] = float("nan"), float("inf")
    result = gemslib.rms_norm(x)
    assert torch.isnan(result[1]).all()
    assert torch.isnan(result[2]).any()  # inf / inf
    assert_close_to_reference(result[[0, 3]], _reference(x[[0, 3]], None), dtype, reduction_len=50)


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (37, 130), (2, 3, 600), (3, 9000)]
                         + ([(4096, 4096), (5, 65536)] if ON_GPU else []))
def test_rms_norm_gradients(shape, dtype, with_weight):
    x = random_tensor(shape, dtype).requires_grad_()
    weight = random_tensor(shape[-1:], dtype, scale=1.0).requires_grad_() if with_weight else None
    grad = random_tensor(shape, dtype)
    gemslib.rms_norm(x, weight).backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_() if with_weight else None
    rms_ops.rms_norm_reference(x64, w64).backward(grad.double())
    rows = x.numel() // shape[-1]
    assert_close_to_reference(x.grad, x64.grad, dtype, reduction_len=shape[-1], msg="dx")
    if with_weight:
        assert_close_to_reference(weight.grad, w64.grad, dtype, reduction_len=rows * 16, msg="dweight")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_gradients(dtype):
    shape = (11, 70)
    x, residual = random_tensor(shape, dtype).requires_grad_(), random_tensor(shape, dtype).requires_grad_()
    weight = random_tensor(shape[-1:], dtype, scale=1.0).requires_grad_()
    grad_normed, grad_total = random_tensor(shape, dtype), random_tensor(shape, dtype)
    normed, total = gemslib.add_rms_norm(x, residual, weight)
    torch.autograd.backward([normed, total], [grad_normed, grad_total])
    # reference from the sum the forward stored (rounded to the dtype, as the kernel normalises
    # it); the gradient of x + residual then reaches x and residual unchanged
    ref_total = total.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref_normed = rms_ops.rms_norm_reference(ref_total, w64)
    torch.autograd.backward([ref_normed, ref_total], [grad_normed.double(), grad_total.double()])
    for name, ours, theirs in (("x", x, ref_total), ("residual", residual, ref_total),
                               ("weight", weight, w64)):
        assert_close_to_reference(ours.grad, theirs.grad, dtype, reduction_len=shape[0] * 16, msg=name)


def test_bad_input_names_the_argument():
    x = random_tensor((3, 8), torch.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\).*got \(7,\)"):
        gemslib.rms_norm(x, torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"residual must have x's shape \(3, 8\), got \(3, 7\)"):
        gemslib.add_rms_norm(x, random_tensor((3, 7), torch.float32))
    with pytest.raises(ValueError, match="residual must be torch.float32"):
        gemslib.add_rms_norm(x, x.half())
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        gemslib.rms_norm(torch.ones(3, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="at least one dim"):
        gemslib.rms_norm(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor or None"):
        gemslib.rms_norm(x, [1.0] * 8)
    with pytest.raises(RuntimeError, match="inplace=True cannot be used"):
        gemslib.add_rms_norm(x.clone().requires_grad_(), x.clone(), inplace=True)


def test_float64_and_mixed_dtypes_fall_back_to_torch():
    x64 = torch.randn(5, 9, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(gemslib.rms_norm(x64), rms_ops.rms_norm_reference(x64))
    x = random_tensor((5, 9), torch.bfloat16)
    weight32 = random_tensor((9,), torch.float32, scale=1.0)
    result = gemslib.rms_norm(x, weight32)
    assert result.dtype == torch.bfloat16
    assert_close_to_reference(result, _reference(x, weight32), torch.bfloat16, reduction_len=9)


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_custom_ops_pass_opcheck(with_weight):
    x = random_tensor((4, 3, 40), torch.float32).requires_grad_()
    weight = random_tensor((40,), torch.float32).requires_grad_() if with_weight else None
    torch.library.opcheck(torch.ops.gemslib.rms_norm_forward, (x, weight, 1e-5))
    residual = random_tensor((4, 3, 40), torch.float32).requires_grad_()
    torch.library.opcheck(torch.ops.gemslib.add_rms_norm, (x, residual, weight, 1e-6))
    out, rstd = torch.ops.gemslib.rms_norm_forward(x.detach(), weight.detach() if with_weight else None, 1e-5)
    grad = random_tensor((4, 3, 40), torch.float32)
    torch.library.opcheck(torch.ops.gemslib.rms_norm_backward,
                          (grad, x.detach(), weight.detach() if with_weight else None, rstd))


def test_traces_under_torch_compile_fullgraph():
    def block(x, residual, weight):
        normed, total = gemslib.add_rms_norm(x, residual, weight)
        return gemslib.rms_norm(normed * 2.0, weight) + total

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    inputs = [random_tensor((6, 32), torch.float32).requires_grad_() for _ in range(2)]
    weight = random_tensor((32,), torch.float32).requires_grad_()
    result = compiled(*inputs, weight)
    leaves = [t.detach().double().requires_grad_() for t in (*inputs, weight)]
    normed, total = rms_ops.add_rms_norm_reference(*leaves)
    expected = rms_ops.rms_norm_reference(normed * 2.0, leaves[2]) + total
    assert_close_to_reference(result, expected, torch.float32, reduction_len=32)
    result.sum().backward()
    expected.sum().backward()
    for ours, theirs in zip((*inputs, weight), leaves):
        assert_close_to_reference(ours.grad, theirs.grad, torch.float32, reduction_len=64)


# ---------------------------------------------------------------------------------------------
# aten overrides: F.rms_norm -> _fused_rms_norm, autograd -> _fused_rms_norm_backward
# ---------------------------------------------------------------------------------------------

FUSED = ("aten::_fused_rms_norm", "aten::_fused_rms_norm_backward")


@pytest.mark.parametrize("dtype", DTYPES)
def test_f_rms_norm_runs_gemslib_forward_and_backward(dtype):
    before = {op: torch._C._dispatch_dump_table(op) for op in FUSED}
    x = random_tensor((5, 3, 40), dtype).requires_grad_()
    weight = random_tensor((40,), dtype, scale=1.0).requires_grad_()
    grad = random_tensor((5, 3, 40), dtype)
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        result = torch.nn.functional.rms_norm(x, (40,), weight, 1e-6)
        result.backward(grad)
    assert activation.calls == {"aten::_fused_rms_norm": 1, "aten::_fused_rms_norm_backward": 1}
    assert {op: torch._C._dispatch_dump_table(op) for op in FUSED} == before
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    expected = rms_ops.rms_norm_reference(x64, w64)
    expected.backward(grad.double())
    assert_close_to_reference(result, expected, dtype, reduction_len=40)
    assert_close_to_reference(x.grad, x64.grad, dtype, reduction_len=40, msg="dx")
    assert_close_to_reference(weight.grad, w64.grad, dtype, reduction_len=15 * 16, msg="dweight")


def test_f_rms_norm_output_masks_and_default_eps():
    x = random_tensor((4, 24), torch.float32)
    weight = random_tensor((24,), torch.float32, scale=1.0)
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        x_only = x.clone().requires_grad_()
        torch.nn.functional.rms_norm(x_only, (24,), weight).sum().backward()   # eps=None
        weight_only = weight.clone().requires_grad_()
        torch.nn.functional.rms_norm(x, (24,), weight_only).sum().backward()
    assert activation.calls == {"aten::_fused_rms_norm": 2, "aten::_fused_rms_norm_backward": 2}
    eps = torch.finfo(torch.float32).eps
    for ours, leaf in ((x_only, "x"), (weight_only, "weight")):
        x64 = x.double().requires_grad_(leaf == "x")
        w64 = weight.double().requires_grad_(leaf == "weight")
        rms_ops.rms_norm_reference(x64, w64, eps).sum().backward()
        assert_close_to_reference(ours.grad, (x64 if leaf == "x" else w64).grad, torch.float32,
                                  reduction_len=24, msg=leaf)


def test_f_rms_norm_unsupported_calls_match_torch():
    x = torch.randn(4, 2, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(2, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    expected = torch.nn.functional.rms_norm(x, (2, 6), weight, 1e-5)
    expected_grads = torch.autograd.grad(expected.sum(), (x, weight))
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        result = torch.nn.functional.rms_norm(x, (2, 6), weight, 1e-5)  # float64, 2-d shape
        grads = torch.autograd.grad(result.sum(), (x, weight))
    assert not activation.calls
    assert activation.fallbacks["aten::_fused_rms_norm"] == 1
    torch.testing.assert_close(result, expected)
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs)
