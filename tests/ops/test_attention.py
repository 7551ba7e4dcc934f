"""attention: forward and backward against float64 references, the SDPA overrides, custom ops."""

import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

import gemslib
from helpers import ON_GPU, random_tensor, opcheck_overloads
from gemslib import runtime
from gemslib.accuracy import assert_close_to_reference, tolerance
from gemslib.fused import attention as attention_ops

# interpreter: fp16/fp32 (bf16 tl.dot is wrong there); GPU: bf16 too
DOT_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if ON_GPU else [torch.float16, torch.float32]

# (B, Hq, Hkv, Sq, Skv, D, Dv)
CASES = [
    (1, 2, 2, 16, 16, 16, 16),
    (2, 4, 2, 37, 53, 32, 32),     # GQA, odd lengths, Sq < Skv
    (1, 3, 1, 45, 20, 24, 24),     # MQA, Sq > Skv, head dim not a power of two
    (1, 2, 1, 1, 70, 64, 40),      # one query row (the decode kernel), Dv != D
    (2, 8, 2, 1, 200, 32, 32),     # one query row, GQA, keys in splits
    (1, 1, 1, 130, 130, 8, 8),     # several blocks of rows and keys, tiny head dim
]
if ON_GPU:
    CASES += [(2, 32, 8, 1024, 1024, 128, 128), (1, 16, 16, 777, 1500, 64, 64),
              (1, 8, 2, 300, 300, 256, 256), (1, 4, 4, 200, 260, 96, 96)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(case, dtype, causal):
    batch, n_q, n_kv, seq_q, seq_kv, dim, dim_v = case
    q = random_tensor((batch, n_q, seq_q, dim), dtype, scale=1.0)
    k = random_tensor((batch, n_kv, seq_kv, dim), dtype, scale=1.0)
    v = random_tensor((batch, n_kv, seq_kv, dim_v), dtype, scale=1.0)
    out, lse = attention_ops._launch_forward(q, k, v, causal, 1.0 / dim ** 0.5)
    expected, expected_lse = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                                causal)
    # p is rounded to the input dtype before p @ v, as in every flash-attention kernel: an
    # error of the dtype's rounding on a convex combination of v's rows
    rtol = tolerance(dtype)["rtol"]
    torch.testing.assert_close(out.double(), expected, rtol=rtol,
                               atol=rtol * v.abs().max().item())
    assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=seq_kv)
    public = gemslib.attention(q, k, v, causal=causal)
    torch.testing.assert_close(public, out, rtol=0, atol=0)


@pytest.mark.parametrize("seq_q,dim", [(70, 16), (1, 16), (5, 300)],
                         ids=["kernel", "decode-kernel", "torch"])
def test_output_is_laid_out_as_sdpa_flash_returns_it(seq_q, dim):
    """o (B, Hq, Sq, Dv) lies as (B, Sq, Hq, Dv), as the fake says (what inductor plans the
    graph around) and as SDPA's flash backend returns it: a decoder's transpose and reshape
    into the output projection's rows is a view of o, no copy."""
    q = random_tensor((2, 4, seq_q, dim), torch.float32, scale=1.0)
    k, v = (random_tensor((2, 2, 33, dim), torch.float32, scale=1.0) for _ in range(2))
    out = gemslib.attention(q, k, v, causal=True)
    rows = out.transpose(1, 2).reshape(2 * seq_q, 4 * dim)
    assert rows.data_ptr() == out.data_ptr() and rows._base is not None
    assert out.transpose(1, 2).is_contiguous()
    with torch._subclasses.FakeTensorMode() as mode:
        fake_out, _ = attention_ops._attention_fake(mode.from_tensor(q), mode.from_tensor(k),
                                                    mode.from_tensor(v), True, 1.0)
    assert fake_out.shape == out.shape and fake_out.stride() == out.stride()
    expected = attention_ops.attention_reference(q.double(), k.double(), v.double(), True)[0]
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_one_query_row_runs_the_decode_kernel(monkeypatch):
    """Sq = 1 (a decode step written with SDPA): one decode launch, whose lse is the one the
    backward reads; the gradients match the reference's through it."""
    launched = []
    real = attention_ops._launch_decode
    monkeypatch.setattr(attention_ops, "_launch_decode",
                        lambda *args, **kwargs: launched.append(kwargs) or real(*args, **kwargs))
    q = random_tensor((2, 4, 1, 16), torch.float32, scale=1.0).requires_grad_()
    k, v = (random_tensor((2, 2, 40, 16), torch.float32, scale=1.0).requires_grad_()
            for _ in range(2))
    grad = random_tensor((2, 4, 1, 16), torch.float32)
    gemslib.attention(q, k, v).backward(grad)
    assert len(launched) == 1 and launched[0]["lse"] is not None
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    attention_ops.attention_reference(*inputs)[0].backward(grad.double())
    for ours, reference in zip((q, k, v), inputs):
        torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=1e-4, atol=1e-5)


def test_one_query_row_through_sdpa_is_written_in_torchs_layout_without_a_copy(monkeypatch):
    """Under enable(), the decode kernel writes an SDPA decode step's output straight into
    the backend's output layout (one launch, no copy of the rows after it), and the result is
    the reference's."""
    copied = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other, *args, **kwargs: (
        copied.append(self.shape), real_copy(self, other, *args, **kwargs))[1])
    q = random_tensor((2, 4, 1, 16), torch.float32, scale=1.0)
    k, v = (random_tensor((2, 2, 40, 16), torch.float32, scale=1.0) for _ in range(2))
    with torch.no_grad(), gemslib.enable(record=True) as record:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert record.calls, "SDPA did not reach gemslib"
    assert q.shape not in copied, copied
    expected = attention_ops.attention_reference(q.double(), k.double(), v.double())[0]
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lazy", [0, 1], ids=["rescaled", "lazy"])
@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_both_load_paths_match_reference(use_tma, causal, dtype, lazy):
    """Pointers or tensor descriptors (TMA) for q, K, V and o: (B, S, H, D) storage seen as
    (B, H, S, D), GQA, ragged query and key blocks, Dv != D and head dims under the block's."""
    q = random_tensor((2, 37, 4, 24), dtype, scale=1.0).transpose(1, 2)
    k = random_tensor((2, 53, 2, 24), dtype, scale=1.0).transpose(1, 2)
    v = random_tensor((2, 53, 2, 40), dtype, scale=1.0).transpose(1, 2)
    assert attention_ops._tma_ready(q, k, v)  # so the descriptor case really uses them
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", use_tma),
                                   ("LAZY", lazy)), 4, 1)
    with attention_ops.ATTENTION_FWD.forced(config):
        out, lse = attention_ops._launch_forward(q, k, v, causal, 0.2)
    expected, expected_lse = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                                causal, 0.2)
    rtol = tolerance(dtype)["rtol"]  # p rounded to the input dtype before p @ v (see above)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * v.abs().max().item())
    assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=53)


@pytest.fixture
def split_head_dim():
    """The forward's two column tiles (opt-in, GEMSLIB_SPLIT_HEAD_DIM=1) on for the test."""
    with attention_ops.SPLIT_HEAD_DIM.switched_on():
        yield


def test_head_dims_between_powers_of_two_split_into_two_column_tiles(split_head_dim):
    """D96 as 64 + 32 (a quarter less matmul work than 128), D80 as 64 + 16; not where
    D != Dv, at a power of two, with a tail wider than half the head tile, or switched off."""
    tiles = attention_ops.column_tiles
    assert [tiles(d, d) for d in (96, 80, 65, 40, 33, 192, 160)] == [
        (64, 32), (64, 16), (64, 16), (32, 16), (32, 16), (128, 64), (128, 32)]
    assert [tiles(d, d) for d in (64, 128, 112, 200, 24, 32, 8)] == [
        (64, 0), (128, 0), (128, 0), (256, 0), (32, 0), (32, 0), (16, 0)]
    assert tiles(96, 64) == (128, 0)
    with attention_ops.SPLIT_HEAD_DIM.switched_off():
        assert tiles(96, 96) == (128, 0)


# (D, dtype, causal, lazy): D96 through every path; D40 and D80 (a tail ending inside its
# 16-wide tile; 64 + 16) on the masked and the unmasked blocks
SPLIT_CASES = [(96, dtype, causal, lazy) for dtype in DOT_DTYPES for causal in (False, True)
               for lazy in (0, 1)] + [(dim, torch.float32, True, 0) for dim in (40, 80)]


@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("dim,dtype,causal,lazy", SPLIT_CASES, ids=str)
def test_split_head_dims_match_reference_on_both_load_paths(dim, dtype, causal, lazy, use_tma,
                                                            split_head_dim):
    """The two column tiles (a tail that ends inside its tile at D40 and D80) give o and lse
    of the float64 reference, and the same o as one padded tile, through pointers and
    descriptors, ragged query and key blocks, GQA."""
    q = random_tensor((2, 37, 4, dim), dtype, scale=1.0).transpose(1, 2)
    k = random_tensor((2, 53, 2, dim), dtype, scale=1.0).transpose(1, 2)
    v = random_tensor((2, 53, 2, dim), dtype, scale=1.0).transpose(1, 2)
    assert attention_ops.column_tiles(dim, dim)[1] > 0 and attention_ops._tma_ready(q, k, v)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", use_tma),
                                   ("LAZY", lazy)), 4, 1)
    with attention_ops.ATTENTION_FWD.forced(config):
        out, lse = attention_ops._launch_forward(q, k, v, causal, 0.2)
        with attention_ops.SPLIT_HEAD_DIM.switched_off():
            padded, _ = attention_ops._launch_forward(q, k, v, causal, 0.2)
    expected, expected_lse = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                                causal, 0.2)
    rtol = tolerance(dtype)["rtol"]
    for got in (out, padded):
        torch.testing.assert_close(got.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
    assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=53)


@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("case", [(70, 70, 17, None), (70, 70, None, 2.0)], ids=str)
def test_split_head_dims_with_a_window_or_a_cap_match_reference(case, use_tma, split_head_dim):
    """The masked path (every block) on two column tiles: D96 with a sliding window or a cap,
    fp16."""
    seq_q, seq_kv, window, softcap = case
    q = random_tensor((1, seq_q, 4, 96), torch.float16, scale=1.0).transpose(1, 2)
    k = random_tensor((1, seq_kv, 2, 96), torch.float16, scale=1.0).transpose(1, 2)
    v = random_tensor((1, seq_kv, 2, 96), torch.float16, scale=1.0).transpose(1, 2)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", use_tma),
                                   ("LAZY", 0)), 4, 1)
    with attention_ops.ATTENTION_FWD.forced(config):
        out, lse = attention_ops._attention_impl(q, k, v, True, 0.5, window or 0,
                                                 softcap or 0.0)
    expected, expected_lse = attention_ops.attention_reference(
        q.double(), k.double(), v.double(), True, 0.5, window or 0, softcap or 0.0)
    rtol = tolerance(torch.float16)["rtol"]
    torch.testing.assert_close(out.double(), expected, rtol=rtol,
                               atol=rtol * v.abs().max().item())
    assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=seq_kv)


# sliding windows and soft-capping (Sq, Skv, window, softcap): a window inside one key block,
# across several, of 1 (each row its own key), wider than the sequence (no-op), more queries
# than keys
# (rows past Skv + window - 1 see no key: NaN rows and -inf lse, as the reference), fewer
# queries than keys; the cap alone and with a window, at a scale that saturates it
BAND_CASES = [(70, 70, 5, None), (70, 70, 37, None), (70, 70, 1, None), (70, 70, 500, None),
              (45, 20, 9, None), (20, 60, 11, None), (70, 70, None, 2.0), (70, 70, 17, 3.0),
              (1, 30, 4, 1.5)]


@pytest.mark.parametrize("use_tma", [0, 1], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("case", BAND_CASES, ids=str)
def test_sliding_window_and_softcap_match_reference(case, dtype, use_tma):
    """Query i sees keys i - window < j <= i, scores capped at softcap * tanh(s / softcap):
    o and lse as the float64 reference's, over query and key blocks smaller than the window."""
    seq_q, seq_kv, window, softcap = case
    q = random_tensor((2, seq_q, 4, 32), dtype, scale=1.0).transpose(1, 2)
    k = random_tensor((2, seq_kv, 2, 32), dtype, scale=1.0).transpose(1, 2)
    v = random_tensor((2, seq_kv, 2, 32), dtype, scale=1.0).transpose(1, 2)
    scale = 1.0 if softcap else 0.2  # large scores: the cap saturates
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", use_tma),
                                   ("LAZY", 1)), 4, 1)
    with attention_ops.ATTENTION_FWD.forced(config):
        out, lse = attention_ops._attention_impl(q, k, v, True, scale, window or 0,
                                                 softcap or 0.0)
    public = gemslib.attention(q, k, v, causal=True, scale=scale, window=window,
                               softcap=softcap)
    expected, expected_lse = attention_ops.attention_reference(
        q.double(), k.double(), v.double(), True, scale, window or 0, softcap or 0.0)
    unbanded = attention_ops.attention_reference(q.double(), k.double(), v.double(), True,
                                                 scale)[0]
    if (window and window < seq_q) or (softcap and seq_q > 1):  # else the band is no-op
        assert not torch.allclose(expected.nan_to_num(), unbanded.nan_to_num(), atol=1e-2)
    rtol = tolerance(dtype)["rtol"]
    for got in (out, public):
        torch.testing.assert_close(got.double(), expected, rtol=rtol, equal_nan=True,
                                   atol=rtol * v.abs().max().item())
    assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=seq_kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seq_q,seq_kv,window,softcap", [
    (70, 70, 5, None), (70, 70, 37, None), (40, 70, 2, None), (70, 70, None, 2.0),
    (70, 70, 17, 3.0)], ids=str)
def test_sliding_window_and_softcap_gradients_match_reference(seq_q, seq_kv, window, softcap,
                                                              dtype):
    """dq, dk and dv through the window's band and the cap's slope 1 - tanh^2, over key and
    query blocks smaller than the window (the dK/dV kernel's rows end at the block's last key
    plus the window; the dq kernel's keys start at its first row's window), GQA."""
    q = random_tensor((2, 4, seq_q, 32), dtype, scale=1.0)
    k = random_tensor((2, 2, seq_kv, 32), dtype, scale=1.0)
    v = random_tensor((2, 2, seq_kv, 32), dtype, scale=1.0)
    grad = random_tensor((2, 4, seq_q, 32), dtype, scale=1.0)
    scale = 1.0 if softcap else 0.2
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16)), 4, 1)
    with attention_ops.ATTENTION_BWD_DKDV.forced(config), \
            attention_ops.ATTENTION_BWD_DQ.forced(config):
        gemslib.attention(*leaves, causal=True, scale=scale, window=window,
                          softcap=softcap).backward(grad)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    attention_ops.attention_reference(*inputs, True, scale, window or 0,
                                      softcap or 0.0)[0].backward(grad.double())
    rtol = tolerance(dtype)["rtol"]
    for ours, reference, name in zip(leaves, inputs, "qkv"):
        torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=4 * rtol,
                                   atol=4 * rtol * reference.grad.abs().max().item(), msg=name)


def test_banded_calls_are_checked():
    """Bad windows and caps name the argument; a planned repeat with another window gives
    that window's attention."""
    q = random_tensor((1, 2, 12, 16), torch.float32, scale=1.0)
    for bad in (0, -2, True, 2.5):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            gemslib.attention(q, q, q, causal=True, window=bad)
    with pytest.raises(ValueError, match="pass causal=True"):
        gemslib.attention(q, q, q, window=3)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
            gemslib.attention(q, q, q, softcap=bad)
    for window in (2, 5, 2, 5):
        expected = attention_ops.attention_reference(q.double(), q.double(), q.double(), True,
                                                     None, window)[0]
        torch.testing.assert_close(gemslib.attention(q, q, q, causal=True, window=window).double(),
                                   expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [32, 96], ids=["one_tile", "two_tiles"])
@pytest.mark.parametrize("lazy", [0, 1], ids=["rescaled", "lazy"])
def test_scores_that_grow_along_the_keys(lazy, dim, split_head_dim):
    """Keys scaled up along the sequence: each block's maxima pass the running ones, by less
    than 2^8 in some blocks (kept stale by the lazy form) and by more in others (rescaled),
    both column tiles' accumulators with them at D96."""
    assert attention_ops.column_tiles(dim, dim)[1] == (32 if dim == 96 else 0)
    q = random_tensor((1, 2, 40, dim), torch.float32, scale=1.0)
    growth = torch.linspace(0.0, 12.0, 160, device=q.device)[None, None, :, None]
    k = random_tensor((1, 2, 160, dim), torch.float32, scale=1.0) * growth
    v = random_tensor((1, 2, 160, dim), torch.float32, scale=1.0)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", 0),
                                   ("LAZY", lazy)), 4, 1)
    for causal in (False, True):
        with attention_ops.ATTENTION_FWD.forced(config):
            out, lse = attention_ops._launch_forward(q, k, v, causal, 0.5)
        expected, expected_lse = attention_ops.attention_reference(
            q.double(), k.double(), v.double(), causal, 0.5)
        assert_close_to_reference(out, expected, torch.float32, reduction_len=160)
        assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=160)


def test_descriptors_are_used_only_where_the_strides_allow():
    aligned = random_tensor((1, 2, 8, 32), torch.float16)
    assert attention_ops._tma_ready(aligned, aligned)
    assert not attention_ops._tma_ready(random_tensor((1, 2, 8, 12), torch.float16))  # 24 B rows
    assert not attention_ops._tma_ready(aligned[..., 1:])   # base off 16 bytes, width 31
    assert not attention_ops._tma_ready(random_tensor((1, 1, 4, 512), torch.float16))  # > 256
    # an unaligned head dim with TMA asked for: pointers, same results
    q = random_tensor((1, 2, 9, 12), torch.float16)
    config = runtime.LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", 16), ("USE_TMA", 1), ("LAZY", 0)),
                                  4, 1)
    with attention_ops.ATTENTION_FWD.forced(config):
        out, _ = attention_ops._launch_forward(q, q, q, False, 0.5)
    expected, _ = attention_ops.attention_reference(q.double(), q.double(), q.double(), False, 0.5)
    rtol = tolerance(torch.float16)["rtol"]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * q.abs().max().item())


def test_matches_sdpa_semantics_with_views_and_scale():
    """(B, S, H, D) storage seen as (B, H, S, D): no copy needed; an explicit scale."""
    q = random_tensor((2, 19, 4, 32), torch.float32).transpose(1, 2)
    k = random_tensor((2, 23, 2, 32), torch.float32).transpose(1, 2)
    v = random_tensor((2, 23, 2, 32), torch.float32).transpose(1, 2)
    for causal in (False, True):
        ours = gemslib.attention(q, k, v, causal=causal, scale=0.3)
        expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                  is_causal=causal, scale=0.3, enable_gqa=True)
        assert_close_to_reference(ours, expected, torch.float32, reduction_len=23)


@pytest.mark.parametrize("scale", [-0.7, 0.0, 1e-3])
def test_any_scale_sign_in_masked_and_unmasked_blocks(scale):
    """Unmasked key blocks fold the scale into the exponent's multiply-add, which needs a
    scale >= 0 (a negative one flips q's sign); 75 keys give full blocks and a ragged end."""
    q = random_tensor((1, 2, 70, 32), torch.float32, scale=1.0)
    k = random_tensor((1, 1, 75, 32), torch.float32, scale=1.0)
    v = random_tensor((1, 1, 75, 32), torch.float32, scale=1.0)
    for causal in (False, True):
        ours = gemslib.attention(q, k, v, causal=causal, scale=scale)
        # by definition: torch 2.13's math SDPA gives NaN for a negative scale with causal
        expected, _ = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                        causal, scale)
        assert_close_to_reference(ours, expected, torch.float32, reduction_len=75)


# the warp-specialised Gluon kernel serves 16-bit D128 inputs on sm_90 (the H200)
HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
# (B, Hq, Hkv, Sq, Skv, (B, S, H, D) storage, scale)
HOPPER_CASES = [
    (1, 2, 2, 256, 256, False, None),     # whole blocks
    (2, 8, 2, 300, 517, True, 0.05),      # GQA, ragged rows and keys, Sq < Skv, views
    (1, 4, 1, 700, 130, False, -0.09),    # MQA, Sq > Skv (causal rows past the keys), < 0 scale
    (1, 2, 2, 1, 1000, False, None),      # one query row
    (1, 2, 1, 129, 1, True, None),        # one key
] if HOPPER else [(1, 2, 1, 40, 70, True, -0.09)]  # the interpreter: the Triton kernel serves


def _keep_hopper_launch(monkeypatch, kept: bool) -> None:
    if attention_ops._attention_hopper is not None:
        monkeypatch.setattr(attention_ops._attention_hopper, "KEEP_FORWARD_LAUNCH", kept)


@pytest.mark.parametrize("kept", [False, True], ids=["triton_launch", "kept_launch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("case", HOPPER_CASES)
def test_hopper_kernel_takes_16_bit_head_dim_128_and_matches_reference(case, dtype, causal,
                                                                       kept, monkeypatch):
    """On sm_90 every such call of more than one query row runs the Gluon kernel (counted), one
    row the decode kernel; each matches float64 in o and the log-sum-exp, also when its
    launch is kept past Triton's (called twice: kept, then launched directly); elsewhere the
    Triton kernel gives the same answers."""
    _check_hopper_forward(case, dtype, causal, kept, 128, monkeypatch)


@pytest.mark.parametrize("kept", [False, True], ids=["triton_launch", "kept_launch"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("case", HOPPER_CASES)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_hopper_forward_at_head_dims_64_and_256_behind_their_switches(head_dim, case, dtype,
                                                                      causal, kept, monkeypatch):
    """With GEMSLIB_GLUON_FORWARD_D64's or _D256's head dim (not yet timed, so off by default)
    the forward on sm_90 runs the same Gluon kernel (its tiles as FORWARD_TILES gives them for
    that head dim), kept or launched by Triton, and matches float64 as the D = 128 one does."""
    monkeypatch.setattr(attention_ops._attention_hopper, "FORWARD_HEAD_DIMS", (head_dim, 128))
    _check_hopper_forward(case, dtype, causal, kept, head_dim, monkeypatch)


def _check_hopper_forward(case, dtype, causal, kept, head_dim, monkeypatch):
    _keep_hopper_launch(monkeypatch, kept)
    batch, n_q, n_kv, seq_q, seq_kv, views, scale = case
    shapes = [(batch, n_q, seq_q, head_dim), (batch, n_kv, seq_kv, head_dim),
              (batch, n_kv, seq_kv, head_dim)]
    if views:  # (B, S, H, D) storage: strided but TMA-addressable
        q, k, v = (random_tensor((b, s, h, d), dtype, scale=1.0).transpose(1, 2)
                   for b, h, s, d in shapes)
    else:
        q, k, v = (random_tensor(shape, dtype, scale=1.0) for shape in shapes)
    scale = head_dim ** -0.5 if scale is None else scale
    calls = []
    hopper_forward = attention_ops._attention_hopper.forward
    monkeypatch.setattr(attention_ops._attention_hopper, "forward",
                        lambda *args: calls.append(args) or hopper_forward(*args))
    decode_calls = []
    launch_decode = attention_ops._launch_decode
    monkeypatch.setattr(attention_ops, "_launch_decode",
                        lambda *args, **kw: decode_calls.append(args) or launch_decode(*args, **kw))
    expected, expected_lse = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                                causal, scale)
    rtol = tolerance(dtype)["rtol"]
    for _ in range(2 if kept else 1):
        out, lse = attention_ops._launch_forward(q, k, v, causal, scale)
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
        assert_close_to_reference(lse, expected_lse, torch.float32, reduction_len=seq_kv)
    one_row = seq_q == 1  # one query row goes to the decode kernel, on every GPU
    calls_each = 2 if kept else 1
    assert (len(calls), len(decode_calls)) == (calls_each * int(HOPPER and not one_row),
                                               calls_each * int(one_row))


@pytest.mark.parametrize("kept", [False, True], ids=["triton_launch", "kept_launch"])
def test_repeated_sdpa_calls_under_enable_each_give_their_own_attention(kept, monkeypatch):
    """Prefill-shaped SDPA calls of one signature on fresh inputs under enable(), GQA and
    causal: each matches float64 on its own inputs. On sm_90 with the forward's launch kept,
    the override's calls are planned (and replayed: the descriptors made again on the new
    tensors)."""
    _keep_hopper_launch(monkeypatch, kept)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    runtime.clear_call_plans()
    for _ in range(4):
        q = random_tensor((2, 4, 80, 128), dtype, scale=1.0)
        k, v = (random_tensor((2, 2, 80, 128), dtype, scale=1.0) for _ in range(2))
        with gemslib.enable():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        expected, _ = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                        True, 128 ** -0.5)
        rtol = tolerance(dtype)["rtol"]
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
    planned = {op: counts for op, counts in runtime.call_plan_counts().items()
               if "scaled_dot_product" in op}
    assert any(n_planned for n_planned, _ in planned.values()) == (HOPPER and kept), planned


@pytest.mark.parametrize("head_dim", [128, 64])
def test_repeated_direct_calls_each_give_their_own_attention(head_dim, monkeypatch):
    """gemslib.attention called again and again with one signature on fresh inputs (no
    gradient): each matches float64 on its own inputs. At D = 128 on sm_90 the calls are
    planned (the Hopper forward's kept launch); the Triton kernel's launch through TMA
    descriptors (D = 64 on the H200) is not."""
    _keep_hopper_launch(monkeypatch, True)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    runtime.clear_call_plans()
    for _ in range(4):
        q = random_tensor((2, 4, 80, head_dim), dtype, scale=1.0)
        k, v = (random_tensor((2, 2, 80, head_dim), dtype, scale=1.0) for _ in range(2))
        out = gemslib.attention(q, k, v, causal=True)
        expected, _ = attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                        True, head_dim ** -0.5)
        rtol = tolerance(dtype)["rtol"]
        torch.testing.assert_close(out.double(), expected, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
    planned = runtime.call_plan_counts().get("attention", (0, 0))[0]
    if HOPPER and head_dim == 128:
        assert planned == 1, runtime.call_plan_counts()
    elif not ON_GPU:  # the interpreter plans nothing
        assert planned == 0, runtime.call_plan_counts()


@pytest.mark.parametrize("fused_dq", ["tma", "writer", None], ids=["dq_tma", "dq_writer",
                                                                  "dq_triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
@pytest.mark.parametrize("case", HOPPER_CASES)
def test_hopper_backward_takes_16_bit_head_dim_128_and_matches_reference(case, dtype, causal,
                                                                         fused_dq, monkeypatch):
    """With the Gluon dK/dV path on (the default), every such call on sm_90 computes dK/dV in
    the Gluon kernel (counted), with dQ from the same kernel (the default without a causal
    mask) or from the Triton one (with one, or that path switched off), and the gradients
    match float64 (GQA/MQA, ragged lengths,
    Sq != Skv, views, a negative scale); elsewhere the Triton kernels give the same answers."""
    batch, n_q, n_kv, seq_q, seq_kv, views, scale = case
    shapes = [(batch, n_q, seq_q, 128), (batch, n_kv, seq_kv, 128), (batch, n_kv, seq_kv, 128)]
    if views:  # (B, S, H, D) storage: strided but TMA-addressable
        q, k, v = (random_tensor((b, s, h, d), dtype, scale=1.0).transpose(1, 2).requires_grad_()
                   for b, h, s, d in shapes)
    else:
        q, k, v = (random_tensor(shape, dtype, scale=1.0).requires_grad_() for shape in shapes)
    scale = 128 ** -0.5 if scale is None else scale
    calls = []
    entry = "backward" if fused_dq and not causal else "backward_dkdv"
    if HOPPER:
        monkeypatch.setattr(attention_ops._attention_hopper, "DQ_BY_TMA", fused_dq == "tma")
    hopper_backward = getattr(attention_ops._attention_hopper, entry)
    monkeypatch.setattr(attention_ops._attention_hopper, entry,
                        lambda *args: calls.append(args) or hopper_backward(*args))
    out, _ = torch.ops.gemslib.attention(q, k, v, causal, scale)
    grad_out = random_tensor(out.shape, dtype, scale=1.0)
    with contextlib.nullcontext() if fused_dq else attention_ops.HOPPER_FUSED_DQ.switched_off():
        ours = torch.autograd.grad(out, (q, k, v), grad_out)
    assert len(calls) == int(HOPPER)
    _assert_grads_close(ours, _reference_grads(q, k, v, causal, scale, grad_out), dtype)


@pytest.mark.parametrize("fused_dq", [False, True], ids=["dq_triton", "dq_fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16])
def test_hopper_backward_at_head_dim_64_behind_its_switch(dtype, causal, fused_dq, monkeypatch):
    """With GEMSLIB_GLUON_BACKWARD_D64's head dims (not yet measured, so off by default) a
    D = 64 backward on sm_90 computes dK/dV in the Gluon kernel (counted) and dQ in Triton's,
    or, with GEMSLIB_FUSED_DQ_D64's too and no causal mask, dQ in the same kernel (each
    warpgroup's partial over its keys, summed by the writer); the gradients match float64
    (GQA, ragged lengths, Sq != Skv); elsewhere the Triton kernels give the same answers."""
    hopper = attention_ops._attention_hopper
    monkeypatch.setattr(hopper, "BACKWARD_HEAD_DIMS", (64, 128))
    if fused_dq:
        monkeypatch.setattr(hopper, "FUSED_DQ_HEAD_DIMS", (64, 128))
    calls = []
    entry = "backward" if fused_dq and not causal else "backward_dkdv"
    hopper_backward = getattr(hopper, entry)
    monkeypatch.setattr(hopper, entry, lambda *args: calls.append(args) or hopper_backward(*args))
    q = random_tensor((1, 4, 130, 64), dtype, scale=1.0).requires_grad_()
    k, v = (random_tensor((1, 2, 200, 64), dtype, scale=1.0).requires_grad_() for _ in range(2))
    scale = 64 ** -0.5
    out, _ = torch.ops.gemslib.attention(q, k, v, causal, scale)
    grad_out = random_tensor(out.shape, dtype, scale=1.0)
    ours = torch.autograd.grad(out, (q, k, v), grad_out)
    assert len(calls) == int(HOPPER)
    _assert_grads_close(ours, _reference_grads(q, k, v, causal, scale, grad_out), dtype)


def test_hopper_kernel_is_not_offered_what_tma_cannot_address():
    """A base off 16-byte alignment, a head dim other than 128, fp32 or a CPU tensor: the
    Triton kernel's business."""
    def dense(*shape, dtype=torch.bfloat16):
        return random_tensor(shape, dtype, scale=1.0)
    q = dense(1, 2, 64, 128)
    assert attention_ops._attention_hopper.eligible(q, q, q) == HOPPER
    shifted = dense(1 * 2 * 64 * 128 + 1)[1:].view(1, 2, 64, 128)  # 2 bytes off alignment
    assert not attention_ops._attention_hopper.eligible(shifted, q, q)
    assert not attention_ops._attention_hopper.eligible(q, shifted, q)
    d64 = dense(1, 2, 64, 64)
    assert not attention_ops._attention_hopper.eligible(d64, d64, d64)
    assert attention_ops._attention_hopper.eligible(d64, d64, d64, (64, 128)) == HOPPER
    assert not attention_ops._attention_hopper.eligible(q, d64, d64, (64, 128))  # D != Dv
    # the forward takes D64 and D256 only behind their switches (FORWARD_HEAD_DIMS)
    d256 = dense(1, 2, 64, 256)
    for other in (d64, d256):
        assert attention_ops._attention_hopper.eligible_forward(other, other, other) == (
            HOPPER and other.shape[-1] in attention_ops._attention_hopper.FORWARD_HEAD_DIMS)
    fp32 = dense(1, 2, 64, 128, dtype=torch.float32)
    assert not attention_ops._attention_hopper.eligible(fp32, fp32, fp32)
    assert not attention_ops._attention_hopper.eligible(q.cpu(), q.cpu(), q.cpu())


def test_empty_and_keyless_inputs_behave_like_sdpa():
    q = random_tensor((1, 2, 3, 16), torch.float32)
    no_keys = random_tensor((1, 2, 0, 16), torch.float32)
    torch.testing.assert_close(gemslib.attention(q, no_keys, no_keys),
                               F.scaled_dot_product_attention(q, no_keys, no_keys))
    no_queries = random_tensor((1, 2, 0, 16), torch.float32)
    k = random_tensor((1, 2, 5, 16), torch.float32)
    assert gemslib.attention(no_queries, k, k).shape == (1, 2, 0, 16)


@pytest.mark.parametrize("dtype,dim", [(torch.float64, 8), (torch.float32, 300)])
def test_float64_and_oversized_heads_are_computed_by_torch(dtype, dim):
    x = random_tensor((1, 2, 5, dim), dtype)
    ours = gemslib.attention(x, x, x, causal=True)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(x, x, x, is_causal=True))


@pytest.mark.parametrize("args,error,match", [
    (((1, 4, 5, 16), (1, 3, 5, 16), (1, 3, 5, 16)), ValueError, "multiple of"),
    (((1, 4, 5, 16), (1, 2, 5, 8), (1, 2, 5, 8)), ValueError, "head dim 8 must equal q's 16"),
    (((1, 4, 5, 16), (1, 2, 5, 16), (1, 2, 6, 16)), ValueError, "sequence length"),
    (((4, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16)), ValueError, "q must be"),
])
def test_bad_inputs_name_the_argument(args, error, match):
    q, k, v = (random_tensor(shape, torch.float32) for shape in args)
    with pytest.raises(error, match=match):
        gemslib.attention(q, k, v)


SDPA_OP = "aten::_scaled_dot_product_flash_attention" + ("" if ON_GPU else "_for_cpu")


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_sdpa_runs_gemslib_under_enable(dtype):
    q = random_tensor((2, 4, 33, 64), dtype, scale=1.0)
    k = random_tensor((2, 2, 40, 64), dtype, scale=1.0)
    v = random_tensor((2, 2, 40, 64), dtype, scale=1.0)
    expected = {causal: attention_ops.attention_reference(q.double(), k.double(), v.double(),
                                                          causal)[0] for causal in (False, True)}
    with gemslib.enable(ops=["attention"], record=True) as activation:
        outs = {causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                for causal in (False, True)}
    served = sum(activation.calls.values())
    if ON_GPU and dtype == torch.float32:
        # no CUDA backend of torch takes fp32 with grouped heads: torch's math path, which
        # gemslib leaves alone, serves the calls
        assert served == 0 and not activation.fallbacks, (activation.calls, activation.fallbacks)
    else:
        assert served == 2 and not activation.fallbacks, (activation.calls, activation.fallbacks)
    if not ON_GPU:  # on the GPU torch may pick any of its three backends, all overridden
        assert activation.calls == {SDPA_OP: 2}
    rtol = tolerance(dtype)["rtol"]
    for causal, out in outs.items():
        torch.testing.assert_close(out.double(), expected[causal], rtol=rtol,
                                   atol=rtol * v.abs().max().item())


@pytest.mark.parametrize("seq_q", [19, 1])  # 1: the decode kernel
@pytest.mark.parametrize("dim", [32, 128])  # 128: the Gluon kernel on the H200
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sdpa_overrides_return_torchs_output_layouts(dtype, dim, seq_q):
    """The overrides' o and lse have the shapes and strides of torch's fake kernels for each
    backend (torch.compile's inductor checks real outputs against those): here for q, k, v
    seen through (B, S, H, D) storage, and a query length that is not a multiple of 32."""
    q, k, v = (random_tensor((2, seq, 4, dim), dtype, scale=1.0).transpose(1, 2)
               for seq in (seq_q, 23, 23))
    if ON_GPU:
        calls = [("_scaled_dot_product_flash_attention", (q, k, v, 0.0, True, False)),
                 ("_scaled_dot_product_cudnn_attention", (q, k, v, None, True, 0.0, True, False)),
                 ("_scaled_dot_product_efficient_attention", (q, k, v, None, True, 0.0, True))]
        if dtype == torch.float32:  # flash and cuDNN take 16-bit inputs only
            calls = calls[2:]
    else:
        calls = [("_scaled_dot_product_flash_attention_for_cpu", (q, k, v, 0.0, True))]
    for name, args in calls:
        op = getattr(torch.ops.aten, name)
        expected = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        with gemslib.enable(ops=["attention"], record=True) as activation:
            actual = op(*args)
        assert activation.calls == {f"aten::{name}": 1}, activation.calls
        for what, ours, torchs in zip(("o", "lse"), actual, expected):
            assert (ours.shape, ours.stride(), ours.dtype) == \
                (torchs.shape, torchs.stride(), torchs.dtype), (name, what)
        # the rest as torch gives it too: torch's backward reads them (a defined cum_seq_q,
        # for one, would mean a nested batch)
        assert len(actual) == len(expected), name
        for index, (ours, torchs) in enumerate(zip(actual[2:], expected[2:]), start=2):
            if isinstance(torchs, torch.Tensor):
                assert (ours.shape, ours.dtype) == (torchs.shape, torchs.dtype), (name, index)
            else:
                assert ours == torchs, (name, index)
        reference, reference_lse = attention_ops.attention_reference(
            q.double(), k.double(), v.double(), True)
        rtol = tolerance(dtype)["rtol"]
        torch.testing.assert_close(actual[0].double(), reference, rtol=rtol,
                                   atol=rtol * v.abs().max().item())
        torch.testing.assert_close(actual[1].flatten(2)[..., :seq_q].double(), reference_lse,
                                   rtol=1e-4, atol=1e-4)


def test_sdpa_calls_the_kernel_does_not_take_go_to_torch():
    """A mask goes to torch's kernel; so does fp32 SDPA that records gradients, forward and
    backward (on the GPU fp32 reaches the memory-efficient pair, on the CPU the flash pair),
    while fp32 inference is gemslib's."""
    q = random_tensor((1, 2, 9, 32), torch.float32)
    mask = torch.rand(9, 9, device=q.device) > 0.3
    leaf = q.detach().requires_grad_()
    with gemslib.enable(ops=["attention"], record=True) as activation:
        masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        needs_grad = F.scaled_dot_product_attention(leaf, leaf, leaf, is_causal=True)
        needs_grad.sum().backward()
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert sum(activation.calls.values()) == 1, activation.calls
    assert sum(activation.fallbacks.values()) == 3, activation.fallbacks
    torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    reference_leaf = q.detach().double().requires_grad_()
    F.scaled_dot_product_attention(reference_leaf, reference_leaf, reference_leaf,
                                   is_causal=True).sum().backward()
    # the backward's own standard: q = k = v at scale 3 gives scores near 50, whose fp32
    # rounding (|s| * eps) the softmax gradient carries (3.8e-5 of 1.0 seen on the H200)
    _assert_grads_close([leaf.grad], [reference_leaf.grad], torch.float32)


# (SDPA backend, dtype, head dim) each backend takes: CUDA flash and cuDNN 16-bit only
SDPA_PAIRS = ([("flash", torch.float16, 64), ("cudnn", torch.bfloat16, 64),
               ("efficient", torch.float16, 64), ("efficient", torch.float32, 64),
               ("flash", torch.bfloat16, 128), ("cudnn", torch.float16, 128),
               ("efficient", torch.bfloat16, 128)] if ON_GPU else
              [("cpu", torch.float16, 64), ("cpu", torch.float32, 64)])


def _sdpa_backend_op(backend):
    return SDPA_OP if backend == "cpu" else f"aten::_scaled_dot_product_{backend}_attention"


@pytest.mark.parametrize("backend,dtype,dim", SDPA_PAIRS)
@pytest.mark.parametrize("scopes", ["both", "forward-only", "backward-only"])
def test_sdpa_backward_pairs_with_its_forward_in_any_scope(scopes, backend, dtype, dim):
    """Under enable() each SDPA backend's forward and backward run gemslib's kernels; with only
    one of them inside the block, torch's other half reads the lse as that backend saves it
    (layout and units), so the gradients are right either way."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if ON_GPU:  # cuDNN at a multiple of 64 rows; the others at odd lengths
        seq = 64 if backend == "cudnn" else 77
        shapes = ((2, 4, seq, dim), (2, 4, seq, dim), (2, 4, seq, dim))
    else:  # grouped heads, Sq < Skv
        shapes = ((2, 4, 33, dim), (2, 2, 40, dim), (2, 2, 40, dim))
    q, k, v = (random_tensor(shape, dtype, scale=1.0).requires_grad_() for shape in shapes)
    grad_out = random_tensor(shapes[0], dtype, scale=1.0)
    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "cpu": SDPBackend.FLASH_ATTENTION}

    def forward():
        with sdpa_kernel(forced[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not ON_GPU)

    def backward(out):
        return torch.autograd.grad(out, (q, k, v), grad_out)

    if scopes == "backward-only":
        out = forward()
    with gemslib.enable(ops=["attention"], record=True) as activation:
        if scopes == "both":
            grads = backward(forward())
        elif scopes == "forward-only":
            out = forward()
        else:
            grads = backward(out)
    if scopes == "forward-only":
        grads = backward(out)
    op = _sdpa_backend_op(backend)
    expected_ops = {"both": {op, op + "_backward"}, "forward-only": {op},
                    "backward-only": {op + "_backward"}}[scopes]
    if dtype == torch.float32:  # fp32 training stays torch's (test_fp32_sdpa_training_...)
        assert set(activation.fallbacks) == expected_ops and not activation.calls, \
            (activation.calls, activation.fallbacks)
    else:
        assert set(activation.calls) == expected_ops and not activation.fallbacks, \
            (activation.calls, activation.fallbacks)
    _assert_grads_close(grads, _reference_grads(q, k, v, True, dim ** -0.5, grad_out), dtype)


@pytest.mark.parametrize("scopes", ["forward-only", "backward-only", "both"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp32_sdpa_training_under_enable_is_torchs_in_any_scope(scopes, causal):
    """fp32 SDPA that records gradients stays torch's under enable(), forward and backward:
    torch's backward recomputes the scores in its own arithmetic, so an lse from gemslib's
    forward paired with it only to the scores' fp32 rounding (3 times torch's own gradient
    error at randn * 3 inputs on the H200). So the gradients are torch's own, bit for bit,
    whichever half runs inside the block."""
    q = random_tensor((4, 4, 3, 8), torch.float32).requires_grad_()
    k = random_tensor((4, 4, 6, 8), torch.float32).requires_grad_()
    v = random_tensor((4, 4, 6, 8), torch.float32).requires_grad_()
    grad_out = random_tensor((4, 4, 3, 8), torch.float32)
    expected = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                   (q, k, v), grad_out)
    forward = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    backward = lambda out: torch.autograd.grad(out, (q, k, v), grad_out)
    out = forward() if scopes == "backward-only" else None
    with gemslib.enable(ops=["attention"], record=True) as inside:
        if scopes == "forward-only":
            out = forward()
        else:
            grads = backward(out if out is not None else forward())
    if scopes == "forward-only":
        grads = backward(out)
    assert not inside.calls and inside.fallbacks, (inside.calls, inside.fallbacks)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend,dtype,dim", [p for p in SDPA_PAIRS if p[1] != torch.float32])
def test_sdpa_backward_overrides_return_torchs_gradient_layouts(backend, dtype, dim):
    """The backward overrides' gradients have the shapes and strides of torch's fake kernels
    (like the inputs for CUDA flash and cuDNN, (B, S, H, D) memory for the CPU flash and the
    efficient kernel), for inputs seen through (B, S, H, D) storage, and the right values."""
    q, k, v = (random_tensor((2, seq, 4, dim), dtype, scale=1.0).transpose(1, 2)
               for seq in (64, 64, 64))
    grad_out = random_tensor((2, 4, 64, dim), dtype, scale=1.0)
    name = _sdpa_backend_op(backend)[len("aten::"):]
    forward_args = {"cpu": (q, k, v, 0.0, True), "flash": (q, k, v, 0.0, True, False),
                    "cudnn": (q, k, v, None, True, 0.0, True, False),
                    "efficient": (q, k, v, None, True, 0.0, True)}[backend]
    with gemslib.enable(ops=["attention"], record=True) as activation:
        forward = getattr(torch.ops.aten, name)(*forward_args)
        out, lse = forward[0], forward[1]
        if backend == "cpu":
            args = (grad_out, q, k, v, out, lse, 0.0, True)
        elif backend == "flash":
            args = (grad_out, q, k, v, out, lse, *forward[2:6], 0.0, True, *forward[6:8])
        elif backend == "cudnn":
            args = (grad_out, q, k, v, out, lse, *forward[6:8], None, *forward[2:6], 0.0, True)
        else:
            args = (grad_out, q, k, v, None, out, lse, *forward[2:4], 0.0,
                    [True, True, True, False], True)
        backward = getattr(torch.ops.aten, name + "_backward")
        grads = backward(*args)[:3]
    assert activation.calls == {f"aten::{name}": 1, f"aten::{name}_backward": 1}, \
        activation.calls
    expected = backward(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    for what, ours, torchs in zip(("dq", "dk", "dv"), grads, expected):
        assert (ours.shape, ours.stride(), ours.dtype) == \
            (torchs.shape, torchs.stride(), torchs.dtype), what
    _assert_grads_close(grads, _reference_grads(q, k, v, True, dim ** -0.5, grad_out), dtype)


def test_custom_ops_pass_opcheck():
    q = random_tensor((1, 4, 9, 16), torch.float32)
    k = random_tensor((1, 2, 11, 16), torch.float32)
    opcheck_overloads(torch.ops.gemslib.attention, (q, k, k, True, 0.25))
    opcheck_overloads(torch.ops.gemslib.attention, (q, k, k, True, 0.25, 4, 5.0),
                      test_utils=("test_schema", "test_faketensor"))
    grad_q = q.detach().clone().requires_grad_()
    opcheck_overloads(torch.ops.gemslib.attention, (grad_q, k, k, False, 0.25))
    out, lse = attention_ops._attention_impl(q, k, k, True, 0.25)
    opcheck_overloads(torch.ops.gemslib.attention_backward,
                      (torch.randn_like(out), q, k, k, out, lse, None, True, 0.25))


def test_traces_under_torch_compile_fullgraph():
    q = random_tensor((1, 4, 9, 16), torch.float32)
    k = random_tensor((1, 2, 11, 16), torch.float32)
    lengths = torch.tensor([7], device=q.device)

    def step(q, k):
        return gemslib.attention(q, k, k, causal=True).sum() + \
            gemslib.decode_attention(q[:, :, 0], k, k, lengths).sum()

    runtime.reload_configs()  # cold caches: tracing must not reach the config lookup (a lock)
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    assert_close_to_reference(compiled(q, k), step(q, k).double(), torch.float32,
                              reduction_len=9 * 16)

    def loss(q, k):  # forward and backward through the custom ops
        return gemslib.attention(q, k, k, causal=True).square().sum()

    compiled_loss = torch.compile(loss, fullgraph=True,
                                  backend="inductor" if ON_GPU else "aot_eager")
    q_grad = q.detach().clone().requires_grad_()
    (ours,) = torch.autograd.grad(compiled_loss(q_grad, k), q_grad)
    (expected,) = torch.autograd.grad(loss(q_grad, k), q_grad)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_sdpa_training_step_under_enable_and_torch_compile():
    """A compiled loss calling SDPA on (B, S, H, D) storage seen as (B, H, S, D), under
    enable(): gemslib serves its forward and backward (on the GPU, inductor checks the
    overrides' outputs against torch's fake kernels), and the gradients are right."""
    dtype = torch.float16  # fp32 training stays torch's (test_fp32_sdpa_training_...)
    bases = [random_tensor((2, 40, 4, 64), dtype, scale=1.0).requires_grad_() for _ in range(3)]
    weight = random_tensor((2, 4, 40, 64), torch.float32, scale=1.0)

    def loss(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return (out.float() * weight).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    with gemslib.enable(ops=["attention"], record=True) as activation:
        grads = torch.autograd.grad(compiled(*bases), bases)
    assert any(name.endswith("_backward") for name in activation.calls), activation.calls
    assert any(not name.endswith("_backward") for name in activation.calls), activation.calls
    views = [t.transpose(1, 2) for t in bases]
    expected = _reference_grads(*views, True, 64 ** -0.5, weight.to(dtype))
    _assert_grads_close([g.transpose(1, 2) for g in grads], expected, dtype)


def _reference_grads(q, k, v, causal, scale, grad_out, grad_lse=None):
    """(dq, dk, dv) of the float64 reference, optionally with a gradient into lse."""
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ops.attention_reference(*inputs, causal, scale)
    outputs, grads = [out], [grad_out.double()]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.double())
    return torch.autograd.grad(outputs, inputs, grads)


def _assert_grads_close(ours, expected, dtype):
    """Within the dtype's rounding at the gradients' scale (the largest entry of the three):
    p and ds are rounded to the input dtype before their matmuls, as in every flash-attention
    backward, and a gradient that cancels to ~0 (dq when a row sees one key) keeps that
    absolute error."""
    rtol = 1e-4 if dtype == torch.float32 else tolerance(dtype)["rtol"] * 4
    magnitude = max(want.abs().max().item() if want.numel() else 0.0 for want in expected)
    for name, got, want in zip(("dq", "dk", "dv"), ours, expected):
        assert got.shape == want.shape and got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=rtol * magnitude + 1e-12,
                                   msg=lambda detail, name=name: f"{name}: {detail}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_gradients_match_float64_reference(case, dtype, causal, monkeypatch):
    """dq, dk, dv from the Triton backward (counted) for GQA/MQA, odd lengths, Sq != Skv,
    Dv != D, head dims not a power of two."""
    batch, n_q, n_kv, seq_q, seq_kv, dim, dim_v = case
    q = random_tensor((batch, n_q, seq_q, dim), dtype, scale=1.0).requires_grad_()
    k = random_tensor((batch, n_kv, seq_kv, dim), dtype, scale=1.0).requires_grad_()
    v = random_tensor((batch, n_kv, seq_kv, dim_v), dtype, scale=1.0).requires_grad_()
    launches = []
    launch_backward = attention_ops._launch_backward
    monkeypatch.setattr(attention_ops, "_launch_backward",
                        lambda *args: launches.append(1) or launch_backward(*args))
    # the Triton kernels everywhere; the Gluon dK/dV kernel has its own test above
    with attention_ops.HOPPER_BACKWARD.switched_off():
        out = gemslib.attention(q, k, v, causal=causal)
        grad_out = random_tensor(out.shape, dtype, scale=1.0)
        ours = torch.autograd.grad(out, (q, k, v), grad_out)
    assert len(launches) == 1
    _assert_grads_close(ours, _reference_grads(q, k, v, causal, dim ** -0.5, grad_out), dtype)


@pytest.mark.parametrize("scale", [-0.4, 0.3])
def test_gradients_through_views_scale_and_lse(scale):
    """(B, S, H, D) storage seen as (B, H, S, D), either sign of scale, and a gradient into
    the row log-sum-exp as well as the output (torch.ops.gemslib.attention returns both)."""
    q = random_tensor((2, 19, 4, 32), torch.float32).transpose(1, 2).requires_grad_()
    k = random_tensor((2, 23, 2, 32), torch.float32).transpose(1, 2).requires_grad_()
    v = random_tensor((2, 23, 2, 24), torch.float32).transpose(1, 2).requires_grad_()
    for causal in (False, True):
        out, lse = torch.ops.gemslib.attention(q, k, v, causal, scale)
        grad_out = random_tensor(out.shape, torch.float32)
        grad_lse = random_tensor(lse.shape, torch.float32)
        ours = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
        _assert_grads_close(ours, _reference_grads(q, k, v, causal, scale, grad_out, grad_lse),
                            torch.float32)


def test_gradients_of_empty_and_keyless_inputs():
    """No keys: the output is 0 whatever q is, so every gradient is 0 (and dk, dv are empty);
    no query rows: nothing flows to k and v."""
    q = random_tensor((1, 2, 5, 16), torch.float32).requires_grad_()
    k = random_tensor((1, 2, 0, 16), torch.float32).requires_grad_()
    dq, dk, dv = torch.autograd.grad(gemslib.attention(q, k, k).sum(), (q, k, k))
    assert dq.shape == q.shape and not dq.any() and dk.shape == k.shape
    q0 = random_tensor((1, 2, 0, 16), torch.float32).requires_grad_()
    k1 = random_tensor((1, 2, 7, 16), torch.float32).requires_grad_()
    _, dk1 = torch.autograd.grad(gemslib.attention(q0, k1, k1).sum(), (q0, k1))
    assert dk1.shape == k1.shape and not dk1.any()


def test_float64_gradients_come_from_torch_and_second_derivatives_raise():
    q = random_tensor((1, 2, 7, 16), torch.float64).requires_grad_()
    k = random_tensor((1, 1, 9, 16), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k: gemslib.attention(q, k, k, causal=True), (q, k))
    q32 = q.detach().float().requires_grad_()
    k32 = k.detach().float()
    (dq,) = torch.autograd.grad(gemslib.attention(q32, k32, k32).sum(), q32, create_graph=False)
    assert torch.isfinite(dq).all()
    with pytest.raises(RuntimeError, match="second derivative"):
        out = gemslib.attention(q32, k32, k32)
        (dq,) = torch.autograd.grad(out.square().sum(), q32, create_graph=True)
        dq.sum().backward()


def test_head_dim_zero_gives_torchs_result():
    """D = 0: every score is 0, so each row averages the values it may see (what SDPA gives),
    forward and backward, direct and under enable()."""
    q = random_tensor((2, 4, 5, 0), torch.float32)
    k = random_tensor((2, 2, 7, 0), torch.float32)
    v = random_tensor((2, 2, 7, 6), torch.float32)
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(gemslib.attention(q, k, v, causal=causal), expected)
        with gemslib.enable(ops=["attention"]):
            torch.testing.assert_close(F.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal),
                expected)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.grad(gemslib.attention(*leaves, causal=True).sum(), leaves)
    expected_grads = torch.autograd.grad(F.scaled_dot_product_attention(
        *leaves, is_causal=True, enable_gqa=True).sum(), leaves)
    for got, want in zip(torch.autograd.grad(gemslib.attention(*leaves, causal=True).sum(),
                                             leaves), expected_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("call,match", [
    (lambda q: gemslib.attention(q, q, q, causal="yes"), "argument 'causal' must be bool, not str"),
    (lambda q: gemslib.attention(q, q, q, causal=1), "argument 'causal' must be bool, not int"),
    (lambda q: gemslib.attention(q, q, q, scale="0.1"), "argument 'scale' must be float or None"),
    (lambda q: gemslib.attention(q, q, q, scale=torch.ones(2)), "argument 'scale' must be float"),
])
def test_scalar_arguments_are_checked_as_torch_does(call, match):
    q = random_tensor((1, 2, 3, 8), torch.float32)
    with pytest.raises(TypeError, match=match):
        call(q)


def test_scalar_arguments_torch_accepts_are_accepted():
    q, k, v = (random_tensor((1, 2, 3, 8), torch.float32) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    for scale in (0.5, torch.tensor(0.5)):
        assert_close_to_reference(gemslib.attention(q, k, v, scale=scale), expected.double(),
                                  torch.float32, reduction_len=8, term_scale=v.abs().max().item())


def test_bf16_calls_are_right_on_every_backend(caplog):
    """bf16: the kernels on a GPU; under the interpreter (whose bf16 tl.dot is wrong) torch
    computes them, and enable() records those calls as fallbacks with the reason."""
    q = random_tensor((1, 4, 9, 16), torch.bfloat16, scale=1.0)
    k = random_tensor((1, 2, 12, 16), torch.bfloat16, scale=1.0)
    v = random_tensor((1, 2, 12, 16), torch.bfloat16, scale=1.0)
    expected, _ = attention_ops.attention_reference(q.double(), k.double(), v.double(), True)
    assert_close_to_reference(gemslib.attention(q, k, v, causal=True), expected, torch.bfloat16,
                              reduction_len=12, term_scale=v.abs().max().item())
    with caplog.at_level(logging.DEBUG, logger="gemslib"), \
            gemslib.enable(ops=["attention"], record=True) as active:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close_to_reference(out, expected, torch.bfloat16, reduction_len=12,
                              term_scale=v.abs().max().item())
    if ON_GPU:
        assert sum(active.calls.values()) == 1 and not active.fallbacks
    else:
        assert sum(active.fallbacks.values()) == 1 and not active.calls
        assert "bf16 under the Triton interpreter" in caplog.text
