"""Graph passes of the norms: transformers' RMSNorm, F.rms_norm and a residual add before
it become rms_norm / add_rms_norm; forms that compute something else are left alone."""

import pytest
import torch

import gemslib
from helpers import DEVICE, assert_compiled_is_eager_s


class _LookAlikeNorms(torch.nn.Module):
    """Forms that trace like transformers' RMSNorm but compute something else."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.row = torch.nn.Parameter(torch.rand(1, width) + 0.5)

    def forward(self, x):
        def norm(h, weight, dim=-1, power=2):
            dtype = h.dtype
            h = h.to(torch.float32)
            h = h * torch.rsqrt(h.pow(power).mean(dim, keepdim=True) + 1e-6)
            return weight * h.to(dtype)
        gemma = norm(x, 1 + self.weight)              # (1 + w): another weight, a 1-d one
        columns = norm(x, self.weight[0], dim=0)      # over the other dim
        fourth = norm(x, self.weight, power=4)        # another exponent
        broadcast = norm(x, self.row)                 # a (1, N) weight
        upcast = norm(x, self.weight.float())         # an fp32 weight: an fp32 result
        shifted = norm(self.row + x, self.weight)     # a broadcast add: the norm alone fuses
        return gemma, columns, fourth, broadcast, upcast, shifted


def test_look_alike_forms_are_left_alone():
    """Only the (1 + w) form (the same computation with another weight) and the norm after a
    broadcast add (the add itself is no add_rms_norm) are replaced; every result stays
    eager's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _LookAlikeNorms(24).to(DEVICE, torch.float16)
    assert_compiled_is_eager_s(module, torch.randn(5, 24, device=DEVICE, dtype=torch.float16),
                                fusions={"rms_norm": 2})


class _FunctionalNorms(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        F = torch.nn.functional
        return (F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5),
                F.rms_norm(x, (x.shape[-1],), None, None),
                F.rms_norm(x, x.shape[-2:], None, 1e-5),                 # two dims: left alone
                x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt() * x)   # 16-bit statistics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_functional_rms_norm_with_and_without_weight(dtype):
    """F.rms_norm over the last dim, with a weight or none and any eps, becomes rms_norm; over
    two dims it does not, nor does a norm computed without the fp32 upcast in 16 bits."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _FunctionalNorms(24).to(DEVICE, dtype)
    # the last form is an RMSNorm too when x is fp32, written in an order no pattern has yet
    assert_compiled_is_eager_s(module, torch.randn(3, 5, 24, device=DEVICE, dtype=dtype),
                                fusions={"rms_norm": 2})


class _FunctionalAddNorm(torch.nn.Module):
    """A residual add before ``F.rms_norm`` (torch.nn.RMSNorm's form), the sum used after."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x, residual):
        total = residual + x
        normed = torch.nn.functional.rms_norm(total, (x.shape[-1],), self.weight, 1e-5)
        return normed, total * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_residual_add_before_functional_rms_norm_runs_add_rms_norm(dtype):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _FunctionalAddNorm(24).to(DEVICE, dtype)
    x, residual = (torch.randn(3, 5, 24, device=DEVICE, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        expected = module(x, residual)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(x, residual)
    assert gemslib.fusion_report() == {"add_rms_norm": 1}, gemslib.fusion_report()
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.allclose(g.float(), e.float(), atol=2e-3 * e.abs().max().item())
