"""Memory-layout helpers shared by kernels: elementwise layouts, program order, TMA.

Elementwise kernels have two paths: a flat one, when every operand has the same
non-overlapping, dense layout (then storage order is the iteration order), and a strided one
for everything else, which walks a logical index through up to ``MAX_RANK`` collapsed dims.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

MAX_RANK = 4
# log2(e), for kernels that compute exp(x) as exp2(x * LOG2E); a tl.constexpr because the
# compiler rejects a plain float global
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """True when two elements share memory (a stride-0 dim of size > 1), as torch detects it."""
    return any(size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride()))


def is_dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots in some order."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def same_dense_layout(*tensors: torch.Tensor) -> bool:
    """All tensors have one shape, one set of strides, and that layout is dense."""
    first = tensors[0]
    return is_dense(first) and all(
        t.shape == first.shape and t.stride() == first.stride() for t in tensors[1:])


def memory_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges spanned by ``a`` and ``b`` intersect (conservative)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        start = t.data_ptr()
        return start, start + (last + 1) * t.element_size()

    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1


def may_overlap_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: a stride-0 dim (an expanded tensor), or
    strides that do not nest (as_strided views). Conservative: False proves no overlap."""
    if t.is_contiguous():  # the usual case, answered without a look at the strides
        return False
    return _strides_overlap(tuple(t.shape), t.stride())


@functools.lru_cache(maxsize=1024)
def _strides_overlap(shape, strides) -> bool:
    span = 0  # elements spanned by the dims of smaller stride, minus one
    for size, stride in sorted((d for d in zip(shape, strides) if d[0] > 1),
                               key=lambda d: abs(d[1])):
        if abs(stride) <= span:  # a stride of 0 (expand) included
            return True
        span += (size - 1) * abs(stride)
    return False


def may_share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of ``a`` and one of ``b`` may be the same memory. Exact for views
    with one set of strides (slices of one buffer, such as q and k of a fused QKV projection)
    unless the search runs long; conservative (True when their bytes' spans intersect)
    otherwise. The verdict depends only on the layouts and the offset between them, so it is
    worked out once per (layouts, offset): in-place calls ask it every step."""
    if not memory_overlaps(a, b):
        return False
    size = a.element_size()
    delta, remainder = divmod(b.data_ptr() - a.data_ptr(), size)
    if a.dim() != b.dim() or size != b.element_size() or remainder:
        return True
    return _offset_reachable(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), delta)


def partly_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share elements without being the same view (same address,
    same strides): writing one while reading the other elementwise would read a written
    element."""
    return not (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()) and \
        may_share_elements(a, b)


@functools.lru_cache(maxsize=1024)
def _offset_reachable(shape_a, strides_a, shape_b, strides_b, delta: int) -> bool:
    """Whether a[i] and b[j] can coincide for views ``delta`` elements apart: iff
    sum_d (i_d - j_d) * stride_d == delta with each digit i_d - j_d in [-(b's size - 1),
    a's size - 1]. A search from the largest stride keeps only digits whose remainder the
    smaller dims can still reach (a dim of size 1 has only index 0, so its stride is the
    other tensor's); True (conservative) where the strides differ or the search runs long."""
    dims = []
    for stride_a, stride_b, size_a, size_b in zip(strides_a, strides_b, shape_a, shape_b):
        if max(size_a, size_b) == 1:
            continue
        stride = stride_b if size_a == 1 else stride_a
        if (size_b > 1 and stride_b != stride) or stride <= 0:
            return True
        dims.append((stride, size_a - 1, size_b - 1))
    dims.sort(reverse=True)
    reach = [(sum(st * up for st, up, _ in dims[i:]), sum(st * down for st, _, down in dims[i:]))
             for i in range(len(dims) + 1)]
    budget = [10000]

    def solvable(index: int, rest: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if index == len(dims):
            return rest == 0
        stride, up, down = dims[index]
        high, low = reach[index + 1]
        first = max(-down, -((high - rest) // stride))  # rest - digit * stride <= high
        last = min(up, (rest + low) // stride)  # rest - digit * stride >= -low
        return any(solvable(index + 1, rest - digit * stride) for digit in range(first, last + 1))

    return solvable(0, delta)


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last stride: itself when it has one (or its last dim has one element),
    else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t (..., n) as a 2-d (rows, n) tensor with a unit last stride: a view where the leading
    dims merge, a copy otherwise."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def rows_of(t: torch.Tensor, output: bool = False) -> tuple[torch.Tensor, int]:
    """(t as something a row kernel can walk, the stride between its rows): contiguous tensors
    as they are (no view to build: this runs on every call), others through :func:`as_rows`.
    An ``output`` is only ever viewed, never copied (a copy would lose the kernel's writes):
    a layout that is not viewable as rows raises."""
    if t.is_contiguous():
        return t, t.shape[-1]
    rows = t.view(-1, t.shape[-1]) if output else as_rows(t)
    return rows, rows.stride(0)


def viewable_as_rows(t: torch.Tensor) -> bool:
    """Whether ``t.view(-1, t.shape[-1])`` exists (so a kernel can write into t's memory)."""
    try:
        t.view(-1, t.shape[-1])
        return True
    except RuntimeError:
        return False


def fits_one_block(args) -> bool:
    """Triton heuristic for row kernels: the whole row (``n_cols``) fits one ``BLOCK_N`` block."""
    return args["n_cols"] <= args["BLOCK_N"]


def collapse_dims(shape: Sequence[int], *strides: Sequence[int]):
    """Drop size-1 dims and merge neighbours that are contiguous in every operand.

    Returns ``(shape, [strides per operand])`` with at least one dim; the logical
    (row-major) element order is unchanged.
    """
    dims = [(size, [s[i] for s in strides]) for i, size in enumerate(shape) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, dim_strides in dims:
        if merged:
            outer_size, outer_strides = merged[-1]
            if all(o == d * size for o, d in zip(outer_strides, dim_strides)):
                merged[-1] = (outer_size * size, dim_strides)
                continue
        merged.append((size, dim_strides))
    if not merged:
        merged = [(1, [0] * len(strides))]
    return [m[0] for m in merged], [[m[1][k] for m in merged] for k in range(len(strides))]


def padded_layout(shape: Sequence[int], *strides: Sequence[int]):
    """``collapse_dims`` padded at the front to ``MAX_RANK`` dims, or ``None`` if it needs more."""
    shape, strides = collapse_dims(shape, *strides)
    if len(shape) > MAX_RANK:
        return None
    pad = MAX_RANK - len(shape)
    return [1] * pad + shape, [[0] * pad + s for s in strides]


@triton.jit
def strided_offsets(o_n, n_1, n_2, n_3, stride_0, stride_1, stride_2, stride_3):
    """Memory offsets of row-major logical indices ``o_n`` in a 4-d layout of sizes
    (any, n_1, n_2, n_3) and strides ``stride_0..3`` (int64 arithmetic)."""
    o_n = o_n.to(tl.int64)
    o_3 = o_n % n_3
    rest = o_n // n_3
    o_2 = rest % n_2
    rest = rest // n_2
    o_1 = rest % n_1
    o_0 = rest // n_1
    return o_0 * stride_0 + o_1 * stride_1 + o_2 * stride_2 + o_3 * stride_3


@triton.jit
def element_offsets(o_n, n_1, n_2, n_3, stride_0, stride_1, stride_2, stride_3,
                    STRIDED: tl.constexpr):
    """Memory offsets of one operand at logical indices ``o_n``: ``o_n`` itself on the flat
    path, else the strided walk."""
    o_mem = o_n
    if STRIDED:
        o_mem = strided_offsets(o_n, n_1, n_2, n_3, stride_0, stride_1, stride_2, stride_3)
    return o_mem


@triton.jit
def head_and_block(n_blocks, HEAVY_FIRST: tl.constexpr):
    """(index into B * H, block index) of this program in a 1-d grid of B * H * n_blocks, for
    kernels whose programs each take one block of one head (attention's, in Triton and in
    Gluon). HEAVY_FIRST (causal, where the kernel numbers each head's blocks heaviest first):
    heads fastest, so every head's heavy blocks go out before any head's light ones and the last
    wave is short programs. Otherwise blocks fastest: the programs running together belong to
    one or two heads and share that head's tiles in L2, a reuse heads fastest would lose."""
    i_hb = tl.program_id(0)
    if HEAVY_FIRST:
        n_heads = tl.num_programs(0) // n_blocks
        return i_hb % n_heads, i_hb // n_heads
    else:
        return i_hb // n_blocks, i_hb % n_blocks


def tma_addressable(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor (Hopper's TMA) can address ``t``: a 16-byte aligned base,
    a unit last stride, every other stride a multiple of 16 bytes, rows of 16 bytes or more."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.shape[-1] * size >= 16
            and not any(stride * size % 16 for stride in t.stride()[:-1]))
