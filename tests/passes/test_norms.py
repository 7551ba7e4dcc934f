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


class _GemmaNorms(torch.nn.Module):
    """Gemma's RMSNorm, ``x_hat * (1 + weight)`` in fp32 rounded once, alone and after a
    residual add, beside forms that differ: another offset, a scale that is no norm weight."""

    def __init__(self, width, rows):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width) * 0.3)
        self.per_row = torch.nn.Parameter(torch.randn(rows, width) * 0.3)

    def forward(self, x, residual):
        from gemslib.passes.forms import gemma_rms_norm

        def scaled(h, scale):
            h32 = h.float()
            h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (h32 * scale).type_as(h)

        total = residual + x
        return (gemma_rms_norm(total, self.weight, 1e-6), total * 2,
                gemma_rms_norm(x, self.weight, 1e-6),
                scaled(x, 2.0 + self.weight.float()),      # another offset
                scaled(x, 1.0 + self.per_row.float()))     # a scale per row: no norm weight


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemma_rms_norm_runs_with_the_weight_offset(dtype):
    """Gemma's norm becomes rms_norm / add_rms_norm with weight_offset 1 (the kernel's fp32
    scale and single rounding are its arithmetic); another offset or a per-row scale is left
    to inductor, and every result stays eager's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _GemmaNorms(24, 5).to(DEVICE, dtype)
    x, residual = (torch.randn(3, 5, 24, device=DEVICE, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        expected = module(x, residual)
        compiled = torch.compile(module, backend="gemslib", fullgraph=True)
        got = compiled(x, residual)
    assert gemslib.fusion_report() == {"add_rms_norm": 1, "rms_norm": 1}, gemslib.fusion_report()
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.allclose(g.float(), e.float(), atol=2e-3 * e.abs().max().item())


def test_every_norm_of_a_tiny_gemma_runs_the_kernel():
    """transformers' Gemma (tiny, fp32, norm weights away from zero): each layer's two norms
    and the final one are gemslib's (the first alone, the others after their residual adds),
    and the logits are eager's within fp32 rounding."""
    from gemslib import models

    spec = models.MODELS["gemma-7b"].tiny()
    model = models.build_model(spec, DEVICE, torch.float32)
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    ids = torch.randint(0, spec.vocab, (2, 12), generator=generator).to(DEVICE)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        got = torch.compile(model, backend="gemslib", fullgraph=True)(
            input_ids=ids, use_cache=False).logits
    report = gemslib.fusion_report()
    assert report.get("rms_norm") == 1 and report.get("add_rms_norm") == 2 * spec.layers, report
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
