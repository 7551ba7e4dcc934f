"""Accuracy of rms_norm and add_rms_norm, forward and backward, against float64 references;
a repeated backward's call plan."""


import ctypes
import types

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import gemslib
from helpers import DEVICE, DTYPES, ON_GPU, random_tensor, opcheck_overloads
from gemslib import registry, runtime
from gemslib.runtime import plans, state
from gemslib.runtime.launch import launch_key
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partials, cols", [(1, 5), (4, 130), (33, 129), (70, 300)])
def test_dweight_sum_matches_reference(partials, cols, dtype):
    """The backward's second kernel alone: fp32 partial rows summed over rows, rounded once to
    the weight's dtype; columns past a block's end and partial rows past a step's."""
    partial = random_tensor((partials, cols), torch.float32)
    dweight = rms_ops._launch_dweight(partial, dtype)
    assert dweight.shape == (cols,) and dweight.dtype == dtype
    assert_close_to_reference(dweight, partial.double().sum(dim=0), dtype, reduction_len=partials)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(300, 130), (150, 9000)], ids=str)
def test_rms_norm_gradients_over_many_programs(shape, dtype, monkeypatch):
    """A GPU's many backward programs (here 20 SMs' worth, 80): more partial dweight rows than
    the sum takes in a step, with one-block rows and rows looped over column blocks."""
    monkeypatch.setattr(runtime, "multiprocessor_count", lambda device_index: 20)
    _, n_programs = rms_ops._backward_programs(shape[0], torch.device(DEVICE))
    _, bucket = rms_ops.RMS_NORM_DWEIGHT.select((n_programs, shape[-1]))
    assert n_programs > 2 * bucket.configs[0].meta_dict["BLOCK_P"]  # a last step not full
    x = random_tensor(shape, dtype).requires_grad_()
    weight = random_tensor(shape[-1:], dtype, scale=1.0).requires_grad_()
    grad = random_tensor(shape, dtype)
    gemslib.rms_norm(x, weight).backward(grad)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    rms_ops.rms_norm_reference(x64, w64).backward(grad.double())
    assert_close_to_reference(x.grad, x64.grad, dtype, reduction_len=shape[-1], msg="dx")
    assert_close_to_reference(weight.grad, w64.grad, dtype, reduction_len=shape[0] * 16,
                              msg="dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (33, 513), (2, 9000)]
                         + ([(1000, 3072)] if ON_GPU else []), ids=str)
def test_a_weight_offset_scales_by_offset_plus_weight(shape, dtype):
    """Gemma's ``x_hat * (1 + weight)``: forward of both norms, in one pass and in the column
    loop, against the float64 reference; zero weights (Gemma's initial ones) give x_hat."""
    x, residual = random_tensor(shape, dtype), random_tensor(shape, dtype)
    weight = random_tensor(shape[-1:], dtype, scale=0.5)
    result = gemslib.rms_norm(x, weight, 1e-6, weight_offset=1.0)
    expected = rms_ops.rms_norm_reference(x.double(), weight.double(), 1e-6, weight_offset=1.0)
    assert_close_to_reference(result, expected, dtype, reduction_len=shape[-1])
    normed, total = gemslib.add_rms_norm(x, residual, weight, 1e-6, weight_offset=1.0)
    ref_normed, ref_total = rms_ops.add_rms_norm_reference(
        x.double(), residual.double(), weight.double(), 1e-6, weight_offset=1.0)
    assert_close_to_reference(total, ref_total, dtype)
    assert_close_to_reference(normed, rms_ops.rms_norm_reference(
        total.double(), weight.double(), 1e-6, weight_offset=1.0), dtype, reduction_len=shape[-1])
    zeros = torch.zeros_like(weight)
    # x_hat within rounding (not bit for bit: the weight-less call compiles another kernel)
    assert_close_to_reference(gemslib.rms_norm(x, zeros, 1e-6, weight_offset=1.0),
                              rms_ops.rms_norm_reference(x.double(), None, 1e-6), dtype,
                              reduction_len=shape[-1])
    in_x, in_residual = x.clone(), residual.clone()
    gemslib.add_rms_norm(in_x, in_residual, weight, 1e-6, inplace=True, weight_offset=1.0)
    assert torch.equal(in_x, normed) and torch.equal(in_residual, total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_offset_gradients(dtype):
    """dx sees the scale (offset + weight); dweight is that of the weight itself."""
    for shape in ((7, 70), (3, 9000)):
        x = random_tensor(shape, dtype).requires_grad_()
        residual = random_tensor(shape, dtype).requires_grad_()
        weight = random_tensor(shape[-1:], dtype, scale=0.5).requires_grad_()
        grad = random_tensor(shape, dtype)
        gemslib.rms_norm(x, weight, 1e-6, weight_offset=1.0).backward(grad)
        x64 = x.detach().double().requires_grad_()
        w64 = weight.detach().double().requires_grad_()
        rms_ops.rms_norm_reference(x64, w64, 1e-6, weight_offset=1.0).backward(grad.double())
        assert_close_to_reference(x.grad, x64.grad, dtype, reduction_len=shape[-1], msg="dx")
        assert_close_to_reference(weight.grad, w64.grad, dtype, reduction_len=shape[0] * 16,
                                  msg="dweight")
        weight.grad = None
        normed, total = gemslib.add_rms_norm(x.detach(), residual, weight, 1e-6,
                                             weight_offset=1.0)
        normed.backward(grad)
        total64 = total.detach().double().requires_grad_()
        w64 = weight.detach().double().requires_grad_()
        rms_ops.rms_norm_reference(total64, w64, 1e-6, weight_offset=1.0).backward(grad.double())
        assert_close_to_reference(residual.grad, total64.grad, dtype,
                                  reduction_len=shape[-1], msg="d residual")
        assert_close_to_reference(weight.grad, w64.grad, dtype, reduction_len=shape[0] * 16,
                                  msg="add_rms_norm dweight")


def test_a_weight_offset_needs_a_weight_and_a_number():
    x = random_tensor((3, 8), torch.float32)
    with pytest.raises(ValueError, match=r"gemslib.rms_norm: weight_offset .* needs a weight"):
        gemslib.rms_norm(x, None, 1e-6, weight_offset=1.0)
    with pytest.raises(ValueError, match=r"gemslib.add_rms_norm: weight_offset .* needs a wei"):
        gemslib.add_rms_norm(x, x.clone(), None, weight_offset=1.0)
    with pytest.raises(TypeError, match=r"weight_offset"):
        gemslib.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, weight_offset="1")
    assert torch.equal(gemslib.rms_norm(x, None, 1e-6, weight_offset=0.0), gemslib.rms_norm(x))


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


@pytest.mark.parametrize("eps", ["1e-6", None, [1e-6], torch.tensor([1e-6])],
                         ids=["str", "None", "list", "1-element 1-d tensor"])
def test_eps_must_be_a_float(eps):
    x = random_tensor((3, 8), torch.float32)
    name = "NoneType" if eps is None else type(eps).__name__
    for requires_grad in (False, True):  # the launcher directly, and through the custom op
        leaf = x.clone().requires_grad_(requires_grad)
        with pytest.raises(TypeError, match=rf"^gemslib.rms_norm\(\): argument 'eps' must be "
                                            rf"float, not {name}$"):
            gemslib.rms_norm(leaf, eps=eps)
        with pytest.raises(TypeError, match=rf"^gemslib.add_rms_norm\(\): argument 'eps' must "
                                            rf"be float, not {name}$"):
            gemslib.add_rms_norm(leaf, x, eps=eps)
    with pytest.raises(TypeError, match="argument 'eps' must be float, not str"):
        gemslib.add_rms_norm(x.clone(), x.clone(), eps="1e-6", inplace=True)


@pytest.mark.parametrize("inplace", [1, 0, "yes", None, torch.tensor(True)],
                         ids=["1", "0", "str", "None", "tensor"])
def test_inplace_must_be_a_bool(inplace):
    x, residual = random_tensor((3, 8), torch.float32), random_tensor((3, 8), torch.float32)
    x_before, residual_before = x.clone(), residual.clone()
    name = "NoneType" if inplace is None else type(inplace).__name__
    with pytest.raises(TypeError, match=rf"^gemslib.add_rms_norm\(\): argument 'inplace' must "
                                        rf"be bool, not {name}$"):
        gemslib.add_rms_norm(x, residual, inplace=inplace)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_eps_takes_what_torch_takes_for_a_float():
    """Like torch's float arguments: ints, bools, 0-d tensors; any value (torch checks none)."""
    x = random_tensor((3, 8), torch.float32)
    weight = random_tensor((8,), torch.float32, scale=1.0)
    for eps, as_float in ((torch.tensor(0.25), 0.25), (1, 1.0),
                          (torch.tensor(2, dtype=torch.int64), 2.0), (-1e-9, -1e-9)):
        for requires_grad in (False, True):
            leaf = x.clone().requires_grad_(requires_grad)
            torch.testing.assert_close(gemslib.rms_norm(leaf, weight, eps=eps),
                                       gemslib.rms_norm(x, weight, eps=as_float), rtol=0, atol=0)
            for ours, theirs in zip(gemslib.add_rms_norm(leaf, x, weight, eps=eps),
                                    gemslib.add_rms_norm(x, x.clone(), weight, eps=as_float)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert_close_to_reference(gemslib.rms_norm(x, weight, eps=eps), _reference(x, weight, as_float),
                                  torch.float32, reduction_len=8)


def _unchanged(*tensors):
    copies = [t.clone() for t in tensors]
    return lambda: all(torch.equal(t, c) for t, c in zip(tensors, copies))


@pytest.mark.parametrize("width", [40, 9000], ids=["one block", "column loop"])
def test_in_place_refuses_x_and_residual_sharing_memory(width):
    buffer = random_tensor((4, 2 * width), torch.float32)
    weight = random_tensor((width,), torch.float32, scale=1.0)
    cases = {
        "same tensor": (buffer[:, :width], buffer[:, :width]),
        "same memory, other view objects": (buffer[:, :width], buffer.view(4, 2, width)[:, 0]),
        "overlapping columns": (buffer[:, :width], buffer[:, width // 2: width // 2 + width]),
        "overlapping rows": (buffer[:3, :width], buffer[1:, :width]),
    }
    for name, (x, residual) in cases.items():
        unchanged = _unchanged(buffer)
        with pytest.raises(ValueError, match="gemslib.add_rms_norm: x and residual must not share "
                                             "memory when inplace=True"):
            gemslib.add_rms_norm(x, residual, weight, inplace=True)
        assert unchanged(), name  # refused before any write
    x, residual = buffer[:, :width], buffer[:, width:]  # one storage, disjoint: fine
    expected = rms_ops.add_rms_norm_reference(x.double(), residual.double(), weight.double())
    normed, total = gemslib.add_rms_norm(x, residual, weight, inplace=True)
    assert normed is x and total is residual
    assert_close_to_reference(total, expected[1], torch.float32)
    assert_close_to_reference(normed, _reference(total, weight), torch.float32, reduction_len=width)


def test_in_place_refuses_tensors_that_overlap_themselves():
    """Where two elements share memory an in-place write cannot hold both results (torch
    refuses in-place writes into expanded tensors too)."""
    weight = random_tensor((8,), torch.float32, scale=1.0)
    for dtype in (torch.float32, torch.float64):  # the kernel, and torch arithmetic + copy_
        row = random_tensor((1, 8), dtype)
        storage = random_tensor((20,), dtype)
        overlapping = {
            "expanded rows": row.expand(3, 8),
            "expanded columns": random_tensor((3, 1), dtype).expand(3, 8),
            "rows that overlap (as_strided)": storage.as_strided((3, 8), (4, 1)),
        }
        for name, self_overlapping in overlapping.items():
            other = random_tensor((3, 8), dtype)
            for argument, (x, residual) in (("x", (self_overlapping, other)),
                                            ("residual", (other, self_overlapping))):
                unchanged = _unchanged(row, storage, other)
                with pytest.raises(ValueError, match=rf"gemslib.add_rms_norm: {argument} has "
                                                     r"elements that share memory.*inplace=True"):
                    gemslib.add_rms_norm(x, residual, weight.to(dtype), inplace=True)
                assert unchanged(), (name, argument, dtype)
                # out of place they are only read
                normed, total = gemslib.add_rms_norm(x, residual, weight.to(dtype))
                assert_close_to_reference(total, x.double() + residual.double(), dtype, msg=name)


@pytest.mark.parametrize("width", [40, 9000], ids=["one block", "column loop"])
def test_in_place_with_the_weight_in_written_memory(width):
    """The weight is read by every row while rows are written: a weight inside x or residual is
    the weight as given when the call started."""
    for written in ("x", "residual"):
        x = random_tensor((3, width), torch.float32)
        residual = random_tensor((3, width), torch.float32)
        weight = (x if written == "x" else residual)[1]  # a row that gets overwritten
        expected_normed, expected_total = gemslib.add_rms_norm(x, residual, weight.clone())
        normed, total = gemslib.add_rms_norm(x, residual, weight, inplace=True)
        assert normed is x and total is residual
        torch.testing.assert_close(x, expected_normed, rtol=0, atol=0, msg=written)
        torch.testing.assert_close(residual, expected_total, rtol=0, atol=0, msg=written)


def test_out_of_place_reads_aliased_inputs():
    """add_rms_norm(a, a, w) normalises 2a; a weight inside x is only read."""
    a = random_tensor((5, 40), torch.float32)
    weight = random_tensor((40,), torch.float32, scale=1.0)
    a_before = a.clone()
    for w in (weight, a[2]):
        normed, total = gemslib.add_rms_norm(a, a, w)
        assert torch.equal(a, a_before)
        assert_close_to_reference(total, 2 * a.double(), torch.float32)
        assert_close_to_reference(normed, _reference(2 * a, w), torch.float32, reduction_len=40)
    overlapping = gemslib.add_rms_norm(a[:, :30], a[:, 10:], weight[:30])
    assert_close_to_reference(overlapping[1], a[:, :30].double() + a[:, 10:].double(),
                              torch.float32)
    leaf = a.clone().requires_grad_()
    w_leaf = weight.clone().requires_grad_()
    grad = random_tensor((5, 40), torch.float32)
    gemslib.add_rms_norm(leaf, leaf, w_leaf)[0].backward(grad)
    a64 = a.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    rms_ops.rms_norm_reference(a64 + a64, w64).backward(grad.double())
    assert_close_to_reference(leaf.grad, a64.grad, torch.float32, reduction_len=40, msg="x")
    assert_close_to_reference(w_leaf.grad, w64.grad, torch.float32, reduction_len=5 * 16, msg="w")


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
    opcheck_overloads(torch.ops.gemslib.rms_norm_forward, (x, weight, 1e-5))
    residual = random_tensor((4, 3, 40), torch.float32).requires_grad_()
    opcheck_overloads(torch.ops.gemslib.add_rms_norm, (x, residual, weight, 1e-6))
    out, rstd = torch.ops.gemslib.rms_norm_forward(x.detach(), weight.detach() if with_weight else None, 1e-5)
    grad = random_tensor((4, 3, 40), torch.float32)
    opcheck_overloads(torch.ops.gemslib.rms_norm_backward,
                      (grad, x.detach(), weight.detach() if with_weight else None, rstd))
    # the graph passes' forms with eps a graph input (a 0-d CPU tensor): forward only
    eps = torch.tensor(1e-5, dtype=torch.float64)
    x, residual = x.detach(), residual.detach()
    weight = weight.detach() if with_weight else None
    opcheck_overloads(torch.ops.gemslib.rms_norm_eps_input, (x, weight, eps),
                      test_utils=("test_schema", "test_faketensor"))
    opcheck_overloads(torch.ops.gemslib.add_rms_norm_eps_input, (x, residual, weight, eps),
                      test_utils=("test_schema", "test_faketensor"))
    expected = torch.ops.gemslib.rms_norm_forward(x, weight, 1e-5)[0]
    assert torch.equal(torch.ops.gemslib.rms_norm_eps_input(x, weight, eps), expected)
    if with_weight:  # Gemma's (1 + weight) through every op
        x, residual, weight = (t.requires_grad_() for t in (x, residual, weight))
        opcheck_overloads(torch.ops.gemslib.rms_norm_forward, (x, weight, 1e-5, 1.0))
        opcheck_overloads(torch.ops.gemslib.add_rms_norm, (x, residual, weight, 1e-6, 1.0))
        x, residual, weight = x.detach(), residual.detach(), weight.detach()
        _, rstd = torch.ops.gemslib.rms_norm_forward(x, weight, 1e-5, 1.0)
        opcheck_overloads(torch.ops.gemslib.rms_norm_backward,
                          (grad, x, weight, rstd, None, 1.0))
        opcheck_overloads(torch.ops.gemslib.rms_norm_eps_input, (x, weight, eps, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
        opcheck_overloads(torch.ops.gemslib.add_rms_norm_eps_input,
                          (x, residual, weight, eps, 1.0),
                          test_utils=("test_schema", "test_faketensor"))


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


def _fused_tables():
    return {op: torch._C._dispatch_dump_table(op).splitlines() for op in FUSED}


def _assert_restored(before):
    """The dispatcher as ``before`` but for the one documented exception to exact restore
    (gemslib.registry's docstring): the backend kernel that torch lacked, installed for good."""
    permanent = registry.permanent_fallbacks()
    for op, now in _fused_tables().items():
        then = before[op]
        if op in permanent:
            assert permanent[op] in now, op
            then, now = ([line for line in lines if line != permanent[op]] for lines in (then, now))
        assert now == then, op


@pytest.mark.parametrize("dtype", DTYPES)
def test_f_rms_norm_runs_gemslib_forward_and_backward(dtype):
    before = _fused_tables()
    x = random_tensor((5, 3, 40), dtype).requires_grad_()
    weight = random_tensor((40,), dtype, scale=1.0).requires_grad_()
    grad = random_tensor((5, 3, 40), dtype)
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        result = torch.nn.functional.rms_norm(x, (40,), weight, 1e-6)
        result.backward(grad)
    assert activation.calls == {"aten::_fused_rms_norm": 1, "aten::_fused_rms_norm_backward": 1}
    _assert_restored(before)
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


# normalized_shape: the last dim, two dims, every dim (1-d and 2-d inputs, then no outer dims)
NORMALIZED = [((4,), (4,)), ((2, 3), (3,)), ((2, 3), (2, 3)), ((2, 3, 5), (5,)),
              ((2, 3, 5), (3, 5)), ((2, 3, 5), (2, 3, 5))]


@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape, normalized_shape", NORMALIZED)
def test_f_rms_norm_gradients_for_every_normalized_shape(shape, normalized_shape, dtype,
                                                         with_weight):
    """Against torch's own F.rms_norm outside enable(): the kernel takes the last dim in a
    kernel dtype, the fallback (torch arithmetic) every other call."""
    x = random_tensor(shape, dtype)
    weight = random_tensor(normalized_shape, dtype, scale=1.0) if with_weight else None
    grad = random_tensor(shape, dtype)

    def f_rms_norm(leaves):
        return torch.nn.functional.rms_norm(leaves[0], normalized_shape,
                                            leaves[1] if with_weight else None, 1e-5)

    leaves = [t.clone().requires_grad_() for t in (x, weight) if t is not None]
    expected = f_rms_norm(leaves)
    expected_grads = torch.autograd.grad(expected, leaves, grad)
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        result = f_rms_norm(leaves)
        grads = torch.autograd.grad(result, leaves, grad)
    kernel_takes = dtype == torch.float32 and len(normalized_shape) == 1
    assert activation.calls["aten::_fused_rms_norm_backward"] == int(kernel_takes)
    assert activation.fallbacks["aten::_fused_rms_norm_backward"] == int(not kernel_takes)
    torch.testing.assert_close(result, expected)
    for ours, theirs in zip(grads, expected_grads):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("shape, normalized_shape", NORMALIZED)
def test_fused_rms_norm_backward_in_torch_matches_torch(shape, normalized_shape):
    """The fallback itself, with the rstd torch's _fused_rms_norm returns."""
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(normalized_shape, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(shape, dtype=torch.float64)
    expected = torch.autograd.grad(torch.nn.functional.rms_norm(x, normalized_shape, weight, 1e-5),
                                   (x, weight), grad)
    _, rstd = torch.ops.aten._fused_rms_norm(x.detach(), list(normalized_shape), weight.detach(),
                                             1e-5)
    for mask in ([True, True], [True, False], [False, True]):
        dx, dweight = rms_ops._fused_rms_norm_backward_in_torch(
            grad, x.detach(), list(normalized_shape), rstd, weight.detach(), mask)
        for ours, theirs, wanted in ((dx, expected[0], mask[0]), (dweight, expected[1], mask[1])):
            if wanted:
                assert ours.shape == theirs.shape
                torch.testing.assert_close(ours, theirs)
            else:
                assert ours is None
    with pytest.raises(RuntimeError, match="normalized_shape .* must be the trailing dims"):
        rms_ops._fused_rms_norm_backward_in_torch(grad, x.detach(), [7], rstd, None, [True, False])


# ---------------------------------------------------------------------------------------------
# Call plans: a repeated backward replays its launches
# ---------------------------------------------------------------------------------------------


def _tensor_at(pointer: int, like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``like``'s dtype, shape and strides over the memory at ``pointer``."""
    extent = sum((size - 1) * stride for size, stride in zip(like.shape, like.stride())) + 1
    memory = (ctypes.c_char * (extent * like.element_size())).from_address(pointer)
    return torch.frombuffer(memory, dtype=like.dtype).as_strided(like.shape, like.stride())


@pytest.fixture
def plans_as_on_a_gpu(monkeypatch):
    """Call plans made and replayed as on a GPU. The interpreter plans nothing (there is no
    compiled kernel to replay), so on the CPU every TunedKernel launch here runs as a GPU's kept
    launch does: a call being planned records it, with a launcher standing for the compiled
    one that a plan's replay calls with data pointers (it runs the interpreted kernel on the
    memory they point to). What decides whether a call is planned is the runtime's own:
    the dispatch mode that watches the call, and the check of the launches' tensors."""
    runtime.clear_call_plans()
    if ON_GPU:
        yield
        runtime.clear_call_plans()
        return
    # calls get signatures (env.INTERPRETER is all plans.py reads of env); a replay's stream
    monkeypatch.setattr(plans, "env", types.SimpleNamespace(INTERPRETER=False))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)

    def kept_run(self, config, grid, args):
        grid_size = tuple(grid(config.meta_dict))
        kernel_kwargs = self.kernel_kwargs(config)

        def compiled_launcher(*fields):  # 13 launch fields, then the arguments
            at = [_tensor_at(value, arg) if isinstance(arg, torch.Tensor) else value
                  for value, arg in zip(fields[13:], args)]
            with runtime.quiet_interpreter():
                self.fn[grid_size](*at, **kernel_kwargs)

        # the interpreter's copies in and out of the kernel are no operation of the call's
        with _disable_current_modes(), runtime.quiet_interpreter():
            self.fn[grid_size](*args, **kernel_kwargs)
        if state.planning.launches is not None:
            compiled = (compiled_launcher, (*grid_size, 1, 1)[:3], 0, False, False, None, (),
                        None, None)
            state.planning.launches.append((compiled, args, launch_key(config, grid_size,
                                                                       args)[1]))

    monkeypatch.setattr(runtime.TunedKernel, "run", kept_run)
    yield
    runtime.clear_call_plans()


def test_a_repeated_fused_rms_norm_backward_is_planned(plans_as_on_a_gpu):
    """aten::_fused_rms_norm_backward under enable(), called again and again with one
    signature, is planned: it launches kernels and allocates, nothing more (dweight's sum
    over the programs' partial rows is a kernel, the partial rows kept scratch). Each replay
    gives its own inputs' dx and dweight: the same values as the calls before the plan."""
    shape, cols = (5, 3, 200), 200
    sets = []
    for _ in range(2):
        x = random_tensor(shape, torch.float32)
        rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        sets.append((random_tensor(shape, torch.float32), x, rstd,
                     random_tensor((cols,), torch.float32, scale=1.0)))
    results = []
    with gemslib.enable(ops=["rms_norm"]):
        # the first call of a signature runs alone, the second is planned, the rest replay
        for grad, x, rstd, weight in (sets[0], sets[1], sets[0], sets[1], sets[0]):
            fresh = [t.clone() for t in (grad, x, rstd, weight)]  # other tensors, one layout
            results.append(torch.ops.aten._fused_rms_norm_backward(
                fresh[0], fresh[1], [cols], fresh[2], fresh[3], [True, True]))
    assert runtime.call_plan_counts().get("aten::_fused_rms_norm_backward") == (1, 0), \
        runtime.call_plan_counts()
    for replayed, first in ((results[2], results[0]), (results[3], results[1]),
                            (results[4], results[0])):
        for ours, theirs in zip(replayed, first):
            assert torch.equal(ours, theirs)
    grad, x, rstd, weight = (t.double() for t in sets[0])
    expected_dx, expected_dweight = rms_ops._fused_rms_norm_backward_in_torch(
        grad, x, [cols], rstd, weight, [True, True])
    assert_close_to_reference(results[0][0], expected_dx, torch.float32, reduction_len=cols)
    assert_close_to_reference(results[0][1], expected_dweight, torch.float32, reduction_len=15)
