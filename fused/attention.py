"""Fused attention: the forward (flash-attention style), its backward, and the SDPA override.

    attention(q, k, v)[b, h, i] = sum_j p_ij v[b, g(h), j],
    p_ij = softmax_j(scale * q[b, h, i] . k[b, g(h), j])  over the keys j row i may see

with g(h) = h // (Hq / Hkv) (grouped-query attention: K/V are never repeated in memory) and,
when causal, the keys j <= i (torch's top-left alignment when Sq != Skv). q is (B, Hq, Sq, D),
k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv), any strides with a unit last stride.

One program per BLOCK_M query rows of one head walks the keys BLOCK_N at a time with an online
softmax in the exp2 domain (scale * log2(e) folded into the scores) and fp32 accumulators;
blocks every row sees in full run without masks, the causal diagonal and the ragged end
separately with them. The row log-sum-exp (natural log) comes out too, for the backward,
which recomputes the probabilities from it. One query row (a decode step through SDPA) runs
``decode_attention.py``'s kernel instead.
On Hopper (sm_90), 16-bit inputs with head dim 128 take the warp-specialised Gluon kernel of
``_attention_hopper.py`` instead: same math, FlashAttention-3's schedule.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemslib import checks, layout, runtime
from gemslib.fused import _attention_sdpa as sdpa
from gemslib.fused._attention_common import (_CHECK_DTYPES, _check, _kernels_take,
                                              attention_reference, band_arguments,
                                              default_scale, soft_tanh)
from gemslib.fused.decode_attention import _launch_decode
from gemslib.layout import LN2, LOG2E
from gemslib.registry import AtenOverride, SelfCheck, TuneBucket, TuneSpace

try:  # the Hopper prefill kernel is written in Gluon (triton.experimental, Triton >= 3.4)
    from gemslib.fused import _attention_hopper
except ImportError:  # pragma: no cover - older Triton: the Triton kernel serves every call
    _attention_hopper = None



# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_blocks(b_acc, b_acc_t, b_row_max, b_row_sum, b_q, b_q_t, p_k, p_v, stride_k_s,
                   stride_v_s, k_desc, v_desc, k_tail_desc, v_tail_desc, i_b, i_hkv,
                   o_m, key_start, key_end, seq_kv, head_dim, head_dim_v, scale_log2,
                   window, cap_log2,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   TMA: tl.constexpr, LAZY: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_DT: tl.constexpr):
    """Fold keys [key_start, key_end) into the running (b_acc, b_row_max, b_row_sum) of the
    query rows o_m; b_row_max is in log2 units. p_k / p_v point at the KV head's K and V.
    MASKED blocks check key bounds (and causality, the sliding window's left edge with
    WINDOW, and cap the scores with SOFTCAP: s -> cap * tanh(s / cap), in log2 units
    cap_log2 = cap * log2(e)); the others need no mask. With LAZY,
    unmasked blocks rescale only when a row's maximum has grown by more than 2^8.
    With TMA, K and V blocks come through tensor descriptors at batch i_b and KV head i_hkv
    (Hopper's bulk copies; rows and features past the tensor's end read as zeros).
    With SPLIT (D == Dv), features [BLOCK_D, BLOCK_D + BLOCK_DT) are a second column tile:
    b_q_t and b_acc_t hold them, K's and V's come through ``*_tail_desc`` or pointers, and
    the scores sum both tiles' products; without it b_q_t and b_acc_t are unused."""
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_t = BLOCK_D + tl.arange(0, BLOCK_DT)
    for i_n in range(key_start, key_end, BLOCK_N):
        o_n = i_n + tl.arange(0, BLOCK_N)
        m_n = (o_n[None, :] < seq_kv) if MASKED else (o_n[None, :] >= 0)
        if TMA:
            b_k = tl.trans(k_desc.load([i_b, i_hkv, i_n, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            b_k = tl.load(p_k + o_n[None, :] * stride_k_s + o_d[:, None],
                          mask=m_n & (o_d[:, None] < head_dim), other=0.0)
        if IEEE:
            b_qk = tl.dot(b_q, b_k, input_precision="ieee")
        else:
            b_qk = tl.dot(b_q, b_k)
        if SPLIT:
            if TMA:
                b_k_t = tl.trans(k_tail_desc.load([i_b, i_hkv, i_n, BLOCK_D])
                                 .reshape(BLOCK_N, BLOCK_DT))
            else:
                b_k_t = tl.load(p_k + o_n[None, :] * stride_k_s + o_t[:, None],
                                mask=m_n & (o_t[:, None] < head_dim), other=0.0)
            if IEEE:
                b_qk = tl.dot(b_q_t, b_k_t, b_qk, input_precision="ieee")
            else:
                b_qk = tl.dot(b_q_t, b_k_t, b_qk)
        if MASKED:
            m_visible = m_n
            if CAUSAL:
                m_visible = m_visible & (o_n[None, :] <= o_m[:, None])
            if WINDOW:
                m_visible = m_visible & (o_n[None, :] > o_m[:, None] - window)
            b_s = b_qk * scale_log2
            if SOFTCAP:
                b_s = cap_log2 * soft_tanh(b_s, cap_log2)
            b_s = tl.where(m_visible, b_s, -float("inf"))
            b_new_max = tl.maximum(b_row_max, tl.max(b_s, axis=1))
            b_ref_max = b_new_max
            if WINDOW:  # a row may have seen no key yet: exponents against 0, not -inf - -inf
                b_ref_max = tl.where(b_new_max == -float("inf"), 0.0, b_new_max)
            b_p = tl.exp2(b_s - b_ref_max[:, None])
        elif LAZY:
            # the running maximum moves only when some row's grows by more than 2^8: until
            # then p <= 256 against a stale maximum, which fp32 sums and the output's
            # normalisation absorb, and the block skips rescaling acc (one multiply per element)
            b_block_max = tl.max(b_qk, axis=1) * scale_log2
            if tl.max(b_block_max - b_row_max, axis=0) > 8.0:
                b_new_max = tl.maximum(b_row_max, b_block_max)
                b_rescale = tl.exp2(b_row_max - b_new_max)
                b_acc = b_acc * b_rescale[:, None]
                if SPLIT:
                    b_acc_t = b_acc_t * b_rescale[:, None]
                b_row_sum = b_row_sum * b_rescale
                b_row_max = b_new_max
            b_new_max = b_row_max
            b_ref_max = b_new_max
            b_p = tl.exp2(b_qk * scale_log2 - b_row_max[:, None])
        else:
            # scale_log2 >= 0 (the launcher flips q's sign otherwise), so the scaled maximum is
            # the maximum scaled, and the exponent is one fused multiply-add per score
            b_new_max = tl.maximum(b_row_max, tl.max(b_qk, axis=1) * scale_log2)
            b_ref_max = b_new_max
            b_p = tl.exp2(b_qk * scale_log2 - b_new_max[:, None])
        if TMA:
            b_v = v_desc.load([i_b, i_hkv, i_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            b_v = tl.load(p_v + o_n[:, None] * stride_v_s + o_dv[None, :],
                          mask=(o_n[:, None] < seq_kv) & (o_dv[None, :] < head_dim_v), other=0.0)
        if SPLIT:
            if TMA:
                b_v_t = v_tail_desc.load([i_b, i_hkv, i_n, BLOCK_D]).reshape(BLOCK_N, BLOCK_DT)
            else:
                b_v_t = tl.load(p_v + o_n[:, None] * stride_v_s + o_t[None, :],
                                mask=(o_n[:, None] < seq_kv) & (o_t[None, :] < head_dim_v),
                                other=0.0)
        if LAZY and not MASKED:  # acc and row_sum are already on row_max's scale
            b_row_sum = b_row_sum + tl.sum(b_p, axis=1)
            if IEEE:
                b_acc = tl.dot(b_p, b_v, b_acc, input_precision="ieee")
                if SPLIT:
                    b_acc_t = tl.dot(b_p, b_v_t, b_acc_t, input_precision="ieee")
            else:
                b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc)
                if SPLIT:
                    b_acc_t = tl.dot(b_p.to(b_v.dtype), b_v_t, b_acc_t)
        else:
            # without a window every row sees key 0 in the first block it folds, so new_max is
            # finite from then on; with one, ref_max stands in for a row's -inf
            b_rescale = tl.exp2(b_row_max - b_ref_max)
            b_row_sum = b_row_sum * b_rescale + tl.sum(b_p, axis=1)
            if IEEE:
                b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
                if SPLIT:
                    b_acc_t = b_acc_t * b_rescale[:, None] + tl.dot(b_p, b_v_t,
                                                                    input_precision="ieee")
            else:
                b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
                if SPLIT:
                    b_acc_t = b_acc_t * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v_t)
        b_row_max = b_new_max
    return b_acc, b_acc_t, b_row_max, b_row_sum


@triton.jit
def _query_block(seq_q, n_q_heads, group_size, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """(i_bh = batch * Hq + head, batch, head, KV head, query block) of this program of a
    forward or dQ grid (B * Hq * query blocks,) in layout.head_and_block's order, the last query
    blocks first when causal (they see the most keys); batch and the heads as int64."""
    n_blocks = tl.cdiv(seq_q, BLOCK_M)
    i_bh, i_m = layout.head_and_block(n_blocks, CAUSAL)
    if CAUSAL:
        i_m = n_blocks - 1 - i_m
    i_b = (i_bh // n_q_heads).to(tl.int64)
    i_h = (i_bh % n_q_heads).to(tl.int64)
    return i_bh, i_b, i_h, i_h // group_size, i_m


@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_desc, k_desc, v_desc, o_desc,
    q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc,
    seq_q, seq_kv, n_q_heads, group_size, head_dim, head_dim_v, scale_log2, window, cap_log2,
    stride_q_b, stride_q_h, stride_q_s, stride_k_b, stride_k_h, stride_k_s,
    stride_v_b, stride_v_h, stride_v_s, stride_o_b, stride_o_h, stride_o_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr,
):
    """Grid (B * Hq * query blocks,) in layout.head_and_block's order. o (B, Hq, Sq, Dv) in
    q's dtype, lse (B, Hq, Sq) fp32. WINDOW (causal only): row i sees the keys
    i - window < j <= i; SOFTCAP: scores capped at cap_log2 (log2 units); with either, every
    key block goes through the masked path.
    TMA (the launcher's decision: the config asks for it with USE_TMA and the tensors' strides
    allow it): q, K, V and o move through the 4-d tensor descriptors ``*_desc``, whose blocks
    are [1, 1, rows, BLOCK_D or BLOCK_DV]; otherwise they are None and pointers are used.
    SPLIT (D == Dv, the launcher's choice for a head dim like 96): the features are two column
    tiles, [0, BLOCK_D) and [BLOCK_D, BLOCK_D + BLOCK_DT) (64 + 32 for D96), rather than one
    padded to a power of two; ``*_tail_desc`` address the second ([1, 1, rows, BLOCK_DT]) with
    TMA."""
    i_bh, i_b, i_h, i_hkv, i_m = _query_block(seq_q, n_q_heads, group_size, CAUSAL, BLOCK_M)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    o_t = BLOCK_D + tl.arange(0, BLOCK_DT)
    p_q = q_ptr + i_b * stride_q_b + i_h * stride_q_h
    p_k = k_ptr + i_b * stride_k_b + i_hkv * stride_k_h
    p_v = v_ptr + i_b * stride_v_b + i_hkv * stride_v_h
    if TMA:  # descriptor indices are int32
        i_b32, i_h32, i_hkv32 = i_b.to(tl.int32), i_h.to(tl.int32), i_hkv.to(tl.int32)
        b_q = q_desc.load([i_b32, i_h32, i_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        i_b32, i_h32, i_hkv32 = i_b, i_h, i_hkv  # unused
        b_q = tl.load(p_q + o_m[:, None] * stride_q_s + o_d[None, :],
                      mask=(o_m[:, None] < seq_q) & (o_d[None, :] < head_dim), other=0.0)
    if SPLIT:
        if TMA:
            b_q_t = q_tail_desc.load([i_b32, i_h32, i_m * BLOCK_M, BLOCK_D]).reshape(
                BLOCK_M, BLOCK_DT)
        else:
            b_q_t = tl.load(p_q + o_m[:, None] * stride_q_s + o_t[None, :],
                            mask=(o_m[:, None] < seq_q) & (o_t[None, :] < head_dim), other=0.0)
    else:
        b_q_t = b_q  # unused

    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    b_acc_t = tl.zeros([BLOCK_M, BLOCK_DT], dtype=tl.float32)  # unused without SPLIT
    b_row_max = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    b_row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CAUSAL:
        # keys below the block's first row are seen by every row: no mask; the rest up to the
        # block's last row is the diagonal
        key_end = tl.minimum(seq_kv, (i_m + 1) * BLOCK_M)
        full_end = (tl.minimum(seq_kv, i_m * BLOCK_M) // BLOCK_N) * BLOCK_N
    else:
        key_end = seq_kv
        full_end = (seq_kv // BLOCK_N) * BLOCK_N
    if WINDOW or SOFTCAP:  # from the first row's first key, every block masked
        key_start = 0
        if WINDOW:
            key_start = (tl.maximum(i_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
        b_acc, b_acc_t, b_row_max, b_row_sum = _attend_blocks(
            b_acc, b_acc_t, b_row_max, b_row_sum, b_q, b_q_t, p_k, p_v, stride_k_s,
            stride_v_s, k_desc, v_desc, k_tail_desc, v_tail_desc, i_b32, i_hkv32, o_m,
            key_start, key_end, seq_kv, head_dim, head_dim_v,
            scale_log2, window, cap_log2, True, CAUSAL, IEEE, TMA, LAZY, WINDOW, SOFTCAP,
            BLOCK_N, BLOCK_D, BLOCK_DV, SPLIT, BLOCK_DT)
    else:
        b_acc, b_acc_t, b_row_max, b_row_sum = _attend_blocks(
            b_acc, b_acc_t, b_row_max, b_row_sum, b_q, b_q_t, p_k, p_v, stride_k_s,
            stride_v_s, k_desc, v_desc, k_tail_desc, v_tail_desc, i_b32, i_hkv32, o_m,
            0, full_end, seq_kv, head_dim, head_dim_v,
            scale_log2, window, cap_log2, False, CAUSAL, IEEE, TMA, LAZY, WINDOW, SOFTCAP,
            BLOCK_N, BLOCK_D, BLOCK_DV, SPLIT, BLOCK_DT)
        b_acc, b_acc_t, b_row_max, b_row_sum = _attend_blocks(
            b_acc, b_acc_t, b_row_max, b_row_sum, b_q, b_q_t, p_k, p_v, stride_k_s,
            stride_v_s, k_desc, v_desc, k_tail_desc, v_tail_desc, i_b32, i_hkv32, o_m,
            full_end, key_end, seq_kv, head_dim, head_dim_v,
            scale_log2, window, cap_log2, True, CAUSAL, IEEE, TMA, LAZY, WINDOW, SOFTCAP,
            BLOCK_N, BLOCK_D, BLOCK_DV, SPLIT, BLOCK_DT)

    b_o = (b_acc / b_row_sum[:, None]).to(o_ptr.dtype.element_ty)
    p_o = o_ptr + i_b * stride_o_b + i_h * stride_o_h
    if TMA:  # rows and features past o's end are not written
        o_desc.store([i_b32, i_h32, i_m * BLOCK_M, 0], b_o.reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        tl.store(p_o + o_m[:, None] * stride_o_s + o_dv[None, :], b_o,
                 mask=(o_m[:, None] < seq_q) & (o_dv[None, :] < head_dim_v))
    if SPLIT:
        b_o_t = (b_acc_t / b_row_sum[:, None]).to(o_ptr.dtype.element_ty)
        if TMA:
            o_tail_desc.store([i_b32, i_h32, i_m * BLOCK_M, BLOCK_D],
                              b_o_t.reshape(1, 1, BLOCK_M, BLOCK_DT))
        else:
            tl.store(p_o + o_m[:, None] * stride_o_s + o_t[None, :], b_o_t,
                     mask=(o_m[:, None] < seq_q) & (o_t[None, :] < head_dim_v))
    b_lse = (b_row_max + tl.log2(b_row_sum)) * LN2
    tl.store(lse_ptr + i_bh.to(tl.int64) * seq_q + o_m, b_lse, mask=o_m < seq_q)


@triton.jit
def _attention_bwd_delta_kernel(o_ptr, do_ptr, grad_lse_ptr, delta_ptr, seq_q, n_q_heads,
                                head_dim_v, stride_o_b, stride_o_h, stride_o_s,
                                stride_do_b, stride_do_h, stride_do_s,
                                BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta[b, h, i] = sum_d o[b, h, i, d] * do[b, h, i, d] - grad_lse[b, h, i] (fp32), the
    row term of the softmax backward (a gradient flowing into lse enters it there, since
    d lse_i / d s_ij = p_ij). Grid (B * Hq, query blocks): B * Hq may pass the 65535 that a
    grid's second axis allows; delta and grad_lse (B, Hq, Sq), grad_lse None where no gradient
    flows into lse."""
    i_bh = tl.program_id(0)
    i_b = (i_bh // n_q_heads).to(tl.int64)
    i_h = (i_bh % n_q_heads).to(tl.int64)
    o_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_dv = tl.arange(0, BLOCK_DV)
    m_o = (o_m[:, None] < seq_q) & (o_dv[None, :] < head_dim_v)
    b_o = tl.load(o_ptr + i_b * stride_o_b + i_h * stride_o_h + o_m[:, None] * stride_o_s
                  + o_dv[None, :], mask=m_o, other=0.0).to(tl.float32)
    b_do = tl.load(do_ptr + i_b * stride_do_b + i_h * stride_do_h + o_m[:, None] * stride_do_s
                   + o_dv[None, :], mask=m_o, other=0.0).to(tl.float32)
    b_delta = tl.sum(b_o * b_do, axis=1)
    o_row = i_bh.to(tl.int64) * seq_q + o_m  # rows of (B, Hq, Sq)
    if grad_lse_ptr is not None:
        b_delta -= tl.load(grad_lse_ptr + o_row, mask=o_m < seq_q, other=0.0)
    tl.store(delta_ptr + o_row, b_delta, mask=o_m < seq_q)


@triton.jit
def _load_tile(p_x, o_row, stride_x_row, n_rows, o_col, n_cols):
    """Rows o_row x columns o_col of one head's (S, D) matrix at p_x with unit last stride,
    zeros outside it."""
    return tl.load(p_x + o_row[:, None] * stride_x_row + o_col[None, :],
                   mask=(o_row[:, None] < n_rows) & (o_col[None, :] < n_cols), other=0.0)


@triton.jit
def _softmax_grad_block(b_q, b_k, b_v, b_do, b_lse_log2, b_delta, o_m, o_n, seq_q, seq_kv,
                        scale_log2, window, cap_log2, KEYS_MAJOR: tl.constexpr,
                        CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
                        SOFTCAP: tl.constexpr):
    """For one block of BLOCK_M queries o_m and BLOCK_N keys o_n: p (the forward's
    probabilities, recomputed from the saved lse) and ds = p * (do . v - delta), zero outside
    the visible (query, key) pairs (causal, and the window's left edge with WINDOW); with
    SOFTCAP the scores are capped as in the forward and ds carries the cap's slope
    1 - tanh^2, so it is the gradient of the scaled score q.k * scale. q (M, D), k (N, D), v (N, Dv), do (M, Dv). Returned (M, N),
    or (N, M) with KEYS_MAJOR: the dK/dV kernel's matmuls then take p^T and ds^T as their left
    operand straight from registers instead of transposing them through shared memory."""
    if KEYS_MAJOR:  # keys down, query rows across
        b_left, b_right, b_left_v, b_right_v = b_k, b_q, b_v, b_do
        o_m_2d, o_n_2d = o_m[None, :], o_n[:, None]
        b_lse_2d, b_delta_2d = b_lse_log2[None, :], b_delta[None, :]
    else:
        b_left, b_right, b_left_v, b_right_v = b_q, b_k, b_do, b_v
        o_m_2d, o_n_2d = o_m[:, None], o_n[None, :]
        b_lse_2d, b_delta_2d = b_lse_log2[:, None], b_delta[:, None]
    if IEEE:
        b_qk = tl.dot(b_left, tl.trans(b_right), input_precision="ieee")
        b_dp = tl.dot(b_left_v, tl.trans(b_right_v), input_precision="ieee")
    else:
        b_qk = tl.dot(b_left, tl.trans(b_right))
        b_dp = tl.dot(b_left_v, tl.trans(b_right_v))
    m_visible = (o_m_2d < seq_q) & (o_n_2d < seq_kv)
    if CAUSAL:
        m_visible = m_visible & (o_n_2d <= o_m_2d)
    if WINDOW:
        m_visible = m_visible & (o_n_2d > o_m_2d - window)
    b_s = b_qk * scale_log2
    if SOFTCAP:
        b_tanh = soft_tanh(b_s, cap_log2)
        b_s = cap_log2 * b_tanh
    b_p = tl.where(m_visible, tl.exp2(b_s - b_lse_2d), 0.0)
    b_ds = b_p * (b_dp - b_delta_2d)
    if SOFTCAP:
        b_ds = b_ds * (1.0 - b_tanh * b_tanh)
    return b_p, b_ds


@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    seq_q, seq_kv, n_kv_heads, group_size, head_dim, head_dim_v, scale, scale_log2, window,
    cap_log2, stride_q_b, stride_q_h, stride_q_s, stride_k_b, stride_k_h, stride_k_s,
    stride_v_b, stride_v_h, stride_v_s, stride_do_b, stride_do_h, stride_do_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV of one block of BLOCK_N keys of one KV head, summed over the group's query
    heads and every query block that sees the keys (no atomics, K/V never repeated):
    dv = sum p^T do, dk = scale * sum ds^T q. Grid (B * Hkv * key blocks,) in
    layout.head_and_block's order (causal: the first key blocks, which see the most query rows,
    are the heavy ones); dk and dv contiguous (B, Hkv, Skv, D / Dv)."""
    i_bhkv, i_n = layout.head_and_block(tl.cdiv(seq_kv, BLOCK_N), CAUSAL)
    i_b = (i_bhkv // n_kv_heads).to(tl.int64)
    i_hkv = (i_bhkv % n_kv_heads).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_k = _load_tile(k_ptr + i_b * stride_k_b + i_hkv * stride_k_h, o_n, stride_k_s, seq_kv,
                     o_d, head_dim)
    b_v = _load_tile(v_ptr + i_b * stride_v_b + i_hkv * stride_v_h, o_n, stride_v_s, seq_kv,
                     o_dv, head_dim_v)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # causal: query rows before the block's first key see none of it
    first_row = (i_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    row_end = seq_q
    if WINDOW:  # rows past the block's last key + window - 1 see none of it
        row_end = tl.minimum(seq_q, (i_n + 1) * BLOCK_N + window - 1)
    row_blocks = tl.cdiv(row_end - first_row, BLOCK_M)
    # one flat loop over (group member, query block): one software pipeline across members
    for i_step in range(0, group_size * row_blocks):
        i_h = i_hkv * group_size + i_step // row_blocks
        o_m = first_row + (i_step % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        b_q = _load_tile(q_ptr + i_b * stride_q_b + i_h * stride_q_h, o_m, stride_q_s, seq_q,
                         o_d, head_dim)
        b_do = _load_tile(do_ptr + i_b * stride_do_b + i_h * stride_do_h, o_m, stride_do_s,
                          seq_q, o_dv, head_dim_v)
        o_row = (i_b * n_kv_heads * group_size + i_h) * seq_q + o_m  # rows of (B, Hq, Sq)
        b_lse_log2 = tl.load(lse_ptr + o_row, mask=o_m < seq_q, other=0.0) * LOG2E
        b_delta = tl.load(delta_ptr + o_row, mask=o_m < seq_q, other=0.0)
        b_pt, b_dst = _softmax_grad_block(b_q, b_k, b_v, b_do, b_lse_log2, b_delta, o_m, o_n,
                                          seq_q, seq_kv, scale_log2, window, cap_log2, True,
                                          CAUSAL, IEEE, WINDOW, SOFTCAP)
        if IEEE:
            b_dv += tl.dot(b_pt, b_do, input_precision="ieee")
            b_dk += tl.dot(b_dst, b_q, input_precision="ieee")
        else:
            b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
            b_dk += tl.dot(b_dst.to(b_q.dtype), b_q)
    o_kv_row = i_bhkv.to(tl.int64) * seq_kv + o_n  # rows of (B, Hkv, Skv)
    tl.store(dk_ptr + o_kv_row[:, None] * head_dim + o_d[None, :],
             (b_dk * scale).to(dk_ptr.dtype.element_ty),
             mask=(o_n[:, None] < seq_kv) & (o_d[None, :] < head_dim))
    tl.store(dv_ptr + o_kv_row[:, None] * head_dim_v + o_dv[None, :],
             b_dv.to(dv_ptr.dtype.element_ty),
             mask=(o_n[:, None] < seq_kv) & (o_dv[None, :] < head_dim_v))


@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    seq_q, seq_kv, n_q_heads, group_size, head_dim, head_dim_v, scale, scale_log2, window,
    cap_log2, stride_q_b, stride_q_h, stride_q_s, stride_k_b, stride_k_h, stride_k_s,
    stride_v_b, stride_v_h, stride_v_s, stride_do_b, stride_do_h, stride_do_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dq = scale * sum_j ds_ij k_j for one block of BLOCK_M query rows of one head, over the
    keys those rows see. Grid (B * Hq * query blocks,) in layout.head_and_block's order, the
    last query blocks first when causal (they see the most keys); dq contiguous (B, Hq, Sq, D)."""
    i_bh, i_b, i_h, i_hkv, i_m = _query_block(seq_q, n_q_heads, group_size, CAUSAL, BLOCK_M)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_q = _load_tile(q_ptr + i_b * stride_q_b + i_h * stride_q_h, o_m, stride_q_s, seq_q,
                     o_d, head_dim)
    b_do = _load_tile(do_ptr + i_b * stride_do_b + i_h * stride_do_h, o_m, stride_do_s, seq_q,
                      o_dv, head_dim_v)
    o_row = i_bh.to(tl.int64) * seq_q + o_m  # rows of (B, Hq, Sq)
    b_lse_log2 = tl.load(lse_ptr + o_row, mask=o_m < seq_q, other=0.0) * LOG2E
    b_delta = tl.load(delta_ptr + o_row, mask=o_m < seq_q, other=0.0)
    p_k = k_ptr + i_b * stride_k_b + i_hkv * stride_k_h
    p_v = v_ptr + i_b * stride_v_b + i_hkv * stride_v_h
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_end = tl.minimum(seq_kv, (i_m + 1) * BLOCK_M) if CAUSAL else seq_kv
    key_start = 0
    if WINDOW:  # keys before the block's first row's window: none of its rows sees them
        key_start = (tl.maximum(i_m * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
    for i_n in range(key_start, key_end, BLOCK_N):
        o_n = i_n + tl.arange(0, BLOCK_N)
        b_k = _load_tile(p_k, o_n, stride_k_s, seq_kv, o_d, head_dim)
        b_v = _load_tile(p_v, o_n, stride_v_s, seq_kv, o_dv, head_dim_v)
        _, b_ds = _softmax_grad_block(b_q, b_k, b_v, b_do, b_lse_log2, b_delta, o_m, o_n,
                                      seq_q, seq_kv, scale_log2, window, cap_log2, False,
                                      CAUSAL, IEEE, WINDOW, SOFTCAP)
        if IEEE:
            b_dq += tl.dot(b_ds, b_k, input_precision="ieee")
        else:
            b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
    tl.store(dq_ptr + o_row[:, None] * head_dim + o_d[None, :],
             (b_dq * scale).to(dq_ptr.dtype.element_ty),
             mask=(o_m[:, None] < seq_q) & (o_d[None, :] < head_dim))


ATTENTION_FWD = runtime.TunedKernel("attention", "attention_fwd", _attention_fwd_kernel,
                                    tunables=("BLOCK_M", "BLOCK_N", "LAZY"),
                                    launcher_knobs=("USE_TMA",),
                                    shape_keys=("head_dim", "causal", "elem_bytes", "seq_q",
                                                "seq_kv"))
ATTENTION_BWD_DKDV = runtime.TunedKernel("attention", "attention_bwd_dkdv",
                                         _attention_bwd_dkdv_kernel,
                                         tunables=("BLOCK_M", "BLOCK_N"),
                                         shape_keys=("head_dim", "elem_bytes"))
ATTENTION_BWD_DQ = runtime.TunedKernel("attention", "attention_bwd_dq", _attention_bwd_dq_kernel,
                                       tunables=("BLOCK_M", "BLOCK_N"),
                                       shape_keys=("head_dim", "elem_bytes"))
# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# On sm_90, 16-bit inputs with D = Dv = 128 go to the warp-specialised Gluon kernel
# (_attention_hopper.py), faster than the Triton kernel there, and the backward computes their
# dK/dV in Gluon too (_attention_hopper.backward_dkdv: K and V kept in shared memory); see
# docs/notes/attention.md. Switched off, every call stays on the Triton kernels.
HOPPER_FORWARD = runtime.KernelPath("attention", "the Gluon forward on sm_90")
HOPPER_BACKWARD = runtime.KernelPath("attention", "the Gluon dK/dV kernel on sm_90")
# ...and dQ from that kernel too (fp32 atomics of ds k, no second pass over s and dp), where
# HOPPER_BACKWARD applies to a call without a causal mask (with one it does not pay: see
# docs/notes/attention.md); switched off, dQ comes from the Triton kernel
HOPPER_FUSED_DQ = runtime.KernelPath("attention", "dQ from the Gluon dK/dV kernel on sm_90")
# the Triton forward's head dims between powers of two (96, 80, 40, 192) as two column tiles
# rather than one padded tile (``column_tiles``). Opt-in (GEMSLIB_SPLIT_HEAD_DIM=1) until
# timed against the padded tile on a GPU (docs/notes/attention.md)
SPLIT_HEAD_DIM = runtime.KernelPath("attention", "head dims like 96 as two column tiles, "
                                    "64 + 32, in the Triton forward",
                                    environment="GEMSLIB_SPLIT_HEAD_DIM", default=False)


def heads_interleaved(batch: int, n_heads: int, seq: int, width: int, dtype: torch.dtype,
                      device) -> torch.Tensor:
    """An empty (B, H, S, width) tensor laid out as (B, S, H, width), as SDPA's flash backend
    returns o: a decoder's ``o.transpose(1, 2).reshape(B, S, H * width)`` before its output
    projection is then a view, not a copy kernel."""
    return torch.empty((batch, seq, n_heads, width), dtype=dtype, device=device).transpose(1, 2)


def _launch_forward(q, k, v, causal: bool, scale: float, out: torch.Tensor | None = None,
                    window: int = 0, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for (B, Hq, Sq, D) q and (B, Hkv, Skv, D / Dv) k / v, validated. ``out``: the
    (B, Hq, Sq, Dv) tensor to write o into, any strides (the SDPA overrides pass torch's
    layout for the backend); by default ``heads_interleaved``'s. ``window`` > 0 (causal) and
    ``softcap`` > 0 as :func:`attention_reference` takes them: the Triton kernel's masked
    path serves such calls."""
    q, k, v = layout.unit_last(q), layout.unit_last(k), layout.unit_last(v)
    if scale < 0:  # the unmasked blocks need a scale >= 0; (-q).k * -scale is exact
        q, scale = -q, -scale
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    if out is not None and out.stride(-1) != 1 and out.shape[-1] > 1:
        result, lse = _launch_forward(q, k, v, causal, scale, None, window, softcap)
        return out.copy_(result), lse
    if out is None:
        out = heads_interleaved(batch, n_q_heads, seq_q, head_dim_v, q.dtype, q.device)
    banded = bool(window or softcap)
    if seq_q == 1 and seq_kv and batch * n_q_heads * head_dim_v:
        # one query row (a decode step through SDPA): the decode kernel reads each KV head once
        # for its group and splits the keys over the SMs, where the prefill kernels would read
        # it once per query head and fill 1 of 64-128 rows. Top-left causal: key 0 only.
        if causal:
            k, v = k[:, :, :1], v[:, :, :1]
        lse = torch.empty((batch, n_q_heads, 1), dtype=torch.float32, device=q.device)
        # (a window starts at the one row's key, 0: it hides nothing of a causal row)
        _launch_decode(q[:, :, 0], k, v, None, scale, lse=lse, out=out[:, :, 0],
                       softcap=softcap)
        return out, lse
    if HOPPER_FORWARD.on and _attention_hopper is not None and batch * n_q_heads * seq_q * \
            seq_kv and not banded and _attention_hopper.eligible_forward(q, k, v):
        return out, _attention_hopper.forward(q, k, v, causal, scale, out)
    lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(-float("inf"))
    if seq_kv == 0:  # no keys: SDPA gives zeros
        return out.zero_(), lse.fill_(-float("inf"))
    # elem_bytes: fp32 inputs need smaller tiles than the 16-bit ones (shared memory)
    shape = (head_dim, int(causal), q.element_size(), seq_q, seq_kv)
    block_d, block_dt = column_tiles(head_dim, head_dim_v)
    split = bool(block_dt)
    block_dt = block_dt or 16  # a shape for the unused tail accumulator
    block_dv = block_d if split else max(16, runtime.next_power_of_2(head_dim_v))
    config = ATTENTION_FWD.planned_config(shape)
    meta = config.meta_dict
    tma = bool(meta["USE_TMA"]) and _tma_ready(q, k, v, out)
    if tma:  # the descriptors' blocks follow the config, so the launch must use this one
        blocks = [(q, meta["BLOCK_M"], block_d), (k, meta["BLOCK_N"], block_d),
                  (v, meta["BLOCK_N"], block_dv), (out, meta["BLOCK_M"], block_dv)]
        descriptors = [TensorDescriptor.from_tensor(t, [1, 1, rows, cols])
                       for t, rows, cols in blocks]
        descriptors += [TensorDescriptor.from_tensor(t, [1, 1, rows, block_dt]) if split
                        else None for t, rows, _ in blocks]
    else:
        descriptors, config = [None] * 8, None
    scale_log2 = scale * LOG2E.value
    # positional (TunedKernel.launch forwards them so), in the kernel's order: tensors and
    # descriptors; sizes and scale; strides; flags and blocks
    ATTENTION_FWD.launch(
        lambda meta: (batch * n_q_heads * runtime.cdiv(seq_q, meta["BLOCK_M"]),),
        q, k, v, out, lse, *descriptors,
        seq_q, seq_kv, n_q_heads, n_q_heads // n_kv_heads, head_dim, head_dim_v, scale_log2,
        int(window), float(softcap) * LOG2E.value,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        causal, q.dtype == torch.float32, tma, bool(window), bool(softcap), block_d, block_dv,
        split, block_dt, shape=shape, config=config)
    return out, lse


def column_tiles(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The forward's feature tiles (BLOCK_D, BLOCK_DT): one of the next power of two (tail 0),
    or, with SPLIT_HEAD_DIM on and D == Dv, a power of two and a tail of at most half of it
    where that pads less (D96: 64 + 32, not 128, a quarter less matmul work; D80: 64 + 16;
    D40: 32 + 16; D192: 128 + 64)."""
    padded = max(16, runtime.next_power_of_2(head_dim))
    if not SPLIT_HEAD_DIM.on or head_dim != head_dim_v or head_dim <= 32 or padded == head_dim:
        return padded, 0
    block_d = padded // 2
    block_dt = max(16, runtime.next_power_of_2(head_dim - block_d))
    return (block_d, block_dt) if block_dt <= block_d // 2 else (padded, 0)


def _launch_backward(grad_out, q, k, v, out, lse, grad_lse, causal: bool, scale: float,
                     window: int = 0,
                     softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, for the forward (out, lse) of validated q, k, v; grad_lse
    (B, Hq, Sq) or None is a gradient flowing into lse. ``window`` and ``softcap`` as the
    forward took them (the Triton kernels serve such calls)."""
    q, k, v, grad_out = (layout.unit_last(t) for t in (q, k, v, grad_out))
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if dq.numel() == 0 or dk.numel() == 0 or dv.numel() == 0:
        return dq, dk, dv  # no rows, no keys or no features: nothing flows
    block_d = max(16, runtime.next_power_of_2(head_dim))
    block_dv = max(16, runtime.next_power_of_2(head_dim_v))
    delta = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    grad_lse = grad_lse.contiguous() if grad_lse is not None else None
    with runtime.quiet_interpreter():
        _attention_bwd_delta_kernel[(batch * n_q_heads, runtime.cdiv(seq_q, 64))](
            o_ptr=out, do_ptr=grad_out, grad_lse_ptr=grad_lse, delta_ptr=delta, seq_q=seq_q,
            n_q_heads=n_q_heads, head_dim_v=head_dim_v,
            stride_o_b=out.stride(0), stride_o_h=out.stride(1), stride_o_s=out.stride(2),
            stride_do_b=grad_out.stride(0), stride_do_h=grad_out.stride(1),
            stride_do_s=grad_out.stride(2), BLOCK_M=64, BLOCK_DV=block_dv)
    shape = (head_dim, q.element_size())
    # both kernels' parameters after the sequence lengths and the head count each kernel's grid
    # runs over, positional (TunedKernel.launch forwards them so): sizes and scales; strides;
    # flags and blocks
    rest = (n_q_heads // n_kv_heads, head_dim, head_dim_v, scale, scale * LOG2E.value,
            int(window), float(softcap) * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
            causal, q.dtype == torch.float32, bool(window), bool(softcap), block_d, block_dv)
    if HOPPER_BACKWARD.on and _attention_hopper is not None and not (window or softcap) and \
            _attention_hopper.eligible_backward(q, k, v) and layout.tma_addressable(grad_out):
        if HOPPER_FUSED_DQ.on and not causal and \
                head_dim in _attention_hopper.FUSED_DQ_HEAD_DIMS:
            return _attention_hopper.backward(q, k, v, grad_out, lse, delta, causal, scale)
        dk, dv = _attention_hopper.backward_dkdv(q, k, v, grad_out, lse, delta, causal, scale)
    else:
        ATTENTION_BWD_DKDV.launch(
            lambda meta: (batch * n_kv_heads * runtime.cdiv(seq_kv, meta["BLOCK_N"]),),
            q, k, v, grad_out, lse, delta, dk, dv,
            seq_q, seq_kv, n_kv_heads, *rest,
            shape=shape)
    ATTENTION_BWD_DQ.launch(
        lambda meta: (batch * n_q_heads * runtime.cdiv(seq_q, meta["BLOCK_M"]),),
        q, k, v, grad_out, lse, delta, dq,
        seq_q, seq_kv, n_q_heads, *rest,
        shape=shape)
    return dq, dk, dv


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need TMA-addressable tensors and at most 256 rows or features per
    block."""
    return all(layout.tma_addressable(t) for t in tensors) and \
        max(t.shape[-1] for t in tensors) <= 256


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)``: q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) with Hq a
    multiple of Hkv; returns (B, Hq, Sq, Dv) in q's dtype. Differentiable in q, k and v (the
    backward recomputes the probabilities from the saved row log-sum-exp).

    Args:
        q: (B, Hq, Sq, D) floating tensor, any strides (a non-unit last stride costs a copy).
            The kernels take fp16, bf16 and fp32 on the kernel device with D and Dv in
            [1, 256]; other calls are computed by torch, in fp32 (fp64 for fp64).
        k: (B, Hkv, Skv, D), q's dtype and device; Hq a multiple of Hkv (grouped-query).
        v: (B, Hkv, Skv, Dv), q's dtype and device.
        causal: query i sees the keys j <= i (top-left alignment when Sq != Skv).
        scale: the scores' factor; None for 1 / sqrt(D).
        window: a sliding window (with ``causal``): query i sees the keys
            i - window < j <= i (Mistral's, Gemma-2's local layers). None for none.
        softcap: each score s (scaled) becomes softcap * tanh(s / softcap) before the
            softmax (Gemma-2's attention logit soft-capping). None for none.

    Returns:
        (B, Hq, Sq, Dv) tensor of q's dtype.

    Raises:
        TypeError: q, k or v is not a floating-point tensor, causal is not a bool, or scale
            is not a real number.
        ValueError: a tensor that is not 4-d, shapes that do not agree as above, k or v of
            another dtype or device, a window below 1 or without ``causal``, or a softcap
            that is not above 0.
    """
    args = (q, k, v, causal, scale, window, softcap)
    key, planned = _ATTENTION_CALLS.replayed(*args)
    if planned is not None:
        return planned[0]
    causal = checks.as_bool("gemslib.attention", "causal", causal)
    _check(q, k, v, scale)
    scale = default_scale(q.shape[-1]) if scale is None else checks.as_float(
        "gemslib.attention", "scale", scale)
    window, softcap = _band(causal, window, softcap)
    if runtime.wants_custom_op(q, k, v):
        return _attention_op(q, k, v, bool(causal), scale, window, softcap)[0]
    # planned with lse, which the launch writes: a plan's launches touch only its outputs
    return _ATTENTION_CALLS.plan(key, args, lambda: _attention_impl(q, k, v, causal, scale,
                                                                   window, softcap))[0]


def _band(causal: bool, window, softcap) -> tuple[int, float]:
    """(window, softcap) as the kernels take them, 0 for none, checked."""
    if window is not None and not causal:
        raise ValueError("gemslib.attention: a window is a causal model's sliding window; "
                         "pass causal=True with it")
    return band_arguments("gemslib.attention", window, softcap)


_ATTENTION_CALLS = runtime.CallPlans("attention")


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float, window: int = 0,
                    softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the kernel where it runs, torch otherwise. window and softcap: 0 for
    none (as :func:`attention` checked them)."""
    if not _kernels_take(q, k, v):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = attention_reference(q.to(work), k.to(work), v.to(work), causal, scale,
                                       window, softcap)
        return heads_interleaved(*out.shape, q.dtype, q.device).copy_(out), lse.float()
    return _launch_forward(q, k, v, causal, scale, None, window, softcap)


def _attention_backward_impl(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             grad_lse: Optional[torch.Tensor], causal: bool, scale: float,
                             window: int = 0, softcap: float = 0.0
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``_attention_impl``'s (out, lse): the kernels where the forward ran
    them, autograd through the float reference otherwise."""
    if not _kernels_take(q, k, v, grad_out):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        with torch.enable_grad():
            inputs = [t.detach().to(work).requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = attention_reference(*inputs, causal, scale, window, softcap)
            outputs, grads = [ref_out], [grad_out.to(work)]
            if grad_lse is not None:
                outputs.append(ref_lse)
                grads.append(grad_lse.to(work))
            dq, dk, dv = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        return tuple((g if g is not None else torch.zeros_like(t)).to(t.dtype)
                     for g, t in zip((dq, dk, dv), (q, k, v)))
    return _launch_backward(grad_out, q, k, v, out, lse, grad_lse, causal, scale, window,
                            softcap)


def _attention_fake(q, k, v, causal, scale, window=0, softcap=0.0):
    batch, n_q_heads, seq_q, _ = q.shape
    return (heads_interleaved(batch, n_q_heads, seq_q, v.shape[-1], q.dtype, q.device),
            q.new_empty((batch, n_q_heads, seq_q), dtype=torch.float32))


def _save_for_attention_backward(ctx, inputs, output):
    q, k, v, causal, scale, *band = inputs
    ctx.causal, ctx.scale, ctx.band = causal, scale, tuple(band) or (0, 0.0)
    ctx.save_for_backward(q, k, v, *output)


def _attention_grad(ctx, grad_out, grad_lse, ops):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = ops.attention_backward(grad_out, q, k, v, out, lse, grad_lse, ctx.causal,
                                        ctx.scale, *ctx.band)
    return dq, dk, dv, None, None, None, None


_attention_backward_op = runtime.CustomOp(
    "attention_backward", _attention_backward_impl,
    fake=lambda grad_out, q, k, v, out, lse, grad_lse, causal, scale, window=0, softcap=0.0: (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)))
_attention_op = runtime.CustomOp("attention", _attention_impl, fake=_attention_fake,
                                 setup_context=_save_for_attention_backward,
                                 backward=_attention_grad, uses=(_attention_backward_op,))


# --------------------------------------------------------------------------------------------
# aten overrides: the SDPA backend operators, adapted in _attention_sdpa.py
# --------------------------------------------------------------------------------------------


def _sdpa_override(aten: str, adapter, unsupported, backend: str) -> AtenOverride:
    """SDPA backend operator ``aten`` served by ``adapter`` of _attention_sdpa.py, bound to the
    kernels' entry point: _launch_backward for a backward operator, else _launch_forward."""
    entry = _launch_backward if aten.endswith("_backward") else _launch_forward
    return AtenOverride(aten, partial(adapter, entry), unsupported, dispatch_keys=(backend,))


ATEN_OVERRIDES = (
    _sdpa_override("aten::_scaled_dot_product_flash_attention_for_cpu",
                   sdpa._aten_flash_for_cpu, sdpa._why_not_flash_for_cpu, "CPU"),
    _sdpa_override("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                   sdpa._aten_flash_for_cpu_backward, sdpa._why_not_flash_for_cpu_backward, "CPU"),
    _sdpa_override("aten::_scaled_dot_product_flash_attention", sdpa._aten_flash,
                   sdpa._why_not_flash, "CUDA"),
    _sdpa_override("aten::_scaled_dot_product_flash_attention_backward",
                   sdpa._aten_flash_backward, sdpa._why_not_flash_backward, "CUDA"),
    _sdpa_override("aten::_scaled_dot_product_cudnn_attention", sdpa._aten_cudnn,
                   sdpa._why_not_cudnn, "CUDA"),
    _sdpa_override("aten::_scaled_dot_product_cudnn_attention_backward",
                   sdpa._aten_cudnn_backward, sdpa._why_not_cudnn_backward, "CUDA"),
    _sdpa_override("aten::_scaled_dot_product_efficient_attention", sdpa._aten_efficient,
                   sdpa._why_not_efficient, "CUDA"),
    _sdpa_override("aten::_scaled_dot_product_efficient_attention_backward",
                   sdpa._aten_efficient_backward, sdpa._why_not_efficient_backward, "CUDA"),
)


# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _attention_inputs(device, dtype, seq):
    """q, k, v with GQA (4 query heads on 2 KV heads, head dim 64) at the check's size; the
    timing size (thousands of tokens) gets Llama's 32 / 8 heads of 128."""
    heads, kv_heads, dim = (32, 8, 128) if seq >= 1024 else (4, 2, 64)
    return (torch.randn(1, heads, seq, dim, device=device, dtype=dtype),
            *(torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype) for _ in range(2)))


def _gradients(attend, q, k, v, grad_out):
    """(dq, dk, dv) of ``attend(q, k, v, causal=True)`` for ``grad_out``, flattened into one."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        grads = torch.autograd.grad(attend(*leaves), leaves, grad_out)
    return torch.cat([g.flatten() for g in grads])


def _attention_backward_inputs(device, dtype, seq):
    q, k, v = _attention_inputs(device, dtype, seq)
    return q, k, v, torch.randn_like(q[..., :v.shape[-1]])


SELF_CHECKS = (
    SelfCheck("attention", _attention_inputs,
              run=lambda q, k, v: attention(q, k, v, causal=True),
              reference=lambda q, k, v: attention_reference(q, k, v, True)[0],
              torch_peer=lambda q, k, v: F.scaled_dot_product_attention(
                  q, k, v, is_causal=True, enable_gqa=True),
              dtypes=_CHECK_DTYPES, term_scale=lambda q, k, v: v.abs().max().item()),
    SelfCheck("attention_backward", _attention_backward_inputs,
              run=lambda q, k, v, grad: _gradients(
                  lambda q, k, v: attention(q, k, v, causal=True), q, k, v, grad),
              reference=lambda q, k, v, grad: _gradients(
                  lambda q, k, v: attention_reference(q, k, v, True)[0], q, k, v, grad),
              torch_peer=lambda q, k, v, grad: _gradients(
                  lambda q, k, v: F.scaled_dot_product_attention(
                      q, k, v, is_causal=True, enable_gqa=True), q, k, v, grad),
              dtypes=_CHECK_DTYPES,
              # the gradients' own scale: p and ds are rounded to the dtype before their matmuls
              term_scale=lambda q, k, v, grad: _gradients(
                  lambda q, k, v: attention_reference(q, k, v, True)[0],
                  *(t.double() for t in (q, k, v, grad))).abs().max().item()),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a problem per bucket
# --------------------------------------------------------------------------------------------

def _prefill_problem(batch: int, heads: int, seq: int, dim: int, dtype: torch.dtype,
                     backward: bool):
    """Causal and not, summed, on the Triton kernels (the Gluon ones switched off while the
    problem runs: they take the 16-bit D128 calls on sm_90 and have no tunables)."""
    def make(device):
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)
                   for _ in range(3))
        grad_out = torch.randn_like(q)
        saved = [_launch_forward(q, k, v, causal, dim ** -0.5) for causal in (False, True)]

        def run():
            with HOPPER_FORWARD.switched_off(), HOPPER_BACKWARD.switched_off():
                if backward:
                    return [_launch_backward(grad_out, q, k, v, out, lse, None, causal,
                                             dim ** -0.5)
                            for causal, (out, lse) in zip((False, True), saved)]
                return [_launch_forward(q, k, v, causal, dim ** -0.5)[0]
                        for causal in (False, True)]
        return run
    return make


def _prefill_buckets(backward: bool):
    # the forward's 16-bit calls of head dims 129-256 (Gemma's 256) get a bucket of their own:
    # under the last one they ran fp32's small tiles, without wgmma (4.3x SDPA's time at D256
    # S8192 on the H100)
    wide = () if backward else (
        TuneBucket({"head_dim": 256, "elem_bytes": 2}, "B1 H16 S4096 D256 bf16",
                   _prefill_problem(1, 16, 4096, 256, torch.bfloat16, backward)),)
    return (TuneBucket({"head_dim": 64, "elem_bytes": 2} if not backward else {"head_dim": 64},
                       "B2 H16 S4096 D64 bf16",
                       _prefill_problem(2, 16, 4096, 64, torch.bfloat16, backward)),
            TuneBucket({"head_dim": 128, "elem_bytes": 2}, "B4 H32 S2048 D128 bf16",
                       _prefill_problem(4, 32, 2048, 128, torch.bfloat16, backward)),
            *wide,
            # the backward's first bucket takes every D64 call, fp32 too
            TuneBucket(None, "B1 H8 S1024 D128 fp32",
                       _prefill_problem(1, 8, 1024, 128, torch.float32, backward)))


# Compiling the candidates is most of a full tuner run, so the lists leave out what does not
# win (see docs/notes/tuning.md): LAZY rescaling, one-stage pipelines for the large backward
# tiles, 128-row dQ tiles on 4 warps (they spill).
TUNING = (
    # 128-row blocks spill with 4 warps (ptxas, D128 bf16), 128-key blocks at 4 stages exceed
    # the shared memory; the small tiles are for fp32 inputs; 8 warps on 32-64 keys, 2-3
    # stages, are D256's tiles that use wgmma without spilling (ptxas, sm_90)
    TuneSpace(ATTENTION_FWD,
              tuple({"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": tma, "LAZY": 0, "num_warps": w,
                     "num_stages": st}
                    for m, n, w, stages in ((64, 64, 4, (2, 3)), (64, 128, 4, (2, 3)),
                                            (128, 64, 8, (2, 3, 4)), (128, 128, 8, (3,)),
                                            (64, 64, 8, (2,)), (128, 32, 8, (2, 3)))
                    for tma in (0, 1) for st in stages)
              + tuple({"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": 0, "LAZY": 0, "num_warps": 4,
                       "num_stages": st} for m, n in ((32, 32), (32, 64), (64, 32)) for st in (1, 2)),
              _prefill_buckets(backward=False)),
    TuneSpace(ATTENTION_BWD_DKDV,
              tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
                    for n in (64, 128) for m in (32, 64) for w in (4, 8) for st in (2, 3))
              + tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": st}
                      for m, n in ((16, 32), (32, 32)) for st in (1, 2)),
              _prefill_buckets(backward=True)),
    TuneSpace(ATTENTION_BWD_DQ,
              tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
                    for m, w in ((64, 4), (64, 8), (128, 8)) for n in (32, 64, 128)
                    for st in (2, 3))
              + tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": 4, "num_stages": st}
                      for m, n in ((32, 16), (32, 32)) for st in (1, 2)),
              _prefill_buckets(backward=True)),
)
