"""decode_attention: split-KV decode against float64 references, lengths, inputs, custom op."""

import re

import pytest
import torch

import gemslib
from helpers import ON_GPU, assert_device_side_assert, random_tensor, opcheck_overloads
from gemslib import runtime
from gemslib.runtime import cuda
from gemslib.accuracy import assert_close_to_reference, tolerance
from gemslib.fused import decode_attention as decode_ops

# interpreter: fp16/fp32 (bf16 tl.dot is wrong there); GPU: bf16 too
DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]


# (B, Hq, Hkv, L, D, Dv, seqlens or None)
DECODE_CASES = [
    (2, 4, 2, 150, 32, 32, [150, 37]),     # ragged, GQA groups of 2
    (3, 8, 1, 90, 16, 24, [1, 0, 90]),     # length 1, an empty sequence, MQA, Dv != D
    (1, 6, 6, 33, 64, 64, None),           # no grouping, the whole cache
    (1, 4, 1, 200, 32, 32, [150]),         # two splits, the second partly filled
    (1, 4, 1, 200, 32, 32, [100]),         # two splits, the second empty
]
if ON_GPU:
    DECODE_CASES += [(16, 32, 8, 8192, 128, 128, None), (1, 32, 8, 32768, 128, 128, [30000])]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_reference(case, dtype):
    batch, n_q, n_kv, cache_len, dim, dim_v, lengths = case
    q = random_tensor((batch, n_q, dim), dtype, scale=1.0)
    k_cache = random_tensor((batch, n_kv, cache_len, dim), dtype, scale=1.0)
    v_cache = random_tensor((batch, n_kv, cache_len, dim_v), dtype, scale=1.0)
    seqlens = None if lengths is None else torch.tensor(lengths, device=q.device)
    out = gemslib.decode_attention(q, k_cache, v_cache, seqlens)
    expected = decode_ops.decode_attention_reference(q.double(), k_cache.double(),
                                                     v_cache.double(), seqlens)
    assert out.shape == (batch, n_q, dim_v) and out.dtype == dtype
    rtol = tolerance(dtype)["rtol"]
    torch.testing.assert_close(out.double(), expected, rtol=rtol,
                               atol=rtol * v_cache.abs().max().item())


def test_decode_splits_the_cache_over_programs():
    """The config's programs per SM (the interpreter counts one SM), rounded down to whole
    waves, never a split shorter than one block of keys, none when the heads alone fill the
    GPU, and at most 256."""
    sms = runtime.multiprocessor_count(0) if ON_GPU else 1
    assert decode_ops._decode_splits(1, 10_000_000, 64, 0, 2) == min(2 * sms, 256)
    assert decode_ops._decode_splits(3, 10_000_000, 64, 0, 8) == min(8 * sms // 3, 256)
    assert decode_ops._decode_splits(sms + 1, 10_000_000, 64, 0, 2) == 1  # not 2: a 2nd wave
    assert decode_ops._decode_splits(1, 100, 64, 0, 2) == min(2 * sms, 2)
    assert decode_ops._decode_splits(2 * sms, 10_000, 64, 0, 2) == 1
    assert decode_ops._decode_splits(1, 10_000_000, 16, 0, 1000) == 256


def test_few_kv_heads_take_the_bucket_bounded_by_kv_heads(config_file):
    """A bucket bounded by kv_heads (B x Hkv: the programs before the cache is split) takes the
    calls with that few and no more; each runs right with its config."""
    config_file("""
        schema: 1
        device: test
        ops:
          decode_attention:
            decode_attention:
              - max: {kv_heads: 4}
                config: {BLOCK_N: 16, PROGRAMS_PER_SM: 3, num_warps: 4, num_stages: 1}
              - config: {BLOCK_N: 32, PROGRAMS_PER_SM: 1, num_warps: 4, num_stages: 1}
    """)
    decode_ops.DECODE.clear_cache()
    rtol = tolerance(torch.float32)["rtol"]
    for batch, block_n in ((2, 16), (3, 32)):  # 4 and 6 (batch, KV head) pairs
        q = random_tensor((batch, 4, 32), torch.float32, scale=1.0)
        k, v = (random_tensor((batch, 2, 96, 32), torch.float32, scale=1.0) for _ in range(2))
        plan = decode_ops._launch_plan(q, k, v, False, 32 ** -0.5)
        assert plan.config.meta_dict["BLOCK_N"] == block_n, (batch, plan.config)
        out = gemslib.decode_attention(q, k, v)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double())
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())


def test_a_growing_cache_keeps_one_compiled_launch_per_specialisation(monkeypatch):
    """Decode calls over a cache one position longer each time (a dynamic cache's steps) each
    give their own attention; on a GPU they share the kept compiled launches of their
    specialisation (a length divisible by 16 or not), so after the first of each the launch no
    longer goes through Triton."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: 4)
    decode_ops.DECODE.clear_cache()
    q = random_tensor((2, 4, 32), torch.float32, scale=1.0)
    full = random_tensor((2, 2, 240, 32), torch.float32, scale=1.0)
    rtol = tolerance(torch.float32)["rtol"]
    for length in range(200, 240):
        k = full[:, :, :length].contiguous()
        out = gemslib.decode_attention(q, k, k)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), k.double())
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * k.abs().max().item())
    assert len(decode_ops.DECODE._compiled) <= 2, len(decode_ops.DECODE._compiled)


def test_decode_merges_splits_in_one_launch_and_leaves_its_counters_at_zero(monkeypatch):
    """Several splits per KV head: the last split to arrive merges them and resets its
    counter, so repeated calls (reusing the counters) give the same answer, in one launch."""
    q = random_tensor((2, 4, 32), torch.float32)
    k = random_tensor((2, 1, 300, 32), torch.float32)
    v = random_tensor((2, 1, 300, 32), torch.float32)
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: 4)  # 128-key splits
    launches = []
    original = decode_ops.DECODE.replay
    monkeypatch.setattr(decode_ops.DECODE, "replay", lambda key, config, grid, *args: (
        launches.append(grid), original(key, config, grid, *args)))
    first = gemslib.decode_attention(q, k, v, torch.tensor([300, 130], device=q.device))
    second = gemslib.decode_attention(q, k, v, torch.tensor([300, 130], device=q.device))
    assert launches == [(3, 2), (3, 2)]  # 3 splits of 128 keys x (B * Hkv), once per call
    assert torch.equal(first, second)
    expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                     torch.tensor([300, 130]))
    assert_close_to_reference(first, expected, torch.float32, reduction_len=300)
    for counters, _ in cuda._split_scratch_cache.values():
        assert not counters.any()


def test_decode_merges_many_splits_in_chunks_for_a_group_that_is_not_a_power_of_two(monkeypatch):
    """40 splits of 64 keys, merged 8 at a time (Dv 256, 4 members), for 3 query heads per KV
    head (one padded member of the merge masked off); a sequence that ends in the first split
    leaves 39 empty ones."""
    q = random_tensor((2, 3, 16), torch.float32)
    k = random_tensor((2, 1, 2560, 16), torch.float32)
    v = random_tensor((2, 1, 2560, 256), torch.float32)
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: 40)
    seqlens = torch.tensor([2500, 7], device=q.device)
    with decode_ops.DECODE.forced(runtime.LaunchConfig((("BLOCK_N", 64),
                                                         ("PROGRAMS_PER_SM", 2)), 4, 1)):
        out = gemslib.decode_attention(q, k, v, seqlens)
    expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                     seqlens.cpu())
    assert_close_to_reference(out, expected, torch.float32, reduction_len=2500)


def test_decode_repeated_layout_with_caches_at_other_alignments():
    """Decode steps replay the compiled kernel of their layout; a step whose caches start at
    an address Triton did not specialise for (one element past 16 bytes) gets its own."""
    q = random_tensor((2, 4, 32), torch.float16)
    storage = random_tensor((2 * 2 * 2 * 300 * 32 + 1,), torch.float16, scale=1.0)
    outputs = []
    for offset in (0, 1, 0):
        caches = storage[offset:offset + storage.numel() - 1].view(2, 2, 2, 300, 32)
        k, v = caches[0], caches[1]
        out = gemslib.decode_attention(q, k, v)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double())
        rtol = tolerance(torch.float16)["rtol"]
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[2])


_BAD_LENGTHS_ON_GPU = r"""
import torch, gemslib
q = torch.randn(3, 2, 16, device="cuda")
k = torch.randn(3, 1, 40, 16, device="cuda")
gemslib.decode_attention(q, k, k, torch.tensor(LENGTHS, device="cuda"))
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("lengths", [[-5, 10, 40], [3, 41, 40], [0, 1000, 7]])
def test_decode_rejects_lengths_outside_the_cache(lengths):
    """A length outside [0, L] is an error, never a silent clamp or a read past the cache: on
    the CPU a ValueError (the kernel path and torch's, for float64), on a GPU the kernel's
    device-side assert (in a subprocess: it leaves the CUDA context unusable)."""
    if ON_GPU:
        assert_device_side_assert(_BAD_LENGTHS_ON_GPU.replace("LENGTHS", str(lengths)),
                                  "seqlens must be in [0, L]")
        return
    for dtype in (torch.float32, torch.float64):
        q = random_tensor((3, 2, 16), dtype)
        k = random_tensor((3, 1, 40, 16), dtype)
        with pytest.raises(ValueError, match=r"seqlens must be in \[0, 40\]"):
            gemslib.decode_attention(q, k, k, torch.tensor(lengths))


def test_decode_lengths_at_the_ends_of_the_range():
    """0 (no keys: zeros) and L (the whole cache) are valid lengths."""
    q = random_tensor((3, 2, 16), torch.float32)
    k = random_tensor((3, 1, 40, 16), torch.float32)
    lengths = torch.tensor([0, 40, 17], device=q.device)
    out = gemslib.decode_attention(q, k, k, lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = decode_ops.decode_attention_reference(q.double(), k.double(), k.double(),
                                                     lengths)
    assert_close_to_reference(out, expected, torch.float32, reduction_len=40)


def test_decode_agrees_with_prefill_attention_of_one_query():
    q = random_tensor((2, 4, 32), torch.float32)
    k = random_tensor((2, 2, 70, 32), torch.float32)
    v = random_tensor((2, 2, 70, 32), torch.float32)
    prefill = gemslib.attention(q[:, :, None], k, v)[:, :, 0]
    assert_close_to_reference(gemslib.decode_attention(q, k, v), prefill.double(), torch.float32,
                              reduction_len=70)


def test_decode_bad_inputs_name_the_argument():
    q = random_tensor((2, 4, 16), torch.float32)
    cache = random_tensor((2, 2, 10, 16), torch.float32)
    with pytest.raises(ValueError, match="gemslib.decode_attention: q must be"):
        gemslib.decode_attention(q[0], cache, cache)
    for lengths in (torch.tensor([1.0, 2.0]), torch.tensor([True, False]), [1, 2]):
        with pytest.raises(ValueError, match="seqlens must be an integer tensor of shape"):
            gemslib.decode_attention(q, cache, cache,
                                     lengths.to(q.device) if torch.is_tensor(lengths) else lengths)
    with pytest.raises(ValueError, match="gemslib.decode_attention: q's 4 heads must be"):
        gemslib.decode_attention(q, cache[:, :1].expand(2, 3, 10, 16), cache[:, :1].expand(2, 3, 10, 16))


def test_decode_inputs_that_need_grad_get_gradients_through_torch():
    q = random_tensor((1, 4, 16), torch.float32).requires_grad_()
    k = random_tensor((1, 2, 11, 16), torch.float32).requires_grad_()
    gemslib.decode_attention(q, k, k).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_head_dim_zero_averages_the_values():
    """D = 0: every score is 0, so each query averages the values of its KV head (what SDPA
    gives)."""
    q = random_tensor((2, 4, 0), torch.float32)
    k = random_tensor((2, 2, 7, 0), torch.float32)
    v = random_tensor((2, 2, 7, 6), torch.float32)
    decoded = gemslib.decode_attention(q, k, v)
    torch.testing.assert_close(decoded, v.mean(2).repeat_interleave(2, 1))


def test_scale_is_checked_as_torch_does():
    q = random_tensor((1, 2, 3, 8), torch.float32)
    with pytest.raises(TypeError, match="gemslib.decode_attention\\(\\): argument 'scale' must "
                                        "be float or None, not str"):
        gemslib.decode_attention(q[:, :, 0], q, q, scale="0.1")


def test_bf16_calls_are_right_on_every_backend():
    """bf16: the kernel on a GPU; under the interpreter (whose bf16 tl.dot is wrong) torch."""
    q = random_tensor((1, 4, 16), torch.bfloat16, scale=1.0)
    k = random_tensor((1, 2, 12, 16), torch.bfloat16, scale=1.0)
    v = random_tensor((1, 2, 12, 16), torch.bfloat16, scale=1.0)
    expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double())
    assert_close_to_reference(gemslib.decode_attention(q, k, v), expected, torch.bfloat16,
                              reduction_len=12, term_scale=v.abs().max().item())


def test_custom_op_passes_opcheck():
    q = random_tensor((1, 4, 16), torch.float32)
    k = random_tensor((1, 2, 11, 16), torch.float32)
    opcheck_overloads(torch.ops.gemslib.decode_attention,
                      (q, k, k, torch.tensor([11], device=q.device), 0.25, None))
    mask = torch.rand(1, 11, device=q.device) < 0.5
    opcheck_overloads(torch.ops.gemslib.decode_attention, (q, k, k, None, 0.25, mask))
    opcheck_overloads(torch.ops.gemslib.decode_attention, (q, k, k, None, 0.25, mask, 4, 3.0))


def _key_masks(batch, cache_len, device):
    """Per sequence: a left-padded prefix (padding, then the valid tokens, then the unused
    cache), a random pattern, and nothing visible at all."""
    generator = torch.Generator().manual_seed(7)
    positions = torch.arange(cache_len)
    masks = [(positions >= 70) & (positions < 190),
             torch.rand(cache_len, generator=generator) < 0.3,
             torch.zeros(cache_len, dtype=torch.bool)]
    return torch.stack([masks[b % len(masks)] for b in range(batch)]).to(device)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_a_key_mask_keeps_only_its_positions(dtype, splits, monkeypatch):
    """key_mask[b, j] False hides key j of sequence b, as SDPA's boolean mask does for one
    query row; blocks it hides entirely (the padding, the unused cache) are skipped, and a
    sequence that sees no key gives 0. With lengths too, both apply."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: splits)
    q = random_tensor((3, 4, 32), dtype, scale=1.0)
    k = random_tensor((3, 2, 256, 32), dtype, scale=1.0)
    v = random_tensor((3, 2, 256, 32), dtype, scale=1.0)
    mask = _key_masks(3, 256, q.device)
    rtol = tolerance(dtype)["rtol"]
    for seqlens in (None, torch.tensor([150, 256, 10], device=q.device)):
        out = gemslib.decode_attention(q, k, v, seqlens, key_mask=mask)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                         seqlens, key_mask=mask)
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
        assert torch.equal(out[2], torch.zeros_like(out[2]))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, :, None], k.double().repeat_interleave(2, 1),
        v.double().repeat_interleave(2, 1), attn_mask=mask[:, None, None])[:, :, 0]
    torch.testing.assert_close(gemslib.decode_attention(q, k, v, key_mask=mask).double(), sdpa,
                               rtol=rtol, atol=rtol * v.abs().max().item())


@pytest.mark.parametrize("splits", [1, 4])
def test_what_a_hidden_position_holds_never_reaches_the_output(splits, monkeypatch):
    """NaN and inf in every position the mask hides (the holes inside the lengths, which are
    read, and the positions past them, which are not): the output is the visible keys'
    attention, finite, with and without lengths."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: splits)
    q = random_tensor((3, 4, 32), torch.float32, scale=1.0)
    k = random_tensor((3, 2, 256, 32), torch.float32, scale=1.0)
    v = random_tensor((3, 2, 256, 32), torch.float32, scale=1.0)
    mask = _key_masks(3, 256, q.device)
    hidden = ~mask[:, None, :, None].expand_as(k)
    poisoned_k = k.masked_fill(hidden, float("nan"))
    poisoned_v = v.masked_fill(hidden, float("inf"))
    rtol = tolerance(torch.float32)["rtol"]
    for seqlens in (None, torch.tensor([190, 256, 10], device=q.device)):
        out = gemslib.decode_attention(q, poisoned_k, poisoned_v, seqlens, key_mask=mask)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                         seqlens, key_mask=mask)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())


def test_a_hole_far_into_a_long_split_is_found(monkeypatch):
    """One split of 5000 keys whose mask hides only position 4500 (past the first step of a
    split's scan for the kept run): that key does not count."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: 1)
    cache_len = 5000
    q = random_tensor((1, 2, 16), torch.float32, scale=1.0)
    k = random_tensor((1, 1, cache_len, 16), torch.float32, scale=1.0)
    v = random_tensor((1, 1, cache_len, 16), torch.float32, scale=1.0)
    k[0, 0, 4500] = 4 * q[0, 0]  # a key the query would attend to above all others
    mask = torch.ones(1, cache_len, dtype=torch.bool, device=q.device)
    mask[0, 4500] = False
    seqlens = torch.tensor([cache_len], device=q.device)
    out = gemslib.decode_attention(q, k, v, seqlens, key_mask=mask)
    expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                     seqlens, key_mask=mask)
    rtol = tolerance(torch.float32)["rtol"]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("splits", [3, 8])
def test_lengths_are_split_over_the_programs_of_each_sequence(splits, monkeypatch):
    """With lengths the splits divide each sequence's own positions (none, one key, a block
    and one side of it, most, all of a 400-long cache), not the cache's; every sequence gets
    its own attention, alone and under a static cache's mask of a prefix (the lengths then
    as the graph pass gives them, one past the last visible position, or longer)."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: splits)
    cache_len = 400
    visible = [0, 1, 63, 64, 65, 333, cache_len]
    batch = len(visible)
    q = random_tensor((batch, 2, 16), torch.float32, scale=1.0)
    k = random_tensor((batch, 1, cache_len, 16), torch.float32, scale=1.0)
    v = random_tensor((batch, 1, cache_len, 16), torch.float32, scale=1.0)
    extents = torch.tensor(visible, device=q.device)
    mask = torch.arange(cache_len, device=q.device)[None, :] < extents[:, None]
    rtol = tolerance(torch.float32)["rtol"]
    for seqlens, key_mask in ((extents, None), (extents, mask),
                              (torch.clamp(extents + 50, max=cache_len), mask)):
        out = gemslib.decode_attention(q, k, v, seqlens, key_mask=key_mask)
        expected = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                         seqlens, key_mask=key_mask)
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # no key visible: 0


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(40, None), (1, None), (500, None), (None, 0.7),
                                            (70, 2.0)], ids=str)
def test_a_sliding_window_and_softcap_match_the_reference(window, softcap, splits, monkeypatch):
    """Only the last ``window`` positions of each sequence count, split over the programs
    (a window of 1: the last key alone; one past the cache: every key), with lengths, a key
    mask, or neither; scores capped at softcap * tanh(s / softcap) at a scale that
    saturates the cap; the planned repeat gives the same."""
    monkeypatch.setattr(decode_ops, "_decode_splits", lambda *args: splits)
    q = random_tensor((4, 4, 32), torch.float32, scale=1.0)
    k = random_tensor((4, 2, 256, 32), torch.float32, scale=1.0)
    v = random_tensor((4, 2, 256, 32), torch.float32, scale=1.0)
    scale = 1.0 if softcap else None
    mask = _key_masks(4, 256, q.device)
    rtol = tolerance(torch.float32)["rtol"]
    for seqlens, key_mask in ((None, None), (torch.tensor([150, 256, 10, 0], device=q.device),
                                             None), (None, mask)):
        expected = decode_ops.decode_attention_reference(
            q.double(), k.double(), v.double(), seqlens, scale, key_mask, window or 0,
            softcap or 0.0)
        plain = decode_ops.decode_attention_reference(q.double(), k.double(), v.double(),
                                                      seqlens, scale, key_mask)
        if (window or 0) < 256 or softcap:
            assert not torch.allclose(expected, plain, atol=1e-3)
        for _ in range(3):
            out = gemslib.decode_attention(q, k, v, seqlens, scale, key_mask, window=window,
                                           softcap=softcap)
            torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                       atol=rtol * v.abs().max().item())


def test_a_bad_window_or_softcap_names_the_argument():
    q = random_tensor((1, 2, 16), torch.float32)
    k = random_tensor((1, 1, 8, 16), torch.float32)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            gemslib.decode_attention(q, k, k, window=bad)
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            gemslib.decode_attention(q, k, k, softcap=bad)


def test_a_key_mask_of_another_shape_or_dtype_is_refused():
    q = random_tensor((2, 4, 16), torch.float32)
    k = random_tensor((2, 2, 12, 16), torch.float32)
    for mask, got in ((torch.ones(2, 11, dtype=torch.bool), "torch.bool (2, 11)"),
                      (torch.ones(2, 12), "torch.float32 (2, 12)"),
                      ([True] * 12, "list")):
        if isinstance(mask, torch.Tensor):
            mask = mask.to(q.device)
        with pytest.raises(ValueError, match=r"key_mask must be a bool tensor of shape \(2, 12\)"
                                             r".*got " + re.escape(got)):
            gemslib.decode_attention(q, k, k, key_mask=mask)


# The decode entries of the shipped files as they stood under ops.attention.decode, before
# decode_attention became its own operator: the entries under its own key must be these, but
# for the H200's 16-bit bucket past head_dim 128, split off (its tiles did not fit there).
_ENTRIES_UNDER_ATTENTION = {
    "default.yaml": """
    decode:
      - config: {BLOCK_N: 64, PROGRAMS_PER_SM: 4, num_warps: 4, num_stages: 2}
""",
    "nvidia_h200.yaml": """
    decode:
      - max: {head_dim: 128, elem_bytes: 2}
        config: {BLOCK_N: 128, PROGRAMS_PER_SM: 1, num_warps: 4, num_stages: 3}
      - max: {elem_bytes: 2}
        config: {BLOCK_N: 64, PROGRAMS_PER_SM: 1, num_warps: 4, num_stages: 3}
      - max: {head_dim: 128}
        config: {BLOCK_N: 64, PROGRAMS_PER_SM: 2, num_warps: 4, num_stages: 2}
      - config: {BLOCK_N: 32, PROGRAMS_PER_SM: 2, num_warps: 4, num_stages: 2}
""",
}


@pytest.mark.parametrize("file_name", sorted(_ENTRIES_UNDER_ATTENTION))
def test_shipped_configs_are_the_ones_attention_held(file_name, tmp_path):
    old = tmp_path / file_name
    old.write_text("schema: 1\ndevice: old\nops:\n  attention:" + _ENTRIES_UNDER_ATTENTION[file_name])
    (old_buckets,) = runtime.load_tune_config(old).ops["attention"].values()
    shipped = runtime.load_tune_config(runtime.shipped_configs_dir() / file_name)
    assert "decode" not in shipped.ops["attention"]
    buckets = shipped.ops["decode_attention"][decode_ops.DECODE.name]
    assert [(b.max, b.configs, b.autotune) for b in buckets] == \
        [(b.max, b.configs, b.autotune) for b in old_buckets]


def test_a_layout_is_checked_and_planned_once(monkeypatch):
    """The first call of a layout checks its arguments and keeps the plan of its launch; the
    next calls of that layout launch it directly. A layout the kernel does not take as given
    (here caches without a unit last stride, which are copied) keeps no plan."""
    q = random_tensor((2, 4, 32), torch.float32)
    k = random_tensor((2, 2, 50, 32), torch.float32)
    strided = random_tensor((2, 2, 32, 50), torch.float32).transpose(-1, -2)
    monkeypatch.setattr(decode_ops, "_decode_layouts", {})
    first = gemslib.decode_attention(q, k, k)
    gemslib.decode_attention(q, strided, strided)
    plans = list(decode_ops._decode_layouts.values())
    assert len(plans) == 2 and plans[0] is not None and plans[1] is None

    def not_again(*args, **kwargs):
        raise AssertionError("checked or planned again")
    monkeypatch.setattr(decode_ops, "_check_decode", not_again)
    monkeypatch.setattr(decode_ops, "_launch_plan", not_again)
    assert torch.equal(gemslib.decode_attention(q, k, k), first)
