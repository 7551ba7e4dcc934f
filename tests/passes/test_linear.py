"""Graph rewrites of projections: merged_linear (a model's q/k/v and gate/up projections of
one input in one GEMM, parameters merged once, not kept twice), linear_swiglu (a merged
gate/up projection and silu_and_mul), linear_geglu (the same with gelu_and_mul) and
rms_norm_linear_silu (rms_norm -> linear -> silu)."""

import pytest
import torch

import gemslib
from helpers import DEVICE, ON_GPU
from gemslib.fused import merged_linear as ml
from gemslib.fused import rms_norm_linear_silu as norm_linear_silu_ops
from gemslib.fused import rms_norm_swiglu as swiglu_ops
from gemslib.passes import linear as linear_passes


# --------------------------------------------------------------------------------------------
# merged_linear: projections of one input merged
# --------------------------------------------------------------------------------------------


class _Projections(torch.nn.Module):
    """Forms of projections around the ones a decoder layer has."""

    def __init__(self, width=16, dtype=torch.float32):
        super().__init__()
        def linear(n, bias=False, dt=dtype):
            return torch.nn.Linear(width, n, bias=bias, device=DEVICE, dtype=dt)
        self.a, self.b = linear(8), linear(8)                  # of x: merged
        self.c = linear(8, bias=True)                          # of x with a bias: alone
        self.d, self.e = linear(6), linear(6)                  # of y: merged, apart from a, b
        self.gate, self.up = linear(12), linear(12)            # of y: GELU, gelu_and_mul
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
    # a+b of x; d, e, gate and up of y (one group, the GELU over its columns); f+g of z; c (a
    # bias) stays alone
    assert gemslib.fusion_report() == {"merged_linear": 3, "gelu_and_mul": 1}, \
        gemslib.fusion_report()
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
    assert gemslib.fusion_report() == {"merged_linear": 2, "gelu_and_mul": 1}, \
        gemslib.fusion_report()
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


# --------------------------------------------------------------------------------------------
# linear_swiglu: a merged gate/up projection and silu_and_mul
# --------------------------------------------------------------------------------------------


def _tiny_llama(dtype, layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, dtype).eval()
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.data.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float16] if ON_GPU else [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [(2, 64), (2, 11)], ids=["128-rows", "22-rows"])
def test_backend_fuses_each_mlp_up_half_into_linear_swiglu(dtype, tokens, monkeypatch):
    """backend="gemslib": each layer's merged gate/up projection and silu_and_mul become one
    linear_swiglu at the Hopper path's MIN_ROWS or more (the (add_)rms_norm before it stays;
    the tiny model's product is let through however few its tiles), none below; logits within
    the dtype's rounding of eager's, and eager unchanged after."""
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_llama(dtype)
    ids = torch.randint(0, 96, tokens, device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits.float()
        again = model(ids).logits.float()
    fusions = gemslib.fusion_report()
    fused = tokens[0] * tokens[1] >= swiglu_ops._rms_norm_linear_silu_hopper.MIN_ROWS
    assert fusions.get("linear_swiglu", 0) == (2 if fused else 0), fusions
    assert fusions["silu_and_mul"] == 2 and fusions["merged_linear"] == 4 and \
        fusions["add_rms_norm"] == 4, fusions
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit"
    assert torch.equal(again, expected)


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_gated_site_is_judged_by_the_weight_rows_its_matmul_reads(family, monkeypatch):
    """The Hopper path's verdict on a gate/up site counts the 2I rows of [Wg | Wu] its matmul
    streams, as linear_swiglu's own dispatch does (for merged projections and for one
    gate_up weight alike), not the I rows of one half."""
    hopper = swiglu_ops._rms_norm_linear_silu_hopper
    asked = []
    judge = hopper.graph_site_fuses
    monkeypatch.setattr(hopper, "graph_site_fuses", lambda x, weight, rows=None: asked.append(
        weight.shape[0] if rows is None else rows) or judge(x, weight, rows))
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        model = _tiny_llama(torch.float16)
    else:
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)).to(DEVICE, torch.float16).eval()
    torch._dynamo.reset()
    # compiled here, not loaded from the cache of an earlier test's graph (which skips passes)
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model, backend="gemslib", fullgraph=True)(
            torch.randint(0, 96, (2, 64), device=DEVICE))
    assert asked and set(asked) == {2 * 112}, asked


# --------------------------------------------------------------------------------------------
# linear_geglu: a merged gate/up projection and gelu_and_mul
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16] if ON_GPU else [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [(2, 64), (2, 11)], ids=["128-rows", "22-rows"])
def test_backend_fuses_each_gemma_mlp_up_half_into_linear_geglu(dtype, tokens, monkeypatch):
    """Gemma's MLP (gelu_pytorch_tanh(gate) * up): each layer's merged gate/up projection and
    gelu_and_mul become one linear_geglu of the tanh form where the Hopper path takes the
    rows, none below; logits within the dtype's rounding of eager's."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    config = transformers.GemmaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).to(DEVICE, dtype).eval()
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    ids = torch.randint(3, 96, tokens, device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        compiled = torch.compile(model, backend="gemslib", fullgraph=True)
        logits = compiled(ids).logits.float()
    fusions = gemslib.fusion_report()
    fused = tokens[0] * tokens[1] >= swiglu_ops._rms_norm_linear_silu_hopper.MIN_ROWS
    assert fusions.get("linear_geglu", 0) == (2 if fused else 0), fusions
    assert fusions["gelu_and_mul"] == 2 and fusions["merged_linear"] == 4, fusions
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit"


class _GeluMlp(torch.nn.Module):
    """down(gelu(gate(x)) * up(x)) with F.gelu's ``approximate`` form, and with ``also_up``
    the up projection used a second time (the merged output then feeds more than the
    activation)."""

    def __init__(self, approximate, also_up=False, dtype=torch.float32):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=dtype)
                                         for k, n in ((64, 96), (64, 96), (96, 64)))
        self.approximate, self.also_up = approximate, also_up

    def forward(self, x):
        up = self.up(x)
        out = self.down(torch.nn.functional.gelu(self.gate(x), approximate=self.approximate) * up)
        return (out, up.sum()) if self.also_up else out


@pytest.mark.parametrize("approximate,also_up", [("none", False), ("tanh", False),
                                                 ("none", True)],
                         ids=["erf", "tanh", "up-used-twice"])
def test_linear_geglu_keeps_the_gelu_form_and_leaves_shared_projections(approximate, also_up,
                                                                        monkeypatch):
    """The fused op computes the form the model wrote (the kernel launched with that GELU,
    counted; in fp32 the result is also closer to that form's float64 reference than the
    forms are to each other); a merged projection whose output feeds more than the activation
    stays merged_linear + gelu_and_mul, right."""
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    activations = []
    launch = swiglu_ops._launch
    monkeypatch.setattr(swiglu_ops, "_launch", lambda *args, **kwargs: activations.append(
        kwargs.get("activation")) or launch(*args, **kwargs))
    dtype = torch.float16 if ON_GPU else torch.float32  # the Hopper path takes 16 bits only
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    torch.manual_seed(0)
    module = _GeluMlp(approximate, also_up, dtype).eval()
    x = torch.randn(2, 64, 64, device=DEVICE, dtype=dtype) * 4
    with torch.no_grad():
        got = torch.compile(module, backend="gemslib", fullgraph=True)(x)
        module64 = _GeluMlp(approximate, also_up, dtype=torch.float64)
        module64.load_state_dict(module.state_dict())
        expected = module64(x.double())
        other = _GeluMlp("tanh" if approximate == "none" else "none", also_up,
                         dtype=torch.float64)
        other.load_state_dict(module.state_dict())
        other_form = other(x.double())
    fusions = gemslib.fusion_report()
    assert fusions.get("linear_geglu", 0) == int(not also_up), fusions
    assert fusions["gelu_and_mul"] == 1, fusions
    form = swiglu_ops.GELU_TANH if approximate == "tanh" else swiglu_ops.GELU_ERF
    assert activations == ([] if also_up else [form])
    got, expected, other_form = (t if isinstance(t, torch.Tensor) else t[0]
                                 for t in (got, expected, other_form))
    error = (got.double() - expected).abs().max().item()
    assert error <= (1e-4 if dtype == torch.float32 else 2e-2) * expected.abs().max().item()
    if dtype == torch.float32:
        gap = (expected - other_form).abs().max().item()
        assert error < gap / 20, f"error {error:.2e} against the forms' gap {gap:.2e}"


# --------------------------------------------------------------------------------------------
# rms_norm_linear_silu: silu of a projection of an rms_norm
# --------------------------------------------------------------------------------------------


class _NormLinearSilu(torch.nn.Module):
    """silu(linear(rms_norm(x))) as a model writes it (transformers' RMSNorm), and, with
    ``also_normed``, the normalised rows used a second time."""

    def __init__(self, k=64, n=96, bias=False, also_normed=False, dtype=torch.float32,
                 gemma=False):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        self.norm = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(k, eps=1e-5) if gemma \
            else transformers.models.llama.modeling_llama.LlamaRMSNorm(k, eps=1e-5)
        self.proj = torch.nn.Linear(k, n, bias=bias)
        self.also_normed = also_normed
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)
        self.to(DEVICE, dtype)

    def forward(self, x):
        normed = self.norm(x)
        out = torch.nn.functional.silu(self.proj(normed))
        return (out, normed * 2) if self.also_normed else out


@pytest.mark.parametrize("dtype", [torch.float16] if ON_GPU else [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,bias,also_normed,gemma,fused", [
    (128, False, False, False, True), (130, True, False, False, True),
    (22, False, False, False, False), (128, False, True, False, False),
    (128, False, False, True, False)],
    ids=["128-rows", "bias", "22-rows", "normed-used-twice", "gemma-norm"])
def test_backend_fuses_silu_of_a_projection_of_an_rms_norm(dtype, rows, bias, also_normed, gemma,
                                                           fused, monkeypatch):
    """backend="gemslib": rms_norm -> linear -> silu becomes one rms_norm_linear_silu where the
    fused path takes it (the Hopper path's rows and up; the tiny product let through however
    few its tiles) and the normalised rows feed nothing else; the result within the dtype's
    rounding of eager's. Gemma's ``(1 + weight)`` norm, which that kernel does not compute,
    stays an rms_norm of its own."""
    monkeypatch.setattr(norm_linear_silu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _NormLinearSilu(bias=bias, also_normed=also_normed, dtype=dtype, gemma=gemma).eval()
    if gemma:
        torch.nn.init.uniform_(module.norm.weight, -0.5, 0.5)
    x = torch.randn(2, rows // 2, 64, device=DEVICE, dtype=dtype)
    with torch.no_grad():
        expected = module(x)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(x)
    fusions = gemslib.fusion_report()
    assert fusions.get("rms_norm_linear_silu", 0) == int(fused), fusions
    assert fusions.get("rms_norm") == 1, fusions
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for a, b in zip(*(((t,) if isinstance(t, torch.Tensor) else t) for t in (got, expected))):
        error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert error <= tolerance, f"max error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16] if ON_GPU else [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [(2, 64), (2, 11)], ids=["128-rows", "22-rows"])
def test_one_gate_up_weight_runs_linear_swiglu_over_its_halves(dtype, tokens, monkeypatch):
    """Phi-3 keeps gate and up in one ``gate_up_proj`` and chunks its output: each layer's
    projection and silu_and_mul become one linear_swiglu over the weight's halves where the
    Hopper path takes the rows (none below); logits within the dtype's rounding of eager's,
    the parameter untouched."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(swiglu_ops._rms_norm_linear_silu_hopper, "MIN_WAVES", 0)
    config = transformers.Phi3Config(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, sliding_window=None)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).to(DEVICE, dtype).eval()
    before = model.model.layers[0].mlp.gate_up_proj.weight.detach().clone()
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    ids = torch.randint(0, 96, tokens, device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits.float()
    fusions = gemslib.fusion_report()
    fused = tokens[0] * tokens[1] >= swiglu_ops._rms_norm_linear_silu_hopper.MIN_ROWS
    assert fusions.get("linear_swiglu", 0) == (2 if fused else 0), fusions
    assert fusions["silu_and_mul"] == 2, fusions
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit"
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight, before)
