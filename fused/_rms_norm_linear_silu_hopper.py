"""Hopper (sm_90) path of ``gemslib.rms_norm_linear_silu`` for large M: two launches.

    xg[m, k] = x[m, k] g[k]  (rounded to x's dtype),   r[m] = 1 / sqrt(mean_k x[m, k]^2 + eps)
    out[m, n] = silu(r[m] * sum_k xg[m, k] W[n, k] + b[n])

1. ``_scale_rows_kernel`` (Triton): one pass over x, writing xg and r.
2. ``_matmul_epilogue`` (Gluon): a persistent, warp-specialised matmul of xg and W.T whose
   epilogue applies r, b and silu before the one store. One producer warp streams A = xg
   ([64, 64] blocks, two per tile) and B = W ([256, 64] blocks) by TMA through a ring of
   STAGES stages; two consumer warpgroups own 64 rows each of a 128 x 256 tile and release a
   stage by an mbarrier that needs both their arrivals; tiles in grouped order (GROUP_M row
   tiles sweep the columns together, so W is read about once per group).

On the H200 Triton's own matmul takes 1.29x cuBLAS's time, this one 1.02-1.07x at most
shapes (benchmark/NOTES.md, RMSNorm + Linear + SiLU); the in-loop fusion of the Triton kernel in
``rms_norm_linear_silu.py`` (which serves every other call) cost another 1.6x on top. The
operand fed to the tensor cores is the same x * g rounded to x's dtype as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemslib import layout, runtime
from gemslib.layout import LOG2E

TILE_ROWS = 64     # rows of a tile per consumer warpgroup (the wgmma M); a tile has two
BLOCK_N = 256      # columns of a tile
BLOCK_K = 64       # K per stage
STAGES = 3         # 3 x (16 + 32) KB of operands, and the epilogue's conversion scratch
GROUP_M = 8
MIN_ROWS = 128     # below, the Triton kernel's small-M tiles stream W better
SCALE_BLOCK = 1024  # x elements per step of the pre-pass

ROWS = gl.constexpr(TILE_ROWS)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@triton.jit
def _scale_rows_kernel(x_ptr, norm_weight_ptr, xg_ptr, rstd_ptr, n_in, x_row_stride, eps,
                       BLOCK: tl.constexpr):
    """One row per program: xg = x * g in x's dtype, rstd = 1 / sqrt(mean(x^2) + eps) fp32."""
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_in, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_in
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        g = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        squares += xf * xf
        tl.store(xg_ptr + row * n_in + cols, (xf * g.to(tl.float32)).to(x.dtype), mask=mask)
    tl.store(rstd_ptr + row, 1.0 / tl.sqrt(tl.sum(squares) / n_in + eps))


@gluon.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, tiles_m, tiles_n, k_steps,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_steps):
            stage = step % STAGES
            # the previous round of this stage must be released by both consumers
            mbarrier.wait(empty.index(stage), ((step // STAGES) + 1) & 1, pred=step >= STAGES)
            mbarrier.expect(ready.index(stage),
                            2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(
                    a_desc, [(pid_m * 2 + half) * ROWS, kk * BLOCK_K], ready.index(stage),
                    a_smem.index(stage * 2 + half))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K],
                                            ready.index(stage), b_smem.index(stage))
            step += 1


@gluon.jit
def _consumer(half, a_smem, b_smem, ready, empty, out_ptr, rstd_ptr, bias_ptr, has_bias, M, N,
              tiles_m, tiles_n, k_steps, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Rows (2 * pid_m + half) * 64 ... of every tile this program visits."""
    BLOCK_N: gl.constexpr = b_smem.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    # the epilogue's layout: 8 consecutive columns (16 bytes) per thread
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8],
                                                [4, 1], [1, 0])
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            a_tile = a_smem.index(stage * 2 + half)
            b_tile = b_smem.index(stage)
            acc = warpgroup_mma(a_tile, b_tile.permute((1, 0)), acc, is_async=True)
            # the previous step's wgmma is done: its stage goes back to the producer
            acc, _, _ = warpgroup_mma_wait(1, deps=[acc, a_tile, b_tile])
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > 0)
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))

        # epilogue: silu(r * acc + b), one store. (A bf16 tile converted straight from this
        # 64 x 256 wgmma layout trips an assertion in Triton 3.6's lowering; fp32 does not.)
        z = gl.convert_layout(acc, out_layout)
        rows = (pid_m * 2 + half) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
        rstd = gl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        bias = gl.load(bias_ptr + cols, mask=(cols < N) & (has_bias != 0), other=0.0)
        z = z * rstd[:, None] + bias.to(gl.float32)[None, :]
        out = z / (1.0 + gl.exp2(-LOG2E * z))
        gl.store(out_ptr + rows[:, None].to(gl.int64) * N + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@gluon.jit
def _matmul_epilogue(a_desc, b_desc, out_ptr, rstd_ptr, bias_ptr, has_bias, M, N, K,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """Persistent grid (at most one program per SM): out (M, N) = silu(rstd * (A @ B.T) + b),
    A (M, K) through a_desc in [64, BLOCK_K] blocks, B (N, K) through b_desc in
    [BLOCK_N, BLOCK_K] blocks; out contiguous, rstd (M,) fp32, bias (N,) read if has_bias."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    tiles_m = gl.cdiv(M, 2 * ROWS)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    a_smem = gl.allocate_shared_memory(dtype, [STAGES * 2, ROWS, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    consumer_args = (a_smem, b_smem, ready, empty, out_ptr, rstd_ptr, bias_ptr, has_bias, M, N,
                     tiles_m, tiles_n, k_steps, GROUP_M, STAGES)
    gl.warp_specialize([(_consumer, (gl.to_tensor(0),) + consumer_args),
                        (_consumer, (gl.to_tensor(1),) + consumer_args),
                        (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, tiles_m,
                                     tiles_n, k_steps, GROUP_M, STAGES))],
                       [4, 1], [232, 40])


def _shared_layouts(dtype: torch.dtype):
    element = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([TILE_ROWS, BLOCK_K], element),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], element))


def eligible(x_rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``forward`` takes x as (M, K) rows with this (N, K) weight: CUDA sm_90, fp16 or
    bf16, M >= MIN_ROWS, and a weight TMA can address (16-byte aligned base and rows)."""
    if not x_rows.is_cuda or x_rows.dtype not in _GL_DTYPES or x_rows.shape[0] < MIN_ROWS or \
            torch.cuda.get_device_capability(x_rows.device) != (9, 0):
        return False
    # x * g is written with rows of K elements, which TMA reads too: K in whole 16 bytes
    return layout.tma_addressable(weight) and weight.shape[1] * weight.element_size() % 16 == 0


def forward(x_rows: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, eps: float, out_rows: torch.Tensor) -> None:
    """Write silu(rms_norm(x) @ W.T + b) into out_rows (M, N), contiguous; ``eligible``
    inputs with K >= 1."""
    n_rows, n_in = x_rows.shape
    n_out = weight.shape[0]
    scaled = torch.empty((n_rows, n_in), dtype=x_rows.dtype, device=x_rows.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x_rows.device)
    with torch.cuda.device(x_rows.device):
        _scale_rows_kernel[(n_rows,)](x_rows, norm_weight, scaled, rstd, n_in, x_rows.stride(0),
                                      eps, BLOCK=SCALE_BLOCK, num_warps=4)
        a_layout, b_layout = _shared_layouts(x_rows.dtype)
        a_desc = TensorDescriptor.from_tensor(scaled, [TILE_ROWS, BLOCK_K], a_layout)
        b_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K], b_layout)
        tiles = runtime.cdiv(n_rows, 2 * TILE_ROWS) * runtime.cdiv(n_out, BLOCK_N)
        programs = min(torch.cuda.get_device_properties(x_rows.device).multi_processor_count,
                       tiles)
        _matmul_epilogue[(programs,)](
            a_desc, b_desc, out_rows, rstd, bias if bias is not None else out_rows,
            int(bias is not None), n_rows, n_out, n_in, GROUP_M=GROUP_M, STAGES=STAGES,
            num_warps=4)
