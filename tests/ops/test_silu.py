"""Accuracy of silu, silu_backward, silu_and_mul, gelu_and_mul and their backwards against
float64 references."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gemslib
from helpers import DEVICE, DTYPES, ON_GPU, poisoned, random_tensor, opcheck_overloads
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import silu as silu_ops

SHAPES = [(1,), (7,), (1023,), (3, 1025), (1, 1), (2, 3, 67), (2, 1, 5, 33), (0,), (4, 0, 3)]
if ON_GPU:
    SHAPES += [(4096, 4097), (3, 511, 8191), (1 << 22,)]

# (3, 512) and (2, 2048): widths that are a multiple of the block, the unmasked kernel variant
SILU_AND_MUL_SHAPES = [(1, 2), (5, 6), (3, 2050), (2, 3, 130), (1, 1, 1, 2), (0, 8), (4, 0),
                       (3, 512), (2, 2048)]
if ON_GPU:
    SILU_AND_MUL_SHAPES += [(4097, 2 * 4099), (2, 1000, 2 * 1376)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_matches_reference(shape, dtype):
    x = random_tensor(shape, dtype)
    out = poisoned(shape, dtype)
    result = gemslib.silu(x, out=out)
    assert result is out
    assert_close_to_reference(out, silu_ops.silu_reference(x.double()), dtype)
    allocated = gemslib.silu(x)
    assert allocated.shape == x.shape and allocated.dtype == dtype
    assert_close_to_reference(allocated, silu_ops.silu_reference(x.double()), dtype)


VIEWS = {
    "transposed": lambda base: base.transpose(0, 2),
    "sliced": lambda base: base[:, 1::3, ::2],
    "permuted": lambda base: base.permute(1, 2, 0),
    "broadcast": lambda base: base[:1, :, :1].expand(6, 10, 12),
    "five_dims": lambda base: base.reshape(3, 2, 5, 4, 6)[:, ::2, :, ::2, 1:],
    "offset": lambda base: base.flatten()[17:17 + 300].view(20, 15),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", VIEWS)
def test_silu_on_views(name, dtype):
    x = VIEWS[name](random_tensor((6, 10, 12), dtype))
    expected = silu_ops.silu_reference(x.double())
    assert_close_to_reference(gemslib.silu(x), expected, dtype, msg=name)
    out = poisoned(x.shape, dtype).transpose(0, -1).contiguous().transpose(0, -1)  # strided out
    gemslib.silu(x, out=out)
    assert_close_to_reference(out, expected, dtype, msg=f"{name} into a strided out")


def test_silu_keeps_the_layout_of_dense_input():
    x = random_tensor((8, 33), torch.float32).t()
    assert gemslib.silu(x).stride() == x.stride()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_propagates_nan_and_inf(dtype):
    x = random_tensor((5, 37), dtype)
    x[0, 0], x[1, 3], x[2, 5], x[4, 36] = float("nan"), float("inf"), -float("inf"), -1e4
    result = gemslib.silu(x)
    expected = silu_ops.silu_reference(x.double())
    assert torch.isnan(result[0, 0]) and torch.isnan(result[2, 5])
    assert result[1, 3] == float("inf")
    assert_close_to_reference(result, expected, dtype)
    # torch's own kernel agrees on the special values (silu(-inf) is NaN there too)
    torch.testing.assert_close(result.double(), F.silu(x.double()), equal_nan=True,
                               rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1025), (2, 1, 67), (0, 5)] + ([(4097, 4099)] if ON_GPU else []))
def test_silu_backward_kernel(shape, dtype):
    x, grad = random_tensor(shape, dtype), random_tensor(shape, dtype)
    result = torch.ops.gemslib.silu_backward(grad, x)
    assert_close_to_reference(result, silu_ops.silu_backward_reference(grad.double(), x.double()),
                              dtype)
    transposed = torch.ops.gemslib.silu_backward(grad.transpose(0, -1), x.transpose(0, -1).contiguous())
    assert_close_to_reference(
        transposed, silu_ops.silu_backward_reference(grad.double().transpose(0, -1),
                                                     x.double().transpose(0, -1)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_gradient_through_direct_call(dtype):
    x = random_tensor((9, 70), dtype).requires_grad_()
    grad = random_tensor((9, 70), dtype)
    gemslib.silu(x).backward(grad)
    x64 = x.detach().double().requires_grad_()
    silu_ops.silu_reference(x64).backward(grad.double())
    assert_close_to_reference(x.grad, x64.grad, dtype)


def test_silu_rejects_bad_input():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        gemslib.silu([1.0, 2.0])
    with pytest.raises(TypeError, match="floating-point.*int64"):
        gemslib.silu(torch.arange(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must have shape \(4, 5\)"):
        gemslib.silu(random_tensor((4, 5), torch.float32), out=torch.empty(5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="out must be torch.float32"):
        gemslib.silu(random_tensor((4, 5), torch.float32),
                     out=torch.empty(4, 5, device=DEVICE, dtype=torch.float16))


def test_silu_float64_falls_back_to_torch():
    x = torch.randn(6, 7, dtype=torch.float64, device=DEVICE)
    assert torch.equal(gemslib.silu(x), F.silu(x))


def test_silu_in_place_into_its_own_input():
    x = random_tensor((33, 65), torch.float32)
    expected = silu_ops.silu_reference(x.double())
    assert gemslib.silu(x, out=x) is x
    assert_close_to_reference(x, expected, torch.float32)


def test_silu_into_a_partially_overlapping_out():
    buffer = random_tensor((200,), torch.float32)
    x, out = buffer[:150], buffer[50:]
    expected = silu_ops.silu_reference(x.double().clone())
    gemslib.silu(x, out=out)
    assert_close_to_reference(buffer[50:], expected, torch.float32)


# ---------------------------------------------------------------------------------------------
# silu_and_mul
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_AND_MUL_SHAPES)
def test_silu_and_mul_matches_reference(shape, dtype):
    x = random_tensor(shape, dtype)
    out_shape = (*shape[:-1], shape[-1] // 2)
    out = poisoned(out_shape, dtype)
    assert gemslib.silu_and_mul(x, out=out) is out
    expected = silu_ops.silu_and_mul_reference(x.double())
    assert_close_to_reference(out, expected, dtype)
    allocated = gemslib.silu_and_mul(x)
    assert allocated.shape == out_shape and allocated.is_contiguous()
    assert_close_to_reference(allocated, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_views(dtype):
    wide = random_tensor((7, 5, 3 * 66), dtype)
    views = {
        "column slice": wide[..., 66:],                      # unit last stride, row stride 198
        "strided columns": wide[..., ::3],                  # last stride 3
        "transposed leading dims": wide[..., :132].transpose(0, 1),  # rows do not merge
    }
    for name, x in views.items():
        expected = silu_ops.silu_and_mul_reference(x.double())
        assert_close_to_reference(gemslib.silu_and_mul(x), expected, dtype, msg=name)
    out = poisoned((5, 7, 66), dtype).transpose(0, 1)   # a non-contiguous out
    gemslib.silu_and_mul(views["column slice"], out=out)
    assert_close_to_reference(out, silu_ops.silu_and_mul_reference(views["column slice"].double()),
                              dtype, msg="strided out")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_propagates_nan_and_inf(dtype):
    x = random_tensor((4, 10), dtype)
    x[0, 0], x[1, 6], x[2, 1], x[3, 2] = float("nan"), float("inf"), float("inf"), -float("inf")
    result = gemslib.silu_and_mul(x)
    assert torch.isnan(result[0, 0]) and torch.isnan(result[3, 2])
    assert result[2, 1] == float("inf") * torch.sign(x[2, 6])
    assert_close_to_reference(result, silu_ops.silu_and_mul_reference(x.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 517), (2, 3, 10), (3, 2 * 1024)]
                         + ([(4097, 2 * 4099), (64, 2 * 14336)] if ON_GPU else []))
def test_silu_and_mul_gradient(shape, dtype):
    x = random_tensor(shape, dtype).requires_grad_()
    grad = random_tensor((*shape[:-1], shape[-1] // 2), dtype)
    gemslib.silu_and_mul(x).backward(grad)
    x64 = x.detach().double().requires_grad_()
    silu_ops.silu_and_mul_reference(x64).backward(grad.double())
    assert_close_to_reference(x.grad, x64.grad, dtype)


def test_silu_and_mul_rejects_bad_input():
    with pytest.raises(ValueError, match=r"last dim must be even.*\(3, 5\)"):
        gemslib.silu_and_mul(random_tensor((3, 5), torch.float32))
    with pytest.raises(ValueError, match="last dim must be even"):
        gemslib.silu_and_mul(torch.tensor(1.0, device=DEVICE))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        gemslib.silu_and_mul(torch.ones(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must have shape \(3, 2\)"):
        gemslib.silu_and_mul(random_tensor((3, 4), torch.float32), out=torch.empty(3, 4, device=DEVICE))


def test_silu_and_mul_float64_falls_back_to_torch():
    x = torch.randn(5, 8, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(gemslib.silu_and_mul(x), silu_ops.silu_and_mul_reference(x),
                               rtol=0, atol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SILU_AND_MUL_SHAPES)
def test_gelu_and_mul_matches_reference(shape, dtype, approximate):
    x = random_tensor(shape, dtype)
    out_shape = (*shape[:-1], shape[-1] // 2)
    out = poisoned(out_shape, dtype)
    assert gemslib.gelu_and_mul(x, approximate, out=out) is out
    expected = silu_ops.gelu_and_mul_reference(x.double(), approximate)
    assert_close_to_reference(out, expected, dtype)
    allocated = gemslib.gelu_and_mul(x, approximate=approximate)
    assert allocated.shape == out_shape and allocated.is_contiguous()
    assert_close_to_reference(allocated, expected, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_at_large_gates_and_on_a_view(approximate):
    """Gates far out on both sides (where tanh and erf saturate), NaN and inf, and a column
    slice of a wider tensor."""
    wide = random_tensor((6, 3 * 40), torch.float32, scale=4.0)
    x = wide[:, 40:]
    x[0, :3] = torch.tensor([60.0, -60.0, 1e4])
    x[1, 0], x[2, 1] = float("nan"), float("inf")
    result = gemslib.gelu_and_mul(x, approximate)
    expected = silu_ops.gelu_and_mul_reference(x.double(), approximate)
    assert torch.isnan(result[1, 0]) and torch.equal(torch.isnan(result), torch.isnan(expected))
    finite = torch.isfinite(expected)
    assert_close_to_reference(result[finite], expected[finite], torch.float32)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul_gradient(dtype, approximate):
    for shape in ((3, 2 * 517), (2, 3, 10)):
        x = random_tensor(shape, dtype).requires_grad_()
        grad = random_tensor((*shape[:-1], shape[-1] // 2), dtype)
        gemslib.gelu_and_mul(x, approximate).backward(grad)
        x64 = x.detach().double().requires_grad_()
        silu_ops.gelu_and_mul_reference(x64, approximate).backward(grad.double())
        assert_close_to_reference(x.grad, x64.grad, dtype)


def test_gelu_and_mul_rejects_bad_input():
    x = random_tensor((3, 4), torch.float32)
    with pytest.raises(ValueError, match=r"gemslib.gelu_and_mul: approximate must be 'none' or "
                                         r"'tanh'.*got 'erf'"):
        gemslib.gelu_and_mul(x, "erf")
    with pytest.raises(TypeError, match="approximate must be a string"):
        gemslib.gelu_and_mul(x, True)
    with pytest.raises(ValueError, match=r"gemslib.gelu_and_mul: x's last dim must be even"):
        gemslib.gelu_and_mul(random_tensor((3, 5), torch.float32))
    x64 = torch.randn(5, 8, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(gemslib.gelu_and_mul(x64, "tanh"),
                               silu_ops.gelu_and_mul_reference(x64, "tanh"), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Custom ops: opcheck and torch.compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tanh", [False, True])
def test_gelu_and_mul_custom_ops_pass_opcheck(tanh):
    x = random_tensor((3, 2, 18), torch.float32).requires_grad_()
    opcheck_overloads(torch.ops.gemslib.gelu_and_mul, (x, tanh))
    grad = random_tensor((3, 2, 9), torch.float32)
    opcheck_overloads(torch.ops.gemslib.gelu_and_mul_backward, (grad, x.detach(), tanh))


@pytest.mark.parametrize("op,shape", [(torch.ops.gemslib.silu_and_mul, (3, 2, 18)),
                                      (torch.ops.gemslib.silu, (4, 9))])
def test_custom_ops_pass_opcheck(op, shape):
    x = random_tensor(shape, torch.float32).requires_grad_()
    opcheck_overloads(op, (x,))


def test_backward_custom_ops_pass_opcheck():
    x, grad = random_tensor((3, 16), torch.float32), random_tensor((3, 8), torch.float32)
    opcheck_overloads(torch.ops.gemslib.silu_and_mul_backward, (grad, x))
    opcheck_overloads(torch.ops.gemslib.silu_backward, (grad, x[:, :8].contiguous()))


def test_silu_and_mul_traces_under_torch_compile_fullgraph():
    def mlp_activation(x):
        return gemslib.silu_and_mul(x) * 2.0 + gemslib.silu(x[..., :4])

    compiled = torch.compile(mlp_activation, fullgraph=True,
                             backend="inductor" if ON_GPU else "aot_eager")
    x = random_tensor((6, 8), torch.float32).requires_grad_()
    result = compiled(x)
    x64 = x.detach().double().requires_grad_()
    expected = silu_ops.silu_and_mul_reference(x64) * 2.0 + silu_ops.silu_reference(x64[..., :4])
    assert_close_to_reference(result, expected, torch.float32)
    result.sum().backward()
    expected.sum().backward()
    assert_close_to_reference(x.grad, x64.grad, torch.float32)


# ---------------------------------------------------------------------------------------------
# Property: any layout a view can have gives the reference result
# ---------------------------------------------------------------------------------------------

@st.composite
def strided_views(draw):
    """A random 1-5-d tensor, permuted and sliced with random steps (sizes may be 0 or 1)."""
    rank = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank))
    base = random_tensor([2 * s + 1 for s in sizes], draw(st.sampled_from(DTYPES)))
    steps = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    view = base[tuple(slice(0, s * step, step) for s, step in zip(sizes, steps))]
    return view.permute(draw(st.permutations(range(rank))))


@settings(max_examples=30, deadline=None)
@given(strided_views())
def test_silu_on_any_view(x):
    assert_close_to_reference(gemslib.silu(x), silu_ops.silu_reference(x.double()), x.dtype)


def test_out_that_partly_overlaps_the_input_keeps_torchs_error_under_enable():
    """aten::silu.out with out a shifted view of the input: torch refuses (an element would be
    read after it was written); under enable() the call goes to torch, which still refuses."""
    buffer = random_tensor((9,), torch.float32)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        torch.ops.aten.silu.out(buffer[:-1], out=buffer[1:])
    with gemslib.enable(ops=["silu"], record=True) as activation:
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch.ops.aten.silu.out(buffer[:-1], out=buffer[1:])
        same = buffer.clone()
        torch.ops.aten.silu.out(same, out=same)  # the same elements: in place, served
    assert activation.fallbacks == {"aten::silu.out": 1}
    assert activation.calls == {"aten::silu.out": 1}
    assert_close_to_reference(same, F.silu(buffer.double()), torch.float32)
