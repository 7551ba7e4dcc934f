"""An MLP's up half in one kernel: silu(n @ Wg.T) * (n @ Wu.T) with n = rms_norm(x) * g.

    out[m, j] = silu(r[m] G[m, j]) * (r[m] U[m, j]),   r[m] = 1 / sqrt(mean_k x[m, k]^2 + eps)
    G[m, j] = sum_k x[m, k] g[k] W[j, k],   U[m, j] = sum_k x[m, k] g[k] W[I + j, k]

x (..., K), g the norm weight (K,), W = [Wg | Wu] the gate and up projections stacked (2I, K),
as a merged gate/up projection holds them. As in rms_norm_linear_silu, the K loop's x tiles
give the rows' sums of squares, the norm weight scales each x tile as it is loaded and r waits
for the epilogue; here one x tile feeds two accumulators, the gate and the up tile of the same
output columns, and only the (M, I) result is written: the (M, 2I) projection and the SwiGLU
pass over it (what a model's `down(act(gate(x)) * up(x))` costs besides its GEMMs) never
exist. On sm_90, 16-bit inputs with 128 or more rows and enough tiles to fill the GPU take the
pre-pass and the Gluon matmul's SwiGLU form (_rms_norm_linear_silu_hopper.forward_gated);
calls whose config says VENDOR_GEMM run gemslib's rms_norm, torch's matmul and gemslib's
silu_and_mul, where cuBLAS streams the weights faster than this kernel.

In a compiled model (``backend="gemslib"``) the same kernels run as ``linear_swiglu``, the
form without the norm, ``silu(x @ Wg.T) * (x @ Wu.T)``, and as ``linear_geglu``, its GeGLU twin
``gelu(x @ Wg.T) * (x @ Wu.T)`` (Gemma's MLP; either of F.gelu's forms, the same tiles with
another epilogue): a graph rewrite (``gemslib.passes.linear``) replaces the merged gate/up
projection and the silu_and_mul or gelu_and_mul after it, and the model's (add_)rms_norm
before it stays. The backward is torch arithmetic (recomputing the projections). The file
reads top-down: kernel, launcher, reference, public function, custom op and autograd,
linear_swiglu and linear_geglu, self-check, tuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemslib import checks, layout, runtime
from gemslib.fused.merged_linear import end_to_end
from gemslib.ops import rms_norm as rms_norm_ops
from gemslib.ops import silu as silu_ops
from gemslib.ops.silu import GELU_ERF, GELU_TANH, SILU, _gate_activation
from gemslib.registry import SelfCheck, TuneBucket, TuneSpace

try:  # the Hopper path's matmul is written in Gluon (triton.experimental, Triton >= 3.4)
    from gemslib.fused import _rms_norm_linear_silu_hopper
except ImportError:  # pragma: no cover - older Triton: the Triton kernel serves every call
    _rms_norm_linear_silu_hopper = None


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_swiglu_kernel(
    x_ptr, norm_weight_ptr, weight_ptr, out_ptr, part_ptr, part_sum_squares_ptr, arrivals_ptr,
    n_rows, n_out, n_in, eps, split_len, n_splits, stride_x_row, stride_weight_row,
    stride_out_row, IEEE: tl.constexpr, NORMALIZE: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of out (n_rows, n_out) per program along axis 0, in grouped
    order (GROUP_M row tiles sweep the columns together). x (n_rows, n_in) and W (2 n_out,
    n_in) with unit last strides: the gate tile reads W's rows j, the up tile rows n_out + j.
    Without NORMALIZE the projections are of x itself (linear_swiglu, linear_geglu;
    norm_weight_ptr is not read). ACTIVATION (ops.silu's SILU, GELU_TANH, GELU_ERF) is the
    gate's: silu in the SwiGLU forms, either GELU in linear_geglu.

    SPLIT_K > 1 (decode: few rows, and the column tiles alone are too few programs to keep
    every SM streaming W): axis 1 splits K into n_splits ranges of split_len. Each program
    stores its fp32 gate and up partial tiles in part (n_splits, n_rows, 2 n_out) and its rows'
    partial sums of squares in part_sum_squares (n_splits, n_rows); the last program of a tile
    to arrive (int32 counters in arrivals, one per tile, zero between launches) adds the
    splits in order (the result does not depend on arrival order) and finishes the tile. With
    SPLIT_K 1 the three are None."""
    i_tile = tl.program_id(0)
    n_m_tiles = tl.cdiv(n_rows, BLOCK_M)
    n_n_tiles = tl.cdiv(n_out, BLOCK_N)
    tiles_per_group = GROUP_M * n_n_tiles
    first_m_tile = (i_tile // tiles_per_group) * GROUP_M
    group_m_tiles = tl.minimum(n_m_tiles - first_m_tile, GROUP_M)
    i_m = first_m_tile + (i_tile % tiles_per_group) % group_m_tiles
    i_n = (i_tile % tiles_per_group) // group_m_tiles

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < n_rows
    m_n = o_n < n_out
    p_x = x_ptr + o_m.to(tl.int64)[:, None] * stride_x_row
    p_gate = weight_ptr + o_n.to(tl.int64)[None, :] * stride_weight_row  # read as W.T tiles
    p_up = weight_ptr + (n_out + o_n).to(tl.int64)[None, :] * stride_weight_row
    if SPLIT_K > 1:
        i_split = tl.program_id(1)
        k_begin = i_split * split_len
        k_end = tl.minimum(n_in, k_begin + split_len)
    else:
        k_begin = 0
        k_end = n_in

    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_sum_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i_k in range(k_begin, k_end, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        m_k = o_k < k_end
        m_w = m_k[:, None] & m_n[None, :]
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_wg = tl.load(p_gate + o_k[:, None], mask=m_w, other=0.0)
        b_wu = tl.load(p_up + o_k[:, None], mask=m_w, other=0.0)
        if NORMALIZE:
            b_g = tl.load(norm_weight_ptr + o_k, mask=m_k, other=0.0)
            b_x32 = b_x.to(tl.float32)
            b_sum_squares += tl.sum(b_x32 * b_x32, axis=1)
            b_xg = (b_x32 * b_g.to(tl.float32)[None, :]).to(b_x.dtype)
        else:
            b_xg = b_x
        if IEEE:
            b_gate = tl.dot(b_xg, b_wg, b_gate, input_precision="ieee")
            b_up = tl.dot(b_xg, b_wu, b_up, input_precision="ieee")
        else:
            b_gate = tl.dot(b_xg, b_wg, b_gate)
            b_up = tl.dot(b_xg, b_wu, b_up)

    m_tile = m_m[:, None] & m_n[None, :]
    finish = True
    if SPLIT_K > 1:
        p_part = part_ptr + (i_split * n_rows + o_m).to(tl.int64)[:, None] * (2 * n_out) \
            + o_n[None, :]
        tl.store(p_part, b_gate, mask=m_tile)
        tl.store(p_part + n_out, b_up, mask=m_tile)
        # every column tile stores the same sums for its rows and split: harmless
        tl.store(part_sum_squares_ptr + i_split * n_rows + o_m, b_sum_squares, mask=m_m)
        counter = i_m * n_n_tiles + i_n
        # acq_rel: the stores above are visible to whichever program arrives last
        finish = tl.atomic_add(arrivals_ptr + counter, 1) == n_splits - 1
        if finish:
            b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            b_sum_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i_s in range(0, n_splits):  # in split order: deterministic sums
                p_part = part_ptr + (i_s * n_rows + o_m).to(tl.int64)[:, None] * (2 * n_out) \
                    + o_n[None, :]
                b_gate += tl.load(p_part, mask=m_tile, other=0.0, cache_modifier=".cg")
                b_up += tl.load(p_part + n_out, mask=m_tile, other=0.0, cache_modifier=".cg")
                b_sum_squares += tl.load(part_sum_squares_ptr + i_s * n_rows + o_m,
                                         mask=m_m, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals_ptr + counter, 0)  # ready for the next launch
    if finish:
        if NORMALIZE:
            b_rstd = 1.0 / tl.sqrt(b_sum_squares / n_in + eps)
            b_gate = b_gate * b_rstd[:, None]
            b_up = b_up * b_rstd[:, None]
        b_act, _ = _gate_activation(b_gate, ACTIVATION)
        b_out = b_act * b_up
        tl.store(out_ptr + o_m.to(tl.int64)[:, None] * stride_out_row + o_n[None, :],
                 b_out.to(out_ptr.dtype.element_ty), mask=m_tile)


# VENDOR_GEMM 1 in a config: calls of that size run the three-kernel form instead (gemslib's
# rms_norm, torch's matmul, gemslib's silu_and_mul), where cuBLAS streams W faster than
# this kernel can
RMS_NORM_SWIGLU = runtime.TunedKernel(
    "rms_norm_swiglu", "rms_norm_swiglu", _rms_norm_swiglu_kernel,
    tunables=("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K"),
    launcher_knobs=("VENDOR_GEMM",), shape_keys=("rows", "n", "k", "elem_bytes"))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# On sm_90, 16-bit inputs with M >= 128 rows and enough tiles to fill the GPU take the
# pre-pass and the Gluon matmul's SwiGLU form; switched off, every call goes by its config.
HOPPER_PATH = runtime.KernelPath("rms_norm_swiglu", "the pre-pass and Gluon matmul on sm_90")


def _hopper_takes(x_rows: torch.Tensor, weight: torch.Tensor, normalize: bool) -> bool:
    hopper = _rms_norm_linear_silu_hopper
    return HOPPER_PATH.on and hopper is not None and hopper.eligible(x_rows, weight) and (
        normalize or layout.tma_addressable(x_rows))  # unnormalised x is read by TMA


def _takes_three_kernels(x: torch.Tensor, gate_up_weight: torch.Tensor) -> bool:
    """Whether ``_launch`` runs rms_norm_swiglu(x, ., gate_up_weight) as gemslib's rms_norm,
    torch's matmul and gemslib's silu_and_mul (its config's VENDOR_GEMM), inputs validated."""
    n_out, n_in = gate_up_weight.shape[0] // 2, gate_up_weight.shape[1]
    if x.numel() == 0 or n_out == 0 or n_in == 0:
        return False
    x_rows = layout.as_rows(layout.unit_last(x))
    if _hopper_takes(x_rows, layout.unit_last(gate_up_weight), normalize=True):
        return False
    config = RMS_NORM_SWIGLU.planned_config((x_rows.shape[0], n_out, n_in, x.element_size()))
    return bool(config.meta_dict["VENDOR_GEMM"])


def _three_kernels(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                   eps: float, hopper_on: bool = True) -> torch.Tensor:
    """The VENDOR_GEMM form through the public, planned operators, for a signature already
    decided (``rms_norm_swiglu``'s call plan; ``hopper_on`` is in its key, unused here)."""
    normed = rms_norm_ops.rms_norm(x, norm_weight, eps)
    return silu_ops.silu_and_mul(torch.nn.functional.linear(normed, gate_up_weight))


def _launch(x: torch.Tensor, norm_weight: torch.Tensor | None, gate_up_weight: torch.Tensor,
            eps: float, normalize: bool = True, activation: int = SILU) -> torch.Tensor:
    """(..., I) in x's dtype; inputs validated, on the kernel device, one kernel dtype. Without
    ``normalize``: the projections of x itself (linear_swiglu, linear_geglu; norm_weight and
    eps unused). ``activation``: the gate's (ops.silu's SILU, GELU_TANH, GELU_ERF)."""
    n_out, n_in = gate_up_weight.shape[0] // 2, gate_up_weight.shape[1]
    out = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if n_in == 0:  # empty sums: silu(0) * 0
        return out.zero_()
    n_rows = out.numel() // n_out
    x_rows = layout.as_rows(layout.unit_last(x))
    weight = layout.unit_last(gate_up_weight)
    out_rows = out.view(n_rows, n_out)
    if _hopper_takes(x_rows, weight, normalize):
        runtime.launched_outside_plans()
        _rms_norm_linear_silu_hopper.forward_gated(
            x_rows, norm_weight.contiguous() if normalize else None, weight, eps, out_rows,
            normalize=normalize, activation=activation)
        return out
    shape = (n_rows, n_out, n_in, x.element_size())
    config = RMS_NORM_SWIGLU.planned_config(shape)
    meta = config.meta_dict
    if meta["VENDOR_GEMM"]:
        normed = rms_norm_ops._forward(x_rows, norm_weight, eps, False)[0] if normalize \
            else x_rows
        silu_ops._launch_silu_and_mul(torch.nn.functional.linear(normed, weight), out_rows,
                                      activation)
        return out
    n_tiles = runtime.cdiv(n_rows, meta["BLOCK_M"]) * runtime.cdiv(n_out, meta["BLOCK_N"])
    if meta["SPLIT_K"] > 1:
        # whole BLOCK_K steps per split
        split_len = runtime.cdiv(runtime.cdiv(n_in, meta["SPLIT_K"]), meta["BLOCK_K"]) \
            * meta["BLOCK_K"]
        n_splits = runtime.cdiv(n_in, split_len)
        part_len = n_splits * n_rows * 2 * n_out
        arrivals, parts = runtime.split_scratch(x.device, n_tiles, part_len + n_splits * n_rows)
        part, part_sum_squares = parts[:part_len], parts[part_len:]
    else:
        split_len, n_splits = n_in, 1
        arrivals = part = part_sum_squares = None
    # positional (TunedKernel.launch forwards them so), in the kernel's order: tensors (the
    # norm weight's pointer is not read without normalize); sizes and eps; strides; flags
    RMS_NORM_SWIGLU.launch(
        lambda meta: (runtime.cdiv(n_rows, meta["BLOCK_M"]) * runtime.cdiv(n_out, meta["BLOCK_N"]),
                      n_splits if meta["SPLIT_K"] > 1 else 1),
        x_rows, norm_weight.contiguous() if normalize else x_rows, weight, out_rows,
        part, part_sum_squares, arrivals,
        n_rows, n_out, n_in, eps, split_len, n_splits,
        x_rows.stride(0), weight.stride(0), out_rows.stride(0),
        x.dtype == torch.float32, normalize, activation,
        shape=shape, config=config)
    return out


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def linear_swiglu_reference(x, gate_up_weight):
    gate, up = torch.nn.functional.linear(x, gate_up_weight).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def linear_geglu_reference(x, gate_up_weight, approximate: str = "none"):
    gate, up = torch.nn.functional.linear(x, gate_up_weight).chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


def rms_norm_swiglu_reference(x, norm_weight, gate_up_weight, eps=1e-6):
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight
    return linear_swiglu_reference(normed, gate_up_weight)


# --------------------------------------------------------------------------------------------
# Public function, custom op, autograd
# --------------------------------------------------------------------------------------------


def _check(x, norm_weight, gate_up_weight) -> None:
    name = "gemslib.rms_norm_swiglu"
    for arg, t in (("x", x), ("norm_weight", norm_weight), ("gate_up_weight", gate_up_weight)):
        checks.float_tensor(name, arg, t, expected="floating-point")
        checks.like(name, arg, t, x, "x")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must be (..., K), got a 0-d tensor")
    n_in = x.shape[-1]
    if gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != n_in or \
            gate_up_weight.shape[0] % 2:
        raise ValueError(f"{name}: gate_up_weight must be (2I, K) with K = x.shape[-1] = {n_in} "
                         f"(the gate rows, then the up rows), got {tuple(gate_up_weight.shape)}")
    if norm_weight.shape != (n_in,):
        raise ValueError(f"{name}: norm_weight must be ({n_in},) to match x's last dim, got "
                         f"{tuple(norm_weight.shape)}")


def _rms_norm_swiglu_impl(x: torch.Tensor, norm_weight: torch.Tensor,
                          gate_up_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel where it runs; torch (fp32 arithmetic, or float64's own) elsewhere."""
    if not runtime.dot_kernel_runs(x):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = rms_norm_swiglu_reference(x.to(work), norm_weight.to(work),
                                        gate_up_weight.to(work), eps)
        return out.to(x.dtype)
    return _launch(x, norm_weight, gate_up_weight, eps)


_CALLS = runtime.CallPlans("rms_norm_swiglu")


def rms_norm_swiglu(x: torch.Tensor, norm_weight: torch.Tensor,
                    gate_up_weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    eps: float = 1e-6) -> torch.Tensor:
    """``silu(n @ Wg.T) * (n @ Wu.T)`` with ``n = rms_norm(x, norm_weight, eps)``, one kernel.

    x (..., K), norm_weight (K,), gate_up_weight (2I, K): Wg's rows then Wu's (as a merged
    gate/up projection holds them), or the pair (Wg, Wu), each (I, K): read in place where
    they lie end to end in one buffer (rows of one merged weight) and no gradient is wanted,
    else stacked into a new tensor on every call. One dtype; returns (..., I) in it.
    Differentiable in every tensor argument (the backward uses torch).

    Args:
        x: (..., K) floating tensor with at least one dim, any strides. The kernels take fp16,
            bf16 and fp32 on the kernel device; other dtypes and devices are computed by
            torch, in fp32 (fp64 for fp64).
        norm_weight: (K,) RMSNorm weight g, x's dtype and device.
        gate_up_weight: (2I, K) tensor, the gate rows then the up rows, or a pair
            (gate_weight, up_weight) of (I, K) tensors; x's dtype and device.
        eps: added to mean(x**2) before the square root; a float or 0-d tensor.

    Returns:
        (..., I) contiguous tensor of x's dtype.

    Raises:
        TypeError: a tensor argument that is not floating-point, a gate_up_weight that is
            neither a tensor nor a pair of tensors, or eps not a real number.
        ValueError: x is 0-d, shapes that do not agree as above, or another dtype or device
            than x's.
    """
    if isinstance(gate_up_weight, (tuple, list)):
        if len(gate_up_weight) != 2 or not all(isinstance(w, torch.Tensor)
                                               for w in gate_up_weight):
            raise TypeError("gemslib.rms_norm_swiglu: gate_up_weight must be a (2I, K) tensor "
                            "or a pair (gate_weight, up_weight) of tensors")
        if gate_up_weight[0].shape != gate_up_weight[1].shape:
            raise ValueError("gemslib.rms_norm_swiglu: gate and up weights must have one shape, "
                             f"got {tuple(gate_up_weight[0].shape)} and "
                             f"{tuple(gate_up_weight[1].shape)}")
        pair, stacked = list(gate_up_weight), None
        if not (torch.is_grad_enabled() and any(w.requires_grad for w in pair)):
            # one view where they lie end to end (a merged projection's); under autograd a
            # view across two tensors would give the second no gradient
            stacked = end_to_end(pair)
        gate_up_weight = stacked if stacked is not None else torch.cat(pair)
    # a decided signature replays: the checks and the choice cost more host time than the GPU
    # spends at a tensor-parallel slice's 128 rows or at decode. Three kernels are a kept
    # route; the Triton kernel's launch a launch plan (the Hopper path launches outside
    # plans, so its calls run their own path every time)
    args = (x, norm_weight, gate_up_weight, eps, HOPPER_PATH.on)
    key, planned = _CALLS.replayed(*args)
    if planned is not None:
        return planned
    _check(x, norm_weight, gate_up_weight)
    eps = checks.as_float("gemslib.rms_norm_swiglu", "eps", eps)
    if runtime.wants_custom_op(x, norm_weight, gate_up_weight):
        return _rms_norm_swiglu_op(x, norm_weight, gate_up_weight, eps)
    if key is None or not runtime.dot_kernel_runs(x):
        return _rms_norm_swiglu_impl(x, norm_weight, gate_up_weight, eps)
    if _takes_three_kernels(x, gate_up_weight):
        _CALLS.keep(key, _three_kernels)
        return _three_kernels(x, norm_weight, gate_up_weight, eps)
    return _CALLS.plan(key, args, lambda: _launch(x, norm_weight, gate_up_weight, eps))


def _setup(ctx, inputs, output):
    x, norm_weight, gate_up_weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, norm_weight, gate_up_weight)


def _grad(ctx, grad_out, ops):
    """Gradients by the chain rule in fp32 (float64 stays float64), the projections
    recomputed: d_up = dy silu(G'), d_gate = dy U' silu'(G') (G', U' the normalised
    projections), dW = [d_gate | d_up].T n, dn = [d_gate | d_up] W, dg = sum dn * x_hat,
    dx = r * (dn g - x_hat * mean(dn g * x_hat))."""
    x, norm_weight, gate_up_weight = ctx.saved_tensors
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x32, g32, w32 = x.to(work), norm_weight.to(work), gate_up_weight.to(work)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + ctx.eps)
    x_hat = x32 * rstd
    normed = x_hat * g32
    gate, up = torch.nn.functional.linear(normed, w32).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dy = grad_out.to(work)
    d_projection = torch.cat([dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig], dim=-1)
    rows = d_projection.reshape(-1, d_projection.shape[-1])
    d_weight = rows.t() @ normed.reshape(-1, normed.shape[-1])
    d_normed = d_projection @ w32
    d_norm_weight = (d_normed * x_hat).reshape(-1, x.shape[-1]).sum(0)
    d_x_hat = d_normed * g32
    dx = rstd * (d_x_hat - x_hat * (d_x_hat * x_hat).mean(dim=-1, keepdim=True))
    return (dx.to(x.dtype), d_norm_weight.to(norm_weight.dtype),
            d_weight.to(gate_up_weight.dtype), None)


# torch arithmetic all the way: the backward is itself differentiable
_rms_norm_swiglu_op = runtime.CustomOp(
    "rms_norm_swiglu", _rms_norm_swiglu_impl,
    fake=lambda x, norm_weight, gate_up_weight, eps: x.new_empty(
        (*x.shape[:-1], gate_up_weight.shape[0] // 2)),
    setup_context=_setup, backward=_grad, differentiable_backward=True)


# --------------------------------------------------------------------------------------------
# linear_swiglu and linear_geglu: the GEMM with the SwiGLU or GeGLU epilogue, without the norm
# (what the graph passes put in place of a merged gate/up projection and its silu_and_mul or
# gelu_and_mul)
# --------------------------------------------------------------------------------------------


def _linear_gated(x: torch.Tensor, gate_up_weights: list[torch.Tensor], activation: int,
                  reference) -> torch.Tensor:
    """act(x @ Wg.T) * (x @ Wu.T), x (..., K), gate_up_weights [Wg, Wu] each (I, K): one GEMM
    over them where they lie end to end (the merged parameters), else over their copy;
    ``reference(x, W)`` where the kernels do not run."""
    weight = end_to_end(gate_up_weights)
    if weight is None:  # a parameter was replaced since the merge
        weight = torch.cat(gate_up_weights)
    if not runtime.dot_kernel_runs(x):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        return reference(x.to(work), weight.to(work)).to(x.dtype)
    return _launch(x, None, weight, 0.0, normalize=False, activation=activation)


def _linear_swiglu_impl(x: torch.Tensor, gate_up_weights: list[torch.Tensor]) -> torch.Tensor:
    """silu(x @ Wg.T) * (x @ Wu.T)."""
    return _linear_gated(x, gate_up_weights, SILU, linear_swiglu_reference)


def _linear_geglu_impl(x: torch.Tensor, gate_up_weights: list[torch.Tensor],
                       tanh: bool) -> torch.Tensor:
    """gelu(x @ Wg.T) * (x @ Wu.T), F.gelu's tanh form with ``tanh``, else its erf form (as
    gelu_and_mul's ``tanh`` argument)."""
    approximate = "tanh" if tanh else "none"
    return _linear_gated(x, gate_up_weights, GELU_TANH if tanh else GELU_ERF,
                         lambda x, w: linear_geglu_reference(x, w, approximate))


def _linear_gated_fake(x, gate_up_weights, *tanh):
    return x.new_empty((*x.shape[:-1], gate_up_weights[0].shape[0]))


_linear_swiglu_op = runtime.CustomOp("linear_swiglu", _linear_swiglu_impl,
                                     fake=_linear_gated_fake)
_linear_geglu_op = runtime.CustomOp("linear_geglu", _linear_geglu_impl, fake=_linear_gated_fake)



# --------------------------------------------------------------------------------------------
# Self-check for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _check_inputs(device, dtype, rows):
    """x (rows, K), norm weight, [gate | up] (2I, K): small at the check's size, a Llama-3-8B
    MLP (K 4096, I 14336) at the timing size."""
    n_in, n_out = (4096, 14336) if rows >= 1024 else (256, 200)
    return (torch.randn(rows, n_in, device=device, dtype=dtype),
            torch.randn(n_in, device=device, dtype=dtype),
            torch.randn(2 * n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5)


def _term_scale(x, norm_weight, gate_up_weight):
    """The size of the products' terms: |silu(G)| |U| bounded by |G| |U|, each from
    |rms_norm(x)| @ |W|.T."""
    x, norm_weight, gate_up_weight = (t.double() for t in (x, norm_weight, gate_up_weight))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    gate, up = (normed.abs() @ gate_up_weight.abs().t()).chunk(2, dim=-1)
    return (gate * up).max().item()


SELF_CHECKS = (
    SelfCheck("rms_norm_swiglu", _check_inputs, run=rms_norm_swiglu,
              reference=rms_norm_swiglu_reference,
              torch_peer=lambda x, g, w: (lambda gate, up: torch.nn.functional.silu(gate) * up)(
                  *torch.nn.functional.linear(
                      torch.nn.functional.rms_norm(x, (x.shape[-1],), g, 1e-6), w).chunk(2, -1)),
              # bf16 tl.dot is wrong in Triton 3.6's interpreter
              dtypes=(torch.float16, torch.float32) if runtime.INTERPRETER else
              (torch.float16, torch.bfloat16, torch.float32),
              term_scale=_term_scale),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a problem per bucket
# --------------------------------------------------------------------------------------------

def _tune_problem(row_counts: tuple[int, ...], n_out: int = 14336, n_in: int = 4096,
                  dtype: torch.dtype = torch.bfloat16):
    """Llama-3-8B's gate and up projections at each row count, on the Triton kernel (the
    Hopper path, where it applies, is switched off while the problem runs)."""
    def make(device):
        xs = [torch.randn(rows, n_in, device=device, dtype=dtype) for rows in row_counts]
        norm_weight = torch.randn(n_in, device=device, dtype=dtype)
        weight = torch.randn(2 * n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5

        def run():
            with HOPPER_PATH.switched_off():
                return [rms_norm_swiglu(x, norm_weight, weight) for x in xs]
        return run
    return make


TUNING = (
    TuneSpace(
        RMS_NORM_SWIGLU,
        # two accumulators per tile: the register budget of one twice as wide
        tuple({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "SPLIT_K": 1,
               "VENDOR_GEMM": 0, "num_warps": w, "num_stages": s}
              for m, n, k in ((128, 64, 64), (128, 128, 64), (64, 128, 64), (128, 64, 128))
              for w in (4, 8) for s in (3, 4))
        # decode: 16 rows, narrow column tiles, long K steps, K split over more programs (the
        # K-long tiles read longer runs of each weight row; see docs/notes/decode.md)
        + tuple({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 1, "SPLIT_K": split,
                 "VENDOR_GEMM": 0, "num_warps": w, "num_stages": s}
                for n, k in ((32, 128), (64, 128), (64, 256), (32, 256), (16, 512), (32, 512))
                for split in (1, 2, 4, 8) for w in (4, 8) for s in (3, 4))
        # the three-kernel form (its tile keys unused)
        + ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1,
            "VENDOR_GEMM": 1, "num_warps": 4, "num_stages": 3},),
        # decode by width: a tensor-parallel quarter or half of an MLP has a quarter or half
        # of the column tiles, so it wants more of K split (Llama-3-8B's I over 4 and 2)
        (TuneBucket({"rows": 64, "n": 4864, "elem_bytes": 2}, "M1 + M16 I3584 K4096",
                    _tune_problem((1, 16), n_out=3584)),
         TuneBucket({"rows": 64, "n": 9472, "elem_bytes": 2}, "M1 + M16 I7168 K4096",
                    _tune_problem((1, 16), n_out=7168)),
         TuneBucket({"rows": 64, "n": 16384, "elem_bytes": 2}, "M1 + M16 I14336 K4096",
                    _tune_problem((1, 16))),
         TuneBucket({"rows": 64, "elem_bytes": 2}, "M1 + M16 I18944 K3584",
                    _tune_problem((1, 16), n_out=18944, n_in=3584)),
         TuneBucket({"elem_bytes": 2}, "M4096 I14336 K4096", _tune_problem((4096,))),
         # fp32 (IEEE products, far below the 16-bit tensor-core rate): a smaller problem
         TuneBucket(None, "M1024 I4096 K4096 fp32",
                    _tune_problem((1024,), n_out=4096, dtype=torch.float32)))),
)
