"""Hopper (sm_90) path of ``gemslib.softmax`` / ``log_softmax`` for wide rows: one HBM read.

    m_r = max_j x_j over CTA r's slice,  s_r = sum_j exp(x_j - m_r)
    m = max_r m_r,  s = sum_r s_r exp(m_r - m),  y_j = exp(x_j - m) / s  (or x_j - m - log s)

One cluster of CLUSTER CTAs (1, 2, 4 or 8: Triton's ``num_ctas``; ``program_id`` is the
cluster's index, here the row) per row. CTA r (``%cluster_ctarank``) copies its slice of the
row into shared memory with cp.async, 16 bytes a copy and every copy of the slice in flight at
once, folds the slice into a running max and rescaled sum per lane as the copies land, writes
its (m_r, s_r) to a scratch slot of the row in global memory, meets the cluster at a cluster
barrier (release/acquire: the slots are visible after it), combines the CLUSTER pairs and
writes its slice's outputs from shared memory. Each thread reads back only the vectors it
copied. Triton 3.6 cannot reduce across a cluster through distributed shared memory (see
docs/notes/softmax.md), hence the two floats a CTA through L2.

Rows are walked from the 16-byte boundary at or before their start (the "window"; window
position w holds column w - head), so odd widths (50257, 152064) move whole vectors too; the
at most 2 * (VEC - 1) columns of the partial vectors at a row's two ends are rank 0's, loaded
and stored one by one. x and y share their dtype, 16-byte aligned bases and row strides equal
modulo VEC (``eligible``). NaN and infinities as in torch: a NaN or +inf makes the row's sum
NaN, a row of only -inf has m = -inf and s = 0, so its outputs are NaN.

The backward holds dy and y of a row the same way (two slices a CTA), each read once:

    softmax:      dx_j = y_j (dy_j - sum_k dy_k y_k)
    log_softmax:  dx_j = dy_j - exp(y_j) sum_k dy_k

each CTA folding its slice's part of the sum and exchanging one float.
"""

from __future__ import annotations

import functools
import math

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from gemslib import runtime
from gemslib.layout import LOG2E

CLUSTERS = (1, 2, 4, 8)        # portable cluster sizes (16 needs a non-portable opt-in)
MAX_SLICE_BYTES = 200 * 1024   # shared memory a CTA may hold (sm_90 allows 227 KB, less scratch)


@gluon.constexpr_function
def _cta_rows(per_thread, num_warps, num_ctas):
    """A [num_ctas, n] layout whose row r is CTA r's (the cluster split over dim 0), each
    row over all the CTA's threads, ``per_thread`` consecutive elements a thread."""
    return gl.BlockedLayout([1, per_thread], [1, 32], [1, num_warps], [1, 0],
                            cga_layout=[[1 << i, 0] for i in range(num_ctas.bit_length() - 1)])


@gluon.constexpr_function
def _cta_rows_shared(num_ctas):
    """Shared memory [chunks, num_ctas, n]: CTA r holds [:, r, :]."""
    return gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0],
                                   cga_layout=[[1 << i, 0]
                                               for i in range(num_ctas.bit_length() - 1)])


@gluon.constexpr_function
def _everywhere(num_warps, num_ctas):
    """A 1-d layout every CTA of the cluster holds whole (for values all of them read)."""
    return gl.BlockedLayout([1], [32], [num_warps], [0],
                            cga_layout=[[0]] * (num_ctas.bit_length() - 1))


@gluon.jit
def _cluster_barrier(b_any):
    """Every thread of the cluster arrives (release) and waits (acquire); ``b_any``: any
    tensor of one element a thread. Returns a zero the compiler cannot fold, for the loads
    after the barrier to depend on."""
    after = gl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
        "mov.u32 $0, 0;", "=r,r", [b_any], dtype=gl.int32, is_pure=False, pack=1)
    return gl.max(after, axis=0)


@gluon.jit
def _edge_columns(head, w_lo, w_hi, n_cols, VEC: gl.constexpr, EDGE: gl.constexpr):
    """Window positions of the partial vectors at a row's two ends, [head, w_lo) and
    [w_hi, head + n_cols), as [CLUSTER, 2 * VEC] (EDGE layout), and their mask: CTA 0's."""
    o_edge_cta = gl.arange(0, gl.num_ctas(), layout=gl.SliceLayout(1, EDGE))[:, None]
    o_edge = gl.arange(0, 2 * VEC, layout=gl.SliceLayout(0, EDGE))[None, :] + 0 * o_edge_cta
    o_edge_w = gl.where(o_edge < VEC, head + o_edge, w_hi + o_edge - VEC)
    m_edge = gl.where(o_edge < VEC, o_edge_w < w_lo, o_edge_w < head + n_cols) & (o_edge_cta == 0)
    return o_edge_w, m_edge


@gluon.jit
def _row_statistics(b_max, b_sum, b_edge, partial_ptr, i_row, o_cta,
                    PER_CTA: gl.constexpr, EDGE: gl.constexpr):
    """(m, s) of row ``i_row`` from each CTA's lanes (running max ``b_max`` and sum below it
    ``b_sum``, [CLUSTER, CHUNK]) and the row's edge columns ``b_edge``: per CTA its slice's
    (m_r, s_r), then, across a cluster, exchanged through ``partial_ptr`` (2 * CLUSTER fp32 a
    row) behind the cluster barrier."""
    CLUSTER: gl.constexpr = gl.num_ctas()
    # per CTA ([CLUSTER], CTA r's entry its own): the slice's max and its sum below that max
    edge_max = gl.convert_layout(gl.max(b_edge, axis=1), PER_CTA)
    slice_max = gl.maximum(gl.max(b_max, axis=1), edge_max)
    finite_max = gl.where(slice_max == float("-inf"), 0.0, slice_max)
    edge_sum = gl.convert_layout(
        gl.sum(gl.exp2((b_edge - gl.convert_layout(finite_max, gl.SliceLayout(1, EDGE))[:, None])
                       * LOG2E), axis=1), PER_CTA)
    slice_sum = gl.sum(b_sum * gl.exp2((b_max - finite_max[:, None]) * LOG2E), axis=1) + edge_sum
    if CLUSTER > 1:
        p_partial = partial_ptr + i_row * (2 * CLUSTER)
        gl.store(p_partial + 2 * o_cta, slice_max)
        gl.store(p_partial + 2 * o_cta + 1, slice_sum)
        o_rank = gl.arange(0, CLUSTER, layout=_everywhere(gl.num_warps(), CLUSTER))
        o_rank = o_rank * 2 + _cluster_barrier(o_rank)
        # .cg: from L2, where the other CTAs' stores are, never a stale L1 line
        b_rank_max = gl.load(p_partial + o_rank, cache_modifier=".cg")
        b_rank_sum = gl.load(p_partial + o_rank + 1, cache_modifier=".cg")
        row_max = gl.max(b_rank_max, axis=0)
        row_sum = gl.sum(b_rank_sum * gl.exp2((b_rank_max - row_max) * LOG2E), axis=0)
    else:
        row_max = gl.max(slice_max, axis=0)
        row_sum = gl.sum(slice_sum, axis=0)
    return row_max, row_sum


@gluon.jit
def _softmax_cluster_fwd_kernel(x_ptr, y_ptr, partial_ptr, n_cols, stride_x_row, stride_y_row,
                                LOG: gl.constexpr, VEC: gl.constexpr, N_CHUNKS: gl.constexpr):
    """Row ``program_id(0)`` of x (rows of n_cols) into y; ``partial_ptr``: 2 * CLUSTER fp32 a
    row of scratch. Tiles are [CLUSTER, CHUNK], CTA r holding row r: its slice of the row is
    N_CHUNKS chunks of CHUNK = VEC * 32 * num_warps columns."""
    CLUSTER: gl.constexpr = gl.num_ctas()
    TILE: gl.constexpr = _cta_rows(VEC, gl.num_warps(), CLUSTER)
    EDGE: gl.constexpr = _cta_rows(1, gl.num_warps(), CLUSTER)
    PER_CTA: gl.constexpr = gl.SliceLayout(1, TILE)
    CHUNK: gl.constexpr = VEC * 32 * gl.num_warps()
    SLICE: gl.constexpr = N_CHUNKS * CHUNK
    slice_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [N_CHUNKS, CLUSTER, CHUNK],
                                           _cta_rows_shared(CLUSTER))
    i_row = gl.program_id(0).to(gl.int64)
    start_x = i_row * stride_x_row
    head = (start_x % VEC).to(gl.int32)
    # written as (offset // VEC) * VEC so that the compiler knows they are 16-byte aligned
    p_x = x_ptr + start_x // VEC * VEC
    p_y = y_ptr + i_row * stride_y_row // VEC * VEC
    w_lo = (head + VEC - 1) // VEC * VEC      # the first whole vector of the row
    w_hi = (head + n_cols) // VEC * VEC       # past its last whole vector
    o_cta = gl.arange(0, CLUSTER, layout=PER_CTA)
    o_tile = (o_cta * SLICE)[:, None] + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, TILE))[None, :]
    for i_chunk in gl.static_range(N_CHUNKS):
        o_w = o_tile + i_chunk * CHUNK
        async_copy.async_copy_global_to_shared(slice_smem.index(i_chunk), p_x + o_w,
                                               mask=(o_w >= w_lo) & (o_w < w_hi))
        async_copy.commit_group()

    # the partial vectors at the row's ends, window [head, w_lo) and [w_hi, head + n_cols):
    # the first CTA's
    o_edge_w, m_edge = _edge_columns(head, w_lo, w_hi, n_cols, VEC, EDGE)
    b_edge = gl.load(p_x + o_edge_w, mask=m_edge, other=float("-inf")).to(gl.float32)

    b_max = gl.full([CLUSTER, CHUNK], float("-inf"), gl.float32, TILE)
    b_sum = gl.zeros([CLUSTER, CHUNK], gl.float32, TILE)
    for i_chunk in gl.static_range(N_CHUNKS):
        async_copy.wait_group(N_CHUNKS - 1 - i_chunk)
        o_w = o_tile + i_chunk * CHUNK
        b_x = gl.where((o_w >= w_lo) & (o_w < w_hi),
                       slice_smem.index(i_chunk).load(TILE).to(gl.float32), float("-inf"))
        # NaN kept (sm_90's max drops it): a lane whose first value is NaN would otherwise
        # stay at -inf and its sum at zero, and the row would lose the NaN torch gives it
        b_new_max = gl.maximum(b_max, b_x, propagate_nan=tl.PropagateNan.ALL)
        # lanes still at -inf (nothing of the row yet) keep a zero sum, not exp(-inf + inf)
        b_sum = gl.where(b_new_max == float("-inf"), 0.0,
                         b_sum * gl.exp2((b_max - b_new_max) * LOG2E)
                         + gl.exp2((b_x - b_new_max) * LOG2E))
        b_max = b_new_max
    row_max, row_sum = _row_statistics(b_max, b_sum, b_edge, partial_ptr, i_row, o_cta,
                                       PER_CTA, EDGE)
    log_sum = gl.log(row_sum)
    inv_sum = 1.0 / row_sum

    for i_chunk in gl.static_range(N_CHUNKS):
        o_w = o_tile + i_chunk * CHUNK
        b_x = slice_smem.index(i_chunk).load(TILE).to(gl.float32)
        if LOG:
            b_y = b_x - row_max - log_sum
        else:
            b_y = gl.exp2((b_x - row_max) * LOG2E) * inv_sum
        gl.store(p_y + o_w, b_y.to(y_ptr.dtype.element_ty), mask=(o_w >= w_lo) & (o_w < w_hi))
    if LOG:
        b_edge_y = b_edge - row_max - log_sum
    else:
        b_edge_y = gl.exp2((b_edge - row_max) * LOG2E) * inv_sum
    gl.store(p_y + o_edge_w, b_edge_y.to(y_ptr.dtype.element_ty), mask=m_edge)


@gluon.jit
def _softmax_cluster_bwd_kernel(grad_ptr, y_ptr, dx_ptr, partial_ptr, n_cols, stride_grad_row,
                                stride_y_row, stride_dx_row, LOG: gl.constexpr,
                                VEC: gl.constexpr, N_CHUNKS: gl.constexpr):
    """dx of row ``program_id(0)`` from dy (``grad_ptr``) and the forward's y; ``partial_ptr``:
    CLUSTER fp32 a row of scratch. Tiles and slices as the forward's, two slices a CTA."""
    CLUSTER: gl.constexpr = gl.num_ctas()
    TILE: gl.constexpr = _cta_rows(VEC, gl.num_warps(), CLUSTER)
    EDGE: gl.constexpr = _cta_rows(1, gl.num_warps(), CLUSTER)
    PER_CTA: gl.constexpr = gl.SliceLayout(1, TILE)
    CHUNK: gl.constexpr = VEC * 32 * gl.num_warps()
    SLICE: gl.constexpr = N_CHUNKS * CHUNK
    SHARED: gl.constexpr = _cta_rows_shared(CLUSTER)
    grad_smem = gl.allocate_shared_memory(grad_ptr.dtype.element_ty, [N_CHUNKS, CLUSTER, CHUNK],
                                          SHARED)
    y_smem = gl.allocate_shared_memory(y_ptr.dtype.element_ty, [N_CHUNKS, CLUSTER, CHUNK], SHARED)
    i_row = gl.program_id(0).to(gl.int64)
    start_grad = i_row * stride_grad_row
    head = (start_grad % VEC).to(gl.int32)  # the same for y and dx (eligible)
    p_grad = grad_ptr + start_grad // VEC * VEC
    p_y = y_ptr + i_row * stride_y_row // VEC * VEC
    p_dx = dx_ptr + i_row * stride_dx_row // VEC * VEC
    w_lo = (head + VEC - 1) // VEC * VEC
    w_hi = (head + n_cols) // VEC * VEC
    o_cta = gl.arange(0, CLUSTER, layout=PER_CTA)
    o_tile = (o_cta * SLICE)[:, None] + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, TILE))[None, :]
    for i_chunk in gl.static_range(N_CHUNKS):
        o_w = o_tile + i_chunk * CHUNK
        m_w = (o_w >= w_lo) & (o_w < w_hi)
        async_copy.async_copy_global_to_shared(grad_smem.index(i_chunk), p_grad + o_w, mask=m_w)
        async_copy.async_copy_global_to_shared(y_smem.index(i_chunk), p_y + o_w, mask=m_w)
        async_copy.commit_group()
    o_edge_w, m_edge = _edge_columns(head, w_lo, w_hi, n_cols, VEC, EDGE)
    b_edge_grad = gl.load(p_grad + o_edge_w, mask=m_edge, other=0.0).to(gl.float32)
    b_edge_y = gl.load(p_y + o_edge_w, mask=m_edge, other=0.0).to(gl.float32)
    b_dot = gl.zeros([CLUSTER, CHUNK], gl.float32, TILE)
    for i_chunk in gl.static_range(N_CHUNKS):
        async_copy.wait_group(N_CHUNKS - 1 - i_chunk)
        # a masked copy fills its 16 bytes with zeros: they add nothing to the sum
        b_grad = grad_smem.index(i_chunk).load(TILE).to(gl.float32)
        if LOG:
            b_dot += b_grad
        else:
            b_dot += b_grad * y_smem.index(i_chunk).load(TILE).to(gl.float32)
    if LOG:
        edge_dot = gl.sum(b_edge_grad, axis=1)
    else:
        edge_dot = gl.sum(b_edge_grad * b_edge_y, axis=1)
    slice_dot = gl.convert_layout(edge_dot, PER_CTA) + gl.sum(b_dot, axis=1)
    if CLUSTER > 1:
        p_partial = partial_ptr + i_row * CLUSTER
        gl.store(p_partial + o_cta, slice_dot)
        o_rank = gl.arange(0, CLUSTER, layout=_everywhere(gl.num_warps(), CLUSTER))
        row_dot = gl.sum(gl.load(p_partial + o_rank + _cluster_barrier(o_rank),
                                 cache_modifier=".cg"), axis=0)
    else:
        row_dot = gl.sum(slice_dot, axis=0)
    for i_chunk in gl.static_range(N_CHUNKS):
        o_w = o_tile + i_chunk * CHUNK
        b_grad = grad_smem.index(i_chunk).load(TILE).to(gl.float32)
        b_y = y_smem.index(i_chunk).load(TILE).to(gl.float32)
        if LOG:
            b_dx = b_grad - gl.exp2(b_y * LOG2E) * row_dot
        else:
            b_dx = b_y * (b_grad - row_dot)
        gl.store(p_dx + o_w, b_dx.to(dx_ptr.dtype.element_ty), mask=(o_w >= w_lo) & (o_w < w_hi))
    if LOG:
        b_edge_dx = b_edge_grad - gl.exp2(b_edge_y * LOG2E) * row_dot
    else:
        b_edge_dx = b_edge_y * (b_edge_grad - row_dot)
    gl.store(p_dx + o_edge_w, b_edge_dx.to(dx_ptr.dtype.element_ty), mask=m_edge)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def n_chunks(n_cols: int, element_size: int, cluster: int, num_warps: int) -> int:
    """Chunks per CTA: the window (the row and up to VEC - 1 columns before it) over the
    cluster's CTAs, CHUNK = VEC * 32 * num_warps columns a chunk."""
    vec = 16 // element_size
    return math.ceil((n_cols + vec - 1) / (vec * 32 * num_warps * cluster))


def slice_bytes(n_cols: int, element_size: int, cluster: int, num_warps: int) -> int:
    """Shared memory one CTA holds its slice in."""
    return n_chunks(n_cols, element_size, cluster, num_warps) * 16 * 32 * num_warps


def fits(n_cols: int, element_size: int, cluster: int, num_warps: int, slices: int = 1) -> bool:
    """Whether ``slices`` slices a CTA (the forward holds x, the backward dy and y) fit."""
    return (cluster in CLUSTERS and n_cols >= 32 // element_size
            and slices * slice_bytes(n_cols, element_size, cluster, num_warps) <= MAX_SLICE_BYTES)


def eligible(*rows: torch.Tensor) -> bool:
    """Whether (rows, n) views (unit last strides; inputs, then the output) can take this
    path: a Hopper-or-later GPU, one dtype of 2 or 4 bytes, 16-byte aligned bases and row
    strides equal modulo 16 bytes (every row of each starts at the same offset from a
    boundary)."""
    first = rows[0]
    if runtime.INTERPRETER or first.device.type != "cuda" or first.element_size() not in (2, 4):
        return False
    vec = 16 // first.element_size()
    for t in rows:
        if t.dtype != first.dtype or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if (t.stride(0) - first.stride(0)) % vec:
            return False
    return _clusters_on(first.device.index or 0)


@functools.lru_cache(maxsize=None)
def _clusters_on(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def forward(kernel: runtime.TunedKernel, x_rows: torch.Tensor, out_rows: torch.Tensor, log: bool,
            cluster: int, num_warps: int) -> None:
    """softmax (log_softmax) of the rows of ``x_rows`` into ``out_rows`` through ``kernel``
    (the TunedKernel of ``_softmax_cluster_fwd_kernel``, whose config for this shape is
    (``cluster``, ``num_warps``): its launches are kept and planned like Triton's); the caller
    checked ``eligible`` and ``fits``."""
    n_rows, n_cols = x_rows.shape
    element_size = x_rows.element_size()
    partials = runtime.split_scratch(x_rows.device, 1, n_rows * cluster * 2)[1]
    kernel.launch(lambda meta: (n_rows,), x_rows, out_rows, partials, n_cols,
                  x_rows.stride(0), out_rows.stride(0), log, 16 // element_size,
                  n_chunks(n_cols, element_size, cluster, num_warps), shape=(n_rows, n_cols))


def backward(kernel: runtime.TunedKernel, grad_rows: torch.Tensor, y_rows: torch.Tensor,
             dx_rows: torch.Tensor, log: bool, cluster: int, num_warps: int) -> None:
    """dx of softmax (log_softmax) into ``dx_rows`` from dy and the forward's y, through
    ``kernel`` (``_softmax_cluster_bwd_kernel``'s, as in :func:`forward`); the caller checked
    ``eligible`` and ``fits`` (two slices)."""
    n_rows, n_cols = y_rows.shape
    element_size = y_rows.element_size()
    partials = runtime.split_scratch(y_rows.device, 1, n_rows * cluster)[1]
    kernel.launch(lambda meta: (n_rows,), grad_rows, y_rows, dx_rows, partials, n_cols,
                  grad_rows.stride(0), y_rows.stride(0), dx_rows.stride(0), log,
                  16 // element_size, n_chunks(n_cols, element_size, cluster, num_warps),
                  shape=(n_rows, n_cols))
