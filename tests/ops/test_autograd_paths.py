"""Eager autograd runs through torch.autograd.Functions, torch.compile through the custom ops;
both paths share the forward and backward code and must give the same gradients."""

import pytest
import torch
import torch.nn.functional as F

import gemslib
from helpers import random_tensor


def _rotary(q, k):
    angles = torch.arange(2 * 4, dtype=torch.float32, device=q.device).reshape(2, 4) * 0.7
    return gemslib.apply_rotary(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype))


def _rotary_op(q, k):
    angles = torch.arange(2 * 4, dtype=torch.float32, device=q.device).reshape(2, 4) * 0.7
    return torch.ops.gemslib.rotary(q, k, angles.cos().to(q.dtype), angles.sin().to(q.dtype),
                                    None, False, False)


# name: (public call, the same through the custom op, input shapes, eager Function's name)
PATHS = {
    "silu": (gemslib.silu, torch.ops.gemslib.silu, [(3, 37)], "SiluFunction"),
    "silu_and_mul": (gemslib.silu_and_mul, torch.ops.gemslib.silu_and_mul, [(3, 38)],
                     "SiluAndMulFunction"),
    "rms_norm": (gemslib.rms_norm, lambda x, w: torch.ops.gemslib.rms_norm_forward(x, w, 1e-6)[0],
                 [(3, 37), (37,)], "RmsNormForwardFunction"),
    "add_rms_norm": (lambda x, r, w: gemslib.add_rms_norm(x, r, w)[0],
                     lambda x, r, w: torch.ops.gemslib.add_rms_norm(x, r, w, 1e-6)[0],
                     [(3, 37), (3, 37), (37,)], "AddRmsNormFunction"),
    "softmax": (gemslib.softmax, lambda x: torch.ops.gemslib.softmax(x, -1, False), [(3, 37)],
                "SoftmaxFunction"),
    "log_softmax": (gemslib.log_softmax, lambda x: torch.ops.gemslib.softmax(x, -1, True),
                    [(3, 37)], "SoftmaxFunction"),
    "rotary": (lambda q, k: _rotary(q, k)[0] * 2 + _rotary(q, k)[1].sum(),
               lambda q, k: _rotary_op(q, k)[0] * 2 + _rotary_op(q, k)[1].sum(),
               [(2, 3, 8), (2, 1, 8)], "RotaryFunction"),
}


def _node_names(node, seen=None) -> set[str]:
    """Class names of every node of an autograd graph."""
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return set()
    seen.add(node)
    names = {type(node).__name__}
    for parent, _ in node.next_functions:
        names |= _node_names(parent, seen)
    return names


def _gradients(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, grad)


@pytest.mark.parametrize("name", PATHS)
def test_eager_function_and_custom_op_give_the_same_gradients(name):
    public, custom_op, shapes, function_name = PATHS[name]
    inputs = [random_tensor(shape, torch.float32) for shape in shapes]
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = public(*leaves)
    grad = random_tensor(out.shape, torch.float32)
    assert f"{function_name}Backward" in _node_names(out.grad_fn)  # eager: through the Function
    expected_out, expected = _gradients(custom_op, inputs, grad)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for ours, theirs in zip(torch.autograd.grad(out, leaves, grad), expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_second_derivatives_raise_where_the_backward_is_not_differentiable():
    x = random_tensor((3, 37), torch.float32).requires_grad_()
    weight = random_tensor((37,), torch.float32).requires_grad_()
    with pytest.raises(RuntimeError, match="RmsNormForwardFunction has no second derivative"):
        torch.autograd.grad(gemslib.rms_norm(x, weight).sum(), x, create_graph=True)
    (dx,) = torch.autograd.grad(gemslib.rms_norm(x, weight).sum(), x)  # first order is fine
    assert dx.shape == x.shape


def test_rotary_is_twice_differentiable():
    q = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: _rotary(a, b), (q, k))


# ---------------------------------------------------------------------------------------------
# Graphs that cross an enable() block: recorded inside, differentiated outside, and the reverse
# ---------------------------------------------------------------------------------------------

RMS_NORM_CALLS = {  # name: (x shape, normalized_shape, dtype)
    "kernel": ((3, 5, 24), (24,), torch.float32),
    "fallback, float64": ((3, 24), (24,), torch.float64),
    "fallback, 2-d normalized_shape": ((3, 4, 6), (4, 6), torch.float32),
    "fallback, every dim": ((4, 6), (4, 6), torch.float32),
}


def _torch_rms_norm_gradients(x, normalized_shape, weight, grad):
    """torch's own F.rms_norm gradients, outside any enable()."""
    leaves = (x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_())
    out = F.rms_norm(leaves[0], normalized_shape, leaves[1], 1e-6)
    return out, torch.autograd.grad(out, leaves, grad)


@pytest.mark.parametrize("call", RMS_NORM_CALLS)
def test_rms_norm_recorded_under_enable_differentiates_after_the_block(call):
    """``with gemslib.enable(): loss = model(x)`` then ``loss.backward()`` outside: the graph
    calls _fused_rms_norm_backward after the block, which torch's CPU build has no kernel for."""
    shape, normalized_shape, dtype = RMS_NORM_CALLS[call]
    x = random_tensor(shape, dtype).requires_grad_()
    weight = random_tensor(normalized_shape, dtype, scale=1.0).requires_grad_()
    grad = random_tensor(shape, dtype)
    with gemslib.enable():
        out = F.rms_norm(x, normalized_shape, weight, 1e-6)
    assert "FusedRmsNormBackward0" in _node_names(out.grad_fn)  # the node that needs the kernel
    assert not gemslib.is_enabled()
    (out * grad).sum().backward()
    expected_out, (expected_dx, expected_dweight) = _torch_rms_norm_gradients(
        x, normalized_shape, weight, grad)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(x.grad, expected_dx)
    torch.testing.assert_close(weight.grad, expected_dweight)


def test_rms_norm_recorded_in_one_block_differentiates_in_another():
    x = random_tensor((3, 5, 24), torch.float32).requires_grad_()
    weight = random_tensor((24,), torch.float32, scale=1.0).requires_grad_()
    grad = random_tensor((3, 5, 24), torch.float32)
    with gemslib.enable(ops=["rms_norm"]):
        out = F.rms_norm(x, (24,), weight, 1e-6)
    with gemslib.enable(ops=["rms_norm"], record=True) as activation:
        out.backward(grad)
    assert activation.calls == {"aten::_fused_rms_norm_backward": 1}  # gemslib's kernel ran
    _, (expected_dx, expected_dweight) = _torch_rms_norm_gradients(x, (24,), weight, grad)
    torch.testing.assert_close(x.grad, expected_dx)
    torch.testing.assert_close(weight.grad, expected_dweight)


@pytest.mark.parametrize("call", RMS_NORM_CALLS)
def test_forward_outside_enable_backward_inside(call):
    shape, normalized_shape, dtype = RMS_NORM_CALLS[call]
    x = random_tensor(shape, dtype).requires_grad_()
    weight = random_tensor(normalized_shape, dtype, scale=1.0).requires_grad_()
    grad = random_tensor(shape, dtype)
    out = F.rms_norm(x, normalized_shape, weight, 1e-6)
    with gemslib.enable():
        out.backward(grad)
    expected_out, (expected_dx, expected_dweight) = _torch_rms_norm_gradients(
        x, normalized_shape, weight, grad)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)  # torch's forward
    torch.testing.assert_close(x.grad, expected_dx)
    torch.testing.assert_close(weight.grad, expected_dweight)


def test_silu_across_the_block_both_ways():
    x = random_tensor((7, 33), torch.float32)
    grad = random_tensor((7, 33), torch.float32)
    leaf = x.clone().requires_grad_()
    expected = torch.autograd.grad(F.silu(leaf), leaf, grad)[0]
    with gemslib.enable(record=True) as activation:  # recorded inside, differentiated outside
        out = F.silu(leaf)
    (after,) = torch.autograd.grad(out, leaf, grad)
    assert activation.calls == {"aten::silu": 1}
    out = F.silu(leaf)  # recorded outside, differentiated inside: gemslib's silu_backward
    with gemslib.enable(record=True) as activation:
        (inside,) = torch.autograd.grad(out, leaf, grad)
    assert activation.calls == {"aten::silu_backward": 1}
    for ours in (after, inside):
        torch.testing.assert_close(ours, expected)
