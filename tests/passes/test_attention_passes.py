"""Graph rewrite: torch.compile(backend="gemslib") puts SDPA on gemslib's attention where
its mask is proven causal or full (or, for one query row, a key mask decode_attention takes),
and leaves every other SDPA to inductor."""

import pytest
import torch
import torch.nn.functional as F

import gemslib
from helpers import DEVICE, random_tensor


class _MaskedAttention(torch.nn.Module):
    """SDPA under a mask built from index comparisons, the way transformers builds its own:
    key j visible to query i when ``j <= i + shift`` (and ``j > i + shift - window``), or
    under ``compare`` instead of ``<=``."""

    def __init__(self, shift=0, window=None, compare=torch.le, hidden=None):
        super().__init__()
        self.shift, self.window, self.compare, self.hidden = shift, window, compare, hidden

    def forward(self, q, k, v):
        keys = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        queries = torch.arange(q.shape[2], device=q.device)[None, None, :, None]
        visible = self.compare(keys, queries + self.shift)
        if self.window is not None:
            visible = visible & (keys > queries + self.shift - self.window)
        if self.hidden is not None:  # an additive mask: 0 where visible
            visible = torch.where(visible, 0.0, self.hidden).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


@pytest.mark.parametrize("seq_q, seq_kv, shift, window, compare, fused", [
    (9, 9, 0, None, torch.le, True),        # causal
    (9, 9, 0, 9, torch.le, True),           # a window wider than the sequence hides nothing
    (9, 9, 0, 4, torch.le, True),           # a sliding window: the kernel's window 4
    (9, 9, 1, 3, torch.lt, True),           # i - 3 < j < i + 1: window 3 written another way
    (9, 9, 2, 4, torch.le, False),          # a window whose right edge is past the diagonal
    (9, 9, 1, None, torch.lt, True),        # j < i + 1: causal written another way
    (9, 9, 0, None, torch.lt, False),       # j < i: the diagonal hidden
    (9, 9, 0, None, torch.ge, False),       # anti-causal
    (1, 9, 8, None, torch.le, True),        # one query that sees every key (decode)
    (3, 9, 6, None, torch.le, False),       # bottom-right causal: not the kernel's alignment
])
def test_sdpa_masks_that_are_proven_causal_or_full_are_fused(seq_q, seq_kv, shift, window,
                                                             compare, fused):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _MaskedAttention(shift, window, compare)
    torch.manual_seed(0)
    q = random_tensor((2, 4, seq_q, 16), torch.float32, scale=1.0)
    k, v = (random_tensor((2, 4, seq_kv, 16), torch.float32, scale=1.0) for _ in range(2))
    with torch.no_grad():
        expected = module(q, k, v)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q, k, v)
    assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()
    finite = expected.isfinite()  # a row that sees no key is NaN either way
    assert torch.equal(finite, got.isfinite())
    assert torch.allclose(got[finite], expected[finite], atol=1e-5)


@pytest.mark.parametrize("hidden, fused", [(float("-inf"), True), (-3.4028234663852886e38, True),
                                           (-65536.0, True), (-1e4, False)])
def test_additive_causal_masks_hide_with_minus_inf_or_the_lowest_number(hidden, fused):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _MaskedAttention(hidden=hidden)
    q, k, v = (random_tensor((1, 2, 7, 16), torch.float32, scale=1.0) for _ in range(3))
    with torch.no_grad():
        expected = module(q, k, v)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q, k, v)
    assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()
    assert torch.allclose(got, expected, atol=1e-5)


class _PaddedMaskAttention(torch.nn.Module):
    """SDPA under transformers' additive causal mask with its key axis padded and sliced, as
    the efficient backend's graph holds it: padded to a multiple of 16 and cut back to its
    length (the same mask), or padded by one hidden key in front and cut at the end (a mask
    shifted one key right: query i sees keys 1 to i + 1). The shifted view
    starts at its storage's start: a view one element in would be misaligned for the
    efficient kernel, which crashes on it in eager torch."""

    def __init__(self, shifted):
        super().__init__()
        self.shifted = shifted

    def forward(self, q, k, v):
        keys = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        queries = torch.arange(q.shape[2], device=q.device)[None, None, :, None]
        mask = torch.where(keys <= queries, 0.0, float("-inf"))
        if self.shifted:
            mask = F.pad(mask, (1, 0), value=float("-inf"))[..., :-1]
        else:
            mask = F.pad(mask, (0, -k.shape[2] % 16))[..., :k.shape[2]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("shifted, fused", [(False, True), (True, False)])
def test_a_mask_padded_and_cut_back_is_read_through(shifted, fused):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _PaddedMaskAttention(shifted)
    compiled = torch.compile(module, backend="gemslib", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for seq in (7, 12):  # symbolic lengths: the mask is read from its index arithmetic
            q, k, v = (random_tensor((1, 2, seq, 16), torch.float32, scale=1.0)
                       for _ in range(3))
            expected, got = module(q, k, v), compiled(q, k, v)
            finite = expected.isfinite()
            assert torch.equal(finite, got.isfinite())
            assert torch.allclose(got[finite], expected[finite], atol=1e-5)
    assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()


@pytest.mark.parametrize("mask_shape, additive, fused", [
    ((3, 1, 1, 40), False, True),    # a static cache's visible positions, per sequence
    ((1, 1, 1, 40), False, True),    # one mask for the batch
    ((3, 1, 1, 40), True, True),     # where(mask, 0, -inf)
    ((3, 4, 1, 40), False, False),   # a mask per head: not decode_attention's
])
def test_one_query_row_under_a_boolean_key_mask_runs_decode_attention(mask_shape, additive,
                                                                      fused):
    """A decode step against a whole static cache under a boolean mask that is a graph input
    (values unknown when compiling): decode_attention with that mask as its key mask, for a
    mask of the visible positions per sequence or for the batch; the first sequence sees no
    key at all (0, as SDPA gives)."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()

    def step(q, k, v, mask):
        if additive:
            mask = torch.where(mask, 0.0, float("-inf"))
        return F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                              v.repeat_interleave(2, 1), attn_mask=mask)

    q = random_tensor((3, 4, 1, 16), torch.float32, scale=1.0)
    k, v = (random_tensor((3, 2, 40, 16), torch.float32, scale=1.0) for _ in range(2))
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(3)) < 0.4
    if mask_shape[0] == 3:
        mask[0] = False
    mask = mask.to(q.device)
    with torch.no_grad():
        expected = step(q, k, v, mask)
        got = torch.compile(step, backend="gemslib", fullgraph=True)(q, k, v, mask)
    assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("head_dim, fused", [(256, True), (288, False)])
def test_heads_wider_than_the_kernels_take_are_left_to_sdpa(head_dim, fused):
    """Past MAX_HEAD_DIM features the op would run torch's math (the scores whole): SDPA
    keeps such a site, eager or SDPA form, and the result is right either way."""
    def eager(q, k, v):
        weights = torch.softmax((q @ k.transpose(-1, -2)) * 0.1, dim=-1, dtype=torch.float32)
        return weights.to(q.dtype) @ v

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (random_tensor((1, 2, 5, head_dim), torch.float32, scale=1.0) for _ in range(3))
    for form in (sdpa, eager):
        torch._dynamo.reset()
        gemslib.reset_fusion_report()
        with torch.no_grad():
            got = torch.compile(form, backend="gemslib", fullgraph=True)(q, k, v)
        assert gemslib.fusion_report().get("attention", 0) == fused, (form.__name__,
                                                                      gemslib.fusion_report())
        assert torch.allclose(got, form(q, k, v), atol=1e-5)


def test_sdpa_with_dropout_or_a_float_mask_is_left_alone():
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    q, k, v = (random_tensor((1, 2, 5, 8), torch.float32, scale=1.0) for _ in range(3))
    bias = random_tensor((5, 5), torch.float32, scale=1.0)
    with torch.no_grad():
        got = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, bias),
                            backend="gemslib", fullgraph=True)(q, k, v)
    assert "attention" not in gemslib.fusion_report()
    assert torch.allclose(got, F.scaled_dot_product_attention(q, k, v, bias), atol=1e-5)


# --------------------------------------------------------------------------------------------
# transformers' eager attention (attn_implementation="eager"), Gemma-2's logit cap included
# --------------------------------------------------------------------------------------------


class _EagerAttention(torch.nn.Module):
    """transformers' Gemma-2 eager attention (matmul, scale, ``tanh`` cap, additive mask,
    fp32 softmax, matmul) over grouped K/V, under a causal mask with an optional sliding
    ``window``, a random float ``bias`` instead, or no mask; ``cap_form`` (divisor,
    multiplier) writes the cap by hand instead (a look-alike when they differ); with
    ``weights`` the softmax weights are returned too."""

    def __init__(self, softcap=None, mask="causal", window=None, cap_form=None, weights=False):
        super().__init__()
        self.head_dim, self.num_key_value_groups, self.scaling = 16, 2, 0.3
        self.softcap, self.mask, self.window = softcap, mask, window
        self.cap_form, self.weights = cap_form, weights

    def forward(self, q, k, v):
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
        keys = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        queries = torch.arange(q.shape[2], device=q.device)[None, None, :, None]
        visible = keys <= queries
        if self.window is not None:
            visible = visible & (keys > queries - self.window)
        mask = torch.where(visible, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        if self.mask == "bias":
            mask = torch.linspace(-1, 1, q.shape[2] * k.shape[2], device=q.device).view(
                1, 1, q.shape[2], k.shape[2]).to(q.dtype)
        if self.cap_form is not None:
            divisor, multiplier = self.cap_form
            scores = torch.matmul(q, k.repeat_interleave(2, 1).transpose(2, 3)) * self.scaling
            scores = torch.tanh(scores / divisor) * multiplier + mask
            weights = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
            return torch.matmul(weights, v.repeat_interleave(2, 1))
        out, weights = eager_attention_forward(self, q, k, v, None if self.mask is None else mask,
                                               scaling=self.scaling, softcap=self.softcap)
        return (out, weights) if self.weights else out


@pytest.fixture(params=["inductor's patterns", "without them"])
def inductor_attention_patterns(request):
    """Both ways eager attention reaches the passes: rewritten to SDPA by inductor's own
    attention patterns first (as on the CPU), or left as it is, its scaled softmax rewritten
    by inductor into ``(x - amax(x)) * scale`` (as for fp32 on a GPU without TF32, where
    inductor skips its patterns)."""
    from torch._inductor.fx_passes import fuse_attention

    check = fuse_attention._sfdp_params_check
    code = check.__code__
    if request.param == "without them":
        check.__code__ = (lambda match: False).__code__
    try:
        yield request.param
    finally:
        check.__code__ = code


@pytest.mark.parametrize("softcap, mask, window, cap_form, weights, fused", [
    (2.0, "causal", None, None, False, True),     # Gemma-2's capped causal layer
    (2.0, "causal", 4, None, False, True),        # its capped sliding-window layer
    (None, "causal", None, None, False, True),    # any model's eager attention
    (None, None, None, None, False, True),        # no mask: every key
    (2.0, "bias", None, None, False, False),      # a float bias: left to inductor
    (None, "causal", None, (2.0, 3.0), False, False),  # tanh(s / 2) * 3: not a cap
    (None, "causal", None, (2.0, 2.0), False, True),   # the cap written by hand
    (2.0, "causal", None, None, True, False),     # the weights returned: not fusible
], ids=["cap", "cap-window", "causal", "no-mask", "bias", "not-a-cap", "cap-by-hand",
        "weights-returned"])
def test_eager_attention_runs_gemslib_attention_with_its_cap_and_window(
        softcap, mask, window, cap_form, weights, fused, inductor_attention_patterns):
    """The eager form fuses under the masks SDPA's does, its tanh cap as the kernel's softcap
    (the result matches eager's, and differs from the uncapped one: the cap is computed) and
    its window as the kernel's; look-alikes and a returned softmax stay inductor's, right."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _EagerAttention(softcap, mask, window, cap_form, weights)
    torch.manual_seed(0)
    q = random_tensor((2, 4, 9, 16), torch.float32, scale=3.0)
    k, v = (random_tensor((2, 2, 9, 16), torch.float32, scale=3.0) for _ in range(2))
    with torch.no_grad():
        expected = module(q, k, v)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q, k, v)
        uncapped = _EagerAttention(None, mask, window)(q, k, v)
    assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()
    for g, e in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expected))):
        assert torch.allclose(g, e, atol=1e-5), (g - e).abs().max()
    if softcap:
        assert (uncapped - (expected[0] if weights else expected)).abs().max() > 1e-2


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["no-cap", "cap"])
def test_one_query_row_of_eager_attention_under_a_key_mask_runs_decode_attention(softcap):
    """A static cache's decode step in eager attention (Gemma-2's, capped or not): one query
    row under the additive form of a boolean key mask that is a graph input -> decode_attention
    with that mask and the cap; every sequence sees some key (eager averages the values of a
    row that sees none, where decode_attention gives 0, as for SDPA's boolean mask)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    class Step(torch.nn.Module):
        head_dim, num_key_value_groups = 16, 2

        def forward(self, q, k, v, mask):
            additive = torch.where(mask, 0.0, torch.finfo(q.dtype).min)
            return eager_attention_forward(self, q, k, v, additive, scaling=0.3,
                                           softcap=softcap)[0]

    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    q = random_tensor((3, 4, 1, 16), torch.float32, scale=3.0)
    k, v = (random_tensor((3, 2, 40, 16), torch.float32, scale=3.0) for _ in range(2))
    mask = torch.rand((3, 1, 1, 40), generator=torch.Generator().manual_seed(3)) < 0.4
    mask[:, :, :, 0] = True
    mask = mask.to(q.device)
    step = Step().eval()
    with torch.no_grad():
        expected = step(q, k, v, mask)
        got = torch.compile(step, backend="gemslib", fullgraph=True)(q, k, v, mask)
    assert gemslib.fusion_report().get("attention", 0) == 1, gemslib.fusion_report()
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def _eager_attention_cuda_form(q, k, v):
    """Capped eager attention as inductor's CUDA post-grad graph holds it: the softmax's max
    and sum from one prepare_softmax_online (its pass runs before gemslib's on CUDA only)."""
    from torch._inductor import inductor_prims

    k, v = (t[:, :, None].expand(2, 2, 2, 9, 16).reshape(2, 4, 9, 16) for t in (k, v))
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.3 / 2.0) * 2.0
    row_max, total = inductor_prims.prepare_softmax_online(scores, -1)
    return torch.matmul(torch.exp(scores - row_max) / total, v)


def test_eager_attention_is_read_through_the_online_softmax_of_cuda_graphs():
    """The rewrite on a graph of that form (traced here, on any device): one site, the
    kernel reading the grouped K/V (repeat_kv's copies gone), the result eager's."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from gemslib.passes import attention as attention_passes

    q = random_tensor((2, 4, 9, 16), torch.float32, scale=3.0)
    k, v = (random_tensor((2, 2, 9, 16), torch.float32, scale=3.0) for _ in range(2))
    traced = make_fx(_eager_attention_cuda_form, tracing_mode="fake")(q, k, v)
    assert len(attention_passes._fuse_eager(traced.graph, None)) == 1
    traced.graph.eliminate_dead_code()
    traced.recompile()
    targets = [node.target for node in traced.graph.nodes]
    assert torch.ops.gemslib.attention.default in targets
    assert torch.ops.aten.clone.default not in targets and torch.ops.aten.bmm.default not in targets
    assert torch.allclose(traced(q, k, v), _eager_attention_cuda_form(q, k, v), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemma2_in_eager_mode_fuses_its_capped_and_windowed_attention(dtype):
    """A tiny Gemma-2 with attn_implementation="eager", a cap that matters (1.0) and a window
    shorter than the prompt: both layers' attention on gemslib's kernel, the other forms
    fused as under SDPA, logits within the dtype's rounding of eager's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma2Config(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, sliding_window=4, attn_logit_softcapping=1.0,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval().to(DEVICE, dtype)
    for layer in model.model.layers:  # scores beyond the cap
        layer.self_attn.q_proj.weight.data.mul_(4)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    ids = torch.randint(3, 96, (2, 11), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits.float()
    # every form once a layer: one rotary launch for q and k each (not q's rotary matched
    # as both of the pattern's branches)
    assert gemslib.fusion_report() == {
        "attention": 2, "rotary": 2, "merged_linear": 4, "gelu_and_mul": 2, "add_rms_norm": 4,
        "rms_norm": 5}, gemslib.fusion_report()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit"
