"""Fused attention: the prefill forward (flash-attention style), split-KV decode and the SDPA
override.

    attention(q, k, v)[b, h, i] = sum_j p_ij v[b, g(h), j],
    p_ij = softmax_j(scale * q[b, h, i] . k[b, g(h), j])  over the keys j row i may see

with g(h) = h // (Hq / Hkv) (grouped-query attention: K/V are never repeated in memory) and,
when causal, the keys j <= i (torch's top-left alignment when Sq != Skv). q is (B, Hq, Sq, D),
k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv), any strides with a unit last stride.

One program per BLOCK_M query rows of one head walks the keys BLOCK_N at a time with an online
softmax in the exp2 domain (scale * log2(e) folded into the scores) and fp32 accumulators;
blocks every row sees in full run without masks, the causal diagonal and the ragged end
separately with them. The row log-sum-exp (natural log) comes out too, for the backward.
On Hopper (sm_90), 16-bit inputs with head dim 128 take the warp-specialised Gluon kernel of
``_attention_hopper.py`` instead: same math, FlashAttention-3's schedule.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemslib import checks, layout, runtime
from gemslib.registry import AtenOverride, SelfCheck, TuneBucket, TuneSpace

try:  # the Hopper prefill kernel is written in Gluon (triton.experimental, Triton >= 3.4)
    from gemslib.fused import _attention_hopper
except ImportError:  # pragma: no cover - older Triton: the Triton kernel serves every call
    _attention_hopper = None

KERNEL_DTYPES = runtime.KERNEL_DTYPES
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_blocks(acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s,
                   k_desc, v_desc, batch, kv_head,
                   rows, key_start, key_end, seq_kv, head_dim, head_dim_v, scale_log2,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   TMA: tl.constexpr, LAZY: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Fold keys [key_start, key_end) into the running (acc, row_max, row_sum); row_max is in
    log2 units. MASKED blocks check key bounds (and causality); the others need no mask. With
    LAZY, unmasked blocks rescale only when a row's maximum has grown by more than 2^8.
    With TMA, K and V blocks come through tensor descriptors (Hopper's bulk copies; rows and
    features past the tensor's end read as zeros)."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = (keys[None, :] < seq_kv) if MASKED else (keys[None, :] >= 0)
        if TMA:
            k = tl.trans(k_desc.load([batch, kv_head, start, 0]).reshape(BLOCK_N, BLOCK_D))
        else:
            k = tl.load(k_head + keys[None, :] * k_stride_s + dims[:, None],
                        mask=key_mask & (dims[:, None] < head_dim), other=0.0)
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        if MASKED:
            visible = key_mask
            if CAUSAL:
                visible = visible & (keys[None, :] <= rows[:, None])
            scores = tl.where(visible, qk * scale_log2, -float("inf"))
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            p = tl.exp2(scores - new_max[:, None])
        elif LAZY:
            # the running maximum moves only when some row's grows by more than 2^8: until
            # then p <= 256 against a stale maximum, which fp32 sums and the output's
            # normalisation absorb, and the block skips rescaling acc (one multiply per element)
            block_max = tl.max(qk, axis=1) * scale_log2
            if tl.max(block_max - row_max, axis=0) > 8.0:
                new_max = tl.maximum(row_max, block_max)
                rescale = tl.exp2(row_max - new_max)
                acc = acc * rescale[:, None]
                row_sum = row_sum * rescale
                row_max = new_max
            new_max = row_max
            p = tl.exp2(qk * scale_log2 - row_max[:, None])
        else:
            # scale_log2 >= 0 (the launcher flips q's sign otherwise), so the scaled maximum is
            # the maximum scaled, and the exponent is one fused multiply-add per score
            new_max = tl.maximum(row_max, tl.max(qk, axis=1) * scale_log2)
            p = tl.exp2(qk * scale_log2 - new_max[:, None])
        if TMA:
            v = v_desc.load([batch, kv_head, start, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            v = tl.load(v_head + keys[:, None] * v_stride_s + dims_v[None, :],
                        mask=(keys[:, None] < seq_kv) & (dims_v[None, :] < head_dim_v), other=0.0)
        if LAZY and not MASKED:  # acc and row_sum are already on row_max's scale
            row_sum = row_sum + tl.sum(p, axis=1)
            if IEEE:
                acc = tl.dot(p, v, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            # every row sees key 0 in the first block it folds, so new_max is finite from then on
            rescale = tl.exp2(row_max - new_max)
            row_sum = row_sum * rescale + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _query_block(seq_q, n_q_heads, group_size, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """(batch * Hq + head, batch, head, kv_head, query block) of this program of a forward or
    dQ grid (B * Hq * query blocks,) in layout.head_and_block's order, the last query blocks
    first when causal (they see the most keys); batch and the heads as int64."""
    n_blocks = tl.cdiv(seq_q, BLOCK_M)
    batch_head, m_block = layout.head_and_block(n_blocks, CAUSAL)
    if CAUSAL:
        m_block = n_blocks - 1 - m_block
    batch = (batch_head // n_q_heads).to(tl.int64)
    head = (batch_head % n_q_heads).to(tl.int64)
    return batch_head, batch, head, head // group_size, m_block


@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, q_desc, k_desc, v_desc, o_desc,
    seq_q, seq_kv, n_q_heads, group_size, head_dim, head_dim_v, scale_log2,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, o_stride_b, o_stride_h, o_stride_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, LAZY: tl.constexpr,
):
    """Grid (B * Hq * query blocks,) in layout.head_and_block's order. o (B, Hq, Sq, Dv) in
    q's dtype, lse (B, Hq, Sq) fp32.
    TMA (the launcher's decision: the config asks for it with USE_TMA and the tensors' strides
    allow it): q, K, V and o move through the 4-d tensor descriptors ``*_desc``, whose blocks
    are [1, 1, rows, BLOCK_D or BLOCK_DV]; otherwise they are None and pointers are used."""
    batch_head, batch, head, kv_head, m_block = _query_block(seq_q, n_q_heads, group_size,
                                                             CAUSAL, BLOCK_M)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q_head = q_ptr + batch * q_stride_b + head * q_stride_h
    k_head = k_ptr + batch * k_stride_b + kv_head * k_stride_h
    v_head = v_ptr + batch * v_stride_b + kv_head * v_stride_h
    if TMA:  # descriptor indices are int32
        batch_i32, head_i32, kv_head_i32 = batch.to(tl.int32), head.to(tl.int32), kv_head.to(tl.int32)
        q = q_desc.load([batch_i32, head_i32, m_block * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        batch_i32, head_i32, kv_head_i32 = batch, head, kv_head  # unused
        q = tl.load(q_head + rows[:, None] * q_stride_s + dims[None, :],
                    mask=(rows[:, None] < seq_q) & (dims[None, :] < head_dim), other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CAUSAL:
        # keys below the block's first row are seen by every row: no mask; the rest up to the
        # block's last row is the diagonal
        key_end = tl.minimum(seq_kv, (m_block + 1) * BLOCK_M)
        full_end = (tl.minimum(seq_kv, m_block * BLOCK_M) // BLOCK_N) * BLOCK_N
    else:
        key_end = seq_kv
        full_end = (seq_kv // BLOCK_N) * BLOCK_N
    acc, row_max, row_sum = _attend_blocks(
        acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s, k_desc, v_desc,
        batch_i32, kv_head_i32, rows, 0, full_end, seq_kv, head_dim, head_dim_v, scale_log2,
        False, CAUSAL, IEEE, TMA, LAZY, BLOCK_N, BLOCK_D, BLOCK_DV)
    acc, row_max, row_sum = _attend_blocks(
        acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s, k_desc, v_desc,
        batch_i32, kv_head_i32, rows, full_end, key_end, seq_kv, head_dim, head_dim_v,
        scale_log2, True, CAUSAL, IEEE, TMA, LAZY, BLOCK_N, BLOCK_D, BLOCK_DV)

    out = (acc / row_sum[:, None]).to(o_ptr.dtype.element_ty)
    if TMA:  # rows and features past o's end are not written
        o_desc.store([batch_i32, head_i32, m_block * BLOCK_M, 0],
                     out.reshape(1, 1, BLOCK_M, BLOCK_DV))
    else:
        o_head = o_ptr + batch * o_stride_b + head * o_stride_h
        tl.store(o_head + rows[:, None] * o_stride_s + dims_v[None, :], out,
                 mask=(rows[:, None] < seq_q) & (dims_v[None, :] < head_dim_v))
    lse = (row_max + tl.log2(row_sum)) * LN2
    tl.store(lse_ptr + batch_head.to(tl.int64) * seq_q + rows, lse, mask=rows < seq_q)


@triton.jit
def _attention_bwd_delta_kernel(o_ptr, do_ptr, grad_lse_ptr, delta_ptr, seq_q, n_q_heads,
                                head_dim_v, o_stride_b, o_stride_h, o_stride_s,
                                do_stride_b, do_stride_h, do_stride_s,
                                HAS_GRAD_LSE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_DV: tl.constexpr):
    """delta[b, h, i] = sum_d o[b, h, i, d] * do[b, h, i, d] - grad_lse[b, h, i] (fp32), the
    row term of the softmax backward (a gradient flowing into lse enters it there, since
    d lse_i / d s_ij = p_ij). Grid (B * Hq, query blocks): B * Hq may pass the 65535 that a
    grid's second axis allows; delta and grad_lse (B, Hq, Sq)."""
    batch_head = tl.program_id(0)
    batch = (batch_head // n_q_heads).to(tl.int64)
    head = (batch_head % n_q_heads).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims_v = tl.arange(0, BLOCK_DV)
    mask = (rows[:, None] < seq_q) & (dims_v[None, :] < head_dim_v)
    o = tl.load(o_ptr + batch * o_stride_b + head * o_stride_h + rows[:, None] * o_stride_s
                + dims_v[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + batch * do_stride_b + head * do_stride_h + rows[:, None] * do_stride_s
                 + dims_v[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    offsets = batch_head.to(tl.int64) * seq_q + rows
    if HAS_GRAD_LSE:
        delta -= tl.load(grad_lse_ptr + offsets, mask=rows < seq_q, other=0.0)
    tl.store(delta_ptr + offsets, delta, mask=rows < seq_q)


@triton.jit
def _load_tile(head_ptr, rows, row_stride, n_rows, cols, n_cols):
    """rows x cols of one head's (S, D) matrix with unit last stride, zeros outside it."""
    return tl.load(head_ptr + rows[:, None] * row_stride + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _softmax_grad_block(q, k, v, do, lse_log2, delta, rows, keys, seq_q, seq_kv, scale_log2,
                        KEYS_MAJOR: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """For one block of BLOCK_M queries and BLOCK_N keys: p (the forward's probabilities,
    recomputed from the saved lse) and ds = p * (do . v - delta), zero outside the visible
    (query, key) pairs. q (M, D), k (N, D), v (N, Dv), do (M, Dv). Returned (M, N), or (N, M)
    with KEYS_MAJOR: the dK/dV kernel's matmuls then take p^T and ds^T as their left operand
    straight from registers instead of transposing them through shared memory."""
    if KEYS_MAJOR:  # keys down, query rows across
        left, right, left_v, right_v = k, q, v, do
        row_ids, key_ids = rows[None, :], keys[:, None]
        lse_2d, delta_2d = lse_log2[None, :], delta[None, :]
    else:
        left, right, left_v, right_v = q, k, do, v
        row_ids, key_ids = rows[:, None], keys[None, :]
        lse_2d, delta_2d = lse_log2[:, None], delta[:, None]
    if IEEE:
        qk = tl.dot(left, tl.trans(right), input_precision="ieee")
        dp = tl.dot(left_v, tl.trans(right_v), input_precision="ieee")
    else:
        qk = tl.dot(left, tl.trans(right))
        dp = tl.dot(left_v, tl.trans(right_v))
    visible = (row_ids < seq_q) & (key_ids < seq_kv)
    if CAUSAL:
        visible = visible & (key_ids <= row_ids)
    p = tl.where(visible, tl.exp2(qk * scale_log2 - lse_2d), 0.0)
    ds = p * (dp - delta_2d)
    return p, ds


@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    seq_q, seq_kv, n_kv_heads, group_size, head_dim, head_dim_v, scale, scale_log2,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV of one block of BLOCK_N keys of one KV head, summed over the group's query
    heads and every query block that sees the keys (no atomics, K/V never repeated):
    dv = sum p^T do, dk = scale * sum ds^T q. Grid (B * Hkv * key blocks,) in
    layout.head_and_block's order (causal: the first key blocks, which see the most query rows,
    are the heavy ones); dk and dv contiguous (B, Hkv, Skv, D / Dv)."""
    batch_kv_head, n_block = layout.head_and_block(tl.cdiv(seq_kv, BLOCK_N), CAUSAL)
    batch = (batch_kv_head // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv_head % n_kv_heads).to(tl.int64)
    keys = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    k = _load_tile(k_ptr + batch * k_stride_b + kv_head * k_stride_h, keys, k_stride_s, seq_kv,
                   dims, head_dim)
    v = _load_tile(v_ptr + batch * v_stride_b + kv_head * v_stride_h, keys, v_stride_s, seq_kv,
                   dims_v, head_dim_v)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # causal: query rows before the block's first key see none of it
    first_row = (n_block * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    row_blocks = tl.cdiv(seq_q - first_row, BLOCK_M)
    # one flat loop over (group member, query block): one software pipeline across members
    for step in range(0, group_size * row_blocks):
        head = kv_head * group_size + step // row_blocks
        rows = first_row + (step % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _load_tile(q_ptr + batch * q_stride_b + head * q_stride_h, rows, q_stride_s, seq_q,
                       dims, head_dim)
        do = _load_tile(do_ptr + batch * do_stride_b + head * do_stride_h, rows, do_stride_s,
                        seq_q, dims_v, head_dim_v)
        row_offsets = (batch * n_kv_heads * group_size + head) * seq_q + rows
        lse_log2 = tl.load(lse_ptr + row_offsets, mask=rows < seq_q, other=0.0) * LOG2E
        delta = tl.load(delta_ptr + row_offsets, mask=rows < seq_q, other=0.0)
        p_t, ds_t = _softmax_grad_block(q, k, v, do, lse_log2, delta, rows, keys, seq_q, seq_kv,
                                        scale_log2, True, CAUSAL, IEEE)
        if IEEE:
            dv += tl.dot(p_t, do, input_precision="ieee")
            dk += tl.dot(ds_t, q, input_precision="ieee")
        else:
            dv += tl.dot(p_t.to(do.dtype), do)
            dk += tl.dot(ds_t.to(q.dtype), q)
    out_rows = batch_kv_head.to(tl.int64) * seq_kv + keys
    tl.store(dk_ptr + out_rows[:, None] * head_dim + dims[None, :],
             (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=(keys[:, None] < seq_kv) & (dims[None, :] < head_dim))
    tl.store(dv_ptr + out_rows[:, None] * head_dim_v + dims_v[None, :],
             dv.to(dv_ptr.dtype.element_ty),
             mask=(keys[:, None] < seq_kv) & (dims_v[None, :] < head_dim_v))


@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    seq_q, seq_kv, n_q_heads, group_size, head_dim, head_dim_v, scale, scale_log2,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, do_stride_b, do_stride_h, do_stride_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dq = scale * sum_j ds_ij k_j for one block of BLOCK_M query rows of one head, over the
    keys those rows see. Grid (B * Hq * query blocks,) in layout.head_and_block's order, the
    last query blocks first when causal (they see the most keys); dq contiguous (B, Hq, Sq, D)."""
    batch_head, batch, head, kv_head, m_block = _query_block(seq_q, n_q_heads, group_size,
                                                             CAUSAL, BLOCK_M)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = _load_tile(q_ptr + batch * q_stride_b + head * q_stride_h, rows, q_stride_s, seq_q,
                   dims, head_dim)
    do = _load_tile(do_ptr + batch * do_stride_b + head * do_stride_h, rows, do_stride_s, seq_q,
                    dims_v, head_dim_v)
    row_offsets = batch_head.to(tl.int64) * seq_q + rows
    lse_log2 = tl.load(lse_ptr + row_offsets, mask=rows < seq_q, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + row_offsets, mask=rows < seq_q, other=0.0)
    k_head = k_ptr + batch * k_stride_b + kv_head * k_stride_h
    v_head = v_ptr + batch * v_stride_b + kv_head * v_stride_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    key_end = tl.minimum(seq_kv, (m_block + 1) * BLOCK_M) if CAUSAL else seq_kv
    for start in range(0, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k = _load_tile(k_head, keys, k_stride_s, seq_kv, dims, head_dim)
        v = _load_tile(v_head, keys, v_stride_s, seq_kv, dims_v, head_dim_v)
        _, ds = _softmax_grad_block(q, k, v, do, lse_log2, delta, rows, keys, seq_q, seq_kv,
                                    scale_log2, False, CAUSAL, IEEE)
        if IEEE:
            dq += tl.dot(ds, k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + row_offsets[:, None] * head_dim + dims[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & (dims[None, :] < head_dim))


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr,
    cache_len, n_q_heads, n_kv_heads, group_size, head_dim, head_dim_v, split_len, n_splits,
    scale_log2, q_stride_b, q_stride_h, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, o_stride_b, o_stride_h,
    HAS_SEQLENS: tl.constexpr, SPLIT: tl.constexpr, HAS_LSE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr,
):
    """Grid (splits, B * Hkv): the query heads sharing one KV head attend to one split of the
    first ``seqlens[b]`` (in [0, L], asserted; all L without seqlens) cache positions, whose
    K/V are read once for all of them.

    Without SPLIT (one split) the program writes the output. With SPLIT it writes each head's
    normalised partial output and log-sum-exp (an empty split: lse -inf, output 0), counts
    itself in ``arrivals[b * Hkv + h]``, and the last of the splits to arrive merges them by
    log-sum-exp (no keys at all gives 0) and puts the counter back to 0 for the next call: one
    launch per decode step instead of a partial and a merge launch. With HAS_LSE the program
    that writes a head's output also writes its log-sum-exp (natural log; -inf without keys)
    to ``lse[b * Hq + head]``. PROGRAMS_PER_SM is the launcher's (it sets the number of
    splits); the kernel does not use it.
    """
    split = tl.program_id(0)
    batch_kv = tl.program_id(1)
    batch = (batch_kv // n_kv_heads).to(tl.int64)
    kv_head = (batch_kv % n_kv_heads).to(tl.int64)
    if HAS_SEQLENS:
        # a length outside [0, L]: a device-side assert (compiled in, see DECODE); clamped so
        # that no input reads outside the cache where asserts are off
        seq_len = tl.load(seqlens_ptr + batch).to(tl.int64)
        tl.device_assert((seq_len >= 0) & (seq_len <= cache_len),
                         "gemslib.decode_attention: seqlens must be in [0, L] (the cache length)")
        seq_len = tl.minimum(tl.maximum(seq_len, 0), cache_len).to(tl.int32)
    else:
        seq_len = cache_len
    key_start = split * split_len
    key_end = tl.minimum(key_start + split_len, seq_len)
    group = tl.arange(0, BLOCK_G)
    heads = kv_head * group_size + group  # the query heads of this KV head
    head_mask = group < group_size
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + batch * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
                mask=head_mask[:, None] & (dims[None, :] < head_dim), other=0.0)
    k_head = k_ptr + batch * k_stride_b + kv_head * k_stride_h
    v_head = v_ptr + batch * v_stride_b + kv_head * v_stride_h
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    row_max = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < key_end
        k = tl.load(k_head + keys[None, :] * k_stride_s + dims[:, None],
                    mask=key_mask[None, :] & (dims[:, None] < head_dim), other=0.0)
        if IEEE:
            scores = tl.dot(q, k, input_precision="ieee") * scale_log2
        else:
            scores = tl.dot(q, k) * scale_log2
        scores = tl.where(key_mask[None, :], scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_head + keys[:, None] * v_stride_s + dims_v[None, :],
                    mask=key_mask[:, None] & (dims_v[None, :] < head_dim_v), other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    empty = row_sum == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, row_sum)[:, None])
    out_mask = head_mask[:, None] & (dims_v[None, :] < head_dim_v)
    out_at = o_ptr + batch * o_stride_b + heads[:, None] * o_stride_h + dims_v[None, :]
    if not SPLIT:
        tl.store(out_at, out.to(o_ptr.dtype.element_ty), mask=out_mask)
        if HAS_LSE:
            tl.store(lse_ptr + batch * n_q_heads + heads,
                     tl.where(empty, -float("inf"), (row_max + tl.log2(row_sum)) * LN2),
                     mask=head_mask)
    else:
        lse = tl.where(empty, -float("inf"), (row_max + tl.log2(row_sum)) * LN2)
        head_slots = (batch * n_q_heads + heads) * n_splits  # (B, Hq, splits) buffers
        tl.store(o_part_ptr + (head_slots + split)[:, None] * head_dim_v + dims_v[None, :], out,
                 mask=out_mask)
        tl.store(lse_part_ptr + head_slots + split, lse, mask=head_mask)
        tl.debug_barrier()  # every thread's stores issued before this program counts itself
        arrived = tl.atomic_add(arrivals_ptr + batch_kv, 1, sem="acq_rel")
        if arrived == n_splits - 1:  # the last split of this KV head: merge
            # the whole group at once, [members, splits(, features)] tiles in chunks of splits
            # with masks instead of branches, so every load can be in flight together (a loop
            # over splits waited one L2 round trip each; one over members, a store between)
            members = tl.arange(0, GROUP)
            member_ok = members < group_size
            slots = (batch * n_q_heads + kv_head * group_size + members) * n_splits
            splits = tl.arange(0, BLOCK_S)
            # .cg: the other programs' results from L2, never from a stale L1 line
            lses = tl.load(lse_part_ptr + slots[:, None] + splits[None, :],
                           mask=member_ok[:, None] & (splits[None, :] < n_splits),
                           other=-float("inf"), cache_modifier=".cg")
            top = tl.max(lses, axis=1)
            total = tl.sum(tl.where(lses == -float("inf"), 0.0, tl.exp(lses - top[:, None])),
                           axis=1)
            merged = tl.zeros([GROUP, BLOCK_DV], dtype=tl.float32)
            for chunk_start in tl.static_range(0, BLOCK_S, MERGE_S):
                chunk = chunk_start + tl.arange(0, MERGE_S)
                in_chunk = member_ok[:, None] & (chunk[None, :] < n_splits)
                chunk_lses = tl.load(lse_part_ptr + slots[:, None] + chunk[None, :],
                                     mask=in_chunk, other=-float("inf"), cache_modifier=".cg")
                weights = tl.where(chunk_lses == -float("inf"), 0.0,
                                   tl.exp(chunk_lses - top[:, None]))
                rows = (slots[:, None] + chunk[None, :]) * head_dim_v
                pieces = tl.load(o_part_ptr + rows[:, :, None] + dims_v[None, None, :],
                                 mask=in_chunk[:, :, None]
                                 & (dims_v[None, None, :] < head_dim_v),
                                 other=0.0, cache_modifier=".cg")
                merged += tl.sum(pieces * weights[:, :, None], axis=1)
            merged = merged / tl.where(total == 0.0, 1.0, total)[:, None]  # no keys at all: 0
            tl.store(o_ptr + batch * o_stride_b
                     + (kv_head * group_size + members)[:, None] * o_stride_h + dims_v[None, :],
                     merged.to(o_ptr.dtype.element_ty),
                     mask=member_ok[:, None] & (dims_v[None, :] < head_dim_v))
            if HAS_LSE:
                tl.store(lse_ptr + batch * n_q_heads + kv_head * group_size + members,
                         tl.where(total == 0.0, -float("inf"), top + tl.log(total)),
                         mask=member_ok)
            tl.atomic_xchg(arrivals_ptr + batch_kv, 0)


ATTENTION_FWD = runtime.TunedKernel("attention", "attention_fwd", _attention_fwd_kernel,
                                    tunables=("BLOCK_M", "BLOCK_N", "USE_TMA", "LAZY"),
                                    shape_keys=("head_dim", "causal", "elem_bytes", "seq_q",
                                                "seq_kv"))
ATTENTION_BWD_DKDV = runtime.TunedKernel("attention", "attention_bwd_dkdv",
                                         _attention_bwd_dkdv_kernel,
                                         tunables=("BLOCK_M", "BLOCK_N"),
                                         shape_keys=("head_dim", "elem_bytes"))
ATTENTION_BWD_DQ = runtime.TunedKernel("attention", "attention_bwd_dq", _attention_bwd_dq_kernel,
                                       tunables=("BLOCK_M", "BLOCK_N"),
                                       shape_keys=("head_dim", "elem_bytes"))
DECODE = runtime.TunedKernel("attention", "decode", _decode_kernel,
                             tunables=("BLOCK_N", "PROGRAMS_PER_SM"),
                             shape_keys=("head_dim", "elem_bytes", "seq_kv"), device_asserts=True)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


# On sm_90, 16-bit inputs with D = Dv = 128 go to the warp-specialised Gluon kernel
# (_attention_hopper.py, 1.2x the Triton kernel's speed there); False keeps every call on the
# Triton kernel (benchmarks compare the two this way).
use_hopper_kernel = True
# The backward's dK/dV in Gluon for the same inputs (_attention_hopper.backward_dkdv: K and V
# kept in shared memory, warp-specialised): on the H200 the whole backward is up to 1.42x
# faster than with the Triton dK/dV kernel (B1 S3001 causal) and at worst 1% slower (B4 S2048
# causal; benchmark/NOTES.md); False keeps the Triton kernel.
use_hopper_backward = True


def _launch_forward(q, k, v, causal: bool, scale: float,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for (B, Hq, Sq, D) q and (B, Hkv, Skv, D / Dv) k / v, validated. ``out``: the
    (B, Hq, Sq, Dv) tensor to write o into, any strides (the SDPA overrides pass torch's
    layout for the backend); by default a contiguous one."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if scale < 0:  # the unmasked blocks need a scale >= 0; (-q).k * -scale is exact
        q, scale = -q, -scale
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    if out is not None and out.stride(-1) != 1 and out.shape[-1] > 1:
        result, lse = _launch_forward(q, k, v, causal, scale)
        return out.copy_(result), lse
    if seq_q == 1 and seq_kv and batch * n_q_heads * head_dim_v:
        # one query row (a decode step through SDPA): the decode kernel reads each KV head once
        # for its group and splits the keys over the SMs, where the prefill kernels would read
        # it once per query head and fill 1 of 64-128 rows. Top-left causal: key 0 only.
        if causal:
            k, v = k[:, :, :1], v[:, :, :1]
        lse = torch.empty((batch, n_q_heads, 1), dtype=torch.float32, device=q.device)
        result = _launch_decode(q[:, :, 0], k, v, None, scale, lse=lse)[:, :, None]
        return (result, lse) if out is None else (out.copy_(result), lse)
    if use_hopper_kernel and _attention_hopper is not None and batch * n_q_heads * seq_q * \
            seq_kv and _attention_hopper.eligible(q, k, v):
        result, lse = _attention_hopper.forward(q, k, v, causal, scale)
        # the Gluon kernel writes contiguous rows; another layout costs one copy
        return (result if out is None or out.stride() == result.stride() else
                out.copy_(result)), lse
    if out is None:
        out = torch.empty((batch, n_q_heads, seq_q, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(-float("inf"))
    if seq_kv == 0:  # no keys: SDPA gives zeros
        return out.zero_(), lse.fill_(-float("inf"))
    # elem_bytes: fp32 inputs need smaller tiles than the 16-bit ones (shared memory)
    shape = (head_dim, int(causal), q.element_size(), seq_q, seq_kv)
    block_d = max(16, runtime.next_power_of_2(head_dim))
    block_dv = max(16, runtime.next_power_of_2(head_dim_v))
    config = ATTENTION_FWD.planned_config(shape)
    meta = config.meta_dict
    tma = bool(meta["USE_TMA"]) and _tma_ready(q, k, v, out)
    if tma:  # the descriptors' blocks follow the config, so the launch must use this one
        descriptors = [TensorDescriptor.from_tensor(t, [1, 1, rows, cols]) for t, rows, cols in
                       ((q, meta["BLOCK_M"], block_d), (k, meta["BLOCK_N"], block_d),
                        (v, meta["BLOCK_N"], block_dv), (out, meta["BLOCK_M"], block_dv))]
    else:
        descriptors, config = [None] * 4, None
    ATTENTION_FWD.launch(
        lambda meta: (batch * n_q_heads * runtime.cdiv(seq_q, meta["BLOCK_M"]),),
        q, k, v, out, lse, *descriptors, seq_q, seq_kv, n_q_heads, n_q_heads // n_kv_heads,
        head_dim, head_dim_v, scale * 1.4426950408889634,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        causal, q.dtype == torch.float32, tma, block_d, block_dv, shape=shape, config=config)
    return out, lse


def _launch_backward(grad_out, q, k, v, out, lse, grad_lse, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, for the forward (out, lse) of validated q, k, v; grad_lse
    (B, Hq, Sq) or None is a gradient flowing into lse."""
    q, k, v, grad_out = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(grad_out)
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
            out, grad_out, grad_lse if grad_lse is not None else delta, delta, seq_q, n_q_heads,
            head_dim_v, *out.stride()[:3], *grad_out.stride()[:3], grad_lse is not None,
            BLOCK_M=64, BLOCK_DV=block_dv)
    shape = (head_dim, q.element_size())
    # after the sequence lengths and the head count each kernel's grid runs over
    rest = (n_q_heads // n_kv_heads, head_dim, head_dim_v, scale, scale * 1.4426950408889634,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], causal,
            q.dtype == torch.float32, block_d, block_dv)
    if use_hopper_backward and _attention_hopper is not None and \
            _attention_hopper.eligible(q, k, v) and layout.tma_addressable(grad_out):
        dk, dv = _attention_hopper.backward_dkdv(q, k, v, grad_out, lse, delta, causal, scale)
    else:
        ATTENTION_BWD_DKDV.launch(
            lambda meta: (batch * n_kv_heads * runtime.cdiv(seq_kv, meta["BLOCK_N"]),),
            q, k, v, grad_out, lse, delta, dk, dv, seq_q, seq_kv, n_kv_heads, *rest,
            shape=shape)
    ATTENTION_BWD_DQ.launch(
        lambda meta: (batch * n_q_heads * runtime.cdiv(seq_q, meta["BLOCK_M"]),),
        q, k, v, grad_out, lse, delta, dq, seq_q, seq_kv, n_q_heads, *rest, shape=shape)
    return dq, dk, dv


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need TMA-addressable tensors and at most 256 rows or features per
    block."""
    return all(layout.tma_addressable(t) for t in tensors) and \
        max(t.shape[-1] for t in tensors) <= 256


def _decode_splits(batch_kv: int, cache_len: int, block_n: int, device_index: int,
                   programs_per_sm: int) -> int:
    """Splits of the KV length: as many programs as fit ``programs_per_sm`` per SM (a config
    choice: streaming the cache wants several resident per SM to keep loads in flight), rounded
    down (a last wave that is partly full takes as long as a full one), but no split shorter
    than one block of keys and at most 256."""
    wanted = programs_per_sm * runtime.multiprocessor_count(device_index) // max(batch_kv, 1)
    return max(1, min(wanted, runtime.cdiv(cache_len, block_n), 256))


def _decode_scratch(device: torch.device, n_counters: int, n_lse: int,
                    head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arrivals, lse_part, o_part) of a decode launch with splits (runtime.split_scratch):
    counters for the last-arrival merge, and fp32 room for the splits' log-sum-exps (n_lse)
    and partial outputs (n_lse x head_dim_v)."""
    arrivals, parts = runtime.split_scratch(device, n_counters, n_lse * (head_dim_v + 1))
    return arrivals, parts[:n_lse], parts[n_lse:]


class _DecodePlan(NamedTuple):
    """Everything about a decode launch that follows from the layout (shapes, strides, dtypes,
    scale, config), worked out once: decode calls the same layout every step, and at B1 the
    host's time is most of a step."""
    config: runtime.LaunchConfig
    grid: tuple[int, int]
    out_shape: tuple[int, int, int]
    scratch: tuple[int, int, int] | None  # _decode_scratch's sizes; None: one split
    arguments: tuple  # the scalars and constexprs after the tensors
    replay_key: tuple  # determines config, grid and arguments (TunedKernel.replay)


def _plan_decode(q, k_cache, v_cache, has_seqlens: bool, scale: float, config,
                 with_lse: bool = False) -> _DecodePlan:
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads, cache_len, head_dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    meta = config.meta_dict
    block_n = meta["BLOCK_N"]
    n_splits = _decode_splits(batch * n_kv_heads, cache_len, block_n, q.device.index or 0,
                              meta["PROGRAMS_PER_SM"])
    split_len = runtime.cdiv(runtime.cdiv(cache_len, n_splits), block_n) * block_n
    n_splits = runtime.cdiv(cache_len, split_len)
    group_size = n_q_heads // n_kv_heads
    block_dv = max(16, runtime.next_power_of_2(head_dim_v))
    block_s = max(2, runtime.next_power_of_2(n_splits))
    group_pow2 = runtime.next_power_of_2(group_size)  # merged in chunks of <= 8192 values
    out_strides = (n_q_heads * head_dim_v, head_dim_v)  # of the contiguous output
    arguments = (
        cache_len, n_q_heads, n_kv_heads, group_size, head_dim, head_dim_v, split_len,
        n_splits, scale * 1.4426950408889634, *q.stride()[:2], *k_cache.stride()[:3],
        *v_cache.stride()[:3], *out_strides, has_seqlens, n_splits > 1, with_lse,
        q.dtype == torch.float32, max(16, group_pow2), group_pow2,
        max(16, runtime.next_power_of_2(head_dim)),
        block_dv, block_s, min(block_s, max(2, 8192 // (block_dv * group_pow2))))
    grid = (n_splits, batch * n_kv_heads)
    scratch = ((batch * n_kv_heads, batch * n_q_heads * n_splits, head_dim_v)
               if n_splits > 1 else None)
    return _DecodePlan(config, grid, (batch, n_q_heads, head_dim_v), scratch, arguments,
                       (config, grid, arguments))


def _check_seqlens_in_cache(seqlens: torch.Tensor | None, cache_len: int,
                            on_device_too: bool = False) -> None:
    """Lengths on the CPU (or anywhere, with ``on_device_too``: the caller reads them on the
    host anyway) are checked here; on a GPU the kernel asserts them itself, since reading them
    here would wait for the device."""
    if seqlens is None or seqlens.numel() == 0 or (seqlens.device.type != "cpu"
                                                   and not on_device_too):
        return
    low, high = int(seqlens.min()), int(seqlens.max())
    if low < 0 or high > cache_len:
        raise ValueError(f"gemslib.decode_attention: seqlens must be in [0, {cache_len}] (the "
                         f"caches' length), got {low if low < 0 else high}")


def _run_decode(plan: _DecodePlan, q, k_cache, v_cache, seqlens,
                lse: torch.Tensor | None = None) -> torch.Tensor:
    """The output (B, Hq, Dv); ``lse`` (B * Hq fp32, contiguous) gets the log-sum-exps when
    the plan was made with_lse."""
    _check_seqlens_in_cache(seqlens, k_cache.shape[2])
    out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    if plan.scratch is not None:
        arrivals, lse_part, o_part = _decode_scratch(q.device, *plan.scratch)
    else:
        arrivals = lse_part = o_part = out  # not touched
    DECODE.replay(plan.replay_key, plan.config, plan.grid,
                  (q, k_cache, v_cache, seqlens if seqlens is not None else out, out,
                   lse if lse is not None else out, o_part, lse_part, arrivals, *plan.arguments))
    return out


# layout key (``_decode_layout``) of arguments that passed the checks -> the plan of their
# kernel launch, or None where the call copies or falls back to torch (the checks were a fifth
# of a B1 step's host time, the plan arithmetic as much again)
_decode_layouts: dict[tuple, _DecodePlan | None] = {}
_UNCHECKED = object()


def _decode_layout(q, k_cache, v_cache, seqlens, scale) -> tuple | None:
    """What a decode plan depends on, from decode_attention's raw arguments (None for
    arguments that are not tensors)."""
    try:
        return (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape,
                v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, q.device,
                k_cache.device, v_cache.device,
                None if seqlens is None else (seqlens.shape, seqlens.dtype, seqlens.device),
                scale, DECODE.planned_config((q.shape[-1], q.element_size(), k_cache.shape[-2])))
    except (AttributeError, IndexError, TypeError):
        return None


def _launch_decode(q, k_cache, v_cache, seqlens, scale: float, layout: tuple | None = None,
                   lse: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Hq, Dv) for q (B, Hq, D) against the first seqlens[b] positions of the caches (all
    of them when seqlens is None). One launch; see ``_decode_kernel``. ``layout`` (the checked
    arguments' ``_decode_layout``) keeps the plan for decode_attention's next calls. ``lse``
    (B, Hq) fp32 contiguous, if given, gets each head's log-sum-exp."""
    unit_last = _unit_last(q), _unit_last(k_cache), _unit_last(v_cache)
    copied = any(a is not b for a, b in zip(unit_last, (q, k_cache, v_cache)))
    q, k_cache, v_cache = unit_last
    batch, n_q_heads, head_dim = q.shape
    cache_len, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if batch * n_q_heads * head_dim_v == 0 or cache_len == 0:
        if lse is not None:
            lse.fill_(-float("inf"))
        return q.new_zeros((batch, n_q_heads, head_dim_v))
    plan = _plan_decode(q, k_cache, v_cache, seqlens is not None, scale,
                        # elem_bytes: fp32 caches need smaller K/V stages (shared memory)
                        DECODE.planned_config((head_dim, q.element_size(), cache_len)),
                        with_lse=lse is not None)
    if layout is not None and not copied and layout in _decode_layouts and lse is None:
        _decode_layouts[layout] = plan
    return _run_decode(plan, q, k_cache, v_cache, seqlens, lse)


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def attention_reference(q, k, v, causal=False, scale=None):
    """(o, lse) by the definition, K/V repeated over each group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, -float("inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def decode_attention_reference(q, k_cache, v_cache, seqlens=None, scale=None):
    """One query per sequence against the first seqlens[b] cache positions (clamped to
    [0, L]; decode_attention rejects lengths outside), by definition."""
    outs = []
    for b in range(q.shape[0]):
        length = k_cache.shape[2] if seqlens is None else min(max(int(seqlens[b]), 0),
                                                               k_cache.shape[2])
        out, _ = attention_reference(q[b:b + 1, :, None], k_cache[b:b + 1, :, :length],
                                     v_cache[b:b + 1, :, :length], False, scale)
        outs.append(out[:, :, 0] if length else torch.zeros_like(out[:, :, 0]))
    return torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v_cache.shape[-1]))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def default_scale(head_dim: int) -> float:
    """SDPA's default scale 1 / sqrt(D). With D = 0 every score is an empty sum, 0, whatever
    the scale (torch gives uniform weights), so any finite scale serves."""
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def _check(q, k, v, scale, name: str = "gemslib.attention") -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be (B, H, S, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: {arg} must be floating-point, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"{name}: k and v must be {q.dtype} on {q.device} like q, got "
                         f"{k.dtype} on {k.device} and {v.dtype} on {v.device}")
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must share the batch, and k and v their heads and "
                         "sequence length")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{name}: k's head dim {k.shape[3]} must equal q's {q.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: q's {q.shape[1]} heads must be a multiple of k and v's "
                         f"{k.shape[1]} (grouped-query attention)")
    checks.as_float(name, "scale", scale, optional=True)


def _check_decode(q, k_cache, v_cache, seqlens, scale) -> None:
    """Validate decode_attention's arguments (once per layout: see ``_decode_layouts``)."""
    name = "gemslib.decode_attention"
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{name}: q must be (B, Hq, D), got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    _check(q[:, :, None], k_cache, v_cache, scale, name)
    batch = q.shape[0]
    if seqlens is not None and (not isinstance(seqlens, torch.Tensor) or seqlens.shape != (batch,)
                                or seqlens.is_floating_point() or seqlens.is_complex()
                                or seqlens.dtype == torch.bool or seqlens.device != q.device):
        raise ValueError(f"{name}: seqlens must be an integer tensor of shape ({batch},) on "
                         f"{q.device}, got {seqlens!r:.80}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)``: q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) with Hq a
    multiple of Hkv; returns (B, Hq, Sq, Dv) in q's dtype. Differentiable in q, k and v (the
    backward recomputes the probabilities from the saved row log-sum-exp)."""
    causal = checks.as_bool("gemslib.attention", "causal", causal)
    _check(q, k, v, scale)
    scale = default_scale(q.shape[-1]) if scale is None else checks.as_float(
        "gemslib.attention", "scale", scale)
    if runtime.wants_custom_op(q, k, v):
        return runtime.differentiable_call(_attention_op, _AttentionFunction, q, k, v,
                                           bool(causal), scale)[0]
    return _attention_impl(q, k, v, causal, scale)[0]


def _kernels_take(q, k, v, *others) -> bool:
    """The attention kernels take these (else torch): head dims 1 to 256, kernel dtypes on the
    kernel device (and not bf16 under the interpreter)."""
    return runtime.dot_kernel_runs(q, k, v, *others) and 0 < min(q.shape[-1], v.shape[-1]) \
        and max(q.shape[-1], v.shape[-1]) <= 256


def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): the kernel where it runs, torch otherwise."""
    if not _kernels_take(q, k, v):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = attention_reference(q.to(work), k.to(work), v.to(work), causal, scale)
        return out.to(q.dtype), lse.float()
    return _launch_forward(q, k, v, causal, scale)


def _attention_backward_impl(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             grad_lse: Optional[torch.Tensor], causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``_attention_impl``'s (out, lse): the kernels where the forward ran
    them, autograd through the float reference otherwise."""
    if not _kernels_take(q, k, v, grad_out):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        with torch.enable_grad():
            inputs = [t.detach().to(work).requires_grad_() for t in (q, k, v)]
            ref_out, ref_lse = attention_reference(*inputs, causal, scale)
            outputs, grads = [ref_out], [grad_out.to(work)]
            if grad_lse is not None:
                outputs.append(ref_lse)
                grads.append(grad_lse.to(work))
            dq, dk, dv = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        return tuple((g if g is not None else torch.zeros_like(t)).to(t.dtype)
                     for g, t in zip((dq, dk, dv), (q, k, v)))
    return _launch_backward(grad_out, q, k, v, out, lse, grad_lse, causal, scale)


_attention_op = torch.library.custom_op("gemslib::attention", _attention_impl, mutates_args=())
_attention_backward_op = torch.library.custom_op("gemslib::attention_backward",
                                                 _attention_backward_impl, mutates_args=())


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, grad_lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# One setup and backward for the custom op (torch.compile) and the eager autograd.Function.

def _save_for_attention_backward(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, *output)


def _attention_grad_via(backward):
    def grad(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, grad_lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None
    return grad


@_attention_op.register_fake
def _(q, k, v, causal, scale):
    batch, n_q_heads, seq_q, _ = q.shape
    return (q.new_empty((batch, n_q_heads, seq_q, v.shape[-1])),
            q.new_empty((batch, n_q_heads, seq_q), dtype=torch.float32))


_attention_op.register_autograd(_attention_grad_via(_attention_backward_op),
                                setup_context=_save_for_attention_backward)
_AttentionFunction = runtime.eager_autograd("AttentionFunction", _attention_impl,
                                            _save_for_attention_backward,
                                            _attention_grad_via(_attention_backward_impl))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seqlens: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """One new query per sequence: q (B, Hq, D) against the first ``seqlens[b]`` positions of
    k_cache (B, Hkv, L, D) and v_cache (B, Hkv, L, Dv); returns (B, Hq, Dv). The KV length is
    split over programs (flash-decoding) and the parts merged by log-sum-exp; the query heads
    of one KV head share a program, so K/V are read once. A sequence of length 0 gives 0."""
    compiling = torch.compiler.is_compiling()  # traced: no Python caches (locks, dicts)
    layout = None if compiling else _decode_layout(q, k_cache, v_cache, seqlens, scale)
    plan = _decode_layouts.get(layout, _UNCHECKED) if layout is not None else _UNCHECKED
    if plan is _UNCHECKED:
        _check_decode(q, k_cache, v_cache, seqlens, scale)
        scale = checks.as_float("gemslib.decode_attention", "scale", scale, optional=True)
        if layout is not None and len(_decode_layouts) < 4096:
            _decode_layouts[layout] = None  # checked; the launch adds its plan
    elif plan is not None and not (torch.is_grad_enabled() and (
            q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)):
        return _run_decode(plan, q, k_cache, v_cache, seqlens)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or
                                    v_cache.requires_grad):
        # no backward kernel: the reference, in torch ops, keeps gradients right
        _check_seqlens_in_cache(seqlens, k_cache.shape[2], on_device_too=True)
        return decode_attention_reference(q, k_cache, v_cache, seqlens, scale)
    if compiling:
        return _decode_attention_op(q, k_cache, v_cache, seqlens, scale)
    return _decode_eager(q, k_cache, v_cache, seqlens, scale, layout)


def _decode_eager(q, k_cache, v_cache, seqlens, scale: float, layout: tuple | None = None):
    if not _kernels_take(q, k_cache, v_cache):
        _check_seqlens_in_cache(seqlens, k_cache.shape[2], on_device_too=True)
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        return decode_attention_reference(q.to(work), k_cache.to(work), v_cache.to(work),
                                          seqlens, scale).to(q.dtype)
    # on a GPU the kernel asserts the lengths itself: no host sync, no extra launch
    return _launch_decode(q, k_cache, v_cache, seqlens, scale, layout)


def _decode_attention_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seqlens: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return _decode_eager(q, k_cache, v_cache, seqlens, scale)


_decode_attention_op = torch.library.custom_op("gemslib::decode_attention",
                                               _decode_attention_impl, mutates_args=())


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, seqlens, scale):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


# --------------------------------------------------------------------------------------------
# aten overrides: the SDPA backend operators F.scaled_dot_product_attention reaches
# (CUDA: flash, cuDNN or memory-efficient, whichever torch picks; CPU: its flash kernel), each
# with its backward operator. Each forward saves the lse in its backend's own layout and units
# (natural log), so a forward and a backward may run in different enable() scopes: either half
# reads what the other wrote.
# --------------------------------------------------------------------------------------------


def _why_not_sdpa(query, key, value, attn_bias=None, dropout_p=0.0, scale=None):
    """Why the kernels do not take this SDPA call (None: they do)."""
    if query.dtype not in KERNEL_DTYPES:
        return f"dtype {query.dtype}"
    if not runtime.dot_kernel_runs(query):
        return runtime.INTERPRETER_BF16_DOT
    if attn_bias is not None:
        return "an attention mask or bias"
    if dropout_p:
        return "dropout"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "inputs that are not (B, H, S, D)"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[-1] != query.shape[-1]:
        return "head counts or head dims the kernel does not pair"
    if max(query.shape[-1], value.shape[-1]) > 256:
        return "a head dim over 256"
    if min(query.shape[-1], value.shape[-1]) == 0:
        return "a head dim of 0"
    return None


_FP32_PAIRING = ("fp32 SDPA that records gradients (torch's backward, wherever it runs, "
                 "recomputes the scores in its own arithmetic; an lse from gemslib's pairs with "
                 "them only to their fp32 rounding)")


def _why_not_sdpa_forward(query, key, value, attn_bias=None, dropout_p=0.0, scale=None):
    """:func:`_why_not_sdpa` for the forward operators. An fp32 forward that autograd records
    stays torch's: its backward may run outside enable() and its scores, recomputed there by
    torch, round differently from gemslib's; at peaked rows the difference to the saved lse
    does not cancel (3 times torch's own gradient error on the H200; benchmark/NOTES.md). So fp32 SDPA
    training under enable() is torch's forward and backward; fp32 inference is gemslib's."""
    if query.dtype == torch.float32 and torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad):
        return _FP32_PAIRING
    return _why_not_sdpa(query, key, value, attn_bias, dropout_p, scale)


def _matching_layout(query, shape):
    """An empty tensor of ``shape`` whose dimensions are laid out in the order of query's
    strides (torch's SDPA backends give their outputs q's layout; their fake kernels say so,
    and torch.compile checks real outputs against them)."""
    if tuple(query.shape) == tuple(shape):
        if query.is_contiguous():
            # also when only a dim of size 1 (one query row) is out of order: empty_like keeps
            # its stride on real tensors, the fake kernels' (on meta) are plain contiguous
            return torch.empty(shape, dtype=query.dtype, device=query.device)
        return torch.empty_like(query)
    order = sorted(range(4), key=lambda dim: query.stride(dim), reverse=True)
    return torch.empty([shape[dim] for dim in order], dtype=query.dtype,
                       device=query.device).permute([order.index(dim) for dim in range(4)])


def _sdpa_outputs(query, key, value, is_causal, scale, out=None):
    default = default_scale(query.shape[-1])
    if out is None:
        out = _matching_layout(query, (*query.shape[:3], value.shape[-1]))
    return _launch_forward(query, key, value, is_causal, default if scale is None else scale,
                           out)


def _aten_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                        scale=None):
    out, lse = _sdpa_outputs(query, key, value, is_causal, scale)
    # torch's CPU kernel keeps lse as (B, Sq, H) memory seen as (B, H, Sq)
    batch, heads, seq_q = lse.shape
    return out, lse.new_empty((batch, seq_q, heads)).transpose(1, 2).copy_(lse)


def _why_not_flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                           scale=None):
    return _why_not_sdpa_forward(query, key, value, attn_mask, dropout_p, scale)


def _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                    heads_last: bool):
    """(dq, dk, dv) for an SDPA backward operator. ``logsumexp``: the forward's, in any
    backend's layout ((B, H, Sq), cuDNN's (B, H, Sq, 1), efficient's padded (B, H, >= Sq), CPU's
    strided). The gradients take the layout of torch's fake kernel for the operator: like the
    inputs (CUDA flash, cuDNN), or ``heads_last`` (B, S, H, D) memory (CPU flash, efficient)."""
    default = default_scale(query.shape[-1])
    lse = logsumexp[..., 0] if logsumexp.dim() == 4 else logsumexp[..., :query.shape[2]]
    grads = _launch_backward(grad_out, query, key, value, out, lse.float().contiguous(), None,
                             is_causal, default if scale is None else scale)
    layouts = [torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)
               if heads_last else torch.empty_like(t) for t in (query, key, value)]
    return tuple(grad if grad.stride() == want.stride() else want.copy_(grad)
                 for grad, want in zip(grads, layouts))


def _why_not_sdpa_backward(grad_out, query, key, value, attn_bias=None, dropout_p=0.0,
                           scale=None):
    # the same call's forward went to the kernels exactly when _why_not_sdpa said None, and
    # when it did not, torch's forward saved the lse in the layout the backward reads
    if grad_out.dtype != query.dtype:
        return f"grad_out in {grad_out.dtype}, inputs in {query.dtype}"
    if query.dtype == torch.float32:  # its forward was torch's (_why_not_sdpa_forward)
        return _FP32_PAIRING
    return _why_not_sdpa(query, key, value, attn_bias, dropout_p, scale)


def _aten_flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                 is_causal, *, attn_mask=None, scale=None):
    return _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                           heads_last=True)


def _why_not_flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                    is_causal, *, attn_mask=None, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_mask, dropout_p, scale)


def _placeholder(query):
    """An empty tensor where the operator returns one that is unused here (debug mask)."""
    return torch.empty(0, dtype=query.dtype, device=query.device)


def _philox_placeholders(query):
    """(seed, offset) as torch's cuDNN and efficient kernels give them: 0-d int64 (no dropout
    here, so never read)."""
    return tuple(torch.zeros((), dtype=torch.int64, device=query.device) for _ in range(2))


def _aten_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                scale=None):
    out, lse = _sdpa_outputs(query, key, value, is_causal, scale)
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask)
    # as torch's kernel gives them without dropout: undefined cum_seq (defined ones would
    # tell torch's backward the batch is nested), a (2,) rng state and a 0-d unused
    return (out, lse, None, None, query.shape[2], key.shape[2],
            torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            _placeholder(query))


def _why_not_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                   *, scale=None):
    return "a debug mask" if return_debug_mask else \
        _why_not_sdpa_forward(query, key, value, None, dropout_p, scale)


def _aten_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    out, lse = _sdpa_outputs(query, key, value, is_causal, scale)
    # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, mask);
    # cuDNN keeps lse as (B, H, Sq, 1)
    return (out, lse.unsqueeze(-1), None, None, query.shape[2], key.shape[2],
            *_philox_placeholders(query), None)


def _why_not_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                   is_causal=False, return_debug_mask=False, *, scale=None):
    return "a debug mask" if return_debug_mask else \
        _why_not_sdpa_forward(query, key, value, attn_bias, dropout_p, scale)


def _aten_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                    is_causal=False, *, scale=None):
    batch, heads, seq_q, _ = query.shape
    # the efficient kernel's layouts: o as (B, Sq, H, Dv) memory, lse padded to 32 rows (or
    # empty when not asked for)
    out = query.new_empty((batch, seq_q, heads, value.shape[-1])).transpose(1, 2)
    out, lse = _sdpa_outputs(query, key, value, is_causal, scale, out)
    padded = lse.new_zeros((batch, heads, -(-seq_q // 32) * 32 if compute_log_sumexp else 0))
    padded[..., :seq_q] = lse[..., :padded.shape[-1]]
    return out, padded, *_philox_placeholders(query)


def _why_not_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                       is_causal=False, *, scale=None):
    return _why_not_sdpa_forward(query, key, value, attn_bias, dropout_p, scale)


def _aten_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                         scale=None):
    return _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                           heads_last=False)


def _why_not_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                            max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                            scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, None, dropout_p, scale)


def _aten_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
                         philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, *, scale=None):
    return _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                           heads_last=False)


def _why_not_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
                            philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                            dropout_p, is_causal, *, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_bias, dropout_p, scale)


def _aten_efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                             philox_seed, philox_offset, dropout_p, grad_input_mask,
                             is_causal=False, *, scale=None):
    dq, dk, dv = _sdpa_gradients(grad_out, query, key, value, out, logsumexp, is_causal, scale,
                                 heads_last=True)
    return dq, dk, dv, _placeholder(query)  # no bias, no bias gradient


def _why_not_efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp,
                                philox_seed, philox_offset, dropout_p, grad_input_mask,
                                is_causal=False, *, scale=None):
    return _why_not_sdpa_backward(grad_out, query, key, value, attn_bias, dropout_p, scale)


ATEN_OVERRIDES = (
    AtenOverride("aten::_scaled_dot_product_flash_attention_for_cpu", _aten_flash_for_cpu,
                 _why_not_flash_for_cpu, dispatch_keys=("CPU",)),
    AtenOverride("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                 _aten_flash_for_cpu_backward, _why_not_flash_for_cpu_backward,
                 dispatch_keys=("CPU",)),
    AtenOverride("aten::_scaled_dot_product_flash_attention", _aten_flash, _why_not_flash,
                 dispatch_keys=("CUDA",)),
    AtenOverride("aten::_scaled_dot_product_flash_attention_backward", _aten_flash_backward,
                 _why_not_flash_backward, dispatch_keys=("CUDA",)),
    AtenOverride("aten::_scaled_dot_product_cudnn_attention", _aten_cudnn, _why_not_cudnn,
                 dispatch_keys=("CUDA",)),
    AtenOverride("aten::_scaled_dot_product_cudnn_attention_backward", _aten_cudnn_backward,
                 _why_not_cudnn_backward, dispatch_keys=("CUDA",)),
    AtenOverride("aten::_scaled_dot_product_efficient_attention", _aten_efficient,
                 _why_not_efficient, dispatch_keys=("CUDA",)),
    AtenOverride("aten::_scaled_dot_product_efficient_attention_backward",
                 _aten_efficient_backward, _why_not_efficient_backward, dispatch_keys=("CUDA",)),
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


def _decode_inputs(device, dtype, cache_len):
    """One query per sequence against full caches of cache_len positions."""
    batch, heads, kv_heads, dim = (16, 32, 8, 128) if cache_len >= 1024 else (3, 4, 2, 64)
    return (torch.randn(batch, heads, dim, device=device, dtype=dtype),
            *(torch.randn(batch, kv_heads, cache_len, dim, device=device, dtype=dtype)
              for _ in range(2)))


def _gradients(attend, q, k, v, grad_out):
    """(dq, dk, dv) of ``attend(q, k, v, causal=True)`` for ``grad_out``, flattened into one."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        grads = torch.autograd.grad(attend(*leaves), leaves, grad_out)
    return torch.cat([g.flatten() for g in grads])


def _attention_backward_inputs(device, dtype, seq):
    q, k, v = _attention_inputs(device, dtype, seq)
    return q, k, v, torch.randn_like(q[..., :v.shape[-1]])


# bf16 tl.dot is wrong in Triton 3.6's interpreter, so the CPU run checks fp16 and fp32
_CHECK_DTYPES = (torch.float16, torch.float32) if runtime.INTERPRETER else \
    (torch.float16, torch.bfloat16, torch.float32)

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
    SelfCheck("decode_attention", _decode_inputs,
              run=decode_attention, reference=decode_attention_reference,
              torch_peer=lambda q, k, v: F.scaled_dot_product_attention(
                  q[:, :, None], k, v, enable_gqa=True)[:, :, 0],
              dtypes=_CHECK_DTYPES, term_scale=lambda q, k, v: v.abs().max().item()),
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
            global use_hopper_kernel, use_hopper_backward
            previous = use_hopper_kernel, use_hopper_backward
            use_hopper_kernel = use_hopper_backward = False
            try:
                if backward:
                    return [_launch_backward(grad_out, q, k, v, out, lse, None, causal,
                                             dim ** -0.5)
                            for causal, (out, lse) in zip((False, True), saved)]
                return [_launch_forward(q, k, v, causal, dim ** -0.5)[0]
                        for causal in (False, True)]
            finally:
                use_hopper_kernel, use_hopper_backward = previous
        return run
    return make


def _decode_problem(shapes: tuple[tuple[int, int], ...], dim: int, dtype: torch.dtype):
    """decode_attention at each (batch, cache length), Hq 32, Hkv 8, summed."""
    def make(device):
        problems = [(torch.randn(batch, 32, dim, device=device, dtype=dtype),
                     torch.randn(batch, 8, length, dim, device=device, dtype=dtype),
                     torch.randn(batch, 8, length, dim, device=device, dtype=dtype))
                    for batch, length in shapes]
        return lambda: [decode_attention(q, k_cache, v_cache) for q, k_cache, v_cache in problems]
    return make


def _prefill_buckets(backward: bool):
    return (TuneBucket({"head_dim": 64, "elem_bytes": 2} if not backward else {"head_dim": 64},
                       "B2 H16 S4096 D64 bf16",
                       _prefill_problem(2, 16, 4096, 64, torch.bfloat16, backward)),
            TuneBucket({"head_dim": 128, "elem_bytes": 2}, "B4 H32 S2048 D128 bf16",
                       _prefill_problem(4, 32, 2048, 128, torch.bfloat16, backward)),
            # the backward's first bucket takes every D64 call, fp32 too
            TuneBucket(None, "B1 H8 S1024 D128 fp32",
                       _prefill_problem(1, 8, 1024, 128, torch.float32, backward)))


# Compiling the candidates is most of a full tuner run (attention's took 361 s of ~500 on
# the H200, 2026-11-30), so the lists leave out what never won a sweep or a tuner run there:
# LAZY rescaling, one-stage pipelines for the large backward tiles, 128-row dQ tiles on 4
# warps (they spill), 4 decode programs per SM.
TUNING = (
    # 128-row blocks spill with 4 warps (ptxas, D128 bf16), 128-key blocks at 4 stages exceed
    # the shared memory; the small tiles are for fp32 inputs
    TuneSpace(ATTENTION_FWD,
              tuple({"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": tma, "LAZY": 0, "num_warps": w,
                     "num_stages": st}
                    for m, n, w, stages in ((64, 64, 4, (2, 3)), (64, 128, 4, (2, 3)),
                                            (128, 64, 8, (3, 4)), (128, 128, 8, (3,)))
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
    # 32-key blocks and 2 warps were latency-bound at B1 on the H200; 3 per SM: the 64-key
    # configs fit three programs on an SM; the 32-key ones are for fp32 caches and wide heads
    TuneSpace(DECODE,
              tuple({"BLOCK_N": n, "PROGRAMS_PER_SM": per_sm, "num_warps": 4, "num_stages": st}
                    for n, st in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3))
                    for per_sm in (1, 2, 3))
              + tuple({"BLOCK_N": 32, "PROGRAMS_PER_SM": per_sm, "num_warps": 4, "num_stages": 2}
                      for per_sm in (1, 2)),
              (TuneBucket({"elem_bytes": 2}, "B16 L8192 + B1 L32768 D128 bf16",
                          _decode_problem(((16, 8192), (1, 32768)), 128, torch.bfloat16)),
               TuneBucket({"head_dim": 128}, "B4 L4096 D128 fp32",
                          _decode_problem(((4, 4096),), 128, torch.float32)),
               TuneBucket(None, "B2 L2048 D256 fp32",
                          _decode_problem(((2, 2048),), 256, torch.float32)))),
)
