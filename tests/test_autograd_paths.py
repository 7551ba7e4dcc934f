"""Eager autograd runs through torch.autograd.Functions, torch.compile through the custom ops;
both paths share the forward and backward code and must give the same gradients."""

import pytest
import torch

import gemslib
from conftest import random_tensor


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
                 [(3, 37), (37,)], "RmsNormFunction"),
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
    with pytest.raises(RuntimeError, match="RmsNormFunction has no second derivative"):
        torch.autograd.grad(gemslib.rms_norm(x, weight).sum(), x, create_graph=True)
    (dx,) = torch.autograd.grad(gemslib.rms_norm(x, weight).sum(), x)  # first order is fine
    assert dx.shape == x.shape


def test_rotary_is_twice_differentiable():
    q = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: _rotary(a, b), (q, k))
