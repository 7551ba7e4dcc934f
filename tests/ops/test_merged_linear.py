"""merged_linear: projections of one input in one GEMM (the graph rewrite that merges a
model's projections into it: tests/passes/test_linear.py)."""

import pytest
import torch

from helpers import DEVICE
from gemslib.fused import merged_linear as ml

merged_linear = torch.ops.gemslib.merged_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_gemm_over_weights_that_lie_end_to_end(dtype, with_bias):
    torch.manual_seed(0)
    widths, k = (40, 24, 24), 37
    x = torch.randn(13, k, device=DEVICE, dtype=dtype)
    whole = torch.randn(sum(widths), k, device=DEVICE, dtype=dtype) / k ** 0.5
    weights = list(whole.split(widths))
    biases = list(torch.randn(sum(widths), device=DEVICE, dtype=dtype).split(widths)) \
        if with_bias else [None] * 3
    assert ml.end_to_end(weights) is not None
    got = merged_linear(x, weights, biases)
    want = ml.merged_linear_reference(x.double(), [w.double() for w in weights],
                                      [None if b is None else b.double() for b in biases])
    assert got.shape == (13, sum(widths)) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), want, atol=tolerance * want.abs().max().item())


def test_weights_apart_or_mixed_biases_are_computed_one_by_one():
    torch.manual_seed(0)
    x = torch.randn(5, 8, device=DEVICE)
    weights = [torch.randn(6, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)]
    assert ml.end_to_end(weights) is None  # two allocations
    biases = [torch.randn(6, device=DEVICE), None]
    got = merged_linear(x, weights, biases)
    want = torch.cat([x @ weights[0].T + biases[0], x @ weights[1].T], dim=-1)
    assert torch.allclose(got, want, atol=1e-5)
    whole = torch.randn(10, 8, device=DEVICE)
    got = merged_linear(x, list(whole.split([6, 4])), biases)  # end to end, one bias missing
    assert torch.allclose(got, torch.cat([x @ whole[:6].T + biases[0], x @ whole[6:].T], -1),
                          atol=1e-5)


def test_end_to_end_needs_one_storage_in_order():
    whole = torch.randn(10, 4)
    a, b = whole[:6], whole[6:]
    assert ml.end_to_end([a, b]).shape == (10, 4)
    assert ml.end_to_end([b, a]) is None                    # out of order
    assert ml.end_to_end([whole[:5], whole[6:]]) is None    # a gap
    assert ml.end_to_end([whole[:, :2], whole[:, 2:]]) is None  # not contiguous
