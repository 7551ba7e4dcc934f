"""silu(rms_norm(x) @ W.T + b) in one kernel: the normalisation and the activation ride on the
matmul. (On sm_90, 16-bit inputs with 128 or more rows and enough tiles to fill the GPU take
the two-launch path of _rms_norm_linear_silu_hopper.py instead; calls whose config says
VENDOR_GEMM run gemslib's rms_norm, torch's matmul and gemslib's silu, where cuBLAS outruns
this kernel.)

    out[m, n] = silu(z[m, n]),   z[m, n] = r[m] * sum_k x[m, k] g[k] W[n, k] + b[n],
    r[m] = 1 / sqrt(mean_k x[m, k]^2 + eps)

x (..., K), g the norm weight (K,), W (N, K) as in ``nn.Linear``, b (N,) or None. The
matmul's K loop reads every element of its x rows anyway, so the same loads give the rows' sums
of squares; the norm weight scales each x tile as it is loaded, and the epilogue applies the
per-row r, the bias and silu before the one store. r is a per-row scale, so it can wait for the
epilogue: sum_k (x g r)[k] W[n, k] = r sum_k (x g)[k] W[n, k]. The operand fed to the tensor
cores is x * g rounded to x's dtype (the unfused form rounds x * r * g: the same one rounding).
Tiles are visited in groups of GROUP_M row tiles per column sweep, so each weight tile is read
from HBM about once per group. Small M (decode) runs the same kernel with 16-row tiles and
narrow column tiles: many programs, each streaming its slice of W once.

The backward is torch arithmetic (recomputing z), correct rather than fast. In a compiled model
(``backend="gemslib"``) a graph rewrite (``gemslib.passes.linear``) replaces
silu(linear(rms_norm(x))) with this op where the Hopper path takes it. The file reads top-down:
kernel, launcher, reference, public function, custom op and autograd, self-check, tuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemslib import checks, layout, runtime
from gemslib.ops import rms_norm as rms_norm_ops
from gemslib.ops import silu as silu_ops
from gemslib.registry import SelfCheck, TuneBucket, TuneSpace

try:  # the Hopper path's matmul is written in Gluon (triton.experimental, Triton >= 3.4)
    from gemslib.fused import _rms_norm_linear_silu_hopper
except ImportError:  # pragma: no cover - older Triton: the Triton kernel serves every call
    _rms_norm_linear_silu_hopper = None


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_linear_silu_kernel(
    x_ptr, norm_weight_ptr, weight_ptr, weight_desc, bias_ptr, out_ptr, part_ptr,
    part_sum_squares_ptr, arrivals_ptr, n_rows, n_out, n_in, eps, split_len, n_splits,
    stride_x_row, stride_weight_row, stride_out_row, IEEE: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of out (n_rows, n_out) per program along axis 0, in grouped
    order. x (n_rows, n_in) and W (n_out, n_in) with unit last strides, bias (n_out,) or None.
    TMA (the launcher's decision: the config asks with USE_TMA and W's layout allows): W tiles
    come through the tensor descriptor ``weight_desc`` ([BLOCK_N, BLOCK_K] blocks, zeros past
    W's end); x always goes through registers, where it is scaled by the norm weight.

    SPLIT_K > 1 (decode: few rows, and a grid of column tiles alone is too short to keep every
    SM streaming W): axis 1 splits K into n_splits ranges of split_len. Each program stores its
    fp32 partial tile in part (n_splits, n_rows, n_out) and its rows' partial sums of squares in
    part_sum_squares (n_splits, n_rows); the last program of a tile to arrive (int32 counters in
    arrivals, one per tile, zero between launches) adds the splits in order, so the result does
    not depend on arrival order, and finishes the tile. With SPLIT_K 1 the three are None."""
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
    p_w = weight_ptr + o_n.to(tl.int64)[None, :] * stride_weight_row  # W read as W.T tiles
    if SPLIT_K > 1:
        i_split = tl.program_id(1)
        k_begin = i_split * split_len
        k_end = tl.minimum(n_in, k_begin + split_len)
    else:
        k_begin = 0
        k_end = n_in

    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_sum_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i_k in range(k_begin, k_end, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        m_k = o_k < k_end
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_g = tl.load(norm_weight_ptr + o_k, mask=m_k, other=0.0)
        if TMA:  # split_len is a whole number of BLOCK_K: a block never crosses k_end < n_in
            b_w = tl.trans(weight_desc.load([i_n * BLOCK_N, i_k]))
        else:
            b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_x32 = b_x.to(tl.float32)
        b_sum_squares += tl.sum(b_x32 * b_x32, axis=1)
        b_xg = (b_x32 * b_g.to(tl.float32)[None, :]).to(b_x.dtype)
        if IEEE:
            b_acc = tl.dot(b_xg, b_w, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_xg, b_w, b_acc)

    m_tile = m_m[:, None] & m_n[None, :]
    finish = True
    if SPLIT_K > 1:
        o_part_row = (i_split * n_rows + o_m).to(tl.int64)
        tl.store(part_ptr + o_part_row[:, None] * n_out + o_n[None, :], b_acc, mask=m_tile)
        # every column tile stores the same sums for its rows and split: harmless
        tl.store(part_sum_squares_ptr + i_split * n_rows + o_m, b_sum_squares, mask=m_m)
        counter = i_m * n_n_tiles + i_n
        # acq_rel: the stores above are visible to whichever program arrives last
        finish = tl.atomic_add(arrivals_ptr + counter, 1) == n_splits - 1
        if finish:
            b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            b_sum_squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i_s in range(0, n_splits):  # in split order: deterministic sums
                o_s_row = (i_s * n_rows + o_m).to(tl.int64)
                b_acc += tl.load(part_ptr + o_s_row[:, None] * n_out + o_n[None, :],
                                 mask=m_tile, other=0.0, cache_modifier=".cg")
                b_sum_squares += tl.load(part_sum_squares_ptr + i_s * n_rows + o_m,
                                         mask=m_m, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrivals_ptr + counter, 0)  # ready for the next launch
    if finish:
        b_rstd = 1.0 / tl.sqrt(b_sum_squares / n_in + eps)
        b_z = b_acc * b_rstd[:, None]
        if bias_ptr is not None:
            b_z += tl.load(bias_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        b_out = b_z / (1.0 + tl.exp(-b_z))
        tl.store(out_ptr + o_m.to(tl.int64)[:, None] * stride_out_row + o_n[None, :],
                 b_out.to(out_ptr.dtype.element_ty), mask=m_tile)


RMS_NORM_LINEAR_SILU = runtime.TunedKernel(
    "rms_norm_linear_silu", "rms_norm_linear_silu", _rms_norm_linear_silu_kernel,
    tunables=("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K"),
    launcher_knobs=("USE_TMA", "VENDOR_GEMM"), shape_keys=("rows", "n", "k", "elem_bytes"))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# On sm_90, 16-bit inputs with M >= 128 rows and enough tiles to fill the GPU take two
# launches: a pre-pass (x * g and 1/rms) and a warp-specialised Gluon matmul with the
# r/bias/silu epilogue (_rms_norm_linear_silu_hopper.py); switched off, every call goes by its
# config: the one Triton kernel, or with VENDOR_GEMM 1 three kernels (gemslib's rms_norm,
# torch's matmul, gemslib's silu) where cuBLAS streams W faster than the Triton kernel can.
HOPPER_PATH = runtime.KernelPath("rms_norm_linear_silu", "the pre-pass and Gluon matmul on sm_90")


def _hopper_takes(x_rows: torch.Tensor, weight: torch.Tensor) -> bool:
    hopper = _rms_norm_linear_silu_hopper
    return HOPPER_PATH.on and hopper is not None and hopper.eligible(x_rows, weight)


def _takes_three_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``_launch`` runs rms_norm_linear_silu(x, ., weight) as gemslib's rms_norm,
    torch's matmul and gemslib's silu (its config's VENDOR_GEMM), inputs validated."""
    n_out, n_in = weight.shape
    if x.numel() == 0 or n_out == 0 or n_in == 0:
        return False
    x_rows = layout.as_rows(layout.unit_last(x))
    if _hopper_takes(x_rows, layout.unit_last(weight)):
        return False
    config = RMS_NORM_LINEAR_SILU.planned_config((x_rows.shape[0], n_out, n_in,
                                                  x.element_size()))
    return bool(config.meta_dict["VENDOR_GEMM"])


def _three_kernels(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float, hopper_on: bool = True) -> torch.Tensor:
    """The VENDOR_GEMM form through the public, planned operators, for a signature already
    decided (``rms_norm_linear_silu``'s call plan; ``hopper_on`` is in its key, unused here)."""
    normed = rms_norm_ops.rms_norm(x, norm_weight, eps)
    return silu_ops.silu(torch.nn.functional.linear(normed, weight, bias))


def _launch(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(..., N) in x's dtype; inputs validated, on the kernel device, one kernel dtype."""
    n_out, n_in = weight.shape
    out = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    n_rows = out.numel() // n_out if n_out else 0
    if out.numel() == 0:
        return out
    if n_in == 0:  # an empty sum: z = b
        return torch.nn.functional.silu(bias.expand_as(out) if bias is not None else out.zero_())
    x_rows = layout.as_rows(layout.unit_last(x))
    weight = layout.unit_last(weight)
    out_rows = out.view(n_rows, n_out)
    if _hopper_takes(x_rows, weight):
        runtime.launched_outside_plans()
        _rms_norm_linear_silu_hopper.forward(x_rows, norm_weight.contiguous(), weight,
                       bias.contiguous() if bias is not None else None, eps, out_rows)
        return out
    # elem_bytes: fp32 tiles take twice the shared memory of 16-bit ones
    shape = (n_rows, n_out, n_in, x.element_size())
    config = RMS_NORM_LINEAR_SILU.planned_config(shape)
    meta = config.meta_dict
    if meta["VENDOR_GEMM"]:
        normed = rms_norm_ops._forward(x_rows, norm_weight, eps, False)[0]
        projected = torch.nn.functional.linear(normed, weight, bias)
        silu_ops._launch_elementwise(silu_ops.SILU_FWD, [projected], out_rows)
        return out
    tma = bool(meta["USE_TMA"]) and _tma_ready(weight)
    # the descriptor's block and the split scratch follow the config: the launch uses it
    if tma:
        weight_desc = TensorDescriptor.from_tensor(weight, [meta["BLOCK_N"], meta["BLOCK_K"]])
    else:
        weight_desc = None
    n_tiles = runtime.cdiv(n_rows, meta["BLOCK_M"]) * runtime.cdiv(n_out, meta["BLOCK_N"])
    if meta["SPLIT_K"] > 1:
        # whole BLOCK_K steps per split, so no block of W straddles two splits
        split_len = runtime.cdiv(runtime.cdiv(n_in, meta["SPLIT_K"]), meta["BLOCK_K"]) \
            * meta["BLOCK_K"]
        n_splits = runtime.cdiv(n_in, split_len)
        part_len = n_splits * n_rows * n_out
        arrivals, parts = runtime.split_scratch(x.device, n_tiles, part_len + n_splits * n_rows)
        part, part_sum_squares = parts[:part_len], parts[part_len:]
    else:
        split_len, n_splits = n_in, 1
        arrivals = part = part_sum_squares = None
    # positional (TunedKernel.launch forwards them so), in the kernel's order: tensors and
    # the descriptor; sizes and eps; strides; flags
    RMS_NORM_LINEAR_SILU.launch(
        lambda meta: (runtime.cdiv(n_rows, meta["BLOCK_M"]) * runtime.cdiv(n_out, meta["BLOCK_N"]),
                      n_splits if meta["SPLIT_K"] > 1 else 1),
        x_rows, norm_weight.contiguous(), weight, weight_desc,
        bias.contiguous() if bias is not None else None, out_rows, part, part_sum_squares,
        arrivals,
        n_rows, n_out, n_in, eps, split_len, n_splits,
        x_rows.stride(0), weight.stride(0), out_rows.stride(0),
        x.dtype == torch.float32, tma,
        shape=shape, config=config)
    return out


def _tma_ready(weight: torch.Tensor) -> bool:
    """A tensor descriptor needs a 16-byte aligned base and row stride."""
    return layout.tma_addressable(weight)


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def rms_norm_linear_silu_reference(x, norm_weight, weight, bias=None, eps=1e-6):
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight
    return torch.nn.functional.silu(torch.nn.functional.linear(normed, weight, bias))


# --------------------------------------------------------------------------------------------
# Public function, custom op, autograd
# --------------------------------------------------------------------------------------------


def _check(x, norm_weight, weight, bias) -> None:
    name = "gemslib.rms_norm_linear_silu"
    for arg, t in (("x", x), ("norm_weight", norm_weight), ("weight", weight), ("bias", bias)):
        if t is None and arg == "bias":
            continue
        checks.float_tensor(name, arg, t, expected="floating-point")
        checks.like(name, arg, t, x, "x")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must be (..., K), got a 0-d tensor")
    n_in = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != n_in:
        raise ValueError(f"{name}: weight must be (N, K) with K = x.shape[-1] = {n_in}, got "
                         f"{tuple(weight.shape)}")
    if norm_weight.shape != (n_in,):
        raise ValueError(f"{name}: norm_weight must be ({n_in},) to match x's last dim, got "
                         f"{tuple(norm_weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be ({weight.shape[0]},) to match weight's rows, got "
                         f"{tuple(bias.shape)}")


def _rms_norm_linear_silu_impl(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The kernel where it runs; torch (fp32 arithmetic, or float64's own) elsewhere."""
    if not runtime.dot_kernel_runs(x):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        out = rms_norm_linear_silu_reference(
            x.to(work), norm_weight.to(work), weight.to(work),
            bias.to(work) if bias is not None else None, eps)
        return out.to(x.dtype)
    return _launch(x, norm_weight, weight, bias, eps)


_CALLS = runtime.CallPlans("rms_norm_linear_silu")


def rms_norm_linear_silu(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``silu(F.linear(rms_norm(x, norm_weight, eps), weight, bias))`` in one kernel.

    x (..., K), norm_weight (K,), weight (N, K), bias (N,) or None, all of one dtype; returns
    (..., N) in that dtype. Differentiable in every tensor argument (the backward uses torch).

    Args:
        x: (..., K) floating tensor with at least one dim, any strides. The kernels take fp16,
            bf16 and fp32 on the kernel device; other dtypes and devices are computed by
            torch, in fp32 (fp64 for fp64).
        norm_weight: (K,) RMSNorm weight g, x's dtype and device.
        weight: (N, K) projection, as ``nn.Linear.weight``; x's dtype and device.
        bias: (N,) or None; x's dtype and device.
        eps: added to mean(x**2) before the square root; a float or 0-d tensor.

    Returns:
        (..., N) contiguous tensor of x's dtype.

    Raises:
        TypeError: a tensor argument that is not floating-point, or eps not a real number.
        ValueError: x is 0-d, shapes that do not agree as above, or another dtype or device
            than x's.
    """
    # a decided signature replays: the checks and the choice cost more host time than the GPU
    # spends at a tensor-parallel slice's 128 rows or at decode. Three kernels are a kept
    # route; the Triton kernel's launch a launch plan (a launch with a TMA descriptor, and the
    # Hopper path, which launches outside plans, leave their calls to run their own path)
    args = (x, norm_weight, weight, bias, eps, HOPPER_PATH.on)
    key, planned = _CALLS.replayed(*args)
    if planned is not None:
        return planned
    _check(x, norm_weight, weight, bias)
    eps = checks.as_float("gemslib.rms_norm_linear_silu", "eps", eps)
    if runtime.wants_custom_op(x, norm_weight, weight, bias):
        return _rms_norm_linear_silu_op(x, norm_weight, weight, bias, eps)
    if key is None or not runtime.dot_kernel_runs(x):
        return _rms_norm_linear_silu_impl(x, norm_weight, weight, bias, eps)
    if _takes_three_kernels(x, weight):
        _CALLS.keep(key, _three_kernels)
        return _three_kernels(x, norm_weight, weight, bias, eps)
    return _CALLS.plan(key, args, lambda: _launch(x, norm_weight, weight, bias, eps))


def _setup(ctx, inputs, output):
    x, norm_weight, weight, bias, eps = inputs
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.save_for_backward(x, norm_weight, weight, bias)


def _grad(ctx, grad_out, ops):
    """Gradients by the chain rule in fp32 (float64 stays float64), z recomputed:
    dz = dy * silu'(z), dW = dz.T h, db = sum dz, dh = dz W, dg = sum dh * x_hat,
    dx = r * (dh g - x_hat * mean(dh g * x_hat))."""
    x, norm_weight, weight, bias = ctx.saved_tensors
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    x32, g32, w32 = x.to(work), norm_weight.to(work), weight.to(work)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + ctx.eps)
    x_hat = x32 * rstd
    normed = x_hat * g32
    z = torch.nn.functional.linear(normed, w32, bias.to(work) if bias is not None else None)
    sig = torch.sigmoid(z)
    dz = grad_out.to(work) * sig * (1 + z * (1 - sig))
    dz_rows, normed_rows = dz.reshape(-1, dz.shape[-1]), normed.reshape(-1, normed.shape[-1])
    d_weight = dz_rows.t() @ normed_rows
    d_bias = dz_rows.sum(0) if ctx.has_bias else None
    d_normed = dz @ w32
    d_norm_weight = (d_normed * x_hat).reshape(-1, x.shape[-1]).sum(0)
    d_x_hat = d_normed * g32
    dx = rstd * (d_x_hat - x_hat * (d_x_hat * x_hat).mean(dim=-1, keepdim=True))
    return (dx.to(x.dtype), d_norm_weight.to(norm_weight.dtype), d_weight.to(weight.dtype),
            d_bias.to(bias.dtype) if d_bias is not None else None, None)


# torch arithmetic all the way: the backward is itself differentiable
_rms_norm_linear_silu_op = runtime.CustomOp(
    "rms_norm_linear_silu", _rms_norm_linear_silu_impl,
    fake=lambda x, norm_weight, weight, bias, eps: x.new_empty((*x.shape[:-1], weight.shape[0])),
    setup_context=_setup, backward=_grad, differentiable_backward=True)


# --------------------------------------------------------------------------------------------
# Self-check for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _check_inputs(device, dtype, rows):
    """x (rows, K), norm weight, weight (N, K), bias: small at the check's size, a Llama MLP's
    gate width (K 4096, N 14336) at the timing size."""
    n_in, n_out = (4096, 14336) if rows >= 1024 else (256, 200)
    return (torch.randn(rows, n_in, device=device, dtype=dtype),
            torch.randn(n_in, device=device, dtype=dtype),
            torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5,
            torch.randn(n_out, device=device, dtype=dtype))


def _term_scale(x, norm_weight, weight, bias):
    """The size of the sums before silu: |rms_norm(x)| @ |W|.T + |b|, x * g rounded to the
    dtype in every term."""
    x, norm_weight, weight, bias = (t.double() for t in (x, norm_weight, weight, bias))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
    return (normed.abs() @ weight.abs().t() + bias.abs()).max().item()


SELF_CHECKS = (
    SelfCheck("rms_norm_linear_silu", _check_inputs, run=rms_norm_linear_silu,
              reference=rms_norm_linear_silu_reference,
              torch_peer=lambda x, g, w, b: torch.nn.functional.silu(torch.nn.functional.linear(
                  torch.nn.functional.rms_norm(x, (x.shape[-1],), g, 1e-6), w, b)),
              # bf16 tl.dot is wrong in Triton 3.6's interpreter
              dtypes=(torch.float16, torch.float32) if runtime.INTERPRETER else
              (torch.float16, torch.bfloat16, torch.float32),
              term_scale=_term_scale),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a problem per bucket (bf16, or fp32 for
# the fp32 buckets: their tiles take twice the shared memory)
# --------------------------------------------------------------------------------------------

def _tune_problem(row_counts: tuple[int, ...], n_out: int = 14336, n_in: int = 4096,
                  dtype: torch.dtype = torch.bfloat16):
    """Llama-3-8B's gate projection at each row count (summed), on the Triton kernel (the
    Hopper path, where it applies, is switched off while the problem runs)."""
    def make(device):
        xs = [torch.randn(rows, n_in, device=device, dtype=dtype) for rows in row_counts]
        norm_weight = torch.randn(n_in, device=device, dtype=dtype)
        weight = torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in ** -0.5

        def run():
            with HOPPER_PATH.switched_off():
                return [rms_norm_linear_silu(x, norm_weight, weight) for x in xs]
        return run
    return make


TUNING = (
    TuneSpace(
        RMS_NORM_LINEAR_SILU,
        # matmul tiles for large M
        tuple({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "USE_TMA": t,
               "SPLIT_K": 1, "VENDOR_GEMM": 0, "num_warps": w, "num_stages": s}
              for m, n, k in ((128, 128, 64), (128, 256, 64), (64, 256, 64), (128, 128, 128))
              for t in (0, 1) for w in (4, 8) for s in (3, 4))
        # decode tiles: 16 rows, narrow column tiles, long K steps (columns narrower than 64
        # do not pay: see docs/notes/matmul-mlp.md)
        + tuple({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 1, "USE_TMA": t,
                 "SPLIT_K": 1, "VENDOR_GEMM": 0, "num_warps": w, "num_stages": s}
                for n, k in ((64, 128), (64, 256), (128, 128))
                for t in (0, 1) for w in (2, 4) for s in (3, 4))
        # decode with K split into SPLIT_K ranges: more programs in flight over W
        + tuple({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 128, "GROUP_M": 1, "USE_TMA": t,
                 "SPLIT_K": split, "VENDOR_GEMM": 0, "num_warps": w, "num_stages": 3}
                for n in (64, 128) for split in (2, 4, 8) for t in (0, 1) for w in (2, 4))
        # the three-kernel form (its tile keys unused)
        + ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "USE_TMA": 0,
            "SPLIT_K": 1, "VENDOR_GEMM": 1, "num_warps": 4, "num_stages": 3},),
        (TuneBucket({"rows": 16, "elem_bytes": 2}, "M1 + M16 N14336 K4096", _tune_problem((1, 16))),
         TuneBucket({"rows": 64, "elem_bytes": 2}, "M64 N14336 K4096", _tune_problem((64,))),
         TuneBucket({"elem_bytes": 2}, "M4096 N14336 K4096", _tune_problem((4096,))),
         # fp32 (IEEE products, far below the 16-bit tensor-core rate): smaller problems
         TuneBucket({"rows": 64}, "M16 N4096 K4096 fp32",
                    _tune_problem((16,), n_out=4096, dtype=torch.float32)),
         TuneBucket(None, "M1024 N4096 K4096 fp32",
                    _tune_problem((1024,), n_out=4096, dtype=torch.float32)))),
)
