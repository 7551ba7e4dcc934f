"""The projections of a decode step, each in one kernel with the small ops around it folded in:
out = epilogue(prologue(x) @ W.T).

    out[m, n] = residual[m, n] + (sum_k a[m, k] W[n, k] + b[n])    (residual, b: when given)
    a = x                                                                   no prologue
    a = round(x[m, k] * r[m] * (g[k] + weight_offset)),                     norm
        r[m] = 1 / sqrt(mean_k x[m, k]^2 + eps)
    a = round(act(x[m, k]) * x[m, I + k]),  act silu, gelu (tanh) or gelu (erf)   gated

x (M, K), or (M, 2I) = [gate | up] with the gated prologue (then K = I); W (N, K) as in
``nn.Linear``; b (N,); residual (M, N); g (K,). round() is to x's dtype: the prologue is
computed in fp32 and rounded once before the products, as transformers' RMSNorm and
``act(gate) * up`` hand a 16-bit tensor to the next projection; the products accumulate in
fp32 and the epilogue adds in fp32 before the one rounding of the output.

At batch <= 16 a projection is memory-bound: its time is reading W once. The point of the
kernel is to read W at full bandwidth and to fold into that read what a transformer layer
otherwise launches on its own (docs/notes/decode.md, the plan of issue 56): the RMSNorm before
the q/k/v and gate/up projections, SwiGLU's (or GeGLU's) act(gate) * up before the down
projection, and the residual add after the o and down projections. A layer then needs about
five launches instead of nine. Each program recomputes what it needs of the activations
instead of waiting for another kernel: with the norm it first reads its rows whole (a few KB
each at decode, from L2) for their rms; with the gate it forms act(gate) * up as it loads.

Tiling: a program per BLOCK_N rows of W (per K range with SPLIT_K), all M rows of x in it, K
in BLOCK_K steps. M = 1 (and the config's GEMV 1 or 2) multiplies the W tile by the row and
sums over K (tl.sum), each K step as it comes (GEMV 1) or once after the loop from a tile of
fp32 products (GEMV 2, no barrier a step): a plain GEMV, fp32 products on the CUDA cores,
nothing padded; M in 2..16
takes tl.dot on a 16-row tile (tensor cores): a multiply-and-sum there would cost M fp32 FMAs
per weight element, near the CUDA cores' rate at Hopper's bandwidth for 16 rows, where the
tensor cores spend nothing that matters. More than 16 rows are not a decode step: they are
computed by torch (the prologue, torch.matmul, the epilogue), correct but not fused.

SPLIT_K > 1 where the column tiles alone are too few programs to keep every SM streaming W
(Llama-3.2-1B's o and down projections: N 2048 is 64 tiles of 32 rows for 132 SMs): K is split
into ranges of whole BLOCK_K steps; each program stores its fp32 partial tile, counts itself in
its column tile's arrival counter, and the last to arrive adds the partials in split order
and runs the epilogue (decode_attention's and rms_norm_linear_silu's scheme; no second
kernel). Not fp32 atomic adds into a zeroed buffer: the sum would depend on the arrival order
(not bit-reproducible), and the buffer would need zeroing before every call, where the kept
``runtime.split_scratch`` pair needs none (its counters are reset by the last program), so a
call plan replays the launch alone. The partials cost a write and a read of M x N fp32 per
split, in L2 (16 x 2048 x 4 splits x 4 B = 0.5 MB against 8 MB of weights).

STREAM_K > 0 (a config's programs an SM; 0, the shipped default, keeps the tile grid): a fixed
grid of STREAM_K x SMs programs shares the (column tile, K step) iterations equally, a share
starting or ending inside a tile. A tile grid's last wave runs on part of the GPU (Llama-3-8B's
gate/up at one row: 896 tiles of 32 rows for ~528 resident programs, 1.7 waves); here every
program streams W to the end. A tile cut between programs is summed by the last contributor to
arrive, in contributor order, with the same kept arrival counters (a cut tile's partials: one
M x BLOCK_N fp32 tile a contributor). The tuner weighs both (docs/notes/decode.md).

``torch.ops.gemslib.decode_gemv_merged`` is the op over a list of weights (and biases), as
merged_linear takes them: the graph rewrite (``gemslib.passes.decode``) puts it where a decode
step's projections of one input were merged. It computes over one view of them where they lie
end to end (merged_linear's parameters, merged once at compile time), else over a copy.

``torch.ops.gemslib.decode_gemv_rotary`` is the q/k/v projection of a decode step with what
follows it until the attention: the projection (norm prologue or none, biases), then each q
and k head rotated (full rotary, a per-token table; with Qwen3's per-head q/k norm first) and
k and v written into the static caches at the step's rows, q returned. Its own kernel reuses
the projection's loop: a program's W rows are rotation pairs, the first features then the
second ones, so the epilogue finds both halves of every pair in its tile (a head's features
r and r + D/2 are D/2 rows apart in W, and a tile of BLOCK_N consecutive rows would hold
only one of them); v's heads are pairs rotated by nothing. With the per-head norm a tile
holds whole heads. The graph rewrite puts it where rotary_into_cache reads the heads of a
decode_gemv, the layer's launches going from six to five.

The file reads top-down: kernels, launchers, references, public function and custom ops,
self-check, tuning.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemslib import checks, layout, pdl, runtime
from gemslib.fused.merged_linear import end_to_end
from gemslib.ops import rotary as rotary_ops
from gemslib.ops import silu as silu_ops
from gemslib.ops.silu import GELU_ERF, GELU_TANH, SILU, _gate_activation
from gemslib.registry import SelfCheck, TuneBucket, TuneSpace

NAME = "gemslib.decode_gemv"
MAX_ROWS = 16  # rows of x the kernel takes; more are computed by torch
# the kernel's PROLOGUE
NO_PROLOGUE, NORM, GATED = 0, 1, 2
# ``gated=`` -> ops.silu's ACTIVATION codes (NO_GATE: no gated prologue)
ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu_erf": GELU_ERF}
NO_GATE = -1
SUM_AT_END_GEMV = 2  # the config's GEMV for a one-row call summing its products after the loop
_GATED_NAMES = {code: name for name, code in ACTIVATIONS.items()}


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _rows_rstd(p_x, m_m, n_in, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """r[m] = 1 / sqrt(mean_k x[m, k]^2 + eps) in fp32 over all n_in columns of the rows at
    p_x ((BLOCK_M, 1) row pointers; m_m: the rows that exist)."""
    b_sum_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i_k in range(0, n_in, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & (o_k[None, :] < n_in),
                      other=0.0).to(tl.float32)
        b_sum_squares += tl.sum(b_x * b_x, axis=1)
    return 1.0 / tl.sqrt(b_sum_squares / n_in + eps)


@triton.jit
def _split_range(split_len, n_in, SPLIT_K: tl.constexpr):
    """[k_begin, k_end): the K range of this program's split (axis 1 of the grid), all of K
    without SPLIT_K."""
    if SPLIT_K > 1:
        k_begin = tl.program_id(1) * split_len
        k_end = tl.minimum(n_in, k_begin + split_len)
    else:
        k_begin = 0
        k_end = n_in
    return k_begin, k_end


@triton.jit
def _tile_products(x_ptr, weight_ptr, norm_weight_ptr, o_m, m_m, o_n, m_n, n_in, k_begin, k_end,
                   eps, weight_offset, stride_x_row, stride_weight_row,
                   PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SUM_AT_END: tl.constexpr):
    """(BLOCK_M, BLOCK_N) fp32: sum over k in [k_begin, k_end) of a[m, k] W[n, k] for the rows
    o_m of x (m_m: those that exist) and the rows o_n of W (m_n), a = prologue(x) (the file's
    docstring). BLOCK_M 1: products by multiply and tl.sum, each K step's summed over K as it
    comes, or (SUM_AT_END) added up in a (BLOCK_N, BLOCK_K) fp32 tile summed over K once after
    the loop: a K step's sum spans the warps, so each costs a round of shared memory and
    barriers that keeps the program's next loads from issuing, where the tile costs
    BLOCK_N x BLOCK_K / threads registers. Else tl.dot (IEEE: fp32 products in full
    precision)."""
    p_x = x_ptr + o_m.to(tl.int64)[:, None] * stride_x_row
    p_w = weight_ptr + o_n.to(tl.int64)[:, None] * stride_weight_row
    if PROLOGUE == 1:  # NORM: each program's own pass over its rows, whole, for their rms
        b_rstd = _rows_rstd(p_x, m_m, n_in, eps, BLOCK_M, BLOCK_K)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ROW_SUMMED_AT_END: tl.constexpr = BLOCK_M == 1 and SUM_AT_END
    if ROW_SUMMED_AT_END:
        b_products = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i_k in range(k_begin, k_end, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        m_k = o_k < k_end
        m_x = m_m[:, None] & m_k[None, :]
        if PROLOGUE == 2:  # GATED: a = act(gate) * up, gate in x's first n_in columns
            b_gate = tl.load(p_x + o_k[None, :], mask=m_x, other=0.0)
            b_up = tl.load(p_x + n_in + o_k[None, :], mask=m_x, other=0.0)
            b_act, _ = _gate_activation(b_gate.to(tl.float32), ACTIVATION)
            b_a = (b_act * b_up.to(tl.float32)).to(b_gate.dtype)
        elif PROLOGUE == 1:  # NORM: a = x * r * (g + weight_offset)
            b_x = tl.load(p_x + o_k[None, :], mask=m_x, other=0.0)
            b_g = tl.load(norm_weight_ptr + o_k, mask=m_k, other=0.0).to(tl.float32) \
                + weight_offset
            b_a = (b_x.to(tl.float32) * b_rstd[:, None] * b_g[None, :]).to(b_x.dtype)
        else:
            b_a = tl.load(p_x + o_k[None, :], mask=m_x, other=0.0)
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        if ROW_SUMMED_AT_END:  # one row, its products summed after the loop
            b_products += b_w.to(tl.float32) * b_a.to(tl.float32)
        elif BLOCK_M == 1:  # one row: (BLOCK_N, BLOCK_K) products summed over K
            b_acc += tl.sum(b_w.to(tl.float32) * b_a.to(tl.float32), axis=1)[None, :]
        elif IEEE:
            b_acc = tl.dot(b_a, tl.trans(b_w), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_a, tl.trans(b_w), b_acc)
    if ROW_SUMMED_AT_END:
        b_acc = tl.sum(b_products, axis=1)[None, :]
    return b_acc


@triton.jit
def _split_k_total(b_acc, part_ptr, arrivals_ptr, i_tile, o_m, o_n, m_tile, n_rows, n_out,
                   n_splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the tile's sum over the splits, whether this program holds it): each program stores
    its fp32 partial tile (columns o_n) in part (n_splits, n_rows, n_out) and counts itself in
    arrivals[i_tile] (int32, zero between launches); the last to arrive adds the splits in
    order (the result does not depend on the arrival order) and puts the counter back to 0."""
    o_part_row = (tl.program_id(1) * n_rows + o_m).to(tl.int64)
    tl.store(part_ptr + o_part_row[:, None] * n_out + o_n[None, :], b_acc, mask=m_tile)
    tl.debug_barrier()  # every thread's stores issued before this program counts itself
    # acq_rel: the stores above are visible to whichever program arrives last
    finish = tl.atomic_add(arrivals_ptr + i_tile, 1, sem="acq_rel") == n_splits - 1
    if finish:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_s in range(0, n_splits):  # in split order: deterministic sums
            o_s_row = (i_s * n_rows + o_m).to(tl.int64)
            # .cg: the other programs' partials from L2, never from a stale L1 line
            b_acc += tl.load(part_ptr + o_s_row[:, None] * n_out + o_n[None, :],
                             mask=m_tile, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + i_tile, 0)  # ready for the next launch
    return b_acc, finish


@triton.jit
def _stream_k_total(b_acc, part_ptr, arrivals_ptr, i_tile, i_contrib, n_contrib, max_contrib,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the tile's sum over its contributors, whether this program holds it) for a stream-K
    share that holds only part of column tile i_tile's K steps: the program stores its fp32
    partial tile in part[i_tile, i_contrib] ((tiles, max_contrib, BLOCK_M, BLOCK_N)) and counts
    itself in arrivals[i_tile] (int32, zero between launches); the last of the tile's n_contrib
    contributors to arrive adds the partials in contributor order (deterministic) and puts the
    counter back to 0."""
    BLOCK_TILE: tl.constexpr = BLOCK_M * BLOCK_N
    o_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    p_part = part_ptr + (i_tile * max_contrib).to(tl.int64) * BLOCK_TILE + o_tile
    tl.store(p_part + i_contrib * BLOCK_TILE, b_acc)
    tl.debug_barrier()  # every thread's stores issued before this program counts itself
    # acq_rel: the stores above are visible to whichever program arrives last
    finish = tl.atomic_add(arrivals_ptr + i_tile, 1, sem="acq_rel") == n_contrib - 1
    if finish:
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_c in range(0, n_contrib):  # in contributor order: deterministic sums
            # .cg: the other programs' partials from L2, never from a stale L1 line
            b_acc += tl.load(p_part + i_c * BLOCK_TILE, cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + i_tile, 0)  # ready for the next launch
    return b_acc, finish


@triton.jit
def _gemv_epilogue(b_acc, bias_ptr, residual_ptr, out_ptr, o_m, o_n, m_n, m_tile,
                   stride_residual_row, stride_out_row):
    """out[o_m, o_n] = b_acc (+ bias[o_n]) (+ residual[o_m, o_n]), fp32, rounded once."""
    if bias_ptr is not None:
        b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if residual_ptr is not None:
        b_acc = tl.load(residual_ptr + o_m.to(tl.int64)[:, None] * stride_residual_row
                        + o_n[None, :], mask=m_tile, other=0.0).to(tl.float32) + b_acc
    tl.store(out_ptr + o_m.to(tl.int64)[:, None] * stride_out_row + o_n[None, :],
             b_acc.to(out_ptr.dtype.element_ty), mask=m_tile)


@triton.jit
def _decode_gemv_kernel(
    x_ptr, weight_ptr, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr, part_ptr, arrivals_ptr,
    n_rows, n_out, n_in, eps, weight_offset, split_len, n_splits, max_contrib,
    stride_x_row, stride_weight_row, stride_residual_row, stride_out_row,
    PROLOGUE: tl.constexpr, ACTIVATION: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    SUM_AT_END: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, STREAM_K: tl.constexpr = 0, PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = False,
):
    """Grid (cdiv(n_out, BLOCK_N), n_splits): rows [i_n BLOCK_N, +BLOCK_N) of W (n_out, n_in)
    against all n_rows (<= BLOCK_M) rows of x, unit last strides; out (n_rows, n_out). x is
    (n_rows, n_in), or (n_rows, 2 n_in) = [gate | up] with PROLOGUE GATED (ACTIVATION: ops.silu's
    SILU, GELU_TANH or GELU_ERF); norm_weight (n_in,) is read with PROLOGUE NORM only; bias
    (n_out,) and residual (n_rows, n_out) are added where not None.

    SPLIT_K > 1: axis 1 splits K into n_splits ranges of split_len (whole BLOCK_K steps), the
    last program of a column tile to arrive adds them and runs the epilogue
    (:func:`_split_k_total`, part (n_splits, n_rows, n_out) fp32 and arrivals (tiles,) int32
    zeroed); with SPLIT_K 1, part and arrivals are None.

    STREAM_K > 0 (SPLIT_K 1): grid (n_splits,), n_splits programs (STREAM_K an SM) sharing the
    T = tiles x split_len iterations equally (iteration i: K step i % split_len of column tile
    i // split_len; split_len = cdiv(n_in, BLOCK_K), n_splits <= T): program p takes [p T /
    n_splits, (p + 1) T / n_splits), so every SM streams W to the end instead of the last
    wave of tiles running on part of them. A tile one program takes whole is finished by it;
    one cut between programs is summed by the last of them to arrive (:func:`_stream_k_total`,
    part (tiles, max_contrib, BLOCK_M, BLOCK_N) fp32, arrivals (tiles,) int32 zeroed).
    SUM_AT_END: with BLOCK_M 1, the products summed over K once after the loop
    (:func:`_tile_products`); no effect on the tl.dot tile.
    PDL: launched dependent (runtime.dependent_launch_here), it first waits for the kernel
    before it on the stream; PDL_EARLY (gemslib.pdl): a tile grid's program first asks L2 for
    its first K step of W, and after the wait lets the next kernel launch."""
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    if STREAM_K > 0:
        pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
        k_steps = split_len
        total_iters = tl.cdiv(n_out, BLOCK_N) * k_steps
        i_p = tl.program_id(0)
        # a program's index times the iterations' count can pass 2^31 (1056 programs x 2M
        # iterations: a weight of a million rows): int64 for the products
        it = ((i_p.to(tl.int64) * total_iters) // n_splits).to(tl.int32)
        it_end = (((i_p + 1).to(tl.int64) * total_iters) // n_splits).to(tl.int32)
        while it < it_end:
            i_tile = it // k_steps
            tile_begin = i_tile * k_steps
            seg_end = tl.minimum(it_end, tile_begin + k_steps)
            o_n = i_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            m_n = o_n < n_out
            m_tile = m_m[:, None] & m_n[None, :]
            b_acc = _tile_products(x_ptr, weight_ptr, norm_weight_ptr, o_m, m_m, o_n, m_n, n_in,
                                   (it - tile_begin) * BLOCK_K,
                                   tl.minimum(n_in, (seg_end - tile_begin) * BLOCK_K), eps,
                                   weight_offset, stride_x_row, stride_weight_row, PROLOGUE,
                                   ACTIVATION, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, SUM_AT_END)
            if (it == tile_begin) & (seg_end == tile_begin + k_steps):
                _gemv_epilogue(b_acc, bias_ptr, residual_ptr, out_ptr, o_m, o_n, m_n, m_tile,
                               stride_residual_row, stride_out_row)
            else:
                # the program holding iteration j is ((j + 1) n_splits - 1) // total_iters
                first = (((tile_begin + 1).to(tl.int64) * n_splits - 1) // total_iters).to(
                    tl.int32)
                last = (((tile_begin + k_steps).to(tl.int64) * n_splits - 1) // total_iters).to(
                    tl.int32)
                b_acc, finish = _stream_k_total(b_acc, part_ptr, arrivals_ptr, i_tile,
                                                i_p - first, last - first + 1, max_contrib,
                                                BLOCK_M, BLOCK_N)
                if finish:
                    _gemv_epilogue(b_acc, bias_ptr, residual_ptr, out_ptr, o_m, o_n, m_n,
                                   m_tile, stride_residual_row, stride_out_row)
            it = seg_end
    else:
        i_n = tl.program_id(0)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < n_out
        k_begin, k_end = _split_range(split_len, n_in, SPLIT_K)
        if PDL_EARLY:  # W is written by no kernel before it
            pdl.prefetch_rows_to_l2(weight_ptr, o_n, m_n, k_begin, k_end, stride_weight_row,
                                    BLOCK_K)
        pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
        b_acc = _tile_products(x_ptr, weight_ptr, norm_weight_ptr, o_m, m_m, o_n, m_n, n_in,
                               k_begin, k_end, eps, weight_offset, stride_x_row,
                               stride_weight_row, PROLOGUE, ACTIVATION, IEEE, BLOCK_M, BLOCK_N,
                               BLOCK_K, SUM_AT_END)
        m_tile = m_m[:, None] & m_n[None, :]
        finish = True
        if SPLIT_K > 1:
            b_acc, finish = _split_k_total(b_acc, part_ptr, arrivals_ptr, i_n, o_m, o_n, m_tile,
                                           n_rows, n_out, n_splits, BLOCK_M, BLOCK_N)
        if finish:
            _gemv_epilogue(b_acc, bias_ptr, residual_ptr, out_ptr, o_m, o_n, m_n, m_tile,
                           stride_residual_row, stride_out_row)


# GEMV 1: a call of one row takes the multiply-and-sum products (BLOCK_M 1), summed over K each
# step; GEMV 2 (SUM_AT_END_GEMV) those products summed once after the K loop; GEMV 0 the 16-row
# tl.dot tile as more rows do; the launcher decides BLOCK_M from it and the rows
DECODE_GEMV = runtime.TunedKernel(
    "decode_gemv", "decode_gemv", _decode_gemv_kernel,
    tunables=("BLOCK_N", "BLOCK_K", "SPLIT_K", "STREAM_K"), launcher_knobs=("GEMV",),
    shape_keys=("rows", "n", "k", "elem_bytes"), dependent_launch=True)


@triton.jit
def _decode_gemv_rotary_kernel(
    x_ptr, weight_ptr, bias_ptr, norm_weight_ptr, q_out_ptr, part_ptr, arrivals_ptr,
    cos_ptr, sin_ptr, cache_position_ptr, k_cache_ptr, v_cache_ptr, q_norm_ptr, k_norm_ptr,
    n_rows, n_out, n_in, eps, weight_offset, split_len, n_splits,
    seq_len, n_q_heads, n_kv_heads, head_dim, n_cache_rows, qk_eps, qk_offset,
    stride_x_row, stride_weight_row, stride_q_out_row,
    stride_cos_b, stride_cos_s, stride_sin_b, stride_sin_s,
    stride_k_cache_b, stride_k_cache_h, stride_k_cache_l,
    stride_v_cache_b, stride_v_cache_h, stride_v_cache_l,
    PROLOGUE: tl.constexpr, IEEE: tl.constexpr, INTERLEAVED: tl.constexpr,
    HEAD_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, SUM_AT_END: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
):
    """A decode step's q/k/v projection with its rotary and its static cache's update: y =
    prologue(x) @ W.T (+ bias), W (n_out, n_in) the q, k and v weights end to end, n_out =
    (n_q_heads + 2 n_kv_heads) head_dim; y's q heads rotated into q_out (n_rows, n_q_heads
    head_dim), its k heads rotated and its v heads as they are written into the caches
    (B, n_kv_heads, n_cache_rows, head_dim) at row cache_position[s] of row m = b seq_len + s.
    PROLOGUE: NO_PROLOGUE or NORM, as in :func:`_decode_gemv_kernel`.

    A program takes BLOCK_N / 2 rotation pairs (features (r, r + D/2) of a head, or (2r,
    2r + 1) INTERLEAVED): its W rows are the pairs' first features then their second, so its
    tile holds both halves of each pair; v's heads are pairs too, rotated by nothing. y is
    rounded to x's dtype (the projection's output), the rotation computed in fp32 from the
    per-token tables cos, sin (B | 1, seq_len, head_dim) and rounded once, as rotary_into_cache
    does. HEAD_PAIRS > 0 (= head_dim / 2, a power of 2 dividing BLOCK_N / 2): each q and k head
    is first RMS-normalised over its features and scaled by qk_offset + q_norm (k_norm)
    (Qwen3's per-head norm; the tile then holds whole heads). A cache_position outside
    [0, n_cache_rows) is a device-side assert and no write. Split-K and PDL as in
    :func:`_decode_gemv_kernel`."""
    BLOCK_P: tl.constexpr = BLOCK_N // 2
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    n_half = head_dim // 2
    # tile column c: pair i_n BLOCK_P + c % BLOCK_P, its first feature (c < BLOCK_P) or second
    o_c = tl.arange(0, BLOCK_N)
    o_n, m_n = _pair_rows(i_n * BLOCK_P + o_c % BLOCK_P, o_c // BLOCK_P, n_half, head_dim,
                          n_out, INTERLEAVED)
    k_begin, k_end = _split_range(split_len, n_in, SPLIT_K)
    if PDL_EARLY:
        pdl.prefetch_rows_to_l2(weight_ptr, o_n, m_n, k_begin, k_end, stride_weight_row,
                                BLOCK_K)
    pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
    b_acc = _tile_products(x_ptr, weight_ptr, norm_weight_ptr, o_m, m_m, o_n, m_n, n_in,
                           k_begin, k_end, eps, weight_offset, stride_x_row, stride_weight_row,
                           PROLOGUE, 0, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, SUM_AT_END)
    finish = True
    if SPLIT_K > 1:
        b_acc, finish = _split_k_total(b_acc, part_ptr, arrivals_ptr, i_n, o_m, o_n,
                                       m_m[:, None] & m_n[None, :], n_rows, n_out, n_splits,
                                       BLOCK_M, BLOCK_N)
    if finish:
        if bias_ptr is not None:
            b_acc += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        # the projection's output, rounded as it would be stored, then its pairs' two halves
        b_y = b_acc.to(q_out_ptr.dtype.element_ty).to(tl.float32)
        b_a, b_b = tl.split(tl.permute(tl.reshape(b_y, [BLOCK_M, 2, BLOCK_P]), (0, 2, 1)))
        o_p = i_n * BLOCK_P + tl.arange(0, BLOCK_P)
        o_head = o_p // n_half
        o_a, m_p = _pair_rows(o_p, 0, n_half, head_dim, n_out, INTERLEAVED)
        o_feat_a = o_a - o_head * head_dim
        o_feat_b = o_feat_a + (1 if INTERLEAVED else n_half)
        is_q = o_head < n_q_heads
        is_v = o_head >= n_q_heads + n_kv_heads
        is_k = (o_head >= n_q_heads) & (o_head < n_q_heads + n_kv_heads)
        if HEAD_PAIRS > 0:  # q's and k's heads RMS-normalised first
            b_a, b_b = _tile_heads_normed(b_a, b_b, o_feat_a, o_feat_b, m_p, is_q, is_v,
                                          q_norm_ptr, k_norm_ptr, head_dim, qk_eps, qk_offset,
                                          BLOCK_M, BLOCK_P, HEAD_PAIRS)
        # each row's token: its sequence, its angles, its cache row
        o_b = (o_m // seq_len).to(tl.int64)
        o_s = (o_m % seq_len).to(tl.int64)
        m_rot = m_m[:, None] & (m_p & ~is_v)[None, :]
        p_cos = cos_ptr + o_b[:, None] * stride_cos_b + o_s[:, None] * stride_cos_s
        p_sin = sin_ptr + o_b[:, None] * stride_sin_b + o_s[:, None] * stride_sin_s
        b_cos_a = tl.load(p_cos + o_feat_a[None, :], mask=m_rot, other=1.0).to(tl.float32)
        b_cos_b = tl.load(p_cos + o_feat_b[None, :], mask=m_rot, other=1.0).to(tl.float32)
        b_sin_a = tl.load(p_sin + o_feat_a[None, :], mask=m_rot, other=0.0).to(tl.float32)
        b_sin_b = tl.load(p_sin + o_feat_b[None, :], mask=m_rot, other=0.0).to(tl.float32)
        dtype = q_out_ptr.dtype.element_ty
        b_out_a = (b_a * b_cos_a - b_b * b_sin_a).to(dtype)
        b_out_b = (b_b * b_cos_b + b_a * b_sin_b).to(dtype)

        p_q = q_out_ptr + o_m.to(tl.int64)[:, None] * stride_q_out_row \
            + (o_head * head_dim)[None, :]
        m_q = m_m[:, None] & (m_p & is_q)[None, :]
        tl.store(p_q + o_feat_a[None, :], b_out_a, mask=m_q)
        tl.store(p_q + o_feat_b[None, :], b_out_b, mask=m_q)
        b_row = tl.load(cache_position_ptr + o_s, mask=m_m, other=0).to(tl.int64)
        m_row = (b_row >= 0) & (b_row < n_cache_rows)
        tl.device_assert(m_row | ~m_m, "gemslib.decode_gemv_rotary: cache_position must be "
                                       "in [0, the cache's length)")
        m_row = m_row & m_m
        o_kv_head = tl.where(is_k, o_head - n_q_heads, o_head - n_q_heads - n_kv_heads)
        o_kv_head = tl.maximum(o_kv_head, 0).to(tl.int64)
        p_k = k_cache_ptr + o_b[:, None] * stride_k_cache_b + b_row[:, None] * stride_k_cache_l \
            + (o_kv_head * stride_k_cache_h)[None, :]
        p_v = v_cache_ptr + o_b[:, None] * stride_v_cache_b + b_row[:, None] * stride_v_cache_l \
            + (o_kv_head * stride_v_cache_h)[None, :]
        m_k = m_row[:, None] & (m_p & is_k)[None, :]
        m_v = m_row[:, None] & (m_p & is_v)[None, :]
        tl.store(p_k + o_feat_a[None, :], b_out_a, mask=m_k)
        tl.store(p_k + o_feat_b[None, :], b_out_b, mask=m_k)
        tl.store(p_v + o_feat_a[None, :], b_out_a, mask=m_v)
        tl.store(p_v + o_feat_b[None, :], b_out_b, mask=m_v)


@triton.jit
def _pair_rows(o_pair, second, n_half, head_dim, n_out, INTERLEAVED: tl.constexpr):
    """(the rows of y, i.e. of W, holding feature ``second`` (0 or 1) of rotation pairs
    o_pair, the mask of the pairs that exist): pair p is (r, r + D/2) of head p // (D/2), or
    (2r, 2r + 1) INTERLEAVED, r = p % (D/2)."""
    o_head = o_pair // n_half
    o_r = o_pair - o_head * n_half
    if INTERLEAVED:
        o_feat = 2 * o_r + second
    else:
        o_feat = o_r + second * n_half
    return o_head * head_dim + o_feat, o_pair < n_out // 2


@triton.jit
def _tile_heads_normed(b_a, b_b, o_feat_a, o_feat_b, m_p, is_q, is_v, q_norm_ptr, k_norm_ptr,
                       head_dim, qk_eps, qk_offset, BLOCK_M: tl.constexpr,
                       BLOCK_P: tl.constexpr, HEAD_PAIRS: tl.constexpr):
    """The pairs' halves (BLOCK_M, BLOCK_P), whole heads of HEAD_PAIRS pairs, each q and k
    head RMS-normalised over its features and scaled by qk_offset + its (head_dim,) weight;
    v's heads as they are."""
    HEADS: tl.constexpr = BLOCK_P // HEAD_PAIRS
    b_squares = tl.sum(tl.reshape(b_a * b_a + b_b * b_b, [BLOCK_M, HEADS, HEAD_PAIRS]), axis=2)
    b_rstd = 1.0 / tl.sqrt(b_squares / head_dim + qk_eps)
    b_rstd = tl.reshape(tl.broadcast_to(b_rstd[:, :, None], [BLOCK_M, HEADS, HEAD_PAIRS]),
                        [BLOCK_M, BLOCK_P])
    m_q = m_p & is_q
    m_k = m_p & ~is_q & ~is_v
    b_w_a = tl.where(is_q, tl.load(q_norm_ptr + o_feat_a, mask=m_q, other=0.0),
                     tl.load(k_norm_ptr + o_feat_a, mask=m_k, other=0.0)).to(tl.float32)
    b_w_b = tl.where(is_q, tl.load(q_norm_ptr + o_feat_b, mask=m_q, other=0.0),
                     tl.load(k_norm_ptr + o_feat_b, mask=m_k, other=0.0)).to(tl.float32)
    b_scale_a = tl.where(is_v[None, :], 1.0, b_rstd * (b_w_a + qk_offset)[None, :])
    b_scale_b = tl.where(is_v[None, :], 1.0, b_rstd * (b_w_b + qk_offset)[None, :])
    return b_a * b_scale_a, b_b * b_scale_b


# the q/k/v projection with its rotary and cache write: BLOCK_N W rows a program (BLOCK_N / 2
# rotation pairs; with the per-head q/k norm, the launcher makes it whole heads)
DECODE_GEMV_ROTARY = runtime.TunedKernel(
    "decode_gemv", "decode_gemv_rotary", _decode_gemv_rotary_kernel,
    tunables=("BLOCK_N", "BLOCK_K", "SPLIT_K"), launcher_knobs=("GEMV",),
    shape_keys=("rows", "n", "k", "elem_bytes"), device_asserts=True, dependent_launch=True)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The kernel computes the call: 1 to MAX_ROWS rows, a non-empty W, kernel dtypes on the
    kernel device (bf16 not under the interpreter, whose bf16 tl.dot is wrong)."""
    return 0 < x.shape[0] <= MAX_ROWS and weight.numel() > 0 and \
        runtime.dot_kernel_runs(x, weight, *others)


def _tiling(x: torch.Tensor, meta: dict, n_tiles: int, n_out: int, n_in: int):
    """(BLOCK_M, split_len, n_splits, max_contrib, arrivals, part) of a launch of ``n_tiles``
    column tiles of W (n_out, n_in) against x's M rows with the config ``meta``: one row by
    multiply-and-sum where its GEMV says so, else the 16-row (or wider) tl.dot tile; K in
    SPLIT_K ranges of whole BLOCK_K steps, with the kept split scratch (arrival counters,
    M x n_out fp32 partials a split), or none. With STREAM_K (programs an SM; absent or 0:
    the tile grid), split_len is a tile's K steps and n_splits the programs, which share the
    tiles' K steps equally (``_decode_gemv_kernel``), and max_contrib the most programs a
    tile's steps can meet, partial tiles' room in the scratch."""
    n_rows = x.shape[0]
    block_m = 1 if n_rows == 1 and meta["GEMV"] else max(16, runtime.next_power_of_2(n_rows))
    if meta.get("STREAM_K", 0) > 0:
        k_steps = runtime.cdiv(n_in, meta["BLOCK_K"])
        total_iters = n_tiles * k_steps
        programs = min(total_iters, meta["STREAM_K"] * runtime.multiprocessor_count(
            x.device.index if x.device.type == "cuda" else 0))
        # a tile's k_steps iterations meet at most this many shares of >= T // P iterations
        max_contrib = runtime.cdiv(k_steps, total_iters // programs) + 1
        arrivals, part = runtime.split_scratch(x.device, n_tiles,
                                               n_tiles * max_contrib * block_m * meta["BLOCK_N"])
        return block_m, k_steps, programs, max_contrib, arrivals, part
    if meta["SPLIT_K"] == 1:
        return block_m, n_in, 1, 0, None, None
    split_len = runtime.cdiv(runtime.cdiv(n_in, meta["SPLIT_K"]), meta["BLOCK_K"]) \
        * meta["BLOCK_K"]
    n_splits = runtime.cdiv(n_in, split_len)
    arrivals, part = runtime.split_scratch(x.device, n_tiles, n_splits * n_rows * n_out)
    return block_m, split_len, n_splits, 0, arrivals, part


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
            weight_offset: float, activation: int) -> torch.Tensor:
    """(M, N) in x's dtype; inputs validated and taken by the kernel (``_kernel_takes``)."""
    n_rows = x.shape[0]
    n_out, n_in = weight.shape
    out = torch.empty((n_rows, n_out), dtype=x.dtype, device=x.device)
    # elem_bytes: fp32 tiles take twice the shared memory and registers of 16-bit ones
    shape = (n_rows, n_out, n_in, x.element_size())
    config = DECODE_GEMV.planned_config(shape)
    n_tiles = runtime.cdiv(n_out, config.meta_dict["BLOCK_N"])
    block_m, split_len, n_splits, max_contrib, arrivals, part = _tiling(
        x, config.meta_dict, n_tiles, n_out, n_in)
    prologue = NORM if norm_weight is not None else GATED if activation != NO_GATE \
        else NO_PROLOGUE
    grid = (n_splits, 1) if config.meta_dict.get("STREAM_K", 0) > 0 else (n_tiles, n_splits)
    # positional (TunedKernel.launch forwards them so), in the kernel's order: tensors; sizes
    # and scalars; strides; flags and BLOCK_M
    DECODE_GEMV.launch(
        lambda meta: grid,
        x, weight, bias.contiguous() if bias is not None else None, residual,
        norm_weight.contiguous() if norm_weight is not None else None, out, part, arrivals,
        n_rows, n_out, n_in, eps, weight_offset, split_len, n_splits, max_contrib,
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0),
        prologue, max(activation, 0), x.dtype == torch.float32, block_m,
        config.meta_dict["GEMV"] == SUM_AT_END_GEMV, shape=shape, config=config)
    return out


# --------------------------------------------------------------------------------------------
# Plain PyTorch: the reference (tests run it in float64) and the path of the calls the
# kernel does not take
# --------------------------------------------------------------------------------------------


def _prologue(x, norm_weight, eps, weight_offset, gated: str | None):
    if norm_weight is not None:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) \
            * (norm_weight + weight_offset)
    if gated == "silu":
        return silu_ops.silu_and_mul_reference(x)
    if gated is not None:
        return silu_ops.gelu_and_mul_reference(x, "tanh" if gated == "gelu_tanh" else "none")
    return x


def decode_gemv_reference(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-6,
                          weight_offset=0.0, gated=None):
    """decode_gemv's arithmetic in x's dtype, nothing rounded between the steps."""
    out = F.linear(_prologue(x, norm_weight, eps, weight_offset, gated), weight, bias)
    return out if residual is None else residual + out


def _torch_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                   weight_offset: float, activation: int) -> torch.Tensor:
    """The call in torch, rounded where the kernel rounds and once more: the prologue in fp32
    (fp64 for fp64) rounded to x's dtype, torch.matmul in x's dtype, the epilogue in fp32."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    activations = _prologue(x.to(work), norm_weight.to(work) if norm_weight is not None else None,
                            eps, weight_offset, _GATED_NAMES.get(activation)).to(x.dtype)
    out = torch.matmul(activations, weight.t()).to(work)
    if bias is not None:
        out = out + bias.to(work)
    if residual is not None:
        out = residual.to(work) + out
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Public function, custom op, autograd
# --------------------------------------------------------------------------------------------


def _activation_code(gated) -> int:
    if gated is None:
        return NO_GATE
    if not isinstance(gated, str):
        raise TypeError(f"{NAME}: gated must be None or one of {', '.join(map(repr, ACTIVATIONS))}"
                        f", got {type(gated).__name__}")
    if gated not in ACTIVATIONS:
        raise ValueError(f"{NAME}: gated must be None or one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}, got {gated!r}")
    return ACTIVATIONS[gated]


def _check(x, weight, bias, residual, norm_weight, activation: int) -> None:
    checks.float_tensor(NAME, "x", x, expected="floating-point")
    for arg, t in (("weight", weight), ("bias", bias), ("residual", residual),
                   ("norm_weight", norm_weight)):
        if t is None and arg != "weight":
            continue
        checks.float_tensor(NAME, arg, t, expected="floating-point")
        checks.like(NAME, arg, t, x, "x")
    if x.dim() != 2:
        raise ValueError(f"{NAME}: x must be 2-d (M, K), got shape {tuple(x.shape)}")
    if norm_weight is not None and activation != NO_GATE:
        raise ValueError(f"{NAME}: norm_weight and gated are mutually exclusive (the norm "
                         f"prologue normalises x, the gated one reads x as [gate | up]); got "
                         f"both, with gated={_GATED_NAMES[activation]!r}")
    n_in = x.shape[1]
    if activation != NO_GATE:
        if n_in % 2:
            raise ValueError(f"{NAME}: with gated={_GATED_NAMES[activation]!r}, x must be "
                             f"(M, 2I) = [gate | up], an even last dim; got shape "
                             f"{tuple(x.shape)}")
        n_in //= 2
    if weight.dim() != 2 or weight.shape[1] != n_in:
        what = "x.shape[1] // 2" if activation != NO_GATE else "x.shape[1]"
        raise ValueError(f"{NAME}: weight must be (N, K) with K = {what} = {n_in}, got shape "
                         f"{tuple(weight.shape)}")
    n_out = weight.shape[0]
    if norm_weight is not None and norm_weight.shape != (n_in,):
        raise ValueError(f"{NAME}: norm_weight must be ({n_in},) to match x's last dim, got "
                         f"shape {tuple(norm_weight.shape)}")
    if bias is not None and bias.shape != (n_out,):
        raise ValueError(f"{NAME}: bias must be ({n_out},) to match weight's rows, got shape "
                         f"{tuple(bias.shape)}")
    if residual is not None and residual.shape != (x.shape[0], n_out):
        raise ValueError(f"{NAME}: residual must be (M, N) = ({x.shape[0]}, {n_out}) like the "
                         f"output, got shape {tuple(residual.shape)}")
    for arg, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{NAME}: {arg}'s last dim must be contiguous (stride 1), got "
                             f"strides {t.stride()}")


def _decode_gemv_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                      eps: float, weight_offset: float, activation: int) -> torch.Tensor:
    """The kernel where it takes the call; torch (``_torch_forward``) elsewhere: also where a
    compiled graph hands the op a last dim that is not contiguous (the public function refuses
    one; a graph's layouts are inductor's choice)."""
    if _kernel_takes(x, weight, bias, residual, norm_weight) and \
            _unit_last_strides(x, weight, residual):
        return _launch(x, weight, bias, residual, norm_weight, eps, weight_offset, activation)
    return _torch_forward(x, weight, bias, residual, norm_weight, eps, weight_offset, activation)


def _unit_last_strides(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.shape[-1] <= 1 or t.stride(-1) == 1 for t in tensors)


_CALLS = runtime.CallPlans("decode_gemv")


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, weight_offset: float = 0.0,
                gated: str | None = None) -> torch.Tensor:
    """``residual + F.linear(prologue(x), weight, bias)`` in one kernel, for decode's few rows.

    The prologue is none, RMSNorm (``norm_weight``: ``x * rsqrt(mean(x**2, -1) + eps) *
    (norm_weight + weight_offset)``) or a gate (``gated``: ``act(x[:, :I]) * x[:, I:]``), computed
    in fp32 and rounded to x's dtype before the products; products and epilogue in fp32, one
    rounding of the output. Up to 16 rows run one Triton kernel that reads the weight once;
    more rows are computed by torch (the prologue, torch.matmul, the epilogue). Differentiable
    in every tensor argument (the backward uses torch).

    Args:
        x: (M, K) floating tensor, or (M, 2I) = [gate | up] with ``gated`` (then K = I); unit
            last stride, any row stride. The kernel takes fp16, bf16 and fp32 on the kernel
            device; other dtypes and devices are computed by torch, in fp32 (fp64 for fp64).
        weight: (N, K), as ``nn.Linear.weight``; x's dtype and device, unit last stride.
        bias: (N,) or None; x's dtype and device.
        residual: (M, N) or None, added last; x's dtype and device, unit last stride.
        norm_weight: (K,) RMSNorm weight g, or None (no norm); x's dtype and device.
        eps: added to mean(x**2) before the square root; a float or 0-d tensor.
        weight_offset: added to norm_weight (in fp32) before it scales: 1.0 for Gemma's
            ``(1 + g)``; needs a norm_weight.
        gated: None, or the gate's activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or
            ``"gelu_erf"`` (GeGLU, F.gelu's tanh and erf forms). Not with norm_weight.

    Returns:
        (M, N) contiguous tensor of x's dtype.

    Raises:
        TypeError: a tensor argument that is not a floating-point tensor, eps or weight_offset
            not a real number, gated not a string.
        ValueError: x not 2-d, shapes that do not agree as above, another dtype or device than
            x's, a last dim with a stride other than 1, an unknown gated, gated and norm_weight
            together, or weight_offset without norm_weight.
    """
    activation = _activation_code(gated)
    eps = checks.as_float(NAME, "eps", eps)
    weight_offset = checks.as_float(NAME, "weight_offset", weight_offset)
    # a decided signature replays: the checks and the choice cost more host time than a
    # decode step's GEMV takes on the GPU. More than 16 rows are a kept route to torch
    args = (x, weight, bias, residual, norm_weight, eps, weight_offset, activation)
    key, planned = _CALLS.replayed(*args)
    if planned is not None:
        return planned
    _check(x, weight, bias, residual, norm_weight, activation)
    if norm_weight is None and weight_offset != 0.0:
        raise ValueError(f"{NAME}: weight_offset scales by (norm_weight + weight_offset) and "
                         f"needs a norm_weight; got norm_weight=None with "
                         f"weight_offset={weight_offset}")
    if runtime.wants_custom_op(x, weight, bias, residual, norm_weight):
        return _decode_gemv_op(*args)
    if key is None:
        return _decode_gemv_impl(*args)
    if not _kernel_takes(x, weight, bias, residual, norm_weight):
        if x.shape[0] > MAX_ROWS:
            _CALLS.keep(key, _torch_forward)
        return _torch_forward(*args)
    return _CALLS.plan(key, args, lambda: _launch(*args))


def _setup(ctx, inputs, output):
    x, weight, bias, residual, norm_weight, eps, weight_offset, activation = inputs
    ctx.eps, ctx.weight_offset, ctx.activation = eps, weight_offset, activation
    ctx.has_residual = residual is not None
    ctx.save_for_backward(x, weight, bias, norm_weight)


def _grad(ctx, grad_out, ops):
    """Gradients by the chain rule in fp32 (float64 stays float64), the prologue's a
    recomputed (unrounded): d_residual = dy, db = sum_m dy, dW = dy.T a, da = dy W; then the
    prologue's: norm: dg = sum_m da * x_hat, dx = r * (da g' - x_hat * mean(da g' * x_hat))
    with x_hat = x r and g' = g + weight_offset; gated: ops.silu's gated backward; none:
    dx = da."""
    x, weight, bias, norm_weight = ctx.saved_tensors
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    dy, x_work, w_work = grad_out.to(work), x.to(work), weight.to(work)
    d_norm_weight = None
    if norm_weight is not None:
        rstd = torch.rsqrt(x_work.pow(2).mean(dim=-1, keepdim=True) + ctx.eps)
        x_hat = x_work * rstd
        scale = norm_weight.to(work) + ctx.weight_offset
        activations = x_hat * scale
    else:
        activations = _prologue(x_work, None, 0.0, 0.0, _GATED_NAMES.get(ctx.activation))
    d_weight = dy.t() @ activations
    d_activations = dy @ w_work
    if norm_weight is not None:
        d_norm_weight = (d_activations * x_hat).sum(0).to(norm_weight.dtype)
        d_x_hat = d_activations * scale
        dx = rstd * (d_x_hat - x_hat * (d_x_hat * x_hat).mean(dim=-1, keepdim=True))
    elif ctx.activation == SILU:
        dx = silu_ops.silu_and_mul_backward_reference(d_activations, x_work)
    elif ctx.activation != NO_GATE:
        dx = silu_ops.gelu_and_mul_backward_reference(
            d_activations, x_work, "tanh" if ctx.activation == GELU_TANH else "none")
    else:
        dx = d_activations
    return (dx.to(x.dtype), d_weight.to(weight.dtype),
            dy.sum(0).to(bias.dtype) if bias is not None else None,
            grad_out.clone() if ctx.has_residual else None, d_norm_weight, None, None, None)


# torch arithmetic all the way: the backward is itself differentiable
_decode_gemv_op = runtime.CustomOp(
    "decode_gemv", _decode_gemv_impl,
    fake=lambda x, weight, bias, residual, norm_weight, eps, weight_offset, activation:
        x.new_empty((x.shape[0], weight.shape[0])),
    setup_context=_setup, backward=_grad, differentiable_backward=True)


# --------------------------------------------------------------------------------------------
# Over merged_linear's weights: the op the graph rewrite (gemslib.passes.decode) puts where a
# decode step's projections of one input were merged
# --------------------------------------------------------------------------------------------


def merged_weights(weights: list[torch.Tensor], biases: list[Optional[torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W, b): ``weights`` (N_i, K) as one (sum_i N_i, K) weight and ``biases`` (one per
    weight, each (N_i,) or None) as one bias or None, as merged_linear computes them: a view
    where they lie end to end (the parameters merged_linear's rewrite merged at compile time),
    else a copy (a parameter replaced since: correct, and a copy of the weights every call); a
    missing bias beside others is zeros."""
    weight = end_to_end(weights)
    if weight is None:
        weight = torch.cat(weights)
    if all(b is None for b in biases):
        return weight, None
    bias = end_to_end(biases) if all(b is not None for b in biases) else None
    if bias is None:
        bias = torch.cat([torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None
                          else b for w, b in zip(weights, biases)])
    return weight, bias


def _decode_gemv_merged_impl(x: torch.Tensor, weights: list[torch.Tensor],
                             biases: list[Optional[torch.Tensor]],
                             residual: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                             eps: float, weight_offset: float, activation: int) -> torch.Tensor:
    """decode_gemv over the weights ``weights`` concatenated (biases: one per weight, each a
    tensor or None; see :func:`merged_weights`): out (M, sum_i N_i), whose column block i is
    the projection by weights[i], as merged_linear's output is."""
    weight, bias = merged_weights(weights, biases)
    return _decode_gemv_impl(x, weight, bias, residual, norm_weight, eps, weight_offset,
                             activation)


# no autograd: only the graph passes put it in a graph, after autograd has been split off
_decode_gemv_merged_op = runtime.CustomOp(
    "decode_gemv_merged", _decode_gemv_merged_impl,
    fake=lambda x, weights, biases, residual, norm_weight, eps, weight_offset, activation:
        x.new_empty((x.shape[0], sum(w.shape[0] for w in weights))))


# --------------------------------------------------------------------------------------------
# The q/k/v projection with its rotary and cache write: the op the graph rewrite puts where a
# decode step's q/k/v GEMV feeds rotary_into_cache
# --------------------------------------------------------------------------------------------

ROTARY_NAME = "gemslib.decode_gemv_rotary"


def _heads(y: torch.Tensor, batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int):
    """(q, k, v) of the projection y (B S, (Hq + 2 Hk) D): (B, S, H, D) views."""
    heads = y.view(batch, y.shape[0] // batch, n_q_heads + 2 * n_kv_heads, head_dim)
    return heads.split([n_q_heads, n_kv_heads, n_kv_heads], dim=2)


def decode_gemv_rotary_reference(x, weight, bias, norm_weight, eps, weight_offset, cos, sin,
                                 interleaved, cache_position, k_cache, v_cache, n_q_heads,
                                 q_weight=None, k_weight=None, qk_eps=0.0, qk_offset=0.0):
    """The projection (:func:`decode_gemv_reference`), then rotary_into_cache's reference on
    its q, k and v heads: q rotated, returned (B S, Hq D); k rotated and v written into the
    caches."""
    y = decode_gemv_reference(x, weight, bias, norm_weight=norm_weight, eps=eps,
                              weight_offset=weight_offset)
    q, k, v = _heads(y, k_cache.shape[0], n_q_heads, k_cache.shape[1], k_cache.shape[3])
    q_rot = rotary_ops.rotary_into_cache_reference(q, k, v, cos, sin, interleaved,
                                                   cache_position, k_cache, v_cache, q_weight,
                                                   k_weight, qk_eps, qk_offset)
    return q_rot.reshape(x.shape[0], -1)


def _check_rotary(x, weight, bias, norm_weight, cos, sin, cache_position, k_cache, v_cache,
                  n_q_heads, q_weight, k_weight, qk_eps, qk_offset) -> None:
    """decode_gemv_rotary's arguments: the projection's as decode_gemv takes them, W's rows the
    q, k and v heads of the caches (B, Hk, L, D) end to end, x's rows the B S tokens of the
    (B | 1, S, D) tables, and rotary_into_cache's checks of the rest; nothing the kernel reads
    shares memory with the caches it writes."""
    _check(x, weight, bias, None, norm_weight, NO_GATE)
    if isinstance(n_q_heads, bool) or not isinstance(n_q_heads, int) or n_q_heads < 1:
        raise ValueError(f"{ROTARY_NAME}: n_q_heads must be an int >= 1, got {n_q_heads!r}")
    for arg, t in (("k_cache", k_cache), ("cos", cos)):
        checks.float_tensor(ROTARY_NAME, arg, t, expected="floating-point")
    if k_cache.dim() != 4 or cos.dim() != 3:
        raise ValueError(f"{ROTARY_NAME}: k_cache must be (B, Hk, L, D) and cos a per-token "
                         f"(B or 1, S, D) table, got k_cache {tuple(k_cache.shape)} and cos "
                         f"{tuple(cos.shape)}")
    batch, n_kv_heads, _, head_dim = k_cache.shape
    seq_len = cos.shape[1]
    if x.shape[0] != batch * seq_len:
        raise ValueError(f"{ROTARY_NAME}: x must have B S = {batch} x {seq_len} rows (the "
                         f"caches' batch, the tables' tokens), got {x.shape[0]}")
    n_out = (n_q_heads + 2 * n_kv_heads) * head_dim
    if weight.shape[0] != n_out:
        raise ValueError(f"{ROTARY_NAME}: the weights must have (Hq + 2 Hk) D = ({n_q_heads} + 2 "
                         f"x {n_kv_heads}) x {head_dim} = {n_out} rows (q, k and v heads), got "
                         f"{weight.shape[0]}")
    # rotary_into_cache's own checks, on (B, S, H, D) stand-ins of x's dtype for q, k and v
    token_heads = x.new_empty(()).expand(batch, seq_len, n_q_heads + n_kv_heads, head_dim)
    rotary_ops._check_cache_write(
        token_heads[:, :, :n_q_heads], token_heads[:, :, n_q_heads:],
        token_heads[:, :, n_q_heads:], cos, sin, cache_position, k_cache, v_cache, q_weight,
        k_weight, qk_eps, qk_offset)
    for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        for arg, t in (("x", x), ("weight", weight), ("bias", bias),
                       ("norm_weight", norm_weight), ("q_weight", q_weight),
                       ("k_weight", k_weight)):
            if t is not None and layout.may_share_elements(cache, t):
                raise ValueError(f"{ROTARY_NAME}: {cache_name} shares memory with {arg}, which "
                                 f"is read while the cache is written")


def _rotary_kernel_takes(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache,
                         q_weight) -> bool:
    """The kernel computes the call: decode_gemv's conditions, a full rotary of an even head
    dim (with the per-head norm, half of it a power of 2: a tile of whole heads), unit last
    strides."""
    head_dim = k_cache.shape[3]
    return _kernel_takes(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache) and \
        _unit_last_strides(x, weight, cos, sin, k_cache, v_cache) and head_dim % 2 == 0 and \
        cos.shape[2] == head_dim and \
        (q_weight is None or runtime.next_power_of_2(head_dim // 2) == head_dim // 2)


def _whole_heads(config: runtime.LaunchConfig, head_dim: int) -> runtime.LaunchConfig:
    """``config`` with tiles of whole heads (the per-head norm): BLOCK_N raised to a multiple
    of head_dim, BLOCK_K and the splits scaled to keep the tile's size and the programs'
    count."""
    meta = config.meta_dict
    block_n = runtime.cdiv(meta["BLOCK_N"], head_dim) * head_dim
    if block_n == meta["BLOCK_N"]:
        return config
    grown = block_n // meta["BLOCK_N"]
    changed = {"BLOCK_N": block_n, "BLOCK_K": max(16, meta["BLOCK_K"] // grown),
               "SPLIT_K": meta["SPLIT_K"] * grown}
    return runtime.LaunchConfig(tuple((key, changed.get(key, value)) for key, value in config.meta),
                                config.num_warps, config.num_stages)


def _launch_rotary(x, weight, bias, norm_weight, eps, weight_offset, cos, sin, interleaved,
                   cache_position, k_cache, v_cache, n_q_heads, q_weight, k_weight, qk_eps,
                   qk_offset) -> torch.Tensor:
    """q rotated, (M, Hq D) in x's dtype; inputs validated and taken by the kernel."""
    n_rows = x.shape[0]
    n_out, n_in = weight.shape
    batch, n_kv_heads, n_cache_rows, head_dim = k_cache.shape
    q_out = torch.empty((n_rows, n_q_heads * head_dim), dtype=x.dtype, device=x.device)
    shape = (n_rows, n_out, n_in, x.element_size())
    config = DECODE_GEMV_ROTARY.planned_config(shape)
    head_pairs = head_dim // 2 if q_weight is not None else 0
    if head_pairs:
        config = _whole_heads(config, head_dim)
    n_tiles = runtime.cdiv(n_out // 2, config.meta_dict["BLOCK_N"] // 2)
    block_m, split_len, n_splits, _, arrivals, part = _tiling(x, config.meta_dict, n_tiles,
                                                             n_out, n_in)
    # a table of one sequence serves every sequence
    table_strides = [stride for t in (cos, sin)
                     for stride in ((t.stride(0) if t.shape[0] > 1 else 0), t.stride(1))]
    DECODE_GEMV_ROTARY.launch(
        lambda meta: (n_tiles, n_splits),
        x, weight, bias.contiguous() if bias is not None else None,
        norm_weight.contiguous() if norm_weight is not None else None, q_out, part, arrivals,
        cos, sin, cache_position, k_cache, v_cache,
        q_weight.contiguous() if q_weight is not None else None,
        k_weight.contiguous() if k_weight is not None else None,
        n_rows, n_out, n_in, eps, weight_offset, split_len, n_splits,
        cos.shape[1], n_q_heads, n_kv_heads, head_dim, n_cache_rows, float(qk_eps),
        float(qk_offset),
        x.stride(0), weight.stride(0), q_out.stride(0), *table_strides,
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NORM if norm_weight is not None else NO_PROLOGUE, x.dtype == torch.float32,
        bool(interleaved), head_pairs, block_m, config.meta_dict["GEMV"] == SUM_AT_END_GEMV,
        shape=shape, config=config)
    return q_out


def _decode_gemv_rotary_impl(x: torch.Tensor, weights: list[torch.Tensor],
                             biases: list[Optional[torch.Tensor]],
                             norm_weight: Optional[torch.Tensor], eps: float,
                             weight_offset: float, cos: torch.Tensor, sin: torch.Tensor,
                             interleaved: bool, cache_position: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor, n_q_heads: int,
                             q_weight: Optional[torch.Tensor] = None,
                             k_weight: Optional[torch.Tensor] = None, qk_eps: float = 0.0,
                             qk_offset: float = 0.0) -> torch.Tensor:
    """A decode step's q/k/v projection, its rotary and its static cache's update in one
    launch: y = norm(x) @ W.T + b over ``weights`` end to end (as decode_gemv_merged; no norm
    where norm_weight is None), W's rows the Hq q heads then the Hk k and Hk v heads of the
    caches (B, Hk, L, D); x (B S, K) the tokens of the per-token (B | 1, S, D) tables (a full
    rotary). Returns q rotated, (B S, Hq D); k rotated and v are written into the caches at
    row cache_position[s] (S,) of token s, as rotary_into_cache writes them (with q_weight
    and k_weight, each q and k head RMS-normalised first). Where the kernel does not take the
    call: decode_gemv, then rotary_into_cache."""
    weight, bias = merged_weights(list(weights), list(biases))
    eps = checks.as_float(ROTARY_NAME, "eps", eps)
    weight_offset = checks.as_float(ROTARY_NAME, "weight_offset", weight_offset)
    _check_rotary(x, weight, bias, norm_weight, cos, sin, cache_position, k_cache, v_cache,
                  n_q_heads, q_weight, k_weight, qk_eps, qk_offset)
    if _rotary_kernel_takes(x, weight, bias, norm_weight, cos, sin, k_cache, v_cache, q_weight):
        return _launch_rotary(x, weight, bias, norm_weight, eps, weight_offset, cos, sin,
                              interleaved, cache_position, k_cache, v_cache, n_q_heads,
                              q_weight, k_weight, qk_eps, qk_offset)
    y = _decode_gemv_impl(x, weight, bias, None, norm_weight, eps, weight_offset, NO_GATE)
    q, k, v = _heads(y, k_cache.shape[0], n_q_heads, k_cache.shape[1], k_cache.shape[3])
    q_rot = rotary_ops._rotary_into_cache_impl(q, k, v, cos, sin, interleaved, cache_position,
                                               k_cache, v_cache, q_weight, k_weight, qk_eps,
                                               qk_offset)
    return q_rot.reshape(x.shape[0], -1)


# no autograd: only the graph passes put it in a graph (an inference graph)
_decode_gemv_rotary_op = runtime.CustomOp(
    "decode_gemv_rotary", _decode_gemv_rotary_impl, mutates_args=("k_cache", "v_cache"),
    fake=lambda x, weights, biases, norm_weight, eps, weight_offset, cos, sin, interleaved,
    cache_position, k_cache, v_cache, n_q_heads, q_weight=None, k_weight=None, qk_eps=0.0,
    qk_offset=0.0: x.new_empty((x.shape[0], n_q_heads * k_cache.shape[3])))


# --------------------------------------------------------------------------------------------
# Self-check for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _check_inputs(device, dtype, rows):
    """x (M, K) with M = min(rows, 16) (a decode step's rows), its norm weight, W (N, K) and a
    residual (M, N): small at the check's size, a Llama-3-8B gate/up projection (K 4096,
    N 28672) at the timing size."""
    n_in, n_out = (4096, 28672) if rows >= 1024 else (256, 200)
    rows = min(rows, MAX_ROWS)
    return (torch.randn(rows, n_in, device=device, dtype=dtype),
            torch.randn(n_in, device=device, dtype=dtype),
            torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5,
            torch.randn(rows, n_out, device=device, dtype=dtype))


def _term_scale(x, norm_weight, weight, residual):
    """The size of the sums: |rms_norm(x)| @ |W|.T + |residual|."""
    x, norm_weight, weight, residual = (t.double() for t in (x, norm_weight, weight, residual))
    normed = _prologue(x, norm_weight, 1e-6, 0.0, None)
    return (normed.abs() @ weight.abs().t() + residual.abs()).max().item()


SELF_CHECKS = (
    SelfCheck("decode_gemv",
              _check_inputs,
              run=lambda x, g, w, r: decode_gemv(x, w, residual=r, norm_weight=g),
              reference=lambda x, g, w, r: decode_gemv_reference(x, w, residual=r,
                                                                 norm_weight=g),
              torch_peer=lambda x, g, w, r: r + F.linear(
                  F.rms_norm(x, (x.shape[-1],), g, 1e-6), w),
              # bf16 tl.dot is wrong in Triton 3.6's interpreter
              dtypes=(torch.float16, torch.float32) if runtime.INTERPRETER else
              (torch.float16, torch.bfloat16, torch.float32),
              term_scale=_term_scale),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a problem per bucket
# --------------------------------------------------------------------------------------------

def _tune_problem(rows: int, n_out: int, n_in: int, prologue: str,
                  dtype: torch.dtype = torch.bfloat16):
    """One projection of a decode step: ``"gated"`` the down projection (x = [gate | up],
    with the residual), ``"norm"`` a merged gate/up projection, ``"plain"`` the o projection
    (with the residual)."""
    def make(device):
        width = 2 * n_in if prologue == "gated" else n_in
        x = torch.randn(rows, width, device=device, dtype=dtype)
        weight = torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5
        norm_weight = torch.randn(n_in, device=device, dtype=dtype) \
            if prologue == "norm" else None
        residual = torch.randn(rows, n_out, device=device, dtype=dtype) \
            if prologue != "norm" else None
        gated = "silu" if prologue == "gated" else None

        def run():
            return decode_gemv(x, weight, residual=residual, norm_weight=norm_weight,
                               gated=gated)
        return run
    return make


def _tune_problems(*makers):
    """The problems of ``makers`` as one: each made on the device, run one after another."""
    def make(device):
        runs = [maker(device) for maker in makers]
        return lambda: [run() for run in runs]
    return make


def _tune_rotary_problem(rows: int, n_q_heads: int, n_kv_heads: int, head_dim: int,
                         n_in: int, qk_norm: bool, dtype: torch.dtype = torch.bfloat16):
    """A decode step's q/k/v projection with its norm, rotary and cache write (a cache of
    1024 rows), and with Qwen3's per-head q/k norm where ``qk_norm``."""
    def make(device):
        def randn(*shape, scale=1.0):
            return torch.randn(*shape, device=device, dtype=dtype) * scale

        widths = (n_q_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim)
        weights = list(randn(sum(widths), n_in, scale=n_in ** -0.5).split(widths))
        x, norm_weight = randn(rows, n_in), randn(n_in)
        table = [randn(rows, 1, head_dim) for _ in range(2)]
        position = torch.tensor([1000], device=device)
        caches = [randn(rows, n_kv_heads, 1024, head_dim) for _ in range(2)]
        qk = (randn(head_dim), randn(head_dim), 1e-6, 0.0) if qk_norm else ()

        def run():
            return torch.ops.gemslib.decode_gemv_rotary(
                x, weights, [None] * 3, norm_weight, 1e-6, 0.0, *table, False, position,
                *caches, n_q_heads, *qk)
        return run
    return make


# column tiles of 16-64 W rows, K steps of 128-512, K split over up to 8 programs; GEMV (one row
# by multiply-and-sum, or the 16-row tl.dot tile) matters at one row only
_CANDIDATES = tuple({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split, "GEMV": gemv, "num_warps": w,
                     "num_stages": 3}
                    for n, k in ((32, 256), (16, 256), (64, 128), (32, 512), (64, 256))
                    for split in (1, 2, 4, 8) for gemv in (1, 0) for w in (4, 8))

# one row's products summed after the K loop (GEMV 2): narrow tiles of long K steps, many
# programs each streaming its rows without a barrier a step (a tile of 4-8 rows of 512 ran a
# Llama layer's chained projections at 72-92% of copy on the H100, decode_gemv's GEMV 1 at
# 65-83%: docs/notes/decode.md); the product tile at most 64 fp32 registers a thread
_SUM_AT_END_CANDIDATES = tuple(
    {"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split, "GEMV": SUM_AT_END_GEMV, "num_warps": w,
     "num_stages": 3}
    for n in (4, 8, 16) for k in (512, 1024) for split in (1, 2, 4) for w in (4, 8)
    if n * k <= 64 * 32 * w)

# the tile grid's candidates, and stream-K's: 2, 4 or 8 programs an SM sharing the tiles' K
# steps equally, no split
_GEMV_CANDIDATES = (
    tuple({**candidate, "STREAM_K": 0} for candidate in _CANDIDATES + _SUM_AT_END_CANDIDATES)
    + tuple({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": 1, "STREAM_K": per_sm, "GEMV": gemv,
             "num_warps": w, "num_stages": 3}
            for n, k in ((32, 256), (16, 256), (64, 128)) for per_sm in (2, 4, 8)
            for gemv in (1, 0) for w in (4, 8)))

TUNING = (
    TuneSpace(
        DECODE_GEMV,
        _GEMV_CANDIDATES,
        # by rows (one, or up to 16) and width: the narrow projections (N 2048, 4096: the o and
        # down projections) have few column tiles and want more of K split
        # the o projections first (K no wider than N: a few K steps a column tile, where the
        # buckets below are sized by the long K of the down projections)
        (TuneBucket({"rows": 1, "n": 4096, "k": 4096, "elem_bytes": 2},
                    "M1 N2048 K2048 + M1 N4096 K4096 plain",
                    _tune_problems(_tune_problem(1, 2048, 2048, "plain"),
                                   _tune_problem(1, 4096, 4096, "plain"))),
         TuneBucket({"rows": 1, "n": 2048, "elem_bytes": 2}, "M1 N2048 K8192 gated",
                    _tune_problem(1, 2048, 8192, "gated")),
         TuneBucket({"rows": 1, "n": 4096, "elem_bytes": 2}, "M1 N4096 K14336 gated",
                    _tune_problem(1, 4096, 14336, "gated")),
         # the wide ones by width too: the column tiles' count over the programs an SM
         # holds decides the last wave's share (Llama-3.2-1B's gate/up 512 tiles of 32 rows,
         # Llama-3-8B's 896)
         TuneBucket({"rows": 1, "n": 16384, "elem_bytes": 2}, "M1 N16384 K2048 norm",
                    _tune_problem(1, 16384, 2048, "norm")),
         TuneBucket({"rows": 1, "elem_bytes": 2}, "M1 N28672 K4096 norm",
                    _tune_problem(1, 28672, 4096, "norm")),
         TuneBucket({"rows": 16, "n": 4096, "k": 4096, "elem_bytes": 2},
                    "M16 N2048 K2048 + M16 N4096 K4096 plain",
                    _tune_problems(_tune_problem(16, 2048, 2048, "plain"),
                                   _tune_problem(16, 4096, 4096, "plain"))),
         TuneBucket({"rows": 16, "n": 2048, "elem_bytes": 2}, "M16 N2048 K8192 gated",
                    _tune_problem(16, 2048, 8192, "gated")),
         TuneBucket({"rows": 16, "n": 4096, "elem_bytes": 2}, "M16 N4096 K14336 gated",
                    _tune_problem(16, 4096, 14336, "gated")),
         TuneBucket({"rows": 16, "n": 16384, "elem_bytes": 2}, "M16 N16384 K2048 norm",
                    _tune_problem(16, 16384, 2048, "norm")),
         TuneBucket({"rows": 16, "elem_bytes": 2}, "M16 N28672 K4096 norm",
                    _tune_problem(16, 28672, 4096, "norm")),
         # fp32 (twice the bytes a weight): a smaller problem
         TuneBucket(None, "M16 N4096 K4096 fp32",
                    _tune_problem(16, 4096, 4096, "plain", dtype=torch.float32)))),
    TuneSpace(
        DECODE_GEMV_ROTARY,
        _CANDIDATES + _SUM_AT_END_CANDIDATES,
        # Llama-3.2-1B's q/k/v (N 3072: 96 tiles of 32 rows, K split), Llama-3-8B's and
        # Qwen3-8B's (N 6144, Qwen3's tiles grown to whole heads for its q/k norm)
        (TuneBucket({"rows": 1, "n": 4096, "elem_bytes": 2}, "M1 N3072 K2048",
                    _tune_rotary_problem(1, 32, 8, 64, 2048, False)),
         TuneBucket({"rows": 1, "elem_bytes": 2}, "M1 N6144 K4096 qk-norm",
                    _tune_rotary_problem(1, 32, 8, 128, 4096, True)),
         TuneBucket({"rows": 16, "n": 4096, "elem_bytes": 2}, "M16 N3072 K2048",
                    _tune_rotary_problem(16, 32, 8, 64, 2048, False)),
         TuneBucket({"rows": 16, "elem_bytes": 2}, "M16 N6144 K4096",
                    _tune_rotary_problem(16, 32, 8, 128, 4096, False)),
         TuneBucket(None, "M16 N3072 K2048 fp32",
                    _tune_rotary_problem(16, 32, 8, 64, 2048, False, dtype=torch.float32)))),
)
