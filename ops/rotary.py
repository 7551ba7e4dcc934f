"""Rotary position embedding for q and k in one launch, forward and backward.

For each token and each head, the first ``rot_dim`` features are rotated in ``rot_dim / 2``
planes; features past ``rot_dim`` pass through (partial rotary). The angles come from one of
two tables:

* a half table (max_position, rot_dim / 2), looked up at each token's position p (one angle
  per pair, the vLLM / FlashInfer layout):

      out_a = x_a * cos[p] - x_b * sin[p]
      out_b = x_b * cos[p] + x_a * sin[p]

* a full per-token table (B or 1, S, rot_dim), as transformers' models compute it (the
  halves of a NeoX row are usually, but not necessarily, equal), read at both features:

      out_a = x_a * cos[b, s, a] - x_b * sin[b, s, a]
      out_b = x_b * cos[b, s, b] + x_a * sin[b, s, b]

  which is exactly transformers' ``x * cos + rotate_half(x) * sin`` for any table.

(x_a, x_b) = (x[i], x[i + rot_dim/2]) in the NeoX/Llama layout (``interleaved=False``) and
(x[2i], x[2i + 1]) in the GPT-J layout (``interleaved=True``). The backward is the transposed
rotation of the incoming gradients (per pair [[cos_a, -sin_a], [sin_b, cos_b]]^T: sin_a and
sin_b swap and change sign; with a half table, the inverse rotation sin -> -sin).

q is (B, S, Hq, D) or (T, Hq, D), k the same with Hk heads (GQA); any strides with a unit last
stride, so a transposed (B, H, S, D) view works without a copy.

``torch.ops.gemslib.rotary_into_cache`` is the same launch for a decode step over a static
KV cache: q rotated into a new tensor, k rotated and v copied straight into the caches
(B, Hk, L, D) at the tokens' rows, which the graph passes (``gemslib.passes.rotary``) put in
place of the rotary and the cache's update. The file reads top-down: kernel, launcher,
reference, public function and custom ops, self-checks, tuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemslib import checks, layout, pdl, runtime
from gemslib.registry import SelfCheck, TuneBucket, TuneSpace


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _head_block(x_ptr, stride_x_h, head_start, n_heads, n_pairs,
                INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """Pointers to the (first, second) features of BLOCK_H heads' rotation pairs, and the mask;
    x_ptr points at one token's first head."""
    o_h = head_start + tl.arange(0, BLOCK_H)[:, None]
    o_r = tl.arange(0, BLOCK_R)[None, :]
    m_x = (o_h < n_heads) & (o_r < n_pairs)
    if INTERLEAVED:
        o_a, o_b = 2 * o_r, 2 * o_r + 1
    else:
        o_a, o_b = o_r, o_r + n_pairs
    p_x = x_ptr + o_h * stride_x_h
    return p_x + o_a, p_x + o_b, m_x


@triton.jit
def _load_heads(x_ptr, stride_x_h, head_start, n_heads, n_pairs,
                INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """(x_a, x_b) of BLOCK_H heads of one token, in fp32."""
    p_a, p_b, m_x = _head_block(x_ptr, stride_x_h, head_start, n_heads, n_pairs,
                                INTERLEAVED, BLOCK_H, BLOCK_R)
    b_xa = tl.load(p_a, mask=m_x, other=0.0).to(tl.float32)
    b_xb = tl.load(p_b, mask=m_x, other=0.0).to(tl.float32)
    return b_xa, b_xb


@triton.jit
def _normed_heads(b_xa, b_xb, norm_ptr, n_pairs, head_dim, norm_eps, norm_offset,
                  INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr):
    """(x_a, x_b) of BLOCK_H heads, each head RMS-normalised over its head_dim features and
    scaled by norm_offset + norm_ptr's (head_dim,) weight (a full rotary: the pairs are every
    feature; the offset 1 for Gemma-3's (1 + w) norm, else 0)."""
    o_r = tl.arange(0, BLOCK_R)[None, :]
    m_r = o_r < n_pairs
    if INTERLEAVED:
        o_a, o_b = 2 * o_r, 2 * o_r + 1
    else:
        o_a, o_b = o_r, o_r + n_pairs
    b_squares = tl.sum(b_xa * b_xa, axis=1) + tl.sum(b_xb * b_xb, axis=1)
    b_rstd = (1.0 / tl.sqrt(b_squares / head_dim + norm_eps))[:, None]
    b_wa = tl.load(norm_ptr + o_a, mask=m_r, other=0.0).to(tl.float32) + norm_offset
    b_wb = tl.load(norm_ptr + o_b, mask=m_r, other=0.0).to(tl.float32) + norm_offset
    return b_xa * b_rstd * b_wa, b_xb * b_rstd * b_wb


@triton.jit
def _store_heads(x_ptr, out_ptr, stride_x_h, stride_out_h, head_start, n_heads, b_xa, b_xb,
                 b_cos_a, b_sin_a, b_cos_b, b_sin_b, n_pairs, head_dim,
                 INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Store the rotated (x_a, x_b) of BLOCK_H heads, out_a = x_a * cos_a - x_b * sin_a and
    out_b = x_b * cos_b + x_a * sin_b (cos_a = cos_b, sin_a = sin_b with a half table); with
    COPY_REST the features past rot_dim are copied from x (out of place with partial rotary)."""
    p_a, p_b, m_x = _head_block(out_ptr, stride_out_h, head_start, n_heads, n_pairs,
                                INTERLEAVED, BLOCK_H, BLOCK_R)
    dtype = out_ptr.dtype.element_ty
    tl.store(p_a, (b_xa * b_cos_a - b_xb * b_sin_a).to(dtype), mask=m_x)
    tl.store(p_b, (b_xb * b_cos_b + b_xa * b_sin_b).to(dtype), mask=m_x)
    if COPY_REST:
        o_h = head_start + tl.arange(0, BLOCK_H)[:, None]
        o_rest = 2 * n_pairs + tl.arange(0, BLOCK_REST)[None, :]
        m_rest = (o_h < n_heads) & (o_rest < head_dim)
        tl.store(out_ptr + o_h * stride_out_h + o_rest,
                 tl.load(x_ptr + o_h * stride_x_h + o_rest, mask=m_rest), mask=m_rest)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_x_h, stride_out_h, head_start, n_heads, n_heads_out,
    b_cos_a, b_sin_a, b_cos_b, b_sin_b, n_pairs, head_dim, norm_ptr, norm_eps, norm_offset,
    INTERLEAVED: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    """Rotate BLOCK_H heads of one token (each RMS-normalised first with norm_ptr's weight,
    unless it is None); x_ptr/out_ptr point at the token's first head. Heads past
    n_heads_out are read but not written."""
    b_xa, b_xb = _load_heads(x_ptr, stride_x_h, head_start, n_heads, n_pairs, INTERLEAVED,
                             BLOCK_H, BLOCK_R)
    if norm_ptr is not None:
        b_xa, b_xb = _normed_heads(b_xa, b_xb, norm_ptr, n_pairs, head_dim, norm_eps,
                                   norm_offset, INTERLEAVED, BLOCK_R)
    _store_heads(x_ptr, out_ptr, stride_x_h, stride_out_h, head_start, n_heads_out, b_xa, b_xb,
                 b_cos_a, b_sin_a, b_cos_b, b_sin_b, n_pairs, head_dim, INTERLEAVED, COPY_REST,
                 BLOCK_H, BLOCK_R, BLOCK_REST)


@triton.jit
def _copy_heads(x_ptr, out_ptr, stride_x_h, stride_out_h, head_start, n_heads, n_heads_out,
                head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Copy BLOCK_H heads of one token (all head_dim features); heads past n_heads_out are
    read but not written."""
    o_h = head_start + tl.arange(0, BLOCK_H)[:, None]
    o_d = tl.arange(0, BLOCK_D)[None, :]
    m_d = o_d < head_dim
    b_x = tl.load(x_ptr + o_h * stride_x_h + o_d, mask=(o_h < n_heads) & m_d)
    tl.store(out_ptr + o_h * stride_out_h + o_d, b_x, mask=(o_h < n_heads_out) & m_d)


@triton.heuristics({"BLOCK_HK": lambda args: min(args["BLOCK_H"],
                                                 runtime.next_power_of_2(args["n_k_heads"]))})
@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, positions_ptr,
    v_ptr, v_out_ptr, out_rows_ptr, q_norm_ptr, k_norm_ptr,
    seq_len, n_q_heads, n_k_heads, n_pairs, head_dim,
    stride_q_b, stride_q_s, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h,
    stride_q_out_b, stride_q_out_s, stride_q_out_h,
    stride_k_out_b, stride_k_out_s, stride_k_out_h,
    stride_v_b, stride_v_s, stride_v_h,
    stride_v_out_b, stride_v_out_s, stride_v_out_h,
    stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s,
    stride_positions_b, stride_positions_s, n_positions, n_out_rows, norm_eps, norm_offset,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, FULL_TABLE: tl.constexpr,
    COPY_REST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_REST: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr, LOOP_HEADS: tl.constexpr, BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
):
    """One token's angles, applied to BLOCK_H heads at a time. Grid (tokens, head blocks of q
    then of k), or with LOOP_HEADS (tokens, 1): each program loops over the token's heads,
    loading its angles once; each step loads a block of BLOCK_H q heads and one of BLOCK_HK
    k heads before storing either, so both reads are in flight together (one program per token
    suits short inputs; the tuned config chooses). n_pairs = rot_dim / 2 per head.

    A KV cache's write (``rotary_into_cache``): with out_rows_ptr, token i_s of k_out (and of
    v_out) is row out_rows[i_s] of its sequence dim, a row outside [0, n_out_rows) a
    device-side assert and no write; with v_ptr, each program that rotates a block of k heads
    copies the same block of v heads (all head_dim features, BLOCK_D a power of 2 above it)
    to v_out unrotated.

    The angles: with FULL_TABLE, row (i_b, i_s) of a (B | 1, S, rot_dim) table (stride_cos_b
    0 for a batch of 1), read at both features of each pair (cos_a, cos_b, sin_a, sin_b);
    otherwise row positions[i_b, i_s] (or i_s) of a (max_position, rot_dim / 2) table, one
    angle per pair (cos_a = cos_b, sin_a = sin_b). INVERSE applies the transposed rotation
    (the backward): per pair [[cos_a, -sin_a], [sin_b, cos_b]] becomes
    [[cos_a, sin_b], [-sin_a, cos_b]], i.e. (sin_a, sin_b) -> (-sin_b, -sin_a). PDL:
    launched dependent (runtime.dependent_launch_here), it first waits for the kernel before
    it on the stream; PDL_EARLY: then lets the next one launch (gemslib.pdl)."""
    pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
    i_t = tl.program_id(0)
    i_b = (i_t // seq_len).to(tl.int64)
    i_s = (i_t % seq_len).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)[None, :]
    m_r = o_r < n_pairs
    if FULL_TABLE:
        if INTERLEAVED:
            o_a, o_b = 2 * o_r, 2 * o_r + 1
        else:
            o_a, o_b = o_r, o_r + n_pairs
        p_cos = cos_ptr + i_b * stride_cos_b + i_s * stride_cos_s
        p_sin = sin_ptr + i_b * stride_sin_b + i_s * stride_sin_s
        b_cos_a = tl.load(p_cos + o_a, mask=m_r, other=1.0).to(tl.float32)
        b_cos_b = tl.load(p_cos + o_b, mask=m_r, other=1.0).to(tl.float32)
        b_sin_a = tl.load(p_sin + o_a, mask=m_r, other=0.0).to(tl.float32)
        b_sin_b = tl.load(p_sin + o_b, mask=m_r, other=0.0).to(tl.float32)
    else:
        if positions_ptr is not None:  # else token i_s of each sequence is at position i_s
            b_pos = tl.load(positions_ptr + i_b * stride_positions_b
                            + i_s * stride_positions_s).to(tl.int64)
            # a position outside the table: a device-side assert (compiled in, see ROTARY),
            # and never a read outside cos/sin (NaN angles where asserts are off)
            m_pos = (b_pos >= 0) & (b_pos < n_positions)
            tl.device_assert(m_pos, "gemslib.apply_rotary: positions must be in [0, cos.shape[0])")
            b_pos = tl.where(m_pos, b_pos, 0)
            m_rp = m_r & m_pos
            b_cos = tl.load(cos_ptr + b_pos * stride_cos_s + o_r, mask=m_rp).to(tl.float32)
            b_sin = tl.load(sin_ptr + b_pos * stride_sin_s + o_r, mask=m_rp).to(tl.float32)
            b_cos = tl.where(m_r, tl.where(m_pos, b_cos, float("nan")), 1.0)
            b_sin = tl.where(m_r, tl.where(m_pos, b_sin, float("nan")), 0.0)
        else:
            b_cos = tl.load(cos_ptr + i_s * stride_cos_s + o_r, mask=m_r, other=1.0)
            b_sin = tl.load(sin_ptr + i_s * stride_sin_s + o_r, mask=m_r, other=0.0)
            b_cos = b_cos.to(tl.float32)
            b_sin = b_sin.to(tl.float32)
        b_cos_a, b_cos_b, b_sin_a, b_sin_b = b_cos, b_cos, b_sin, b_sin
    if INVERSE:
        b_sin_a, b_sin_b = -b_sin_b, -b_sin_a
    i_s_out = i_s
    n_k_heads_out = n_k_heads  # the k (and v) heads written: none for a row off the cache
    if out_rows_ptr is not None:
        b_row = tl.load(out_rows_ptr + i_s).to(tl.int64)
        m_row = (b_row >= 0) & (b_row < n_out_rows)
        tl.device_assert(m_row, "gemslib.rotary_into_cache: cache_position must be in "
                                "[0, the cache's length)")
        i_s_out = tl.where(m_row, b_row, 0)
        n_k_heads_out = tl.where(m_row, n_k_heads, 0)
    p_q = q_ptr + i_b * stride_q_b + i_s * stride_q_s
    p_q_out = q_out_ptr + i_b * stride_q_out_b + i_s * stride_q_out_s
    p_k = k_ptr + i_b * stride_k_b + i_s * stride_k_s
    p_k_out = k_out_ptr + i_b * stride_k_out_b + i_s_out * stride_k_out_s
    p_v, p_v_out = v_ptr, v_out_ptr
    if v_ptr is not None:
        p_v = v_ptr + i_b * stride_v_b + i_s * stride_v_s
        p_v_out = v_out_ptr + i_b * stride_v_out_b + i_s_out * stride_v_out_s
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    if LOOP_HEADS:
        # a block past the last heads of q or k is fully masked: no memory traffic
        for i_h in range(0, tl.maximum(n_q_blocks, tl.cdiv(n_k_heads, BLOCK_HK))):
            b_qa, b_qb = _load_heads(p_q, stride_q_h, i_h * BLOCK_H, n_q_heads, n_pairs,
                                     INTERLEAVED, BLOCK_H, BLOCK_R)
            b_ka, b_kb = _load_heads(p_k, stride_k_h, i_h * BLOCK_HK, n_k_heads, n_pairs,
                                     INTERLEAVED, BLOCK_HK, BLOCK_R)
            if q_norm_ptr is not None:  # q's and k's heads RMS-normalised first (Qwen3)
                b_qa, b_qb = _normed_heads(b_qa, b_qb, q_norm_ptr, n_pairs, head_dim, norm_eps,
                                           norm_offset, INTERLEAVED, BLOCK_R)
                b_ka, b_kb = _normed_heads(b_ka, b_kb, k_norm_ptr, n_pairs, head_dim, norm_eps,
                                           norm_offset, INTERLEAVED, BLOCK_R)
            _store_heads(p_q, p_q_out, stride_q_h, stride_q_out_h,
                         i_h * BLOCK_H, n_q_heads, b_qa, b_qb, b_cos_a, b_sin_a, b_cos_b, b_sin_b,
                         n_pairs, head_dim,
                         INTERLEAVED, COPY_REST, BLOCK_H, BLOCK_R, BLOCK_REST)
            _store_heads(p_k, p_k_out, stride_k_h, stride_k_out_h,
                         i_h * BLOCK_HK, n_k_heads_out, b_ka, b_kb, b_cos_a, b_sin_a, b_cos_b,
                         b_sin_b, n_pairs, head_dim,
                         INTERLEAVED, COPY_REST, BLOCK_HK, BLOCK_R, BLOCK_REST)
            if v_ptr is not None:
                _copy_heads(p_v, p_v_out, stride_v_h, stride_v_out_h, i_h * BLOCK_HK, n_k_heads,
                            n_k_heads_out, head_dim, BLOCK_HK, BLOCK_D)
    else:
        i_h = tl.program_id(1)
        if i_h < n_q_blocks:
            _rotate_heads(p_q, p_q_out, stride_q_h, stride_q_out_h,
                          i_h * BLOCK_H, n_q_heads, n_q_heads, b_cos_a, b_sin_a, b_cos_b, b_sin_b,
                          n_pairs, head_dim, q_norm_ptr, norm_eps, norm_offset,
                          INTERLEAVED, COPY_REST, BLOCK_H, BLOCK_R, BLOCK_REST)
        else:
            i_hk = (i_h - n_q_blocks) * BLOCK_H
            _rotate_heads(p_k, p_k_out, stride_k_h, stride_k_out_h, i_hk, n_k_heads,
                          n_k_heads_out, b_cos_a, b_sin_a, b_cos_b, b_sin_b, n_pairs, head_dim,
                          k_norm_ptr, norm_eps, norm_offset, INTERLEAVED, COPY_REST, BLOCK_H,
                          BLOCK_R, BLOCK_REST)
            if v_ptr is not None:
                _copy_heads(p_v, p_v_out, stride_v_h, stride_v_out_h, i_hk, n_k_heads,
                            n_k_heads_out, head_dim, BLOCK_H, BLOCK_D)


ROTARY = runtime.TunedKernel("rotary", "rotary", _rotary_kernel, tunables=("BLOCK_H", "LOOP_HEADS"),
                             shape_keys=("tokens", "heads", "head_dim"), device_asserts=True,
                             dependent_launch=True)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 3 else t


def _launch(q, k, q_out, k_out, cos, sin, positions, interleaved: bool, inverse: bool,
            v=None, v_out=None, out_rows=None, q_norm=None, k_norm=None,
            norm_eps: float = 0.0, norm_offset: float = 0.0) -> None:
    """The rotation of q into q_out and of k into k_out; with ``out_rows`` (S,) k's token s goes
    to row out_rows[s] of k_out's sequence dim (k_out (B, L, Hk, D), a cache), and with ``v``
    v (like k) is copied unrotated into v_out (like k_out) at the same rows. With ``q_norm``
    and ``k_norm`` ((D,) weights; a full rotary) each head is RMS-normalised first, scaled by
    norm_offset + weight."""
    q4, k4, q_out4, k_out4 = _as_4d(q), _as_4d(k), _as_4d(q_out), _as_4d(k_out)
    batch, seq_len, n_q_heads, head_dim = q4.shape
    n_k_heads = k4.shape[2]
    full_table = cos.dim() == 3  # (B | 1, S, rot_dim), else (max_position, rot_dim / 2)
    half = cos.shape[2] // 2 if full_table else cos.shape[1]
    n_tokens = batch * seq_len
    if n_tokens == 0 or (n_q_heads + n_k_heads) == 0 or head_dim == 0:
        return
    if positions is not None:
        positions2 = positions.view(1, -1) if positions.dim() == 1 else positions
        position_strides = positions2.stride()
    else:
        position_strides = (0, 0)
    copy_rest = 2 * half < head_dim and q_out.data_ptr() != q.data_ptr()
    block_r = runtime.next_power_of_2(half)
    block_rest = runtime.next_power_of_2(head_dim - 2 * half)
    strides = [*q4.stride()[:3], *k4.stride()[:3], *q_out4.stride()[:3], *k_out4.stride()[:3]]
    v_strides = [*v.stride()[:3], *v_out.stride()[:3]] if v is not None else [0] * 6
    if full_table:  # a batch of 1 serves every sequence
        table_strides = [t.stride(0) if t.shape[0] > 1 else 0 for t in (cos, sin)]
        table_strides = [table_strides[0], cos.stride(1), table_strides[1], sin.stride(1)]
    else:
        table_strides = [0, cos.stride(0), 0, sin.stride(0)]

    def grid(meta):
        if meta["LOOP_HEADS"]:
            return (n_tokens, 1)
        return (n_tokens, runtime.cdiv(n_q_heads, meta["BLOCK_H"]) + runtime.cdiv(n_k_heads, meta["BLOCK_H"]))

    # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
    ROTARY.launch(
        grid,
        q4, k4, q_out4, k_out4, cos, sin, positions, v, v_out, out_rows, q_norm, k_norm,
        seq_len, n_q_heads, n_k_heads, half, head_dim,
        *strides, *v_strides,
        *table_strides, *position_strides, cos.shape[0], k_out4.shape[1], norm_eps, norm_offset,
        interleaved, inverse, full_table, copy_rest, block_r, block_rest,
        runtime.next_power_of_2(head_dim),
        shape=(n_tokens, n_q_heads + n_k_heads, head_dim),
        restore=[t for t in (q, k) if t is q_out or t is k_out])


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def _pair_halves(t, interleaved):
    """The (first, second) features of each rotation pair along the last dim of ``t``."""
    if interleaved:
        return t[..., 0::2], t[..., 1::2]
    half = t.shape[-1] // 2
    return t[..., :half], t[..., half:]


def _angles(x, cos, sin, positions, interleaved):
    """(cos_a, sin_a, cos_b, sin_b) per token, shaped to broadcast over heads: (..., 1, half)."""
    if cos.dim() == 3:  # per-token full table (B | 1, S, rot_dim); (1, T, rot_dim) for (T, H, D)
        if x.dim() == 3:
            cos, sin = cos[0], sin[0]
        cos_a, cos_b = _pair_halves(cos.unsqueeze(-2), interleaved)
        sin_a, sin_b = _pair_halves(sin.unsqueeze(-2), interleaved)
        return cos_a, sin_a, cos_b, sin_b
    seq_len = x.shape[-3]
    if positions is None:
        positions = torch.arange(seq_len, device=x.device)
    cos_t, sin_t = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)
    return cos_t, sin_t, cos_t, sin_t


def rotary_reference(q, k, cos, sin, positions=None, interleaved=False, inverse=False):
    """out_a = x_a * cos_a - x_b * sin_a, out_b = x_b * cos_b + x_a * sin_b for q and k; with
    ``inverse`` the transposed rotation, out_a = x_a * cos_a + x_b * sin_b and
    out_b = x_b * cos_b - x_a * sin_a (the backward; the inverse rotation for a half table)."""
    def rotate(x):
        cos_a, sin_a, cos_b, sin_b = _angles(x, cos, sin, positions, interleaved)
        if inverse:
            sin_a, sin_b = -sin_b, -sin_a
        rot_dim = 2 * cos_a.shape[-1]
        rotated, rest = x[..., :rot_dim], x[..., rot_dim:]
        x_a, x_b = _pair_halves(rotated, interleaved)
        out_a, out_b = x_a * cos_a - x_b * sin_a, x_b * cos_b + x_a * sin_b
        if interleaved:
            out = torch.stack([out_a, out_b], dim=-1).flatten(-2)
        else:
            out = torch.cat([out_a, out_b], dim=-1)
        return torch.cat([out, rest], dim=-1)

    return rotate(q), rotate(k)


# --------------------------------------------------------------------------------------------
# Public function and custom ops
# --------------------------------------------------------------------------------------------


def _check(q, k, cos, sin, positions, name="gemslib.apply_rotary") -> None:
    for arg, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        checks.float_tensor(name, arg, t, expected="floating-point")
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(f"{name}: q and k must both be (B, S, H, D) or (T, H, D), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on the "
                         "token dims and the head dim")
    checks.like(name, "k", k, q, "q")
    if cos.dim() not in (2, 3) or cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must both be (max_position, rot_dim // 2) or "
                         f"(B or 1, S, rot_dim), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"{name}: cos and sin must be on {q.device}, got {cos.device} and {sin.device}")
    if cos.dim() == 3:
        _check_full_table(name, q, cos, positions)
        return
    if 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"{name}: rot_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} exceeds the head "
                         f"dim {q.shape[-1]}")
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or \
                positions.dtype == torch.bool:
            raise TypeError(f"{name}: positions must be an integer tensor, got "
                            f"{getattr(positions, 'dtype', type(positions).__name__)}")
        expected = tuple(q.shape[:-2])
        if tuple(positions.shape) != expected:
            raise ValueError(f"{name}: positions must have shape {expected} (the token dims of q), "
                             f"got {tuple(positions.shape)}")
        if positions.device != q.device:
            raise ValueError(f"{name}: positions must be on {q.device}, got {positions.device}")
    elif q.shape[-3] > cos.shape[0]:
        raise ValueError(f"{name}: {q.shape[-3]} positions need cos/sin with at least that many "
                         f"rows, got {cos.shape[0]}")


def _check_full_table(name, q, cos, positions) -> None:
    """A per-token table (B or 1, S, rot_dim) for q (B, S, H, D), (1, T, rot_dim) for (T, H, D)."""
    batch, seq_len = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    if positions is not None:
        raise ValueError(f"{name}: positions index a (max_position, rot_dim // 2) table; cos and "
                         f"sin of shape {tuple(cos.shape)} are a per-token (B or 1, S, rot_dim) "
                         "table already, so positions must be None")
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(f"{name}: a per-token cos/sin table for q {tuple(q.shape)} must be "
                         f"({batch} or 1, {seq_len}, rot_dim), got {tuple(cos.shape)}")
    rot_dim = cos.shape[2]
    if rot_dim % 2 or rot_dim > q.shape[-1]:
        raise ValueError(f"{name}: rot_dim = cos.shape[2] must be even and at most the head dim "
                         f"{q.shape[-1]}, got {rot_dim}")


def _check_writes_alias_nothing(q, k, cos, sin, positions) -> None:
    """In place, q and k are written while q, k, cos, sin and positions are read by other
    programs: a shared element would be read after it was written."""
    name = "gemslib.apply_rotary"
    for arg, t in (("q", q), ("k", k)):
        if layout.may_overlap_itself(t):
            raise ValueError(f"{name}: inplace=True needs {arg} without overlapping elements "
                             "(a stride-0 dim, as from expand)")
    if layout.may_share_elements(q, k):
        raise ValueError(f"{name}: inplace=True needs q and k that do not share memory")
    for written, target in (("q", q), ("k", k)):
        for arg, t in (("cos", cos), ("sin", sin), ("positions", positions)):
            if t is not None and layout.may_share_elements(target, t):
                raise ValueError(f"{name}: inplace=True writes {written}, which shares memory "
                                 f"with {arg}")


def _kernel_runs(q, k, cos, sin) -> bool:
    return (q.dtype in runtime.KERNEL_DTYPES and runtime.on_kernel_device(q)
            and cos.dtype in runtime.KERNEL_DTYPES and sin.dtype in runtime.KERNEL_DTYPES
            and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def _check_positions_in_table(positions, n_positions: int) -> None:
    """Positions on the CPU are checked here; on a GPU, where reading them would wait for the
    device, the kernel checks them itself (a device-side assert)."""
    if positions is None or positions.device.type != "cpu" or positions.numel() == 0:
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= n_positions:
        bad = low if low < 0 else high
        raise IndexError(f"gemslib.apply_rotary: positions must be in [0, {n_positions}) (the rows "
                         f"of cos and sin), got {bad}")


def _rotary(q, k, cos, sin, positions, interleaved, inverse, q_out, k_out):
    """Kernel (or torch) into q_out/k_out, which may be q/k themselves."""
    _check_positions_in_table(positions, cos.shape[0])
    if q_out is q:  # in place (the check reads data pointers: here, not where compile traces)
        _check_writes_alias_nothing(q, k, cos, sin, positions)
    if not _kernel_runs(q, k, cos, sin):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_rot, k_rot = rotary_reference(q.to(work), k.to(work), cos.to(work), sin.to(work),
                                        positions, interleaved, inverse)
        q_out.copy_(q_rot)
        k_out.copy_(k_rot)
        return q_out, k_out
    _launch(layout.unit_last(q), layout.unit_last(k), q_out, k_out, cos, sin, positions,
            interleaved, inverse)
    return q_out, k_out


_ROTARY_CALLS = runtime.CallPlans("rotary")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor | None = None, interleaved: bool = False,
                 inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the angles of their tokens' positions; returns (q_rot, k_rot).

    q (B, S, Hq, D) or (T, Hq, D); k the same with Hk heads; any strides with a unit last
    stride (a (B, H, S, D) tensor is passed as ``x.transpose(1, 2)``, no copy). cos and sin
    (one shape, any strides with a unit last stride) are either

    * a half table (max_position, rot_dim / 2), one angle per pair, looked up at positions
      (B, S) or (T,) integers (default arange(S) for every sequence):
      out_a = x_a * cos - x_b * sin, out_b = x_b * cos + x_a * sin; or
    * a full per-token table (B or 1, S, rot_dim), as transformers computes it ((1, T, rot_dim)
      for (T, H, D) q; positions must be None), read at both features of each pair:
      out_a = x_a * cos[a] - x_b * sin[a], out_b = x_b * cos[b] + x_a * sin[b], which is
      ``x * cos + rotate_half(x) * sin`` for any table (its halves need not be equal).

    (a, b) = (i, i + rot_dim/2) (NeoX/Llama, ``interleaved=False``) or (2i, 2i + 1) (GPT-J);
    features past rot_dim pass through. With ``inplace=True`` q and k are overwritten and
    returned. Differentiable in q and k when not in place (the backward is the transposed
    rotation, one launch).
    Positions outside [0, max_position) raise IndexError for CPU tensors; on a GPU the kernel
    stops with a device-side assert (torch raises it at the next synchronisation), as torch's
    own indexing does.

    Args:
        q: (B, S, Hq, D) or (T, Hq, D) floating tensor, any strides (a non-unit last stride
            costs a copy). The kernel takes fp16, bf16 and fp32 on the kernel device (math in
            fp32); other dtypes and devices are computed by torch.
        k: (B, S, Hk, D) or (T, Hk, D), q's dtype and device.
        cos: (max_position, rot_dim / 2) half table, or (B or 1, S, rot_dim) per-token table
            ((1, T, rot_dim) for (T, H, D) q); rot_dim even, at most D; on q's device.
        sin: the same shape as cos.
        positions: (B, S) or (T,) integer tensor on q's device, each in [0, max_position), or
            None for arange(S) in every sequence; only with a half table.
        interleaved: False for the NeoX/Llama half-split pairs, True for GPT-J's (2i, 2i + 1).
        inplace: overwrite q and k (they must then have a unit last stride, not require grad,
            and share no memory with each other or with cos, sin, positions).

    Returns:
        (q_rot, k_rot) of q's and k's shapes and dtype: new tensors, or q and k when in place.

    Raises:
        TypeError: a tensor argument that is not floating-point (positions: not integer), or
            interleaved or inplace not a bool.
        ValueError: shapes, dtypes or devices that do not agree as above; in place, a layout
            or aliasing the kernel cannot write.
        IndexError: a CPU position outside [0, max_position).
        RuntimeError: ``inplace=True`` with q or k requiring grad.
    """
    args = (q, k, cos, sin, positions, interleaved)  # as given (see rms_norm)
    key, planned = _ROTARY_CALLS.replayed(*args) if inplace is False else (None, None)
    if planned is not None:
        return planned
    interleaved = checks.as_bool("gemslib.apply_rotary", "interleaved", interleaved)
    inplace = checks.as_bool("gemslib.apply_rotary", "inplace", inplace)
    _check(q, k, cos, sin, positions)
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise RuntimeError("gemslib.apply_rotary: inplace=True cannot be used on tensors "
                               "that require grad")
        if q.stride(-1) != 1 or k.stride(-1) != 1:
            raise ValueError("gemslib.apply_rotary: inplace=True needs q and k with a unit last "
                             "stride")
        if torch.compiler.is_compiling():  # the compiler must see the writes
            _rotary_inplace_op(q, k, cos, sin, positions, interleaved)
            return q, k
        return _rotary(q, k, cos, sin, positions, interleaved, False, q, k)
    if runtime.wants_custom_op(q, k, cos, sin):
        return _rotary_op(q, k, cos, sin, positions, interleaved, False)
    return _ROTARY_CALLS.plan(key, args, lambda: _rotary(
        q, k, cos, sin, positions, interleaved, False, torch.empty_like(q), torch.empty_like(k)))


def _rotary_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor | None, interleaved: bool,
                 inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation (inverse=True: the transposed rotation, the backward) into new tensors."""
    return _rotary(q, k, cos, sin, positions, interleaved, inverse, torch.empty_like(q),
                   torch.empty_like(k))


def _rotary_setup(ctx, inputs, output):
    _, _, cos, sin, positions, interleaved, inverse = inputs
    ctx.interleaved, ctx.inverse = interleaved, inverse
    ctx.save_for_backward(cos, sin, positions)


def _rotary_grad(ctx, grad_q, grad_k, ops):
    """The transposed rotation (the inverse one for a half table), through this same
    operator: differentiable too."""
    cos, sin, positions = ctx.saved_tensors
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise NotImplementedError("gemslib.apply_rotary: gradients for cos and sin are not "
                                  "implemented (they are usually fixed buffers)")
    dq, dk = ops.rotary(grad_q.contiguous(), grad_k.contiguous(), cos, sin, positions,
                        ctx.interleaved, not ctx.inverse)
    return dq, dk, None, None, None, None, None


_rotary_op = runtime.CustomOp(
    "rotary", _rotary_impl,
    fake=lambda q, k, cos, sin, positions, interleaved, inverse: (torch.empty_like(q),
                                                                  torch.empty_like(k)),
    setup_context=_rotary_setup, backward=_rotary_grad, differentiable_backward=True)


def heads_rms_normed(x, weight, eps, weight_offset=0.0):
    """Each head (last dim) of ``x`` RMS-normalised and scaled by weight_offset + its (D,)
    weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight + weight_offset)


def rotary_qk_norm_reference(q, k, cos, sin, positions, interleaved, q_weight, k_weight, eps,
                             weight_offset=0.0):
    """Each head of q and k RMS-normalised over head_dim and scaled by weight_offset + its (D,)
    weight, then rotated (the per-head q/k norm before the rotary: Qwen3's, Gemma-3's with
    weight_offset 1)."""
    return rotary_reference(heads_rms_normed(q, q_weight, eps, weight_offset),
                            heads_rms_normed(k, k_weight, eps, weight_offset),
                            cos, sin, positions, interleaved)


def _rotary_qk_norm_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor | None, interleaved: bool,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                         weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph passes' fusion of a per-head q/k RMSNorm with the rotary after it, forward
    only (compiled inference graphs): q (B, S, Hq, D), k (B, S, Hk, D), any strides with a unit
    last one; weights (D,) of q's dtype, each scaling by weight_offset + weight; a full rotary
    (rot_dim D). One launch; what the kernel does not take is computed by torch in fp32."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _check_positions_in_table(positions, cos.shape[0])
    if not (_kernel_runs(q, k, cos, sin) and q_weight.dtype == q.dtype == k_weight.dtype):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        q_rot, k_rot = rotary_qk_norm_reference(
            q.to(work), k.to(work), cos.to(work), sin.to(work), positions, interleaved,
            q_weight.to(work), k_weight.to(work), eps, weight_offset)
        return q_out.copy_(q_rot), k_out.copy_(k_rot)
    _launch(layout.unit_last(q), layout.unit_last(k), q_out, k_out, cos, sin, positions,
            interleaved, False, q_norm=q_weight.contiguous(), k_norm=k_weight.contiguous(),
            norm_eps=eps, norm_offset=weight_offset)
    return q_out, k_out


_rotary_qk_norm_op = runtime.CustomOp(
    "rotary_qk_norm", _rotary_qk_norm_impl,
    fake=lambda q, k, cos, sin, positions, interleaved, q_weight, k_weight, eps,
    weight_offset=0.0: (torch.empty_like(q), torch.empty_like(k)))


def _rotary_inplace_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         positions: torch.Tensor | None, interleaved: bool) -> None:
    """In-place rotation of q and k (``apply_rotary(..., inplace=True)`` under torch.compile)."""
    _rotary(q, k, cos, sin, positions, interleaved, False, q, k)


_rotary_inplace_op = runtime.CustomOp("rotary_", _rotary_inplace_impl, mutates_args=("q", "k"),
                                     fake=lambda q, k, cos, sin, positions, interleaved: None)


def _check_cache_write(q, k, v, cos, sin, cache_position, k_cache, v_cache, q_weight,
                       k_weight, eps, weight_offset=0.0) -> None:
    """rotary_into_cache's arguments: q (B, S, Hq, D), k and v (B, S, Hk, D), a per-token
    table, caches (B, Hk, L, D) of k's dtype, cache_position (S,) integers, no write that
    lands on what is read (or on the other cache), and both per-head norm weights (D,) of q's
    dtype with a float eps and weight_offset, or neither."""
    name = "gemslib.rotary_into_cache"
    if (q_weight is None) != (k_weight is None):
        raise ValueError(f"{name}: q_weight and k_weight go together (the per-head q/k norm), "
                         f"got {'q_weight' if k_weight is None else 'k_weight'} alone")
    for arg, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if weight is not None:
            checks.like(name, arg, weight, q, "q")
            if weight.shape != (q.shape[-1],):
                raise ValueError(f"{name}: {arg} must be ({q.shape[-1]},) (q's head dim), got "
                                 f"{tuple(weight.shape)}")
    if q_weight is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))
                                 or not eps >= 0):
        raise ValueError(f"{name}: eps must be a number >= 0, got {eps!r}")
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise TypeError(f"{name}: weight_offset must be a number, got {weight_offset!r}")
    for arg, t in (("q", q), ("cos", cos)):
        checks.float_tensor(name, arg, t, expected="floating-point")
    if q.dim() != 4 or cos.dim() != 3:
        raise ValueError(f"{name}: q and k must be (B, S, H, D) and cos, sin a per-token "
                         f"(B or 1, S, rot_dim) table, got q {tuple(q.shape)} and cos "
                         f"{tuple(cos.shape)}")
    _check(q, k, cos, sin, None, name)
    checks.float_tensor(name, "v", v, expected="floating-point")
    if v.shape != k.shape:
        raise ValueError(f"{name}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    checks.like(name, "v", v, k, "k")
    batch, seq_len, n_k_heads, head_dim = k.shape
    for arg, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.float_tensor(name, arg, cache, expected="floating-point")
        checks.like(name, arg, cache, k, "k")
        if cache.dim() != 4 or (cache.shape[0], cache.shape[1], cache.shape[3]) != \
                (batch, n_k_heads, head_dim):
            raise ValueError(f"{name}: {arg} must be (B, Hk, L, D) = ({batch}, {n_k_heads}, L, "
                             f"{head_dim}), got {tuple(cache.shape)}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have one shape")
    if not isinstance(cache_position, torch.Tensor) or cache_position.is_floating_point() or \
            cache_position.dtype == torch.bool or cache_position.shape != (seq_len,):
        raise TypeError(f"{name}: cache_position must be ({seq_len},) integers (a row of the "
                        f"caches per token), got {getattr(cache_position, 'dtype', cache_position)} "
                        f"of shape {tuple(getattr(cache_position, 'shape', ()))}")
    if cache_position.device != q.device:
        raise ValueError(f"{name}: cache_position must be on {q.device}, got "
                         f"{cache_position.device}")
    for written, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if layout.may_overlap_itself(cache):
            raise ValueError(f"{name}: {written} has overlapping elements (a stride-0 dim)")
        for arg, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin),
                       ("cache_position", cache_position)):
            if layout.may_share_elements(cache, t):
                raise ValueError(f"{name}: {written} shares memory with {arg}, which is read "
                                 "while the cache is written")
    if layout.may_share_elements(k_cache, v_cache):
        raise ValueError(f"{name}: k_cache and v_cache share memory")
    if cache_position.device.type == "cpu" and seq_len:  # on a GPU the kernel asserts
        low, high = int(cache_position.min()), int(cache_position.max())
        if low < 0 or high >= k_cache.shape[2]:
            raise IndexError(f"{name}: cache_position must be in [0, {k_cache.shape[2]}) (the "
                             f"caches' length), got {low if low < 0 else high}")


def rotary_into_cache_reference(q, k, v, cos, sin, interleaved, cache_position, k_cache, v_cache,
                                q_weight=None, k_weight=None, eps=0.0, weight_offset=0.0):
    """The rotation of q and k by a per-token table (q returned), rotated k and v written into
    the (B, Hk, L, D) caches at rows cache_position, as a static cache's update does; with the
    weights, each head of q and k RMS-normalised first (:func:`rotary_qk_norm_reference`)."""
    if q_weight is not None:
        q_rot, k_rot = rotary_qk_norm_reference(q, k, cos, sin, None, interleaved, q_weight,
                                                k_weight, eps, weight_offset)
    else:
        q_rot, k_rot = rotary_reference(q, k, cos, sin, None, interleaved)
    k_cache[:, :, cache_position] = k_rot.transpose(1, 2).to(k_cache.dtype)
    v_cache[:, :, cache_position] = v.transpose(1, 2).to(v_cache.dtype)
    return q_rot


def _rotary_into_cache_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, interleaved: bool, cache_position: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            q_weight: torch.Tensor | None = None,
                            k_weight: torch.Tensor | None = None,
                            eps: float = 0.0, weight_offset: float = 0.0) -> torch.Tensor:
    """q (B, S, Hq, D) rotated by a per-token (B or 1, S, rot_dim) table into a new tensor;
    k (B, S, Hk, D) rotated and v copied into the caches (B, Hk, L, D), token s at row
    cache_position[s]: a decode step's rotary and its static cache's update in one launch.
    With q_weight and k_weight ((D,), a full rotary), each head of q and k is RMS-normalised
    with weight_offset + its weight first (Qwen3's per-head q/k norm; Gemma-3's with offset 1)."""
    _check_cache_write(q, k, v, cos, sin, cache_position, k_cache, v_cache, q_weight, k_weight,
                       eps, weight_offset)
    q_out = torch.empty_like(q)
    normed = q_weight is not None
    rot_dim = cos.shape[-1] if cos.dim() == 3 else 2 * cos.shape[-1]
    if not _kernel_runs(q, k, cos, sin) or k_cache.stride(-1) != 1 or \
            v_cache.stride(-1) != 1 or (normed and rot_dim != q.shape[-1]):
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        weights = (q_weight.to(work), k_weight.to(work)) if normed else (None, None)
        q_rot = rotary_into_cache_reference(q.to(work), k.to(work), v, cos.to(work),
                                            sin.to(work), interleaved, cache_position,
                                            k_cache, v_cache, *weights, eps, weight_offset)
        return q_out.copy_(q_rot)
    _launch(layout.unit_last(q), layout.unit_last(k), q_out, k_cache.transpose(1, 2), cos, sin,
            None, interleaved, False, v=layout.unit_last(v), v_out=v_cache.transpose(1, 2),
            out_rows=cache_position, q_norm=q_weight.contiguous() if normed else None,
            k_norm=k_weight.contiguous() if normed else None, norm_eps=float(eps),
            norm_offset=float(weight_offset))
    return q_out


_rotary_into_cache_op = runtime.CustomOp(
    "rotary_into_cache", _rotary_into_cache_impl, mutates_args=("k_cache", "v_cache"),
    fake=lambda q, k, v, cos, sin, interleaved, cache_position, k_cache, v_cache,
    q_weight=None, k_weight=None, eps=0.0, weight_offset=0.0: torch.empty_like(q))



# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _rotary_inputs(device, dtype, rows):
    seq_len, head_dim = max(rows // 4, 1), 128
    q = torch.randn(2, seq_len, 8, head_dim, device=device, dtype=torch.float32).to(dtype)
    k = torch.randn(2, seq_len, 2, head_dim, device=device, dtype=torch.float32).to(dtype)
    angles = torch.randn(seq_len, head_dim // 2, device=device) * 3
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _full_table_inputs(device, dtype, rows):
    """(B, S, H, D) q and k with a per-token (B, S, D) table whose halves differ."""
    q, k, _, _ = _rotary_inputs(device, dtype, rows)
    angles = torch.randn(q.shape[0], q.shape[1], q.shape[-1], device=device) * 3
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _transformers_formula(q, k, cos, sin):
    """What transformers computes: x * cos + rotate_half(x) * sin, for (B, S, H, D) q and k and
    a (B, S, D) table."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return torch.cat([(x * cos + rotate_half(x) * sin).flatten() for x in (q, k)])


SELF_CHECKS = (
    SelfCheck("apply_rotary_full_table", _full_table_inputs,
              run=lambda q, k, cos, sin: torch.cat([t.flatten() for t in apply_rotary(q, k, cos, sin)]),
              reference=_transformers_formula, torch_peer=_transformers_formula),
    SelfCheck("apply_rotary", _rotary_inputs,
              run=lambda q, k, cos, sin: torch.cat([t.flatten() for t in apply_rotary(q, k, cos, sin)]),
              reference=lambda q, k, cos, sin: torch.cat(
                  [t.flatten() for t in rotary_reference(q, k, cos, sin)]),
              torch_peer=lambda q, k, cos, sin: torch.cat(
                  [t.flatten() for t in rotary_reference(q, k, cos, sin)])),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a bf16 problem per bucket
# --------------------------------------------------------------------------------------------

def _tune_problem(batch: int, seq: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128):
    def make(device):
        q = torch.randn(batch, seq, q_heads, head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(batch, seq, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
        angles = torch.rand(seq, head_dim // 2, device=device) * 6.3
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return lambda: apply_rotary(q, k, cos, sin)
    return make


TUNING = (
    # BLOCK_H heads of a token per program (LOOP_HEADS 0), or one program per token looping
    # over its heads BLOCK_H at a time (LOOP_HEADS 1)
    TuneSpace(ROTARY, tuple({"BLOCK_H": h, "LOOP_HEADS": loop, "num_warps": w}
                            for h in (4, 8, 16, 32) for loop in (0, 1) for w in (1, 2, 4, 8)),
              (TuneBucket({"tokens": 4096}, "B1 S4096 Hq32 Hk8 D128", _tune_problem(1, 4096)),
               TuneBucket(None, "B8 S4096 Hq32 Hk8 D128", _tune_problem(8, 4096)))),
)
