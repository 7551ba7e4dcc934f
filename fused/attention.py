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
                                              attention_reference, default_scale)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr,
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
# (_attention_hopper.py, 1.2x the Triton kernel's speed there), and the backward computes their
# dK/dV in Gluon too (_attention_hopper.backward_dkdv: K and V kept in shared memory; on the H200
# the whole backward up to 1.42x faster than with the Triton dK/dV kernel, at worst 1% slower;
# benchmark/NOTES.md). Switched off, every call stays on the Triton kernels.
HOPPER_FORWARD = runtime.KernelPath("attention", "the Gluon forward on sm_90")
HOPPER_BACKWARD = runtime.KernelPath("attention", "the Gluon dK/dV kernel on sm_90")


def _launch_forward(q, k, v, causal: bool, scale: float,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for (B, Hq, Sq, D) q and (B, Hkv, Skv, D / Dv) k / v, validated. ``out``: the
    (B, Hq, Sq, Dv) tensor to write o into, any strides (the SDPA overrides pass torch's
    layout for the backend); by default a contiguous one."""
    q, k, v = layout.unit_last(q), layout.unit_last(k), layout.unit_last(v)
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
    if HOPPER_FORWARD.on and _attention_hopper is not None and batch * n_q_heads * seq_q * \
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
        head_dim, head_dim_v, scale * LOG2E.value,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        causal, q.dtype == torch.float32, tma, block_d, block_dv, shape=shape, config=config)
    return out, lse


def _launch_backward(grad_out, q, k, v, out, lse, grad_lse, causal: bool,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), contiguous, for the forward (out, lse) of validated q, k, v; grad_lse
    (B, Hq, Sq) or None is a gradient flowing into lse."""
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
            out, grad_out, grad_lse if grad_lse is not None else delta, delta, seq_q, n_q_heads,
            head_dim_v, *out.stride()[:3], *grad_out.stride()[:3], grad_lse is not None,
            BLOCK_M=64, BLOCK_DV=block_dv)
    shape = (head_dim, q.element_size())
    # after the sequence lengths and the head count each kernel's grid runs over
    rest = (n_q_heads // n_kv_heads, head_dim, head_dim_v, scale, scale * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], causal,
            q.dtype == torch.float32, block_d, block_dv)
    if HOPPER_BACKWARD.on and _attention_hopper is not None and \
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


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


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
        return _attention_op(q, k, v, bool(causal), scale)[0]
    return _attention_impl(q, k, v, causal, scale)[0]


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


def _attention_fake(q, k, v, causal, scale):
    batch, n_q_heads, seq_q, _ = q.shape
    return (q.new_empty((batch, n_q_heads, seq_q, v.shape[-1])),
            q.new_empty((batch, n_q_heads, seq_q), dtype=torch.float32))


def _save_for_attention_backward(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.causal, ctx.scale = causal, scale
    ctx.save_for_backward(q, k, v, *output)


def _attention_grad(ctx, grad_out, grad_lse, ops):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = ops.attention_backward(grad_out, q, k, v, out, lse, grad_lse, ctx.causal,
                                        ctx.scale)
    return dq, dk, dv, None, None


_attention_backward_op = runtime.CustomOp(
    "attention_backward", _attention_backward_impl,
    fake=lambda grad_out, q, k, v, out, lse, grad_lse, causal, scale: (
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
    return (TuneBucket({"head_dim": 64, "elem_bytes": 2} if not backward else {"head_dim": 64},
                       "B2 H16 S4096 D64 bf16",
                       _prefill_problem(2, 16, 4096, 64, torch.bfloat16, backward)),
            TuneBucket({"head_dim": 128, "elem_bytes": 2}, "B4 H32 S2048 D128 bf16",
                       _prefill_problem(4, 32, 2048, 128, torch.bfloat16, backward)),
            # the backward's first bucket takes every D64 call, fp32 too
            TuneBucket(None, "B1 H8 S1024 D128 fp32",
                       _prefill_problem(1, 8, 1024, 128, torch.float32, backward)))


# Compiling the candidates is most of a full tuner run, so the lists leave out what never won
# a sweep or a tuner run on the H200 (benchmark/NOTES.md): LAZY rescaling, one-stage pipelines for the large backward tiles, 128-row
# dQ tiles on 4 warps (they spill).
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
)
