"""merged_linear: projections of one input in one GEMM, and the graph rewrite that merges a
model's q/k/v and gate/up projections (parameters merged once, not kept twice)."""

import pytest
import torch

import gemslib
from helpers import DEVICE
from gemslib.fused import merged_linear as ml
from gemslib.passes import linear as linear_passes

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


class _Projections(torch.nn.Module):
    """Forms of projections around the ones a decoder layer has."""

    def __init__(self, width=16, dtype=torch.float32):
        super().__init__()
        def linear(n, bias=False, dt=dtype):
            return torch.nn.Linear(width, n, bias=bias, device=DEVICE, dtype=dt)
        self.a, self.b = linear(8), linear(8)                  # of x: merged
        self.c = linear(8, bias=True)                          # of x with a bias: alone
        self.d, self.e = linear(6), linear(6)                  # of y: merged, apart from a, b
        self.gate, self.up = linear(12), linear(12)            # of y: GELU, not silu_and_mul
        self.f, self.g = linear(10), linear(10)                # of z: silu of the second half

    def forward(self, x, y, z):
        F = torch.nn.functional
        return (self.a(x), self.b(x), self.c(x), self.d(y) * self.e(y),
                F.gelu(self.gate(y)) * self.up(y), self.f(z) * F.silu(self.g(z)))


def test_rewrite_merges_only_projections_of_one_input_alike():
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _Projections().eval()
    torch.manual_seed(1)
    x, y, z = (torch.randn(3, 5, 16, device=DEVICE) for _ in range(3))
    with torch.no_grad():
        expected = module(x, y, z)
        results = torch.compile(module, backend="gemslib", fullgraph=True)(x, y, z)
    # a+b of x; d, e, gate and up of y (one group); f+g of z; c (a bias) stays alone
    assert gemslib.fusion_report() == {"merged_linear": 3}, gemslib.fusion_report()
    for got, want in zip(results, expected):
        assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item())
    assert ml.end_to_end([module.a.weight, module.b.weight]) is not None
    group = [module.d.weight, module.e.weight, module.gate.weight, module.up.weight]
    group.sort(key=lambda w: w.storage_offset())  # merged in the graph's order
    assert ml.end_to_end(group) is not None


def test_merged_parameters_are_one_copy_and_a_replaced_one_is_used():
    """After the compile each merged parameter is a view of one buffer the size of them all
    (nothing kept twice); a parameter replaced afterwards is what the compiled model uses."""
    torch._dynamo.reset()
    module = _Projections().eval()
    x, y, z = (torch.randn(2, 16, device=DEVICE) for _ in range(3))
    compiled = torch.compile(module, backend="gemslib", fullgraph=True)
    with torch.no_grad():
        compiled(x, y, z)
    storage = module.a.weight.untyped_storage()
    assert module.b.weight.untyped_storage().data_ptr() == storage.data_ptr()
    assert storage.nbytes() == module.a.weight.nbytes + module.b.weight.nbytes
    with torch.no_grad():
        module.b.weight = torch.nn.Parameter(torch.randn_like(module.b.weight))
        module.d.weight.mul_(2)  # in place: the merged buffer sees it
        expected = module(x, y, z)
        results = compiled(x, y, z)
    for got, want in zip(results, expected):
        assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item())


def test_tensors_that_are_not_parameters_merge_into_storages_of_their_own():
    """A tensor subclass's inner tensors (a DTensor's shards) are plain tensors: merged, each
    keeps a storage of its own over its rows of one buffer (dynamo cannot fakeify subclass
    tensors whose inner tensors share a storage), and they still read as end to end."""
    a, b = torch.randn(3, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE)
    expected = torch.cat([a, b])
    assert linear_passes.merge_once([a, b])
    buffer = getattr(a, ml.MERGED_ROWS)
    assert getattr(b, ml.MERGED_ROWS) is buffer and buffer.nbytes == a.nbytes + b.nbytes
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert b.data_ptr() == a.data_ptr() + a.nbytes
    assert torch.equal(ml.end_to_end([a, b]), expected)
    b.data = torch.randn_like(b)  # moved out: no longer end to end
    assert ml.end_to_end([a, b]) is None


def test_a_merged_parameter_moved_out_of_its_buffer_is_left_alone_by_a_new_compile():
    """A merged parameter whose ``.data`` was pointed elsewhere (its partners still in the
    old buffer): a later compile cannot merge the group again without copying a parameter
    another group may hold, so it computes those projections one by one, correctly."""
    torch._dynamo.reset()
    module = _Projections().eval()
    x, y, z = (torch.randn(2, 16, device=DEVICE) for _ in range(3))
    with torch.no_grad():
        torch.compile(module, backend="gemslib", fullgraph=True)(x, y, z)
        module.b.weight.data = torch.randn_like(module.b.weight)
        expected = module(x, y, z)
        torch._dynamo.reset()
        gemslib.reset_fusion_report()
        results = torch.compile(module, backend="gemslib", fullgraph=True)(x, y, z)
    assert gemslib.fusion_report() == {"merged_linear": 2}, gemslib.fusion_report()
    for got, want in zip(results, expected):
        assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item())


def test_a_site_without_real_parameters_is_left_alone():
    """The passes installed in a plain inductor config have no real parameters to merge:
    the projections stay separate GEMMs (merging them at every call would copy the weights)."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _Projections().eval()
    x = torch.randn(2, 16, device=DEVICE)
    with torch.no_grad(), torch._inductor.config.patch(
            post_grad_custom_post_pass=gemslib.passes.PASSES):
        torch.compile(module, fullgraph=True)(x, x, x)
    assert "merged_linear" not in gemslib.fusion_report()
    assert ml.end_to_end([module.a.weight, module.b.weight]) is None
