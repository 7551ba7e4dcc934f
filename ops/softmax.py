"""softmax and log_softmax over any dim, forward and backward.

    softmax(x)_i     = exp(x_i - m) / s,       m = max_j x_j,  s = sum_j exp(x_j - m)
    log_softmax(x)_i = x_i - m - log(s)
    softmax backward:     dx = y * (dy - sum_j dy_j * y_j)
    log_softmax backward: dx = dy - exp(y) * sum_j dy_j

Rows that fit one block are read once. Wider rows (vocabulary-sized) take an online pass for
the statistics, a running max and a rescaled running sum per lane, then a second pass that
writes the outputs: two reads and one write. A second form for wide rows splits each row over
several programs that exchange their pieces' statistics and write from registers, one read
(``softmax_split_fwd``, for rows whose tuned config gives it a CHUNK). On Hopper a third
form holds each row in shared memory across a cluster of 1-8 CTAs and reads it once
(``_softmax_hopper.py``; ``softmax_cluster_fwd``'s CLUSTER, 0 where unused), and the
backward holds dy and y so (``softmax_cluster_bwd``). Looped rows that
start off a 16-byte boundary (odd widths such as 50257) are walked from the boundary before
them, so that all blocks but the first and last move full vectors (``ALIGN``). exp is
computed as exp2 with log2(e) folded in.
NaN and infinities behave as in torch: a row holding NaN or +inf, or only -inf, is all NaN.
A reduction over a non-last dim moves that dim last (a copy, so that one row kernel serves
every dim; the aten overrides leave such calls to torch's strided kernel). Why these forms:
see docs/notes/softmax.md. The file reads top-down: kernels, launchers, references, public
functions and custom ops, aten overrides, self-checks, tuning.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from gemslib import checks, layout, runtime
from gemslib.layout import LOG2E
from gemslib.registry import AtenOverride, SelfCheck, TuneBucket, TuneSpace

try:  # Gluon (triton.experimental) is optional: without it the Triton kernels serve every call
    from gemslib.ops import _softmax_hopper
except ImportError:  # pragma: no cover - depends on the Triton build
    _softmax_hopper = None


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _row_block(n_rows, BLOCK_M: tl.constexpr):
    """This program's BLOCK_M rows as an int64 column of indices and their mask."""
    o_row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return o_row.to(tl.int64)[:, None], o_row[:, None] < n_rows


@triton.jit
def _in_row(o_n, shift, n_cols, m_row, ALIGN: tl.constexpr):
    """Mask of the columns ``o_n`` (counted from ``shift`` elements before the row) that
    belong to a row of ``n_cols``; ``shift`` is 0 when ALIGN is 1."""
    if ALIGN == 1:
        return m_row & (o_n < n_cols)
    else:
        return m_row & (o_n >= shift) & (o_n < shift + n_cols)


@triton.jit
def _row_start(x_ptr, o_row, stride_x_row, ALIGN: tl.constexpr, ONE_PASS: tl.constexpr):
    """Where a program walks its rows ``o_row`` of a tensor ``x`` from: the rows themselves, or
    for looped rows with ALIGN > 1 the aligned address before each, written as
    (offset // ALIGN) * ALIGN so that the compiler knows it is aligned (and vectorizes the
    accesses from it)."""
    if ONE_PASS or ALIGN == 1:
        return x_ptr + o_row * stride_x_row
    else:
        return x_ptr + (o_row * stride_x_row // ALIGN) * ALIGN


@triton.jit
def _row_shift(o_row, stride_x_row, ALIGN: tl.constexpr, ONE_PASS: tl.constexpr):
    """Elements each row starts past the address ``_row_start`` gives (0 unless ALIGN > 1)."""
    if ONE_PASS or ALIGN == 1:
        return 0
    else:
        return (o_row * stride_x_row) % ALIGN


@triton.jit
def _block_range(n_cols, ALIGN: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first_full, end_full, n_blocks) of a looped row walk: blocks [first_full, end_full)
    lie inside every row (no column mask, full vectors); blocks start ``shift`` (< ALIGN <=
    BLOCK_N) elements before the row when ALIGN > 1, so block 0 is partial then."""
    if ALIGN == 1:
        first_full = 0
    else:
        first_full = 1
    return first_full, n_cols // BLOCK_N, tl.cdiv(n_cols + ALIGN - 1, BLOCK_N)


@triton.jit
def _write_block(p_x, p_y, m_x, b_row_max, b_row_sum, LOG: tl.constexpr):
    """y = softmax or log_softmax of the block at ``p_x``, from the row's max and sum."""
    b_shifted = (tl.load(p_x, mask=m_x, other=-float("inf")).to(tl.float32) - b_row_max) * LOG2E
    if LOG:
        b_y = (b_shifted - tl.log2(b_row_sum)) / LOG2E
    else:
        b_y = tl.exp2(b_shifted) / b_row_sum
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), mask=m_x)


@triton.heuristics({"ONE_PASS": layout.fits_one_block})
@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, n_rows, n_cols, stride_x_row, stride_y_row,
    LOG: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """BLOCK_M rows of ``n_cols`` per program; y = softmax or log_softmax of each row.

    ALIGN > 1 (looped rows whose starts are not 16-byte aligned, e.g. 50257 columns): each row
    is walked in blocks that start at the aligned address ``shift`` elements before the row,
    so that every block but the first and the last loads and stores full vectors unmasked.
    The launcher sets it only when x and y rows share the misalignment (equal strides mod ALIGN).
    """
    o_row, m_row = _row_block(n_rows, BLOCK_M)
    # y's rows start ``shift`` past alignment too (the launcher checks the strides)
    shift = _row_shift(o_row, stride_x_row, ALIGN, ONE_PASS)
    p_x = _row_start(x_ptr, o_row, stride_x_row, ALIGN, ONE_PASS)
    p_y = _row_start(y_ptr, o_row, stride_y_row, ALIGN, ONE_PASS)
    if ONE_PASS:
        o_n = tl.arange(0, BLOCK_N)[None, :]
        m_x = m_row & (o_n < n_cols)
        b_x = tl.load(p_x + o_n, mask=m_x, other=-float("inf")).to(tl.float32)
        b_shifted = (b_x - tl.max(b_x, axis=1)[:, None]) * LOG2E  # log2 units
        b_exp = tl.exp2(b_shifted)
        b_row_sum = tl.sum(b_exp, axis=1)[:, None]
        if LOG:
            b_y = (b_shifted - tl.log2(b_row_sum)) / LOG2E
        else:
            b_y = b_exp / b_row_sum
        tl.store(p_y + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_x)
    else:
        first_full, end_full, n_blocks = _block_range(n_cols, ALIGN, BLOCK_N)
        b_lane_max = tl.full([BLOCK_M, BLOCK_N], -float("inf"), dtype=tl.float32)
        b_lane_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_n in range(0, n_blocks):
            o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            if (i_n >= first_full) & (i_n < end_full):
                b_x = tl.load(p_x + o_n, mask=m_row, other=-float("inf")).to(tl.float32)
            else:
                b_x = tl.load(p_x + o_n, mask=_in_row(o_n, shift, n_cols, m_row, ALIGN),
                              other=-float("inf")).to(tl.float32)
            # on the GPU tl.maximum drops NaN operands unless told otherwise
            b_new_max = tl.maximum(b_lane_max, b_x, propagate_nan=tl.PropagateNan.ALL)
            # a lane that has seen only -inf keeps a zero sum; (-inf) - (-inf) would make it
            # NaN. A NaN or +inf input does make the sum NaN, and with it the row, as in torch.
            m_only_neg_inf = b_new_max == -float("inf")
            b_rescale = tl.where(m_only_neg_inf, 0.0, tl.exp2((b_lane_max - b_new_max) * LOG2E))
            b_term = tl.where(m_only_neg_inf, 0.0, tl.exp2((b_x - b_new_max) * LOG2E))
            b_lane_sum = b_lane_sum * b_rescale + b_term
            b_lane_max = b_new_max
        b_row_max = tl.max(b_lane_max, axis=1)[:, None]
        b_row_sum = tl.sum(b_lane_sum * tl.exp2((b_lane_max - b_row_max) * LOG2E), axis=1)[:, None]
        for i_step in range(0, n_blocks):  # last block first: it is the one still in cache
            i_n = n_blocks - 1 - i_step
            o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            # two calls, not one on a merged mask: the unmasked one must see a mask that is
            # constant along the row, or its loads and stores are not vectorized
            if (i_n >= first_full) & (i_n < end_full):
                _write_block(p_x + o_n, p_y + o_n, m_row, b_row_max, b_row_sum, LOG)
            else:
                _write_block(p_x + o_n, p_y + o_n, _in_row(o_n, shift, n_cols, m_row, ALIGN),
                             b_row_max, b_row_sum, LOG)


@triton.jit
def _softmax_split_fwd_kernel(
    x_ptr, y_ptr, stats_ptr, counters_ptr, n_rows, n_cols, n_chunks, stride_x_row, stride_y_row,
    LOG: tl.constexpr, PHASE: tl.constexpr, MAX_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
):
    """Rows too wide for one program, split into ``n_chunks`` pieces of CHUNK columns, one
    program per piece; each piece is read from memory once.

    PHASE 0, one launch: a program stores its piece's (max, sum of exp) in ``stats``, counts
    itself in ``counters[1 + row]``, waits until every piece of its row has, combines the
    statistics and writes its piece from registers. Programs take tickets in the order they
    start (``counters[0]``) instead of using their program ids, so a program only ever waits
    for pieces that have started or will start in the next free slot: no deadlock while the GPU
    holds ``n_chunks`` programs at once (the launcher checks). ``counters`` (the ticket, one
    per row, one for rows done) are zero before the launch and after it: each program counts
    itself again on its way out, the row's last one out puts the row's counter back, and the
    last row's puts back the other two (the counters are reused, runtime.split_scratch).
    PHASE 1 then PHASE 2, two
    launches without ``counters`` (None): the statistics, then the outputs from a second read
    (for the interpreter, which runs one program after another, and when a row has more pieces
    than the GPU has SMs).
    """
    if PHASE == 0:
        i_ticket = tl.atomic_add(counters_ptr, 1)
    else:
        i_ticket = tl.program_id(0)
    i_row = (i_ticket // n_chunks).to(tl.int64)
    i_chunk = i_ticket % n_chunks
    o_n = i_chunk * CHUNK + tl.arange(0, CHUNK)
    m_n = o_n < n_cols
    b_x = tl.load(x_ptr + i_row * stride_x_row + o_n, mask=m_n,
                  other=-float("inf")).to(tl.float32)
    p_stats = stats_ptr + i_row * n_chunks * 2  # (max, sum) per piece
    if PHASE != 2:
        b_piece_max = tl.max(b_x, axis=0)
        # a piece of only -inf has a zero sum; NaN or +inf make it NaN, and the row with it
        b_piece_sum = tl.sum(tl.exp2((b_x - b_piece_max) * LOG2E), axis=0)
        b_piece_sum = tl.where(b_piece_max == -float("inf"), 0.0, b_piece_sum)
        tl.store(p_stats + 2 * i_chunk, b_piece_max)
        tl.store(p_stats + 2 * i_chunk + 1, b_piece_sum)
    if PHASE == 0:
        tl.debug_barrier()  # the statistics are stored before this program counts itself
        p_arrivals = counters_ptr + 1 + i_row
        arrived = tl.atomic_add(p_arrivals, 1, sem="acq_rel") + 1
        while arrived < n_chunks:
            arrived = tl.atomic_add(p_arrivals, 0, sem="acquire")
        tl.debug_barrier()
        # out: no program of the row still waits once all have counted themselves twice
        left = tl.atomic_add(p_arrivals, 1, sem="acq_rel") + 1
        if left == 2 * n_chunks:
            tl.atomic_xchg(p_arrivals, 0)
            p_rows_done = counters_ptr + 1 + n_rows
            rows_done = tl.atomic_add(p_rows_done, 1, sem="acq_rel") + 1
            if rows_done == n_rows:  # every program has taken its ticket
                tl.atomic_xchg(counters_ptr, 0)
                tl.atomic_xchg(p_rows_done, 0)
    if PHASE != 1:
        o_chunk = tl.arange(0, MAX_CHUNKS)
        # .cg: read the other programs' statistics from L2, never from a stale L1 line
        b_maxes = tl.load(p_stats + 2 * o_chunk, mask=o_chunk < n_chunks, other=-float("inf"),
                          cache_modifier=".cg")
        b_sums = tl.load(p_stats + 2 * o_chunk + 1, mask=o_chunk < n_chunks, other=0.0,
                         cache_modifier=".cg")
        b_row_max = tl.max(b_maxes, axis=0)
        b_row_sum = tl.sum(tl.where(b_maxes == -float("inf"), 0.0,
                                    b_sums * tl.exp2((b_maxes - b_row_max) * LOG2E)), axis=0)
        b_shifted = (b_x - b_row_max) * LOG2E
        if LOG:
            b_y = (b_shifted - tl.log2(b_row_sum)) / LOG2E
        else:
            b_y = tl.exp2(b_shifted) / b_row_sum
        tl.store(y_ptr + i_row * stride_y_row + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


@triton.jit
def _grad_dot_terms(p_grad, p_y, m_x, LOG: tl.constexpr):
    """One block's terms of the row's sum: dy * y (softmax) or dy (log_softmax)."""
    b_grad = tl.load(p_grad, mask=m_x, other=0.0).to(tl.float32)
    if LOG:
        return b_grad
    else:
        return b_grad * tl.load(p_y, mask=m_x, other=0.0).to(tl.float32)


@triton.jit
def _write_grad_block(p_grad, p_y, p_dx, m_x, b_row_dot, LOG: tl.constexpr):
    """dx of one block from the row's sum of dy * y (softmax) or of dy (log_softmax)."""
    b_grad = tl.load(p_grad, mask=m_x, other=0.0).to(tl.float32)
    b_y = tl.load(p_y, mask=m_x, other=0.0).to(tl.float32)
    if LOG:
        b_dx = b_grad - tl.exp(b_y) * b_row_dot
    else:
        b_dx = b_y * (b_grad - b_row_dot)
    tl.store(p_dx, b_dx.to(p_dx.dtype.element_ty), mask=m_x)


@triton.heuristics({"ONE_PASS": layout.fits_one_block})
@triton.jit
def _softmax_bwd_kernel(
    grad_ptr, y_ptr, dx_ptr, n_rows, n_cols, stride_grad_row, stride_y_row, stride_dx_row,
    LOG: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """dx from the forward's output y: softmax y * (dy - sum(dy * y)); log dy - exp(y) sum(dy).
    ALIGN as in softmax_fwd (all three tensors' rows share the offset)."""
    o_row, m_row = _row_block(n_rows, BLOCK_M)
    shift = _row_shift(o_row, stride_grad_row, ALIGN, ONE_PASS)
    p_grad = _row_start(grad_ptr, o_row, stride_grad_row, ALIGN, ONE_PASS)
    p_y = _row_start(y_ptr, o_row, stride_y_row, ALIGN, ONE_PASS)
    p_dx = _row_start(dx_ptr, o_row, stride_dx_row, ALIGN, ONE_PASS)
    if ONE_PASS:
        o_n = tl.arange(0, BLOCK_N)[None, :]
        m_x = m_row & (o_n < n_cols)
        b_grad = tl.load(p_grad + o_n, mask=m_x, other=0.0).to(tl.float32)
        b_y = tl.load(p_y + o_n, mask=m_x, other=0.0).to(tl.float32)
        if LOG:
            b_dx = b_grad - tl.exp(b_y) * tl.sum(b_grad, axis=1)[:, None]
        else:
            b_dx = b_y * (b_grad - tl.sum(b_grad * b_y, axis=1)[:, None])
        tl.store(p_dx + o_n, b_dx.to(dx_ptr.dtype.element_ty), mask=m_x)
    else:
        first_full, end_full, n_blocks = _block_range(n_cols, ALIGN, BLOCK_N)
        b_lane_dot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_n in range(0, n_blocks):
            o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            if (i_n >= first_full) & (i_n < end_full):  # a call per mask, see forward
                b_lane_dot += _grad_dot_terms(p_grad + o_n, p_y + o_n, m_row, LOG)
            else:
                b_lane_dot += _grad_dot_terms(p_grad + o_n, p_y + o_n,
                                              _in_row(o_n, shift, n_cols, m_row, ALIGN), LOG)
        b_row_dot = tl.sum(b_lane_dot, axis=1)[:, None]
        for i_step in range(0, n_blocks):  # last block first: it is the one still in cache
            i_n = n_blocks - 1 - i_step
            o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            if (i_n >= first_full) & (i_n < end_full):
                _write_grad_block(p_grad + o_n, p_y + o_n, p_dx + o_n, m_row, b_row_dot, LOG)
            else:
                _write_grad_block(p_grad + o_n, p_y + o_n, p_dx + o_n,
                                  _in_row(o_n, shift, n_cols, m_row, ALIGN), b_row_dot, LOG)


SOFTMAX_FWD = runtime.TunedKernel("softmax", "softmax_fwd", _softmax_fwd_kernel,
                                  tunables=("BLOCK_M", "BLOCK_N"), shape_keys=("rows", "cols"))
SOFTMAX_BWD = runtime.TunedKernel("softmax", "softmax_bwd", _softmax_bwd_kernel,
                                  tunables=("BLOCK_M", "BLOCK_N"), shape_keys=("rows", "cols"))
# CHUNK 0 in a config: rows of that size are not split (softmax_fwd takes them)
SOFTMAX_SPLIT_FWD = runtime.TunedKernel("softmax", "softmax_split_fwd", _softmax_split_fwd_kernel,
                                        tunables=("CHUNK",), shape_keys=("rows", "cols"))
_MAX_CHUNKS = 256  # pieces per row the statistics combine in one block
# the Hopper path (_softmax_hopper.py): a config's CLUSTER CTAs a row (the Gluon kernels'
# num_ctas), 0 where it is not used
SOFTMAX_CLUSTER_FWD = runtime.TunedKernel(
    "softmax", "softmax_cluster_fwd",
    None if _softmax_hopper is None else _softmax_hopper._softmax_cluster_fwd_kernel,
    tunables=(), launcher_knobs=("CLUSTER",), cluster_knob="CLUSTER", shape_keys=("rows", "cols"))
SOFTMAX_CLUSTER_BWD = runtime.TunedKernel(
    "softmax", "softmax_cluster_bwd",
    None if _softmax_hopper is None else _softmax_hopper._softmax_cluster_bwd_kernel,
    tunables=(), launcher_knobs=("CLUSTER",), cluster_knob="CLUSTER", shape_keys=("rows", "cols"))


# --------------------------------------------------------------------------------------------
# Launchers: any dim, any layout -> (rows, n) with a unit last stride
# --------------------------------------------------------------------------------------------


def _normalize_dim(function: str, x: torch.Tensor, dim: int) -> int:
    rank = max(x.dim(), 1)
    if not -rank <= dim < rank:
        raise IndexError(f"{function}: dim {dim} is out of range for a tensor of {x.dim()} dims")
    return dim % rank


def _row_alignment(rows: list[tuple[torch.Tensor, int]]) -> int:
    """The row kernels' ALIGN for (tensor, row stride) pairs, the first setting the pace: the
    elements in 16 bytes of it where its rows start off that alignment in a way every other
    tensor's rows share (equal strides modulo it, 16-byte aligned bases), else 1."""
    first, first_stride = rows[0]
    per_vector = 16 // first.element_size()
    if first_stride % per_vector == 0 or any(
            (stride - first_stride) % per_vector or t.data_ptr() % 16 for t, stride in rows):
        return 1
    return per_vector


def _launch_rows(kernel: runtime.TunedKernel, inputs: list[torch.Tensor], out: torch.Tensor,
                 log: bool) -> None:
    """``inputs`` and ``out`` are (..., n) with the reduction on the last dim; out contiguous."""
    if out.numel() == 0:
        return
    n_cols = out.shape[-1]
    n_rows = out.numel() // n_cols
    rows = [layout.rows_of(t) for t in inputs]
    align = _row_alignment(rows + [(out, n_cols)])
    kernel.launch(lambda meta: (runtime.cdiv(n_rows, meta["BLOCK_M"]),),
                  *[r for r, _ in rows], out, n_rows, n_cols, *[stride for _, stride in rows],
                  n_cols, log, align, shape=(n_rows, n_cols))


def _launch_split(x_rows: torch.Tensor, out_rows: torch.Tensor, log: bool, chunk: int) -> None:
    """softmax_split_fwd over (rows, n) views with a unit last stride."""
    n_rows, n_cols = out_rows.shape
    n_chunks = runtime.cdiv(n_cols, chunk)
    # (ticket, a counter per row, rows done), zero at rest; (max, sum) per piece
    counters, stats = runtime.split_scratch(x_rows.device, n_rows + 2, n_rows * n_chunks * 2)
    max_chunks = 1 << max(n_chunks - 1, 1).bit_length()

    def launch(counters, phase):
        # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
        SOFTMAX_SPLIT_FWD.launch(
            lambda meta: (n_rows * n_chunks,),
            x_rows, out_rows, stats, counters,
            n_rows, n_cols, n_chunks,
            x_rows.stride(0), out_rows.stride(0),
            log, phase, max_chunks,
            shape=(n_rows, n_cols))

    # the one-launch form waits on the row's other pieces: all of them must be resident at
    # once, which one program per SM guarantees
    if runtime.INTERPRETER or n_chunks > runtime.multiprocessor_count(x_rows.device.index or 0):
        launch(None, phase=1)  # no counters in the two-launch form
        launch(None, phase=2)
    else:
        launch(counters, phase=0)


def _cluster_config(kernel: runtime.TunedKernel, n_rows: int, n_cols: int, element_size: int,
                    slices: int = 1) -> tuple[int, int] | None:
    """(CLUSTER, num_warps) of the Hopper path (``kernel``: the forward's or the backward's,
    holding ``slices`` slices a CTA) for rows of this size, or None where the configs do not
    use it (or it could not hold the row)."""
    config = kernel.planned_config((n_rows, n_cols))
    cluster = config.meta_dict["CLUSTER"]
    if not cluster or _softmax_hopper is None or runtime.INTERPRETER:
        return None
    if not _softmax_hopper.fits(n_cols, element_size, cluster, config.num_warps, slices):
        return None
    return cluster, config.num_warps


def _split_chunk(n_rows: int, n_cols: int) -> int:
    """CHUNK for rows of this size, or 0 where softmax_fwd's one program per row is used."""
    chunk = SOFTMAX_SPLIT_FWD.planned_config((n_rows, n_cols)).meta_dict["CHUNK"]
    if chunk <= 0 or chunk >= n_cols or runtime.cdiv(n_cols, chunk) > _MAX_CHUNKS:
        return 0
    return chunk


def _to_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t if t.dim() == 0 or dim == t.dim() - 1 else t.movedim(dim, -1)


def _from_last(t: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    return t if ndim == 0 or dim == ndim - 1 else t.movedim(-1, dim).contiguous()


def _forward(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Kernel path: x of a kernel dtype, on the kernel device; returns a new tensor."""
    moved = _to_last(x, dim).reshape(1, 1) if x.dim() == 0 else _to_last(x, dim)
    out = torch.empty_like(moved, dtype=out_dtype, memory_format=torch.contiguous_format)
    n_cols = moved.shape[-1]
    cluster = _cluster_config(SOFTMAX_CLUSTER_FWD, out.numel() // n_cols, n_cols,
                              out.element_size()) if out.numel() else None
    if cluster:
        x_rows, out_rows = layout.as_rows(moved), out.view(-1, n_cols)
        if _softmax_hopper.eligible(x_rows, out_rows):
            _softmax_hopper.forward(SOFTMAX_CLUSTER_FWD, x_rows, out_rows, log, *cluster)
            return out.reshape(()) if x.dim() == 0 else _from_last(out, dim, x.dim())
    chunk = _split_chunk(out.numel() // n_cols, n_cols) if out.numel() else 0
    if chunk:
        _launch_split(layout.as_rows(moved), out.view(-1, n_cols), log, chunk)
    else:
        _launch_rows(SOFTMAX_FWD, [moved], out, log)
    return out.reshape(()) if x.dim() == 0 else _from_last(out, dim, x.dim())


def _backward(grad: torch.Tensor, y: torch.Tensor, dim: int, log: bool,
              out_dtype: torch.dtype) -> torch.Tensor:
    """Kernel path: dx from the forward's output ``y`` and the incoming gradient."""
    scalar = y.dim() == 0
    if scalar:
        grad, y = grad.reshape(1, 1), y.reshape(1, 1)
    moved_grad, moved_y = _to_last(grad, dim), _to_last(y, dim)
    dx = torch.empty_like(moved_y, dtype=out_dtype, memory_format=torch.contiguous_format)
    n_cols = dx.shape[-1]
    cluster = _cluster_config(SOFTMAX_CLUSTER_BWD, dx.numel() // n_cols, n_cols,
                              dx.element_size(), slices=2) if dx.numel() else None
    if cluster:
        grad_rows, y_rows = layout.as_rows(moved_grad), layout.as_rows(moved_y)
        dx_rows = dx.view(-1, n_cols)
        if _softmax_hopper.eligible(grad_rows, y_rows, dx_rows):
            _softmax_hopper.backward(SOFTMAX_CLUSTER_BWD, grad_rows, y_rows, dx_rows, log,
                                     *cluster)
            return dx.reshape(()) if scalar else _from_last(dx, dim, y.dim())
    _launch_rows(SOFTMAX_BWD, [moved_grad, moved_y], dx, log)
    return dx.reshape(()) if scalar else _from_last(dx, dim, y.dim())


# --------------------------------------------------------------------------------------------
# Plain PyTorch references (tests run them in float64)
# --------------------------------------------------------------------------------------------


def softmax_reference(x, dim=-1):
    return torch.softmax(x, dim)


def log_softmax_reference(x, dim=-1):
    return torch.log_softmax(x, dim)


def softmax_backward_reference(grad, y, dim=-1):
    return y * (grad - (grad * y).sum(dim, keepdim=True))


def log_softmax_backward_reference(grad, y, dim=-1):
    return grad - torch.exp(y) * grad.sum(dim, keepdim=True)


# --------------------------------------------------------------------------------------------
# Public functions and custom ops
# --------------------------------------------------------------------------------------------


def _check(function: str, x, dim) -> int:
    checks.float_tensor(function, "x", x)
    # torch's rule and words: an int that is not a bool, or a 0-d integer tensor
    return _normalize_dim(function, x, checks.as_int(function, "dim", dim))


def _softmax_any(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """Kernel where it runs, torch otherwise; no autograd."""
    if not runtime.kernel_runs(x):
        return (torch.log_softmax if log else torch.softmax)(x, dim)
    return _forward(x, dim, log, x.dtype)


_SOFTMAX_CALLS = runtime.CallPlans("softmax")
_LOG_SOFTMAX_CALLS = runtime.CallPlans("log_softmax")


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``; same shape and dtype as x.

    Statistics in fp32; rows of any width (vocabulary-sized ones in an online pass).
    Differentiable.

    Args:
        x: (...) floating tensor of any shape (0-d included) and strides. The kernels take
            fp16, bf16 and fp32 on the kernel device; other dtypes and devices go to torch.
        dim: the dim to normalise over, in [-x.dim(), x.dim()) (an int or 0-d int tensor).

    Returns:
        (...) tensor of x's shape and dtype, contiguous from the kernels.

    Raises:
        TypeError: x is not a floating-point tensor, or dim is not an int.
        IndexError: dim is out of range.
    """
    args = (x, dim)  # as given: a plan is found by the arguments of the calls it serves
    key, planned = _SOFTMAX_CALLS.replayed(*args)
    if planned is not None:
        return planned
    dim = _check("gemslib.softmax", x, dim)
    if runtime.wants_custom_op(x):
        return _softmax_op(x, dim, False)
    return _SOFTMAX_CALLS.plan(key, args, lambda: _softmax_any(x, dim, log=False))


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - max - log(sum(exp(x - max)))`` along ``dim``; same shape and dtype as x.

    Statistics in fp32, as for ``softmax``. Differentiable.

    Args:
        x: (...) floating tensor of any shape (0-d included) and strides. The kernels take
            fp16, bf16 and fp32 on the kernel device; other dtypes and devices go to torch.
        dim: the dim to normalise over, in [-x.dim(), x.dim()) (an int or 0-d int tensor).

    Returns:
        (...) tensor of x's shape and dtype, contiguous from the kernels.

    Raises:
        TypeError: x is not a floating-point tensor, or dim is not an int.
        IndexError: dim is out of range.
    """
    args = (x, dim)  # as given: a plan is found by the arguments of the calls it serves
    key, planned = _LOG_SOFTMAX_CALLS.replayed(*args)
    if planned is not None:
        return planned
    dim = _check("gemslib.log_softmax", x, dim)
    if runtime.wants_custom_op(x):
        return _softmax_op(x, dim, True)
    return _LOG_SOFTMAX_CALLS.plan(key, args, lambda: _softmax_any(x, dim, log=True))


def _backward_any(grad, y, dim, log, out_dtype):
    if not runtime.kernel_runs(grad, y) or grad.dtype != y.dtype:
        reference = log_softmax_backward_reference if log else softmax_backward_reference
        compute = torch.float64 if torch.float64 in (grad.dtype, y.dtype) else torch.float32
        return reference(grad.to(compute), y.to(compute), dim).to(out_dtype)
    return _backward(grad, y, dim, log, out_dtype)


def _softmax_impl(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """softmax (log=False) or log_softmax (log=True) of x along dim, contiguous."""
    return _softmax_any(x, dim, log).contiguous()


def _softmax_backward_impl(grad: torch.Tensor, y: torch.Tensor, dim: int,
                           log: bool) -> torch.Tensor:
    return _backward_any(grad, y, dim, log, y.dtype).contiguous()


def _softmax_setup(ctx, inputs, output):
    ctx.dim, ctx.log = inputs[1], inputs[2]
    ctx.save_for_backward(output)


def _softmax_grad(ctx, grad, ops):
    (y,) = ctx.saved_tensors
    return ops.softmax_backward(grad, y, ctx.dim, ctx.log), None, None


_softmax_backward_op = runtime.CustomOp(
    "softmax_backward", _softmax_backward_impl,
    fake=lambda grad, y, dim, log: torch.empty_like(y, memory_format=torch.contiguous_format))
_softmax_op = runtime.CustomOp(
    "softmax", _softmax_impl,
    fake=lambda x, dim, log: torch.empty_like(x, memory_format=torch.contiguous_format),
    setup_context=_softmax_setup, backward=_softmax_grad, uses=(_softmax_backward_op,))


# --------------------------------------------------------------------------------------------
# aten overrides: what F.softmax / F.log_softmax and their autograd reach on every backend
# --------------------------------------------------------------------------------------------


def _not_last_dim(t: torch.Tensor, dim: int) -> bool:
    """A reduction over a non-last dim: gemslib would move it last with a copy, which torch's
    strided kernel avoids, so the override leaves those calls to torch."""
    return t.dim() > 1 and dim % t.dim() != t.dim() - 1


def _why_not_forward(self, dim, half_to_float, out=None):
    if self.dtype not in runtime.KERNEL_DTYPES:
        return f"dtype {self.dtype}"
    if _not_last_dim(self, dim):
        return "reduction over a non-last dim"
    if half_to_float and (self.dtype == torch.float32 or self.device.type == "cpu"):
        return "half_to_float on a float32 input or a CPU tensor (torch raises)"
    if out is not None:
        expected = torch.float32 if half_to_float else self.dtype
        if out.shape != self.shape or out.dtype != expected or layout.has_internal_overlap(out):
            return "out needs resizing, another dtype, or has overlapping elements"
        if layout.memory_overlaps(self, out):
            return "out overlaps the input"
    return None


def _why_not_backward(grad_output, output, dim, input_dtype, out=None):
    if grad_output.dtype not in runtime.KERNEL_DTYPES or grad_output.dtype != output.dtype:
        return f"dtypes {grad_output.dtype}, {output.dtype}"
    if _not_last_dim(output, dim):
        return "reduction over a non-last dim"
    if input_dtype not in runtime.KERNEL_DTYPES or grad_output.shape != output.shape:
        return f"input dtype {input_dtype} or shapes differ"
    if input_dtype != grad_output.dtype and grad_output.device.type == "cpu":
        return "a half_to_float backward on a CPU tensor (torch raises)"
    if out is not None and (out.shape != output.shape or out.dtype != input_dtype
                            or layout.has_internal_overlap(out)):
        return "grad_input needs resizing, another dtype, or has overlapping elements"
    return None


def _aten_forward(self, dim, half_to_float, *, log):
    dim = _normalize_dim("softmax", self, dim)
    return _forward(self, dim, log, torch.float32 if half_to_float else self.dtype)


def _aten_forward_out(self, dim, half_to_float, *, out, log):
    return out.copy_(_aten_forward(self, dim, half_to_float, log=log))


def _aten_backward(grad_output, output, dim, input_dtype, *, log):
    dim = _normalize_dim("softmax backward", output, dim)
    return _backward(grad_output, output, dim, log, input_dtype)


def _aten_softmax_backward_out(grad_output, output, dim, input_dtype, *, grad_input):
    return grad_input.copy_(_aten_backward(grad_output, output, dim, input_dtype, log=False))


def _aten_log_softmax_backward_out(grad_output, output, dim, input_dtype, *, out):
    return out.copy_(_aten_backward(grad_output, output, dim, input_dtype, log=True))


def _why_not_softmax_backward_out(grad_output, output, dim, input_dtype, *, grad_input):
    return _why_not_backward(grad_output, output, dim, input_dtype, grad_input)


ATEN_OVERRIDES = (
    AtenOverride("aten::_softmax", partial(_aten_forward, log=False), _why_not_forward),
    AtenOverride("aten::_softmax.out", partial(_aten_forward_out, log=False), _why_not_forward),
    AtenOverride("aten::_softmax_backward_data", partial(_aten_backward, log=False),
                 _why_not_backward),
    AtenOverride("aten::_softmax_backward_data.out", _aten_softmax_backward_out,
                 _why_not_softmax_backward_out),
    AtenOverride("aten::_log_softmax", partial(_aten_forward, log=True), _why_not_forward),
    AtenOverride("aten::_log_softmax.out", partial(_aten_forward_out, log=True), _why_not_forward),
    AtenOverride("aten::_log_softmax_backward_data", partial(_aten_backward, log=True),
                 _why_not_backward),
    AtenOverride("aten::_log_softmax_backward_data.out", _aten_log_softmax_backward_out,
                 _why_not_backward),
)


# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _logits(device, dtype, rows, width=5003):
    return (torch.randn(rows, width, device=device, dtype=torch.float32) * 4).to(dtype)


SELF_CHECKS = (
    SelfCheck("softmax", lambda device, dtype, rows: (_logits(device, dtype, rows),),
              run=softmax, reference=softmax_reference,
              torch_peer=lambda x: torch.softmax(x, -1)),
    SelfCheck("log_softmax", lambda device, dtype, rows: (_logits(device, dtype, rows),),
              run=log_softmax, reference=log_softmax_reference,
              torch_peer=lambda x: torch.log_softmax(x, -1)),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a bf16 problem per bucket
# --------------------------------------------------------------------------------------------

def _tune_problem(rows: int, cols: int, kernel: str):
    def make(device):
        x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        if kernel == "fwd":  # the row kernel itself, whatever the split config says
            out = torch.empty_like(x)
            return lambda: _launch_rows(SOFTMAX_FWD, [x], out, False) or out
        if kernel == "split":  # the Triton kernels' public path: CHUNK decides split or not
            return lambda: _forward_on_triton(x)
        if kernel == "cluster":  # the public call: CLUSTER decides the Hopper path or not
            return lambda: _forward(x, -1, False, x.dtype)
        y, grad = torch.softmax(x.float(), -1).to(x.dtype), torch.randn_like(x)
        if kernel == "bwd":  # the row kernel itself, whatever the cluster config says
            return lambda: _backward_on_triton(grad, y)
        return lambda: _backward(grad, y, -1, False, x.dtype)
    return make


_NO_CLUSTER = runtime.LaunchConfig((("CLUSTER", 0),), 8, 1)  # the Hopper paths off


def _forward_on_triton(x: torch.Tensor) -> torch.Tensor:
    with SOFTMAX_CLUSTER_FWD.forced(_NO_CLUSTER):
        return _forward(x, -1, False, x.dtype)


def _backward_on_triton(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with SOFTMAX_CLUSTER_BWD.forced(_NO_CLUSTER):
        return _backward(grad, y, -1, False, y.dtype)


def _buckets(shapes, kernel: str):
    return tuple(TuneBucket(bound, f"{rows}x{cols}", _tune_problem(rows, cols, kernel))
                 for bound, rows, cols in shapes)


_ROW_CANDIDATES = tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w}
                        for m, n in ((16, 128), (8, 256), (4, 512), (2, 1024), (1, 1024),
                                     (1, 2048), (2, 2048), (1, 4096), (2, 4096), (1, 8192),
                                     (1, 16384))
                        for w in (4, 8, 16)) \
    + tuple({"BLOCK_M": 1, "BLOCK_N": 32768, "num_warps": w} for w in (16, 32))  # 32000 in one read

# CLUSTER 0 is the Triton kernels (as the split and row kernels' configs choose them)
_CLUSTER_CANDIDATES = ({"CLUSTER": 0, "num_warps": 8},) + tuple(
    {"CLUSTER": c, "num_warps": w} for c in (1, 2, 4, 8) for w in (4, 8, 16))
_CLUSTER_SHAPES = (({"cols": 8192}, 16384, 4096), ({"cols": 32768}, 8192, 32000),
                   ({"cols": 65536}, 2048, 50257), ({"cols": 131072}, 1024, 131072),
                   ({"cols": 160000}, 256, 152064), (None, 512, 262144))

TUNING = (
    TuneSpace(SOFTMAX_FWD, _ROW_CANDIDATES,
              _buckets((({"cols": 128}, 65536, 128), ({"cols": 1024}, 65536, 1024),
                        ({"cols": 4096}, 16384, 4096), ({"cols": 8192}, 8192, 8192),
                        (None, 8192, 32000)), "fwd")),
    # CHUNK 0 is softmax_fwd's one program per row, the baseline the split forms must beat
    TuneSpace(SOFTMAX_SPLIT_FWD,
              ({"CHUNK": 0, "num_warps": 8},)
              + tuple({"CHUNK": c, "num_warps": w} for c in (2048, 4096, 8192, 16384, 32768)
                      for w in (2, 4, 8, 16)),
              _buckets((({"cols": 32768}, 8192, 32000), ({"cols": 65536}, 2048, 50257),
                        (None, 1024, 131072)), "split")),
    TuneSpace(SOFTMAX_CLUSTER_FWD, _CLUSTER_CANDIDATES, _buckets(_CLUSTER_SHAPES, "cluster")),
    TuneSpace(SOFTMAX_BWD, _ROW_CANDIDATES,
              _buckets((({"cols": 128}, 65536, 128), ({"cols": 1024}, 65536, 1024),
                        ({"cols": 8192}, 16384, 4096), (None, 8192, 32000)), "bwd")),
    TuneSpace(SOFTMAX_CLUSTER_BWD, _CLUSTER_CANDIDATES, _buckets(_CLUSTER_SHAPES, "cluster_bwd")),
)
