"""RMSNorm over the last dim, optionally fused with a residual add; forward and backward.

    rstd      = 1 / sqrt(mean(x**2) + eps)            per row (fp32)
    rms_norm  = x * rstd * (weight_offset + weight)    x (..., N), weight (N,) or None
    add_rms_norm(x, residual) = (rms_norm(x + residual), x + residual)

weight_offset is 0 for most models and 1 for Gemma's ``x_hat * (1 + weight)`` (its weights
are stored as offsets from one); the scale is applied in fp32, before the one rounding.

    backward, with x_hat = x * rstd and g = grad * (weight_offset + weight):
    dx        = rstd * (g - x_hat * mean(g * x_hat))   per row
    dweight   = sum over rows of grad * x_hat          (fp32 partial sums per program, no atomics,
                                                       then summed by a second kernel)

Rows that fit one block (N <= BLOCK_N) are read once; wider rows loop over column blocks
(two passes: the sum of squares, then the normalisation). The file reads top-down: kernels,
launchers, references, public functions and custom ops, autograd, aten overrides, self-checks,
tuning.
"""

from __future__ import annotations

import math


import torch
import triton
import triton.language as tl

from gemslib import checks, layout, pdl, runtime
from gemslib.registry import AtenOverride, SelfCheck, TuneBucket, TuneSpace


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.heuristics({"ONE_PASS": layout.fits_one_block})
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, rstd_ptr,
    n_rows, n_cols,
    stride_x_row, stride_residual_row, stride_out_row, stride_residual_out_row,
    eps, weight_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
    PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
):
    """BLOCK_M rows per program. With a residual, ``residual_out = x + residual`` is stored and
    normalised; ``residual_out`` may be ``residual`` itself and ``out`` may be ``x`` (in place):
    every element is read before the same thread writes it. ``residual`` and ``residual_out``
    (given together), ``weight`` and ``rstd`` (rows,) may be None. PDL: launched dependent
    (runtime.dependent_launch_here), it first waits for the kernel before it on the stream;
    PDL_EARLY: then lets the next one launch (gemslib.pdl)."""
    pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
    o_row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_row = o_row < n_rows
    o_row_64 = o_row.to(tl.int64)[:, None]  # int64: row * stride can pass 2**31
    p_x = x_ptr + o_row_64 * stride_x_row
    p_out = out_ptr + o_row_64 * stride_out_row
    if residual_ptr is not None:
        p_residual = residual_ptr + o_row_64 * stride_residual_row
        p_residual_out = residual_out_ptr + o_row_64 * stride_residual_out_row
    if ONE_PASS:
        o_n = tl.arange(0, BLOCK_N)[None, :]
        m_x = m_row[:, None] & (o_n < n_cols)
        b_x = tl.load(p_x + o_n, mask=m_x, other=0.0).to(tl.float32)
        # the weight is issued with x's load, not after the reduction: off the critical path
        if weight_ptr is not None:
            b_weight = tl.load(weight_ptr + o_n, mask=o_n < n_cols,
                               other=0.0).to(tl.float32) + weight_offset
        if residual_ptr is not None:
            b_x += tl.load(p_residual + o_n, mask=m_x, other=0.0).to(tl.float32)
            tl.store(p_residual_out + o_n, b_x.to(residual_out_ptr.dtype.element_ty), mask=m_x)
        b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / n_cols + eps)
        b_out = b_x * b_rstd[:, None]
        if weight_ptr is not None:
            b_out *= b_weight
        tl.store(p_out + o_n, b_out.to(out_ptr.dtype.element_ty), mask=m_x)
    else:
        # per-lane sums, reduced once after the loop (not a cross-thread reduction per block)
        b_squares = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i_n in range(0, n_cols, BLOCK_N):  # i_n: the block's first column
            o_n = i_n + tl.arange(0, BLOCK_N)[None, :]
            m_x = m_row[:, None] & (o_n < n_cols)
            b_x = tl.load(p_x + o_n, mask=m_x, other=0.0).to(tl.float32)
            if residual_ptr is not None:
                b_x += tl.load(p_residual + o_n, mask=m_x, other=0.0).to(tl.float32)
                tl.store(p_residual_out + o_n, b_x.to(residual_out_ptr.dtype.element_ty),
                         mask=m_x)
            b_squares += b_x * b_x
        b_rstd = 1.0 / tl.sqrt(tl.sum(b_squares, axis=1) / n_cols + eps)
        n_blocks = tl.cdiv(n_cols, BLOCK_N)
        for i_step in range(0, n_blocks):  # last block first: it is the one still in cache
            col_start = (n_blocks - 1 - i_step) * BLOCK_N
            o_n = col_start + tl.arange(0, BLOCK_N)[None, :]
            m_x = m_row[:, None] & (o_n < n_cols)
            # the last read of these bytes: evict them first, keep other rows' first pass
            if residual_ptr is not None:  # the sum this program stored in the first pass
                b_x = tl.load(p_residual_out + o_n, mask=m_x, other=0.0,
                              eviction_policy="evict_first").to(tl.float32)
            else:
                b_x = tl.load(p_x + o_n, mask=m_x, other=0.0,
                              eviction_policy="evict_first").to(tl.float32)
            b_out = b_x * b_rstd[:, None]
            if weight_ptr is not None:
                b_out *= tl.load(weight_ptr + o_n, mask=o_n < n_cols,
                                 other=0.0).to(tl.float32) + weight_offset
            tl.store(p_out + o_n, b_out.to(out_ptr.dtype.element_ty), mask=m_x)
    if rstd_ptr is not None:
        tl.store(rstd_ptr + o_row, b_rstd, mask=m_row)


@triton.heuristics({"ONE_PASS": layout.fits_one_block})
@triton.jit
def _rms_norm_bwd_kernel(
    grad_ptr, x_ptr, weight_ptr, rstd_ptr, grad_extra_ptr, dx_ptr, dweight_partial_ptr,
    n_rows, n_cols, rows_per_program,
    stride_grad_row, stride_x_row, stride_grad_extra_row, stride_dx_row,
    weight_offset,
    BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Rows [i_m * rows_per_program, ...) one at a time; this program's share of dweight goes
    to row ``i_m`` of the fp32 ``dweight_partial`` (n_programs, n_cols), None without a
    weight. ``grad_extra`` (the gradient of add_rms_norm's sum output, or None) is added to dx
    before its single rounding."""
    i_m = tl.program_id(0)
    row_start = i_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    if weight_ptr is not None:
        p_partial = dweight_partial_ptr + i_m.to(tl.int64) * n_cols
    first_row = row_start.to(tl.int64)  # pointers advance one row per iteration
    p_x = x_ptr + first_row * stride_x_row
    p_grad = grad_ptr + first_row * stride_grad_row
    p_dx = dx_ptr + first_row * stride_dx_row
    if grad_extra_ptr is not None:
        p_grad_extra = grad_extra_ptr + first_row * stride_grad_extra_row
    p_rstd = rstd_ptr + first_row
    if ONE_PASS:
        o_n = tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        if weight_ptr is not None:
            b_weight = tl.load(weight_ptr + o_n, mask=m_n, other=0.0).to(tl.float32) \
                + weight_offset
        b_dweight = tl.zeros([BLOCK_N], dtype=tl.float32)
        for _ in range(row_start, row_end):
            b_x = tl.load(p_x + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_grad = tl.load(p_grad + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_rstd = tl.load(p_rstd)
            b_xhat = b_x * b_rstd
            b_g = b_grad
            if weight_ptr is not None:
                b_g = b_grad * b_weight
            b_mean_g_xhat = tl.sum(b_g * b_xhat, axis=0) / n_cols
            b_dx = b_rstd * (b_g - b_xhat * b_mean_g_xhat)
            if grad_extra_ptr is not None:
                b_dx += tl.load(p_grad_extra + o_n, mask=m_n, other=0.0).to(tl.float32)
            tl.store(p_dx + o_n, b_dx.to(dx_ptr.dtype.element_ty), mask=m_n)
            b_dweight += b_grad * b_xhat
            p_x += stride_x_row
            p_grad += stride_grad_row
            p_dx += stride_dx_row
            if grad_extra_ptr is not None:
                p_grad_extra += stride_grad_extra_row
            p_rstd += 1
        if weight_ptr is not None:
            tl.store(p_partial + o_n, b_dweight, mask=m_n)
    else:
        # this program's partial row starts at zero; it accumulates in place
        if weight_ptr is not None:
            for i_n in range(0, n_cols, BLOCK_N):  # i_n: the block's first column
                o_n = i_n + tl.arange(0, BLOCK_N)
                tl.store(p_partial + o_n, tl.zeros([BLOCK_N], dtype=tl.float32),
                         mask=o_n < n_cols)
        for _ in range(row_start, row_end):
            b_rstd = tl.load(p_rstd)
            b_dot = tl.zeros([BLOCK_N], dtype=tl.float32)
            for i_n in range(0, n_cols, BLOCK_N):
                o_n = i_n + tl.arange(0, BLOCK_N)
                m_n = o_n < n_cols
                b_x = tl.load(p_x + o_n, mask=m_n, other=0.0).to(tl.float32)
                b_g = tl.load(p_grad + o_n, mask=m_n, other=0.0).to(tl.float32)
                if weight_ptr is not None:
                    b_g *= tl.load(weight_ptr + o_n, mask=m_n, other=0.0).to(tl.float32) \
                        + weight_offset
                b_dot += b_g * b_x
            b_mean_g_xhat = tl.sum(b_dot, axis=0) * b_rstd / n_cols
            n_blocks = tl.cdiv(n_cols, BLOCK_N)
            for i_step in range(0, n_blocks):  # last block first: it is the one still in cache
                col_start = (n_blocks - 1 - i_step) * BLOCK_N
                o_n = col_start + tl.arange(0, BLOCK_N)
                m_n = o_n < n_cols
                b_xhat = tl.load(p_x + o_n, mask=m_n, other=0.0).to(tl.float32) * b_rstd
                b_grad = tl.load(p_grad + o_n, mask=m_n, other=0.0).to(tl.float32)
                b_g = b_grad
                if weight_ptr is not None:
                    b_g = b_grad * (tl.load(weight_ptr + o_n, mask=m_n,
                                            other=0.0).to(tl.float32) + weight_offset)
                    b_partial = tl.load(p_partial + o_n, mask=m_n, other=0.0)
                    tl.store(p_partial + o_n, b_partial + b_grad * b_xhat, mask=m_n)
                b_dx = b_rstd * (b_g - b_xhat * b_mean_g_xhat)
                if grad_extra_ptr is not None:
                    b_dx += tl.load(p_grad_extra + o_n, mask=m_n, other=0.0).to(tl.float32)
                tl.store(p_dx + o_n, b_dx.to(dx_ptr.dtype.element_ty), mask=m_n)
            p_x += stride_x_row
            p_grad += stride_grad_row
            p_dx += stride_dx_row
            if grad_extra_ptr is not None:
                p_grad_extra += stride_grad_extra_row
            p_rstd += 1


@triton.jit
def _rms_norm_dweight_kernel(
    partial_ptr, dweight_ptr,
    n_partials, n_cols,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """``dweight[n] = sum over p of partial[p, n]``: the backward's fp32 partial rows
    (n_partials, n_cols), contiguous, BLOCK_N columns a program, BLOCK_P rows a step; summed
    in fp32 and rounded once to dweight's dtype (n_cols,)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    # per-lane sums, reduced over the rows once after the loop
    b_sums = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for i_p in range(0, n_partials, BLOCK_P):  # i_p: the step's first partial row
        o_p = i_p + tl.arange(0, BLOCK_P)
        m_partial = (o_p < n_partials)[:, None] & m_n[None, :]
        # int64: partial rows * n_cols can pass 2**31 for very wide rows
        p_partial = partial_ptr + o_p.to(tl.int64)[:, None] * n_cols + o_n[None, :]
        b_sums += tl.load(p_partial, mask=m_partial, other=0.0)
    tl.store(dweight_ptr + o_n, tl.sum(b_sums, axis=0).to(dweight_ptr.dtype.element_ty),
             mask=m_n)


RMS_NORM_FWD = runtime.TunedKernel("rms_norm", "rms_norm_fwd", _rms_norm_fwd_kernel,
                                   tunables=("BLOCK_M", "BLOCK_N"), shape_keys=("rows", "cols"),
                                   dependent_launch=True)
RMS_NORM_BWD = runtime.TunedKernel("rms_norm", "rms_norm_bwd", _rms_norm_bwd_kernel,
                                   tunables=("BLOCK_N",), shape_keys=("rows", "cols"))
# partials: the rows of rms_norm_bwd's dweight_partial (its programs), not x's rows
RMS_NORM_DWEIGHT = runtime.TunedKernel("rms_norm", "rms_norm_dweight", _rms_norm_dweight_kernel,
                                       tunables=("BLOCK_N", "BLOCK_P"),
                                       shape_keys=("partials", "cols"))


# --------------------------------------------------------------------------------------------
# Launchers (inputs validated by the public functions)
# --------------------------------------------------------------------------------------------


def _launch_forward(x, residual, weight, eps, out, residual_out, want_rstd: bool,
                    weight_offset: float = 0.0):
    """Writes ``out`` (and ``residual_out``); returns rstd (rows,) fp32 or None."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else math.prod(x.shape[:-1])
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if want_rstd else None
    if x.numel() == 0:
        return rstd.fill_(float("nan")) if want_rstd else None  # a mean over no columns
    # outputs are contiguous or (in place) viewable as rows, as the callers check
    x_rows, x_stride = layout.rows_of(x)
    out_rows, out_stride = layout.rows_of(out, output=True)
    residual_rows, residual_stride = layout.rows_of(residual) if residual is not None \
        else (None, 0)
    residual_out_rows, residual_out_stride = layout.rows_of(residual_out, output=True) \
        if residual_out is not None else (None, 0)
    in_place = out is x or (residual is not None and residual_out is residual)
    # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
    RMS_NORM_FWD.launch(
        lambda meta: (runtime.cdiv(n_rows, meta["BLOCK_M"]),),
        x_rows, residual_rows, weight, out_rows, residual_out_rows, rstd,
        n_rows, n_cols,
        x_stride, residual_stride, out_stride, residual_out_stride,
        eps, weight_offset,
        shape=(n_rows, n_cols),
        restore=[t for t in (x, residual) if t is not None] if in_place else ())
    return rstd


def _launch_backward(grad, x, weight, rstd, grad_extra=None, weight_offset: float = 0.0):
    """(dx, dweight or None) for ``rms_norm(x, weight)`` given the forward's rstd; dx includes
    ``grad_extra`` when given."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight) if weight is not None else None
    x_rows, grad_rows = layout.as_rows(x), layout.as_rows(grad)
    n_rows, n_cols = x_rows.shape
    rows_per_program, n_programs = _backward_programs(n_rows, x.device)
    partial = None
    if weight is not None:
        # kept scratch, not a buffer of the call's own: a call plan replays only launches on
        # the call's tensors, its outputs and kept scratch. Every element is written by the
        # backward kernel before the sum reads it (launches on one stream run in order).
        n_floats = n_programs * n_cols
        partial = runtime.split_scratch(x.device, 0, n_floats)[1][:n_floats].view(
            n_programs, n_cols)
    dx_rows = dx.view(-1, n_cols)
    extra_rows = layout.as_rows(grad_extra) if grad_extra is not None else None
    # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
    RMS_NORM_BWD.launch(
        lambda meta: (n_programs,),
        grad_rows, x_rows, weight, rstd, extra_rows, dx_rows, partial,
        n_rows, n_cols, rows_per_program,
        grad_rows.stride(0), x_rows.stride(0),
        extra_rows.stride(0) if extra_rows is not None else 0, dx_rows.stride(0),
        weight_offset,
        shape=(n_rows, n_cols))
    dweight = _launch_dweight(partial, weight.dtype) if weight is not None else None
    return dx, dweight


def _backward_programs(n_rows: int, device: torch.device) -> tuple[int, int]:
    """(rows a program, programs) of the backward kernel: enough programs to fill the GPU (4
    per SM), few enough partial dweight rows (one a program) to sum."""
    slots = 4 * runtime.multiprocessor_count(device.index or 0)
    rows_per_program = runtime.cdiv(n_rows, slots)
    return rows_per_program, runtime.cdiv(n_rows, rows_per_program)


def _launch_dweight(partial, dtype):
    """dweight (n_cols,) of ``dtype``: the sum of the fp32 ``partial`` rows (n_partials,
    n_cols), contiguous; a kernel (not torch's sum), so that the backward's call stays
    plannable (only kernel launches and allocations)."""
    n_partials, n_cols = partial.shape
    dweight = torch.empty(n_cols, dtype=dtype, device=partial.device)
    # positional, one group per line (TunedKernel.launch forwards no keyword kernel arguments)
    RMS_NORM_DWEIGHT.launch(
        lambda meta: (runtime.cdiv(n_cols, meta["BLOCK_N"]),),
        partial, dweight,
        n_partials, n_cols,
        shape=(n_partials, n_cols))
    return dweight


# --------------------------------------------------------------------------------------------
# Plain PyTorch references (tests run them in float64)
# --------------------------------------------------------------------------------------------


def rms_norm_reference(x, weight=None, eps=1e-6, weight_offset=0.0):
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed * (weight + weight_offset) if weight is not None else normed


def add_rms_norm_reference(x, residual, weight=None, eps=1e-6, weight_offset=0.0):
    total = x + residual
    return rms_norm_reference(total, weight, eps, weight_offset), total


# --------------------------------------------------------------------------------------------
# Public functions and custom ops
# --------------------------------------------------------------------------------------------


def _check_inputs(function: str, x, weight, residual=None):
    checks.float_tensor(function, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{function}: x must have at least one dim (normalised over the last)")
    if residual is not None:
        checks.tensor(function, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{function}: residual must have x's shape {tuple(x.shape)}, "
                             f"got {tuple(residual.shape)}")
        checks.like(function, "residual", residual, x)
    if weight is not None:
        checks.tensor(function, "weight", weight, or_none=True)
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"{function}: weight must have shape ({x.shape[-1]},) to match x's "
                             f"last dim, got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"{function}: weight must be on {x.device}, got {weight.device}")
        checks.float_tensor(function, "weight", weight, expected="floating-point")


def _upcast_reference(fn, *tensors, eps, weight_offset=0.0):
    """Torch's own arithmetic for what the kernels do not take (float64, other devices):
    float64 stays float64, anything else is computed in fp32, like the kernels."""
    work = [t if t is None or t.dtype == torch.float64 else t.float() for t in tensors]
    return fn(*work, eps=eps, weight_offset=weight_offset)


def _check_weight_offset(function: str, weight, weight_offset) -> float:
    weight_offset = checks.as_float(function, "weight_offset", weight_offset)
    if weight is None and weight_offset != 0.0:
        raise ValueError(f"{function}: weight_offset scales by (weight_offset + weight) and "
                         f"needs a weight; got weight=None with weight_offset={weight_offset}")
    return weight_offset


def _forward(x, weight, eps, want_rstd, weight_offset=0.0):
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = _launch_forward(x, None, weight.contiguous() if weight is not None else None, eps,
                           out, None, want_rstd, weight_offset)
    return out, rstd


def _kernel_takes(x, *others) -> bool:
    return runtime.kernel_runs(x, *others) and all(t is None or t.dtype == x.dtype for t in others)


_RMS_NORM_CALLS = runtime.CallPlans("rms_norm")
_ADD_RMS_NORM_CALLS = runtime.CallPlans("add_rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6,
             weight_offset: float = 0.0) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * (weight_offset + weight)`` over the last dim of
    ``x`` (..., N).

    weight: (N,) or None. Statistics in fp32; the result has x's dtype and shape (contiguous).
    Differentiable (dx and dweight).

    Args:
        x: (..., N) floating tensor with at least one dim, any strides. The kernel takes fp16,
            bf16 and fp32 on the kernel device; other dtypes and devices (or a weight of
            another dtype) are computed by torch, in fp32 (fp64 for fp64).
        weight: (N,) floating tensor on x's device, or None (no scale).
        eps: added to mean(x**2) before the square root; a float or 0-d tensor.
        weight_offset: added to the weight (in fp32) before it scales: 1.0 for Gemma's
            ``(1 + weight)``; needs a weight.

    Returns:
        (..., N) contiguous tensor of x's dtype.

    Raises:
        TypeError: x or weight is not a floating-point tensor, or eps or weight_offset is not
            a real number.
        ValueError: x is 0-d, weight is not (N,) or on another device, or weight_offset is
            not 0 without a weight.
    """
    args = (x, weight, eps, weight_offset)  # as given: a plan is found by the calls' arguments
    key, planned = _RMS_NORM_CALLS.replayed(*args)
    if planned is not None:
        return planned
    _check_inputs("gemslib.rms_norm", x, weight)
    eps = checks.as_float("gemslib.rms_norm", "eps", eps)
    weight_offset = _check_weight_offset("gemslib.rms_norm", weight, weight_offset)
    if runtime.wants_custom_op(x, weight):
        return _rms_norm_forward_op(x, weight, eps, weight_offset)[0]
    if not _kernel_takes(x, weight):
        return _upcast_reference(rms_norm_reference, x, weight, eps=eps,
                                 weight_offset=weight_offset).to(x.dtype)
    return _RMS_NORM_CALLS.plan(key, args, lambda: _forward(x, weight, eps, want_rstd=False,
                                                            weight_offset=weight_offset)[0])


def _add_rms_norm(x, residual, weight, eps, out=None, residual_out=None, weight_offset=0.0):
    """Kernel (or torch for what it does not take) without autograd; ``out``/``residual_out``
    may be ``x``/``residual`` (in place)."""
    if not _kernel_takes(x, residual, weight):
        normed, total = _upcast_reference(add_rms_norm_reference, x, residual, weight, eps=eps,
                                          weight_offset=weight_offset)
    elif out is not None and not all(t.stride(-1) == 1 and layout.viewable_as_rows(t) for t in (out, residual_out)):
        # layouts the kernel cannot write
        normed, total = _add_rms_norm(x, residual, weight, eps, weight_offset=weight_offset)
    else:
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _launch_forward(x, residual, weight.contiguous() if weight is not None else None, eps,
                        out, residual_out, want_rstd=False, weight_offset=weight_offset)
        return out, residual_out
    if out is None:
        return normed.to(x.dtype), total.to(x.dtype)
    residual_out.copy_(total)
    return out.copy_(normed), residual_out


def _check_in_place_aliasing(function: str, x, residual, weight):
    """``add_rms_norm(..., inplace=True)`` writes the normalised rows into x and the sum into
    residual: refuse tensors the kernel would read after another element's write (x and
    residual sharing memory, or either sharing memory with itself). A weight that shares memory
    with them is copied first (it is one row), so the call sees the weight it was given.
    Returns the weight to use."""
    for name, t in (("x", x), ("residual", residual)):
        if layout.may_overlap_itself(t):
            raise ValueError(f"{function}: {name} has elements that share memory (e.g. an "
                             f"expanded tensor, a stride-0 dim), so inplace=True cannot write "
                             f"into it; pass {name}.clone()")
    if layout.may_share_elements(x, residual):
        raise ValueError(f"{function}: x and residual must not share memory when inplace=True "
                         f"(the sum is written into residual and the normalised result into x); "
                         f"pass a clone of one of them, or call it with inplace=False")
    if weight is not None and (layout.memory_overlaps(weight, x) or
                               layout.memory_overlaps(weight, residual)):
        weight = weight.clone()
    return weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                 eps: float = 1e-6, inplace: bool = False, weight_offset: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight), x + residual)`` in one pass over the data.

    x, residual: (..., N) of one dtype; weight (N,) or None. With ``inplace=True`` (as LLM
    servers use it) the sum is written into ``residual`` and the normalised result into ``x``,
    and those two tensors are returned; x and residual must then not share memory, with each
    other or within themselves (an expanded tensor): a ValueError says which. Out of place,
    they may (``add_rms_norm(a, a)`` normalises ``2 * a``). Differentiable when not in place.

    Args:
        x: (..., N) floating tensor with at least one dim, any strides; as for ``rms_norm``,
            fp16, bf16 and fp32 on the kernel device run the kernel, the rest torch.
        residual: (..., N) tensor of x's shape, dtype and device.
        weight: (N,) floating tensor on x's device, or None (no scale).
        eps: added to mean(sum**2) before the square root; a float or 0-d tensor.
        inplace: write the normalised rows into x and the sum into residual.
        weight_offset: as for ``rms_norm`` (1.0 for Gemma's ``(1 + weight)``).

    Returns:
        (normed, total), both (..., N) of x's dtype: ``normed = rms_norm(total, weight, eps)``,
        ``total = x + residual``; contiguous new tensors, or ``(x, residual)`` when in place.

    Raises:
        TypeError: x, residual or weight is not a (floating-point) tensor, or eps or inplace
            has the wrong type.
        ValueError: x is 0-d, residual differs from x in shape, dtype or device, weight is not
            (N,) or on another device, weight_offset is not 0 without a weight; in place, x
            and residual share memory.
        RuntimeError: ``inplace=True`` with x or residual requiring grad.
    """
    args = (x, residual, weight, eps, weight_offset)  # as given (see rms_norm)
    key, planned = _ADD_RMS_NORM_CALLS.replayed(*args) if inplace is False else (None, None)
    if planned is not None:
        return planned
    _check_inputs("gemslib.add_rms_norm", x, weight, residual)
    eps = checks.as_float("gemslib.add_rms_norm", "eps", eps)
    inplace = checks.as_bool("gemslib.add_rms_norm", "inplace", inplace)
    weight_offset = _check_weight_offset("gemslib.add_rms_norm", weight, weight_offset)
    if inplace:
        if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad):
            raise RuntimeError("gemslib.add_rms_norm: inplace=True cannot be used on tensors "
                               "that require grad")
        weight = _check_in_place_aliasing("gemslib.add_rms_norm", x, residual, weight)
        return _add_rms_norm(x, residual, weight, eps, out=x, residual_out=residual,
                             weight_offset=weight_offset)
    if runtime.wants_custom_op(x, residual, weight):
        return _add_rms_norm_op(x, residual, weight, eps, weight_offset)
    return _ADD_RMS_NORM_CALLS.plan(key, args, lambda: _add_rms_norm(
        x, residual, weight, eps, weight_offset=weight_offset))


def _forward_with_rstd(x, weight, eps, weight_offset=0.0):
    if not _kernel_takes(x, weight):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=-1) + eps).reshape(-1)
        out = _upcast_reference(rms_norm_reference, x, weight, eps=eps,
                                weight_offset=weight_offset)
        return out.to(x.dtype).contiguous(), rstd
    return _forward(x, weight, eps, want_rstd=True, weight_offset=weight_offset)


def _backward(grad, x, weight, rstd, grad_extra=None, weight_offset=0.0):
    if not _kernel_takes(x, grad, weight, grad_extra):
        x32, g32 = x.float(), grad.float()
        rstd_col = rstd.reshape(*x.shape[:-1], 1)
        x_hat = x32 * rstd_col
        g = g32 * (weight.float() + weight_offset) if weight is not None else g32
        dx = rstd_col * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        if grad_extra is not None:
            dx = dx + grad_extra.float()
        dweight = (g32 * x_hat).reshape(-1, x.shape[-1]).sum(0) if weight is not None else None
        return dx.to(x.dtype), dweight.to(weight.dtype) if weight is not None else None
    return _launch_backward(grad, x, weight.contiguous() if weight is not None else None, rstd,
                            grad_extra, weight_offset)


def _rms_norm_forward_impl(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, rstd) with rstd (rows,) fp32, what the backward needs."""
    return _forward_with_rstd(x, weight, eps, weight_offset)


def _rms_norm_backward_impl(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                            rstd: torch.Tensor, grad_extra: torch.Tensor | None = None,
                            weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [+ grad_extra], dweight); dweight is empty when there is no weight."""
    dx, dweight = _backward(grad, x, weight, rstd, grad_extra, weight_offset)
    return dx, dweight if dweight is not None else x.new_empty((0,))


def _add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm(x, residual, weight, eps, weight_offset=weight_offset)


def _rms_norm_forward_fake(x, weight, eps, weight_offset=0.0):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(
        (rows,), dtype=torch.float32)


def _rms_norm_backward_fake(grad, x, weight, rstd, grad_extra=None, weight_offset=0.0):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight) if weight is not None else x.new_empty((0,)))


def _add_rms_norm_fake(x, residual, weight, eps, weight_offset=0.0):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, *offset = inputs
    ctx.weight_offset, ctx.n_inputs = (offset[0] if offset else 0.0), len(inputs)
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx, grad_out, grad_rstd, ops):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = ops.rms_norm_backward(grad_out.contiguous(), x, weight, rstd, None,
                                        ctx.weight_offset)
    return (dx, (dweight if weight is not None else None)) + (None,) * (ctx.n_inputs - 2)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps, *offset = inputs
    ctx.eps, ctx.weight_offset = eps, (offset[0] if offset else 0.0)
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(output[1], weight)


def _add_rms_norm_grad(ctx, grad_normed, grad_total, ops):
    total, weight = ctx.saved_tensors
    # the forward kept no rstd (it serves inference); one cheap pass recomputes it
    _, rstd = ops.rms_norm_forward(total, weight, ctx.eps, ctx.weight_offset)
    d_total, dweight = ops.rms_norm_backward(
        grad_normed.contiguous(), total, weight, rstd,
        grad_total.contiguous() if grad_total is not None else None, ctx.weight_offset)
    return (d_total, d_total, (dweight if weight is not None else None)) + \
        (None,) * (ctx.n_inputs - 3)


_rms_norm_backward_op = runtime.CustomOp("rms_norm_backward", _rms_norm_backward_impl,
                                         fake=_rms_norm_backward_fake)
_rms_norm_forward_op = runtime.CustomOp("rms_norm_forward", _rms_norm_forward_impl,
                                        fake=_rms_norm_forward_fake, setup_context=_rms_norm_setup,
                                        backward=_rms_norm_grad, uses=(_rms_norm_backward_op,))
_add_rms_norm_op = runtime.CustomOp("add_rms_norm", _add_rms_norm_impl,
                                    fake=_add_rms_norm_fake, setup_context=_add_rms_norm_setup,
                                    backward=_add_rms_norm_grad,
                                    uses=(_rms_norm_forward_op, _rms_norm_backward_op))


def _rms_norm_eps_input_impl(x: torch.Tensor, weight: torch.Tensor | None,
                             eps: torch.Tensor, weight_offset: float = 0.0) -> torch.Tensor:
    """rms_norm with eps a 0-d CPU tensor: under ``dynamic=True`` dynamo makes a module's float
    epsilon a graph input, which the graph passes hand on as it is (forward only)."""
    return _forward_with_rstd(x, weight, float(eps), weight_offset)[0]


def _add_rms_norm_eps_input_impl(x: torch.Tensor, residual: torch.Tensor,
                                 weight: torch.Tensor | None, eps: torch.Tensor,
                                 weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm(x, residual, weight, float(eps), weight_offset=weight_offset)


_rms_norm_eps_input_op = runtime.CustomOp(
    "rms_norm_eps_input", _rms_norm_eps_input_impl,
    fake=lambda x, weight, eps, weight_offset=0.0: _rms_norm_forward_fake(x, weight, 0.0)[0])
_add_rms_norm_eps_input_op = runtime.CustomOp(
    "add_rms_norm_eps_input", _add_rms_norm_eps_input_impl,
    fake=lambda x, residual, weight, eps, weight_offset=0.0: _add_rms_norm_fake(
        x, residual, weight, 0.0))


# --------------------------------------------------------------------------------------------
# aten overrides: what F.rms_norm reaches (aten::rms_norm is CompositeImplicitAutograd and calls
# _fused_rms_norm, whose derivative is _fused_rms_norm_backward). On torch's CPU build
# _fused_rms_norm is itself composite; registering a CPU kernel for it makes autograd use the
# same derivative formula as on CUDA, so the interpreter exercises the CUDA path's logic.
# --------------------------------------------------------------------------------------------

_DEFAULT_EPS = torch.finfo(torch.float32).eps  # torch's choice for eps=None (fp32 accumulation)


def _why_not_fused(input, normalized_shape, weight):
    if input.dtype not in runtime.KERNEL_DTYPES:
        return f"dtype {input.dtype}"
    if len(normalized_shape) != 1 or input.dim() == 0 or list(input.shape[-1:]) != list(normalized_shape):
        return f"normalized_shape {list(normalized_shape)} is not x's last dim"
    if weight is not None and (weight.dtype != input.dtype or list(weight.shape) != list(normalized_shape)):
        return "weight dtype or shape"
    if input.numel() == 0:
        return "empty input"
    return None


def _why_not_fused_rms_norm(input, normalized_shape, weight, eps):
    return _why_not_fused(input, normalized_shape, weight)


def _aten_fused_rms_norm(input, normalized_shape, weight, eps):
    """(out, rstd) with rstd float32 of shape input.shape[:-1] + (1,), as torch returns it."""
    out, rstd = _forward(input, weight, _DEFAULT_EPS if eps is None else eps, want_rstd=True)
    return out, rstd.view(*input.shape[:-1], 1)


def _why_not_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    reason = _why_not_fused(input, normalized_shape, weight)
    if reason is None and (grad_out.dtype != input.dtype or grad_out.shape != input.shape):
        reason = "grad_out dtype or shape"
    return reason


def _aten_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    rstd = rstd.reshape(-1)
    if rstd.dtype != torch.float32:  # torch's is fp32 for these dtypes; .float() would still
        rstd = rstd.float()          # be an aten call, which leaves the call unplanned
    dx, dweight = _backward(grad_out, input, weight, rstd)
    return (dx if output_mask[0] else None,
            dweight if output_mask[1] and weight is not None else None)


def _fused_rms_norm_backward_in_torch(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """For calls the kernel does not take where the backend has no kernel of its own (and, on
    such a backend, torch's kernel for the op outside enable(): see gemslib.registry): torch
    arithmetic in fp32 (fp64 for fp64 inputs) over the normalised dims, which may be all of
    input's dims (then there are no outer dims to sum dweight over)."""
    n_outer = input.dim() - len(normalized_shape)
    if not normalized_shape or n_outer < 0 or list(input.shape[n_outer:]) != list(normalized_shape):
        raise RuntimeError(f"_fused_rms_norm_backward: normalized_shape {list(normalized_shape)} "
                           f"must be the trailing dims of input {list(input.shape)}")
    work = torch.float64 if input.dtype == torch.float64 else torch.float32
    reduce_dims = tuple(range(n_outer, input.dim()))
    x, grad = input.to(work), grad_out.to(work)
    rstd = rstd.to(work).reshape(*input.shape[:n_outer], *([1] * len(normalized_shape)))
    x_hat = x * rstd
    g = grad * weight.to(work) if weight is not None else grad
    dx = rstd * (g - x_hat * (g * x_hat).mean(dim=reduce_dims, keepdim=True))
    dweight = None
    if weight is not None and output_mask[1]:
        dweight = grad * x_hat
        if n_outer:  # sum(dim=()) would reduce every dim to a 0-d tensor
            dweight = dweight.sum(dim=tuple(range(n_outer)))
        dweight = dweight.to(weight.dtype)
    return (dx.to(input.dtype) if output_mask[0] else None), dweight


ATEN_OVERRIDES = (
    AtenOverride("aten::_fused_rms_norm", _aten_fused_rms_norm, _why_not_fused_rms_norm),
    AtenOverride("aten::_fused_rms_norm_backward", _aten_fused_rms_norm_backward,
                 _why_not_fused_rms_norm_backward, fallback=_fused_rms_norm_backward_in_torch),
)


# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _inputs(device, dtype, rows, width=4099):
    x = torch.randn(rows, width, device=device, dtype=torch.float32).mul_(2).to(dtype)
    weight = torch.randn(width, device=device, dtype=torch.float32).to(dtype)
    return x, weight


SELF_CHECKS = (
    SelfCheck("rms_norm", lambda device, dtype, rows: _inputs(device, dtype, rows),
              run=rms_norm, reference=rms_norm_reference,
              torch_peer=lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)),
    SelfCheck("add_rms_norm",
              lambda device, dtype, rows: (*_inputs(device, dtype, rows)[:1],
                                           *_inputs(device, dtype, rows)),
              run=lambda x, r, w: add_rms_norm(x, r, w)[0],
              reference=lambda x, r, w: add_rms_norm_reference(x, r, w)[0],
              torch_peer=lambda x, r, w: torch.nn.functional.rms_norm(x + r, (x.shape[-1],), w, 1e-6)),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a bf16 problem per bucket
# --------------------------------------------------------------------------------------------

def _tune_problem(rows: int, cols: int, backward: bool):
    def make(device):
        x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        weight = torch.randn(cols, device=device, dtype=torch.bfloat16)
        if not backward:
            return lambda: rms_norm(x, weight)
        grad = torch.randn_like(x)
        _, rstd = _forward(x, weight, 1e-6, want_rstd=True)
        return lambda: _launch_backward(grad, x, weight, rstd)
    return make


def _buckets(shapes, backward: bool):
    """(max, rows, cols) -> TuneBuckets whose problems are rows x cols."""
    return tuple(TuneBucket(bound, f"{rows}x{cols}", _tune_problem(rows, cols, backward))
                 for bound, rows, cols in shapes)


def _dweight_problem(rows: int, cols: int):
    """The dweight sum alone, over the partial rows a rows x cols backward leaves."""
    def make(device):
        _, n_programs = _backward_programs(rows, device)
        partial = torch.randn(n_programs, cols, device=device, dtype=torch.float32)
        return lambda: _launch_dweight(partial, torch.bfloat16)
    return make


TUNING = (
    # a row per program up to 16K columns in one block, or a few rows together when narrow;
    # blocks narrower than the row stay candidates, since looping over column blocks can win
    # for wide rows (see docs/notes/tuning.md)
    TuneSpace(RMS_NORM_FWD,
              tuple({"BLOCK_M": m, "BLOCK_N": n, "num_warps": w}
                    for m, n in ((16, 128), (8, 256), (4, 512), (2, 1024), (1, 1024), (4, 1024),
                                 (1, 2048), (2, 2048), (4, 2048), (1, 4096), (2, 4096),
                                 (4, 4096), (1, 8192), (2, 8192), (1, 16384))
                    for w in (4, 8, 16)),
              # a short prompt's rows apart from a long one's: at 64-1024 rows the tiles of a
              # 4096-row problem lost to inductor's kernel on the H100 (docs/notes/tuning.md)
              _buckets((({"cols": 128}, 65536, 128), ({"cols": 512}, 65536, 512),
                        ({"cols": 2048, "rows": 1024}, 1024, 2048),
                        ({"cols": 2048}, 16384, 2048), ({"cols": 4096, "rows": 64}, 64, 4096),
                        ({"cols": 4096, "rows": 1024}, 1024, 4096),
                        ({"cols": 4096, "rows": 8192}, 4096, 4096),
                        ({"cols": 4096}, 65536, 4096), ({"cols": 6144}, 8192, 5120),
                        ({"cols": 8192}, 16384, 8192), ({"cols": 16384}, 2048, 12288),
                        (None, 512, 65536)), backward=False)),
    # num_stages > 1 lets Triton prefetch the next row while this one is reduced
    TuneSpace(RMS_NORM_BWD,
              tuple({"BLOCK_N": n, "num_warps": w, "num_stages": st}
                    for n in (1024, 2048, 4096, 8192) for w in (4, 8, 16) for st in (1, 2)),
              _buckets((({"cols": 1024}, 16384, 1024), ({"cols": 4096}, 4096, 4096),
                        ({"cols": 6144}, 8192, 5120), (None, 2048, 12288)), backward=True)),
    # the backward's 4-per-SM partial rows: narrower column blocks make more programs, more
    # rows a step fewer turns of the loop
    TuneSpace(RMS_NORM_DWEIGHT,
              tuple({"BLOCK_N": n, "BLOCK_P": p, "num_warps": w}
                    for n in (64, 128, 256) for p in (16, 32) for w in (4, 8)),
              (TuneBucket(None, "4096x4096", _dweight_problem(4096, 4096)),)),
)
