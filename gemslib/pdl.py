"""Programmatic dependent launch (sm_90) inside kernels: the wait, the early trigger, and the
prefetch of what the kernel before does not write.

A kernel launched dependent (``launch_pdl``; ``runtime.dependent_launch_here``) may start its
programs while the kernel before it on the stream still runs; it must not read what that
kernel writes, nor write what it reads, before ``griddepcontrol.wait`` returns. With
``PDL_EARLY`` (``runtime.early_dependents_here``) each program, once past its wait, lets the
next kernel launch (``griddepcontrol.launch_dependents``: the next kernel starts when every
program of this one has said so or ended), and a GEMV uses the time before its own wait to
bring its first K step of weights into L2: weights are written by no kernel of the step, and
a prefetch only warms L2 (the point of coherence), so a write to them before the wait would
still be read after it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

L2_LINE_BYTES = tl.constexpr(128)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr, PDL_EARLY: tl.constexpr):
    """PDL: wait until the kernel before this one on the stream has ended and its writes are
    visible. PDL_EARLY: then let the next kernel's programs launch."""
    if PDL:
        gdc_wait()
        if PDL_EARLY:
            gdc_launch_dependents()


@triton.jit
def prefetch_rows_to_l2(base_ptr, o_row, m_row, col_begin, col_end, stride_row,
                        BLOCK_COLS: tl.constexpr):
    """Ask L2 for columns [col_begin, min(col_begin + BLOCK_COLS, col_end)) of the rows
    ``o_row`` (where ``m_row``) of a row-major matrix at ``base_ptr``: one
    ``prefetch.global.L2`` a 128-byte line (one a row where BLOCK_COLS, a power of 2, is under
    a line's elements), nothing waited for, nothing loaded into registers. Normal eviction
    priority: a weight is read once, and lines kept as evict_last would outlive their read.
    Lanes out of bounds prefetch the matrix's first line instead (a prefetch of an address
    outside every allocation is undefined)."""
    LINE: tl.constexpr = L2_LINE_BYTES * 8 // base_ptr.dtype.element_ty.primitive_bitwidth
    STEP: tl.constexpr = LINE if BLOCK_COLS >= LINE else BLOCK_COLS
    o_col = col_begin + tl.arange(0, BLOCK_COLS // STEP) * STEP
    inside = m_row[:, None] & (o_col < col_end)[None, :]
    offsets = tl.where(inside, o_row.to(tl.int64)[:, None] * stride_row + o_col[None, :], 0)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                              "=r,l", [base_ptr + offsets], dtype=tl.int32, is_pure=False,
                              pack=1)
