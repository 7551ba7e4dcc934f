"""Fused attention: the prefill forward, flash-attention style. (Work in progress: decode, the
SDPA override and the H200 tuning follow.)

    attention(q, k, v)[b, h, i] = sum_j p_ij v[b, g(h), j],
    p_ij = softmax_j(scale * q[b, h, i] . k[b, g(h), j])  over the keys j row i may see

with g(h) = h // (Hq / Hkv) (grouped-query attention: K/V are never repeated in memory) and,
when causal, the keys j <= i (torch's top-left alignment when Sq != Skv). q is (B, Hq, Sq, D),
k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv), any strides with a unit last stride.

One program per BLOCK_M query rows of one head walks the keys BLOCK_N at a time with an online
softmax in the exp2 domain (scale * log2(e) folded into the scores) and fp32 accumulators;
blocks every row sees in full run without masks, the causal diagonal and the ragged end
separately with them. The row log-sum-exp (natural log) comes out too, for the backward.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gemslib import runtime

KERNEL_DTYPES = runtime.KERNEL_DTYPES
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_blocks(acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s,
                   rows, key_start, key_end, seq_kv, head_dim, head_dim_v, scale_log2,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Fold keys [key_start, key_end) into the running (acc, row_max, row_sum); row_max is in
    log2 units. MASKED blocks check key bounds (and causality); the others need no mask."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for start in range(key_start, key_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = (keys[None, :] < seq_kv) if MASKED else (keys[None, :] >= 0)
        k = tl.load(k_head + keys[None, :] * k_stride_s + dims[:, None],
                    mask=key_mask & (dims[:, None] < head_dim), other=0.0)
        if IEEE:
            scores = tl.dot(q, k, input_precision="ieee") * scale_log2
        else:
            scores = tl.dot(q, k) * scale_log2
        if MASKED:
            visible = key_mask
            if CAUSAL:
                visible = visible & (keys[None, :] <= rows[:, None])
            scores = tl.where(visible, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # every row sees key 0 in the first block it folds, so new_max is finite from then on
        rescale = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = tl.load(v_head + keys[:, None] * v_stride_s + dims_v[None, :],
                    mask=(keys[:, None] < seq_kv) & (dims_v[None, :] < head_dim_v), other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    seq_q, seq_kv, n_q_heads, group_size, head_dim, head_dim_v, scale_log2,
    q_stride_b, q_stride_h, q_stride_s, k_stride_b, k_stride_h, k_stride_s,
    v_stride_b, v_stride_h, v_stride_s, o_stride_b, o_stride_h, o_stride_s,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (query blocks, B * Hq). o (B, Hq, Sq, Dv) in q's dtype, lse (B, Hq, Sq) fp32."""
    m_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = (batch_head // n_q_heads).to(tl.int64)
    head = (batch_head % n_q_heads).to(tl.int64)
    kv_head = head // group_size
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q_head = q_ptr + batch * q_stride_b + head * q_stride_h
    k_head = k_ptr + batch * k_stride_b + kv_head * k_stride_h
    v_head = v_ptr + batch * v_stride_b + kv_head * v_stride_h
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
        acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s, rows, 0, full_end,
        seq_kv, head_dim, head_dim_v, scale_log2, False, CAUSAL, IEEE, BLOCK_N, BLOCK_D, BLOCK_DV)
    acc, row_max, row_sum = _attend_blocks(
        acc, row_max, row_sum, q, k_head, v_head, k_stride_s, v_stride_s, rows, full_end,
        key_end, seq_kv, head_dim, head_dim_v, scale_log2, True, CAUSAL, IEEE, BLOCK_N, BLOCK_D,
        BLOCK_DV)

    out = acc / row_sum[:, None]
    o_head = o_ptr + batch * o_stride_b + head * o_stride_h
    tl.store(o_head + rows[:, None] * o_stride_s + dims_v[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & (dims_v[None, :] < head_dim_v))
    lse = (row_max + tl.log2(row_sum)) * LN2
    tl.store(lse_ptr + batch_head.to(tl.int64) * seq_q + rows, lse, mask=rows < seq_q)


ATTENTION_FWD = runtime.TunedKernel("attention", "attention_fwd", _attention_fwd_kernel,
                                    tunables=("BLOCK_M", "BLOCK_N"),
                                    shape_keys=("head_dim", "seq_q", "seq_kv"))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _launch_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for (B, Hq, Sq, D) q and (B, Hkv, Skv, D / Dv) k / v, validated."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((batch, n_q_heads, seq_q, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(-float("inf"))
    if seq_kv == 0:  # no keys: SDPA gives zeros
        return out.zero_(), lse.fill_(-float("inf"))
    ATTENTION_FWD.launch(
        lambda meta: (runtime.cdiv(seq_q, meta["BLOCK_M"]), batch * n_q_heads),
        q, k, v, out, lse, seq_q, seq_kv, n_q_heads, n_q_heads // n_kv_heads, head_dim,
        head_dim_v, scale * 1.4426950408889634,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        causal, q.dtype == torch.float32, max(16, runtime.next_power_of_2(head_dim)),
        max(16, runtime.next_power_of_2(head_dim_v)),
        shape=(head_dim, seq_q, seq_kv))
    return out, lse


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def attention_reference(q, k, v, causal=False, scale=None):
    """(o, lse) by the definition, K/V repeated over each group of query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, -float("inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _check(q, k, v, scale) -> None:
    name = "gemslib.attention"
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
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{name}: scale must be a number or None, got {type(scale).__name__}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=True)``: q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv) with Hq a
    multiple of Hkv; returns (B, Hq, Sq, Dv) in q's dtype. Forward only for now."""
    _check(q, k, v, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not runtime.kernel_runs(q, k, v) or max(q.shape[-1], v.shape[-1]) > 256:
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, _ = attention_reference(q.to(work), k.to(work), v.to(work), causal, scale)
        return out.to(q.dtype)
    return _launch_forward(q, k, v, causal, scale)[0]


ATEN_OVERRIDES = ()
SELF_CHECKS = ()
