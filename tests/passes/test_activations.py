"""Graph pass of the activations: silu(gate) * up over the columns of one projection output
becomes silu_and_mul; look-alikes that compute something else are left alone."""

import pytest
import torch

import gemslib
from helpers import DEVICE, assert_compiled_is_eager_s


class _GatedUp(torch.nn.Module):
    """``silu(gate) * up`` over the columns of one (merged) projection output, the ways models
    take them apart: chunk, split, split_with_sizes, open slices, or the gate/up columns of a
    projection wider still (a parallel block's q | k | v | gate | up); and look-alikes that
    compute something else: silu of the second half, a split over another dim, an up of
    another width."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, h):
        F = torch.nn.functional
        n = h.shape[-1] // 2
        if self.form == "chunk":                      # Phi-3, GLM: up * act(gate)
            gate, up = h.chunk(2, dim=-1)
            return up * F.silu(gate)
        if self.form == "split":
            gate, up = h.split(n, dim=-1)
            return F.silu(gate) * up
        if self.form == "split_with_sizes":
            gate, up = h.split([n, n], dim=-1)
            return F.silu(gate) * up
        if self.form == "open_slices":
            return F.silu(h[..., :n]) * h[..., n:]
        if self.form == "inner_columns":              # columns 8:24 and 24:40 of a 48-wide row
            _, gate, up, _ = h.split([8, 16, 16, 8], dim=-1)
            return F.silu(gate) * up
        if self.form == "silu_of_second":
            gate, up = h.chunk(2, dim=-1)
            return F.silu(up) * gate
        if self.form == "other_dim":
            gate, up = h.chunk(2, dim=1)
            return F.silu(gate) * up
        gate, up = h.split([20, 28], dim=-1)          # "other_width"
        return F.silu(gate) * up[..., :20]


@pytest.mark.parametrize("form, fused", [
    ("chunk", True), ("split", True), ("split_with_sizes", True), ("open_slices", True),
    ("inner_columns", True), ("silu_of_second", False), ("other_dim", False),
    ("other_width", False)])
def test_silu_times_up_over_columns_of_one_output_runs_silu_and_mul(form, fused):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    h = torch.randn(3, 48, 48, device=DEVICE, dtype=torch.float16)
    assert_compiled_is_eager_s(_GatedUp(form), h, fusions={"silu_and_mul": 1} if fused else {})


class _GeluGated(torch.nn.Module):
    """``gelu(gate) * up`` over one output's halves in either of F.gelu's forms (Gemma's MLP
    takes the tanh one), and GELU-like formulas that are neither: another constant inside the
    tanh, a sigmoid GELU."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, h):
        F = torch.nn.functional
        gate, up = h.chunk(2, dim=-1)
        if self.form in ("none", "tanh"):
            return F.gelu(gate, approximate=self.form) * up
        g = gate.float()
        if self.form == "other_constant":
            act = 0.5 * g * (1 + torch.tanh(0.8 * (g + 0.044715 * g * g * g)))
        else:  # "sigmoid"
            act = g * torch.sigmoid(1.702 * g)
        return act.to(h.dtype) * up


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("form, fused", [("none", True), ("tanh", True),
                                         ("other_constant", False), ("sigmoid", False)])
def test_gelu_times_up_runs_gelu_and_mul_with_its_form(form, fused, dtype):
    """Each of F.gelu's forms becomes gelu_and_mul with that form (an erf GELU never runs the
    tanh one, nor the other way round: the results are eager's); the look-alikes stay
    inductor's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    h = torch.randn(3, 8, 48, device=DEVICE, dtype=dtype) * 3
    assert_compiled_is_eager_s(_GeluGated(form), h,
                                fusions={"gelu_and_mul": 1} if fused else {})
    if dtype == torch.float32 and fused:  # the two forms differ by ~1e-3: fp32 tells them apart
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(_GeluGated(form), backend="gemslib", fullgraph=True)(h)
        torch.testing.assert_close(got, _GeluGated(form)(h), rtol=1e-5, atol=1e-5)
