"""Graph passes of the rotary: transformers' rotary (rotate_half or the interleaved form)
becomes apply_rotary, look-alikes are left alone, and a decode step's rotary with its static
cache's update becomes rotary_into_cache."""

import functools

import pytest
import torch

import gemslib
from helpers import DEVICE, caches_written_in_place, random_tensor
from gemslib.passes import rotary as rotary_passes


# --------------------------------------------------------------------------------------------
# Graph pattern: torch.compile(backend="gemslib") turns transformers' rotary into the op
# --------------------------------------------------------------------------------------------

_MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),           # q, k, v projection biases
           "mistral": ("MistralConfig", "MistralForCausalLM", {})}


def _tiny_model(kind, dtype, layers=2):
    transformers = pytest.importorskip("transformers")
    config_class, model_class, extra = _MODELS[kind]
    config = getattr(transformers, config_class)(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).to(DEVICE, dtype).eval()


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("llama", torch.float16),
                                        ("qwen2", torch.float16), ("mistral", torch.float32)])
def test_every_layer_s_rotary_becomes_one_launch(kind, dtype):
    """The rotary of q and k of every decoder layer is replaced (one op for both), and the
    logits stay eager's within the dtype's rounding."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    layers = 2
    model = _tiny_model(kind, dtype, layers)
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits.float()
    assert gemslib.fusion_report().get("rotary") == layers, gemslib.fusion_report()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit (tolerance {tolerance})"


def _rotate_half(x, dim=-1, split=None, form="model"):
    """Indexed as transformers writes it (``x[..., :half]``): the graph then holds the same
    slice bounds as the pattern's trace."""
    split = x.shape[dim] // 2 if split is None else split
    lead = (...,) if dim == -1 else (slice(None),) * dim
    x1, x2 = x[(*lead, slice(None, split))], x[(*lead, slice(split, None))]
    if form == "model":
        return torch.cat((-x2, x1), dim=dim)
    if form == "first half negated":       # (-x1, x2): the pattern's structure, other slices
        return torch.cat((-x1, x2), dim=dim)
    if form == "sign on the other half":   # (x2, -x1): the inverse rotation
        return torch.cat((x2, -x1), dim=dim)
    raise ValueError(form)


def _rope_unsqueezed(q, k, cos, sin, **rotate):
    """transformers' rotary after its cos.unsqueeze(1): cos and sin (B or 1, 1, S, D)."""
    return (q * cos + _rotate_half(q, **rotate) * sin, k * cos + _rotate_half(k, **rotate) * sin)


def _rope(q, k, cos, sin, **rotate):
    return _rope_unsqueezed(q, k, cos.unsqueeze(1), sin.unsqueeze(1), **rotate)


def _look_alikes(q, k, cos, sin, wide_cos, wide_sin):
    """q (B, 4, S, D), k (B, 2, S, D), cos and sin (B, S, D) whose halves differ."""
    half = q.shape[-1] // 2
    partial_q, partial_k = _rope(q[..., :half], k[..., :half], cos[..., :half], sin[..., :half])
    return {
        # computed exactly by the op: replaced
        "halves that differ": _rope(q, k, cos, sin),
        "partial rotary": (torch.cat((partial_q, q[..., half:]), -1),
                           torch.cat((partial_k, k[..., half:]), -1)),
        # another computation: left alone
        "first half negated": _rope(q, k, cos, sin, form="first half negated"),
        "sign on the other half": _rope(q, k, cos, sin, form="sign on the other half"),
        "another split": _rope(q, k, cos, sin, split=half - 3),
        "over dim 2": _rope(q, k, cos, sin, dim=2),
        "fp32 cos and sin": _rope(q, k, wide_cos, wide_sin),           # an fp32 result
        "one angle for all tokens": (q * cos[:, None, :1] + _rotate_half(q) * sin[:, None, :1],
                                     k * cos[:, None, :1] + _rotate_half(k) * sin[:, None, :1]),
    }


def test_look_alike_rotaries_are_left_alone_or_computed_exactly():
    """Only the forms the op computes exactly (a table whose halves differ; a rotary over the
    first half of D, the rest passed through) are replaced; every result stays eager's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    dtype = torch.float16
    q = random_tensor((2, 4, 6, 16), dtype, scale=1.0)
    k = random_tensor((2, 2, 6, 16), dtype, scale=1.0)
    angles = torch.rand(2, 6, 16, device=DEVICE) * 6.3     # no duplicated halves
    wide_cos, wide_sin = angles.cos(), angles.sin()
    cos, sin = wide_cos.to(dtype), wide_sin.to(dtype)
    with torch.no_grad():
        expected = _look_alikes(q, k, cos, sin, wide_cos, wide_sin)
        results = torch.compile(_look_alikes, backend="gemslib", fullgraph=True)(
            q, k, cos, sin, wide_cos, wide_sin)
    # the partial rotary's concatenations are gone too: the op rotates whole heads
    assert gemslib.fusion_report() == {"rotary": 2, "rotary_partial": 1}, gemslib.fusion_report()
    for name, want in expected.items():
        for got, wanted in zip(results[name], want):
            assert got.dtype == wanted.dtype and got.shape == wanted.shape, name
            error = ((got.float() - wanted.float()).abs().max() / wanted.float().abs().max()).item()
            assert error <= 2e-3, f"{name}: max error {error:.2e}"


def test_a_training_graph_of_rotary_keeps_its_gradients():
    """With gradients on, the forward graph's rotary is replaced; the backward (inductor's,
    from the joint graph) gives eager's gradients."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_model("llama", torch.float32, layers=1)
    ids = torch.randint(0, 96, (2, 7), device=DEVICE)
    model(ids).logits.square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.compile(model, backend="gemslib")(ids).logits.square().mean().backward()
    assert gemslib.fusion_report().get("rotary") == 1, gemslib.fusion_report()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item() + 1e-12)


def _check_on_trace(q, k, cos, sin, k_is_q=False, rotations="half", one_input=False,
                    **rotate):
    """The pattern's check on the whole trace of the rotary of q and k (``rotate``: the form
    of rotate_half), as if the matcher had matched it: what the check proves on its own,
    whatever the matcher's re-trace compares before it (``rotations``: the rotate_half
    pattern's check, or the interleaved one's). ``one_input``: q's rotary alone, both of the
    pattern's branches and inputs mapped onto it (as the matcher can map them)."""
    from types import SimpleNamespace

    from torch._inductor.pattern_matcher import fwd_only

    def traced(q, k, cos, sin):
        return _rope_unsqueezed(q, q if k_is_q else k, cos, sin, **rotate)

    graph = fwd_only(traced, [q, k, cos, sin]).graph
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    if one_input:
        graph = fwd_only(lambda q, cos, sin: _rope_unsqueezed(q, q, cos, sin, **rotate)[0],
                         [q, cos, sin]).graph
        q_node, cos_node, sin_node = [node for node in graph.nodes if node.op == "placeholder"]
        branch = [node for node in graph.nodes if node.op == "call_function"]
        match = SimpleNamespace(kwargs={"q": q_node, "k": q_node, "cos": cos_node,
                                        "sin": sin_node}, nodes=branch + branch)
        return rotary_passes._is_rotary(match, rotary_passes._half_rotations)
    match = SimpleNamespace(kwargs=dict(zip(("q", "k", "cos", "sin"), inputs)),
                            nodes=[node for node in graph.nodes if node.op == "call_function"])
    return rotary_passes._is_rotary(match, {"half": rotary_passes._half_rotations,
                                            "pairs": rotary_passes._pair_rotations}[rotations])


def test_the_check_alone_refuses_every_other_computation():
    half = torch.float16
    q, k = random_tensor((2, 4, 6, 16), half), random_tensor((2, 2, 6, 16), half)
    cos, sin = random_tensor((2, 1, 6, 16), half), random_tensor((1, 1, 6, 16), half)
    assert _check_on_trace(q, k, cos, sin)
    assert _check_on_trace(q.float(), k.float(), cos.float(), sin.float())
    assert not _check_on_trace(q, k, cos, sin, rotations="pairs")  # not the interleaved form
    for form in ({"form": "first half negated"}, {"form": "sign on the other half"},
                 {"split": 5}, {"dim": 2}):
        assert not _check_on_trace(q, k, cos, sin, **form), form
    # tables that do not broadcast as (B or 1, 1, S, D) over heads only, or of another dtype
    wider = random_tensor((3, 1, 6, 16), half)
    for q_, k_, cos_ in ((q, k, cos[:, :, :1]),                  # one angle for every token
                         (q[:, :2], k, random_tensor((2, 2, 6, 16), half)),  # per head
                         (q, k, cos.float()),                     # fp32: an fp32 result
                         (q[:1], k[:1], wider)):                  # a batch q does not have
        assert not _check_on_trace(q_, k_, cos_, sin), tuple(cos_.shape)
    assert not _check_on_trace(q, k.float(), cos, sin)        # q and k of two dtypes
    assert not _check_on_trace(q, k, cos, sin, k_is_q=True)   # one tensor matched twice
    assert not _check_on_trace(q, k, cos, sin, one_input=True)  # one rotary matched as both


# --------------------------------------------------------------------------------------------
# Graph rewrite: a decode step's rotary and its static cache's update -> rotary_into_cache
# --------------------------------------------------------------------------------------------


def _partial_rotaries(q, k, cos, sin):
    """A rotary over the first 8 of each head's 16 features, the rest concatenated back, as
    models write it, and look-alikes of that concatenation that are other computations (or
    keep the rotated half for another reader)."""
    q_half, k_half = _rope(q[..., :8], k[..., :8], cos[..., :8], sin[..., :8])
    return {
        "partial rotary": (torch.cat((q_half, q[..., 8:]), -1), torch.cat((k_half, k[..., 8:]), -1)),
        "the rest of another tensor": (torch.cat((q_half, (q + 1)[..., 8:]), -1),
                                       torch.cat((k_half, (k + 1)[..., 8:]), -1)),
        "the rest from further on": (torch.cat((q_half, q[..., 10:]), -1),
                                     torch.cat((k_half, k[..., 10:]), -1)),
        "the rest first": (torch.cat((q[..., 8:], q_half), -1), torch.cat((k[..., 8:], k_half), -1)),
        "the rotated half read again": (torch.cat((q_half, q[..., 8:]), -1),
                                        torch.cat((k_half, k[..., 8:]), -1), q_half.sum()),
    }


@pytest.mark.parametrize("form", ["partial rotary", "the rest of another tensor",
                                  "the rest from further on", "the rest first",
                                  "the rotated half read again"])
def test_a_partial_rotary_becomes_one_rotary_over_whole_heads_only_in_its_own_form(form):
    """``cat((rotary(q[..., :R]), q[..., R:]), -1)`` and k's alike (StableLM, GPT-NeoX, Phi,
    Persimmon, Nemotron) -> one rotary over the whole heads, which passes features past R
    through; a concatenation of anything else, or a rotated half another op reads, stays as
    it is. Every form gives eager's result."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    q = random_tensor((2, 4, 5, 16), torch.float32, scale=1.0)
    k = random_tensor((2, 2, 5, 16), torch.float32, scale=1.0)
    angles = torch.rand(2, 5, 16, device=DEVICE) * 6.3
    cos, sin = angles.cos(), angles.sin()

    def step(q, k, cos, sin):
        return _partial_rotaries(q, k, cos, sin)[form]

    with torch.no_grad():
        expected = step(q, k, cos, sin)
        got = torch.compile(step, backend="gemslib", fullgraph=True)(q, k, cos, sin)
    assert gemslib.fusion_report().get("rotary") == 1, gemslib.fusion_report()
    assert gemslib.fusion_report().get("rotary_partial", 0) == (form == "partial rotary"), \
        gemslib.fusion_report()
    for got_tensor, want in zip(got, expected):
        torch.testing.assert_close(got_tensor, want, rtol=1e-5, atol=1e-5)


def _cache_step(q, k, v, cos, sin, k_cache, v_cache, positions, mask, form="static cache"):
    """A decode step as transformers' static cache writes it: q, k (B, H, S, D) rotated by a
    per-token table (B, S, D), k and v written into (B, H, L, D) caches at rows ``positions``
    (in place: graph inputs copied back), and attention over the caches under a mask.
    ``form``: the step itself, or a look-alike the rewrite must leave alone."""
    if form == "partial rotary":  # the first half of each head rotated, the rest passed on
        half = q.shape[-1] // 2
        q_half, k_half = _rope(q[..., :half], k[..., :half], cos[..., :half], sin[..., :half])
        q_rot, k_rot = torch.cat((q_half, q[..., half:]), -1), torch.cat((k_half, k[..., half:]), -1)
    else:
        q_rot, k_rot = _rope(q, k, cos, sin)
    k_cache[:, :, positions] = k_rot
    v_cache[:, :, positions if form != "v at other rows" else positions.flip(0)] = v
    if form == "k written with accumulation":
        k_cache.index_put_((torch.arange(k.shape[0], device=k.device)[:, None, None],
                            torch.arange(k.shape[1], device=k.device)[None, :, None],
                            positions[None, None, :]), k_rot, accumulate=True)
    out = torch.nn.functional.scaled_dot_product_attention(q_rot, k_cache, v_cache,
                                                           attn_mask=mask)
    if form == "rotated k read again":
        return out, k_rot.sum()
    return out


def _cache_step_inputs():
    """A decode step's table (B2, 3 tokens, D16), fp32 caches of 9 positions (and copies for
    eager), the tokens' rows, and a mask over the caches that keeps position 0."""
    angles = torch.rand(2, 3, 16, device=DEVICE) * 6.3
    caches = [random_tensor((2, 2, 9, 16), torch.float32) for _ in range(2)]
    mask = torch.rand(2, 1, 3, 9, device=DEVICE) > 0.3
    mask[..., 0] = True
    return (angles.cos(), angles.sin(), caches, [c.clone() for c in caches],
            torch.tensor([4, 2, 7], device=DEVICE), mask)


_CACHE_STEP_FORMS = {"static cache": 1, "partial rotary": 1, "v at other rows": 0,
                     "rotated k read again": 0, "k written with accumulation": 0}


@pytest.mark.parametrize("form", sorted(_CACHE_STEP_FORMS))
def test_a_static_cache_update_goes_into_the_rotary_launch(form):
    """Only a rotated k read by nothing but its cache's update, paired with v's update at the
    same rows that the same attention reads, becomes rotary_into_cache; every form gives
    eager's outputs and caches, and the fused form updates the caches in place (inductor
    reinplaced it: no copy of a cache, and the op runs on the graph's cache inputs)."""
    from torch._inductor.fx_passes.reinplace import ReinplaceCounters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    ReinplaceCounters.clear()
    q, k, v = (random_tensor((2, 2, 3, 16), torch.float32, scale=1.0) for _ in range(3))
    cos, sin, caches, expected_caches, positions, mask = _cache_step_inputs()
    with torch.no_grad():
        expected = _cache_step(q, k, v, cos, sin, *expected_caches, positions, mask, form)
        compiled = torch.compile(functools.partial(_cache_step, form=form), backend="gemslib",
                                 fullgraph=True)
        got, (code,) = run_and_get_code(compiled, q, k, v, cos, sin, *caches, positions, mask)
    fused = _CACHE_STEP_FORMS[form]
    assert gemslib.fusion_report().get("rotary_into_cache", 0) == fused, gemslib.fusion_report()
    assert gemslib.fusion_report().get("rotary") == 1, gemslib.fusion_report()
    assert gemslib.fusion_report().get("rotary_partial", 0) == (form == "partial rotary")
    for got_tensor, want in zip(torch.utils._pytree.tree_leaves(got),
                                torch.utils._pytree.tree_leaves(expected)):
        torch.testing.assert_close(got_tensor, want, rtol=1e-5, atol=1e-5)
    for cache, want in zip(caches, expected_caches):
        torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5)
    on_inputs = caches_written_in_place(code)
    assert len(on_inputs) == fused, code
    assert ReinplaceCounters.get_total_missed_bytes() == 0


def _normed_cache_step(q_proj, k_proj, v, cos, sin, k_cache, v_cache, positions, mask,
                       q_weight, k_weight, gemma=False):
    """Qwen3's decode step over a static cache: each head of q and k RMS-normalised before
    the rotary, then :func:`_cache_step`; with ``gemma``, Gemma-3's: the (1 + w) norm in fp32
    after the heads' transpose."""
    from gemslib.passes.forms import transformers_rms_norm

    batch, seq, dim = q_proj.shape[0], q_proj.shape[1], q_weight.shape[0]
    if gemma:
        def norm(x, weight):
            x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
            return (x_hat * (1.0 + weight.float())).type_as(x)
        q = norm(q_proj.view(batch, seq, -1, dim).transpose(1, 2), q_weight)
        k = norm(k_proj.view(batch, seq, -1, dim).transpose(1, 2), k_weight)
    else:
        q = transformers_rms_norm(q_proj.view(batch, seq, -1, dim), q_weight,
                                  1e-6).transpose(1, 2)
        k = transformers_rms_norm(k_proj.view(batch, seq, -1, dim), k_weight,
                                  1e-6).transpose(1, 2)
    return _cache_step(q, k, v, cos, sin, k_cache, v_cache, positions, mask)


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
def test_a_static_cache_update_takes_the_per_head_norms_into_the_rotary_launch(gemma):
    """Qwen3's and Gemma-3's decode steps: the cache write goes into the rotary's launch, and
    then the per-head q/k norms too (rotary_into_cache with its weights, and Gemma's weight
    offset 1: one launch for norms, rotary and the cache update); outputs and caches are
    eager's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    q_proj, k_proj = (random_tensor((2, 3, 2 * 16), torch.float32, scale=1.0) for _ in range(2))
    v = random_tensor((2, 2, 3, 16), torch.float32, scale=1.0)
    weights = [torch.rand(16, device=DEVICE) + (-0.5 if gemma else 0.5) for _ in range(2)]
    cos, sin, caches, expected_caches, positions, mask = _cache_step_inputs()
    with torch.no_grad():
        expected = _normed_cache_step(q_proj, k_proj, v, cos, sin, *expected_caches, positions,
                                      mask, *weights, gemma)
        got = torch.compile(_normed_cache_step, backend="gemslib", fullgraph=True)(
            q_proj, k_proj, v, cos, sin, *caches, positions, mask, *weights, gemma)
    report = gemslib.fusion_report()
    assert report.get("rotary_into_cache") == 1 and report.get("rotary_qk_norm") == 1, report
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for cache, want in zip(caches, expected_caches):
        torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5)


def test_the_cache_write_rewrite_can_be_switched_off(monkeypatch):
    """GEMSLIB_ROTARY_INTO_CACHE=0 (the default of the option, read when a graph compiles)
    leaves the static cache's update to inductor: the rotary is still gemslib's, the results
    still eager's."""
    monkeypatch.setenv("GEMSLIB_ROTARY_INTO_CACHE", "0")
    _check_cache_write_left_to_inductor()


def test_the_cache_write_rewrite_is_switched_off_by_its_option():
    _check_cache_write_left_to_inductor({"gemslib.rotary_into_cache": False})


def _check_cache_write_left_to_inductor(options=None):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    q, k, v = (random_tensor((2, 2, 1, 16), torch.float32, scale=1.0) for _ in range(3))
    angles = torch.rand(2, 1, 16, device=DEVICE) * 6.3
    caches = [random_tensor((2, 2, 5, 16), torch.float32) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    positions, mask = torch.tensor([3], device=DEVICE), torch.ones(2, 1, 1, 5, dtype=torch.bool,
                                                                   device=DEVICE)
    args = (q, k, v, angles.cos(), angles.sin())
    with torch.no_grad():
        expected = _cache_step(*args, *expected_caches, positions, mask)
        got = torch.compile(_cache_step, backend="gemslib", fullgraph=True, options=options)(
            *args, *caches, positions, mask)
    assert gemslib.fusion_report() == {"rotary": 1, "attention": 1}, gemslib.fusion_report()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for cache, want in zip(caches, expected_caches):
        torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The interleaved rotary (GLM's, Helium's): the pairs' form
# --------------------------------------------------------------------------------------------


def _pair_rotation(x, negate_odd=True, pair_dim=-1):
    first, second = (-x[..., 1::2], x[..., ::2]) if negate_odd else (-x[..., ::2], x[..., 1::2])
    return torch.stack((first, second), dim=pair_dim).flatten(-2)


class _InterleavedRotary(torch.nn.Module):
    """GLM's / Helium's rotary (the interleaved rotate_half, the table's first half repeated
    per pair), on q and k (B, H, S, D), with and without the pass-through features of a
    partial rotary; and look-alikes: the other pair element negated (the inverse rotation),
    the pairs stacked on another dim (another layout)."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        rotation = {"inverse": lambda x: _pair_rotation(x, negate_odd=False),
                    "other_layout": lambda x: _pair_rotation(x, pair_dim=-2)}.get(
                        self.form, _pair_rotation)
        if self.form == "partial":
            rotated = cos.shape[-1] // 2
            cos, sin = cos[..., :rotated], sin[..., :rotated]
            (q, q_pass), (k, k_pass) = q.split([rotated, rotated], -1), k.split([rotated, rotated], -1)
            return (torch.cat([q * cos + rotation(q) * sin, q_pass], -1),
                    torch.cat([k * cos + rotation(k) * sin, k_pass], -1))
        return q * cos + rotation(q) * sin, k * cos + rotation(k) * sin


@pytest.mark.parametrize("form, fused", [
    ("full", True), ("partial", True), ("inverse", False), ("other_layout", False)])
def test_interleaved_rotary_runs_rotary(form, fused):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _InterleavedRotary(form)
    q, k = (torch.randn(2, heads, 5, 16, device=DEVICE) for heads in (4, 2))
    cos, sin = (torch.randn(1, 5, 16, device=DEVICE) for _ in range(2))
    with torch.no_grad():
        expected = module(q, k, cos, sin)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q, k, cos, sin)
    assert gemslib.fusion_report() == ({"rotary": 1} if fused else {}), gemslib.fusion_report()
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5)


class _HeadNormsThenRotary(torch.nn.Module):
    """Qwen3's attention input: q and k projections viewed as heads, each head RMS-normalised
    (transformers' RMSNorm over head_dim), transposed to head-major, rotated; Gemma-3's, its
    (1 + w) norm applied after the transpose; and forms that must keep their norms: k's norm
    with another eps, q's normalised heads read again, q's norm Gemma's and k's Qwen's."""

    def __init__(self, form, dim=16):
        super().__init__()
        self.form = form
        self.q_weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.k_weight = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, q_proj, k_proj, cos, sin):
        from gemslib.passes.forms import transformers_rms_norm

        batch, seq, dim = q_proj.shape[0], q_proj.shape[1], self.q_weight.shape[0]
        if self.form in ("gemma3", "mixed_offsets"):
            def gemma_norm(x, weight):  # Gemma3RMSNorm's arithmetic: x_hat * (1 + w) in fp32
                x32 = x.float()
                x_hat = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
                return (x_hat * (1.0 + weight.float())).type_as(x)
            q = gemma_norm(q_proj.view(batch, seq, -1, dim).transpose(1, 2), self.q_weight)
            if self.form == "gemma3":
                k = gemma_norm(k_proj.view(batch, seq, -1, dim).transpose(1, 2), self.k_weight)
            else:
                k = transformers_rms_norm(k_proj.view(batch, seq, -1, dim), self.k_weight,
                                          1e-6).transpose(1, 2)
            return _rope(q, k, cos, sin)
        q_heads = transformers_rms_norm(q_proj.view(batch, seq, -1, dim), self.q_weight, 1e-6)
        k_eps = 1e-5 if self.form == "other_eps" else 1e-6
        k_heads = transformers_rms_norm(k_proj.view(batch, seq, -1, dim), self.k_weight, k_eps)
        q, k = _rope(q_heads.transpose(1, 2), k_heads.transpose(1, 2), cos, sin)
        if self.form == "normed_read_again":
            return q, k, q_heads * 2
        return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form, fused", [("qwen3", True), ("gemma3", True), ("other_eps", False),
                                         ("normed_read_again", False),
                                         ("mixed_offsets", False)])
def test_per_head_norms_before_the_rotary_run_in_its_launch(form, fused, dtype):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _HeadNormsThenRotary(form).to(DEVICE, dtype)
    q_proj = torch.randn(2, 5, 4 * 16, device=DEVICE, dtype=dtype)
    k_proj = torch.randn(2, 5, 2 * 16, device=DEVICE, dtype=dtype)
    angles = torch.rand(2, 5, 16, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.no_grad():
        expected = module(q_proj, k_proj, cos, sin)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q_proj, k_proj, cos, sin)
    report = gemslib.fusion_report()
    assert report.get("rotary_qk_norm", 0) == int(fused), report
    assert report.get("rotary") == 1 and report.get("rms_norm") == 2, report
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.allclose(g.float(), e.float(), atol=4e-3 * e.abs().max().item())
