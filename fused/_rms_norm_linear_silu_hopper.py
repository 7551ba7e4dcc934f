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

On Hopper Triton's own matmul falls well short of cuBLAS, and the in-loop fusion of the
Triton kernel in ``rms_norm_linear_silu.py`` (which serves every other call) costs more on
top; this schedule comes close to cuBLAS (see docs/notes/matmul-mlp.md). The operand fed to
the tensor cores is the same x * g rounded to x's dtype as there.

The same matmul with ``GATED`` (``forward_gated``, under ``rms_norm_swiglu``, ``linear_swiglu``
and ``linear_geglu``) computes an MLP's up half, act(n @ Wg.T) * (n @ Wu.T) with act silu or
either GELU, over a stacked W = [Wg | Wu] (2I, K): each stage brings a [128, 64] block of gate rows and, below it in the
same buffer, the matching block of up rows, so one 64 x 256 wgmma per consumer fills the
gate and up columns of one accumulator, and the epilogue writes the (M, I) result only,
never the (M, 2I) projection.
"""

from __future__ import annotations

import functools

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
from gemslib.ops.silu import SILU

TILE_ROWS = 64     # rows of a tile per consumer warpgroup (the wgmma M); a tile has two
BLOCK_N = 256      # columns of a tile
BLOCK_K = 64       # K per stage
STAGES = 3         # 3 x (16 + 32) KB of operands, and the epilogue's conversion scratch
GROUP_M = 8
GATED_BLOCK_N = 128  # output columns of a gated tile: a gate and an up block per stage
MIN_ROWS = 128     # below, the Triton kernel's small-M tiles stream W better
MIN_WAVES = 4      # tiles per SM below which a persistent program's tail and the epilogues
                   # cost more than cuBLAS's split tiles lose (see docs/notes/matmul-mlp.md)
SCALE_BLOCK = 1024  # x elements per step of the pre-pass

ROWS = gl.constexpr(TILE_ROWS)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@triton.jit
def _scale_rows_kernel(x_ptr, norm_weight_ptr, xg_ptr, rstd_ptr, n_in, stride_x_row, eps,
                       BLOCK_K: tl.constexpr):
    """One row per program, BLOCK_K elements a step: xg = x * g in x's dtype, rstd = 1 /
    sqrt(mean(x^2) + eps) fp32."""
    i_m = tl.program_id(0).to(tl.int64)
    b_squares = tl.zeros([BLOCK_K], tl.float32)
    for i_k in range(0, n_in, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        m_k = o_k < n_in
        b_x = tl.load(x_ptr + i_m * stride_x_row + o_k, mask=m_k, other=0.0)
        b_g = tl.load(norm_weight_ptr + o_k, mask=m_k, other=0.0)
        b_xf = b_x.to(tl.float32)
        b_squares += b_xf * b_xf
        tl.store(xg_ptr + i_m * n_in + o_k, (b_xf * b_g.to(tl.float32)).to(b_x.dtype), mask=m_k)
    tl.store(rstd_ptr + i_m, 1.0 / tl.sqrt(tl.sum(b_squares) / n_in + eps))


@gluon.jit
def _tile_coords(i_tile, n_tiles_m, n_tiles_n, GROUP_M: gl.constexpr):
    """(row tile, column tile) of tile i_tile in grouped order."""
    tiles_per_group = GROUP_M * n_tiles_n
    first_m = (i_tile // tiles_per_group) * GROUP_M
    group_m = gl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + (i_tile % tiles_per_group) % group_m, (i_tile % tiles_per_group) // group_m


@gluon.jit
def _producer(xg_desc, weight_desc, xg_smem, weight_smem, ready, empty, n_tiles_m, n_tiles_n,
              n_k_steps, up_row, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              GATED: gl.constexpr):
    """GATED: a stage's W buffer holds two blocks one above the other, the gate rows of the
    tile's columns and the up rows ``up_row`` further down (W = [gate | up] stacked); else
    one."""
    BLOCK_K: gl.constexpr = xg_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = weight_desc.block_type.shape[0]
    W_BLOCKS: gl.constexpr = 2 if GATED else 1
    i_step = 0
    for i_tile in range(gl.program_id(0), n_tiles_m * n_tiles_n, gl.num_programs(0)):
        i_m, i_n = _tile_coords(i_tile, n_tiles_m, n_tiles_n, GROUP_M)
        for i_k in range(n_k_steps):
            stage = i_step % STAGES
            # the previous round of this stage must be released by both consumers
            mbarrier.wait(empty.index(stage), ((i_step // STAGES) + 1) & 1, pred=i_step >= STAGES)
            mbarrier.expect(ready.index(stage), 2 * xg_desc.block_type.nbytes
                            + W_BLOCKS * weight_desc.block_type.nbytes)
            for i_half in gl.static_range(2):
                tma.async_copy_global_to_shared(
                    xg_desc, [(i_m * 2 + i_half) * ROWS, i_k * BLOCK_K], ready.index(stage),
                    xg_smem.index(stage * 2 + i_half))
            for i_block in gl.static_range(W_BLOCKS):
                tma.async_copy_global_to_shared(
                    weight_desc, [i_block * up_row + i_n * BLOCK_N, i_k * BLOCK_K],
                    ready.index(stage), weight_smem.index(stage).slice(i_block * BLOCK_N, BLOCK_N))
            i_step += 1


@gluon.jit
def _gated(b_gate, b_up, ACTIVATION: gl.constexpr):
    """act(gate) * up in fp32, act by ACTIVATION as in ops.silu's gated kernels: SILU, GELU_TANH
    (g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3): 1 + tanh(u) never formed, so no
    cancellation far below zero) or GELU_ERF (g/2 (1 + erf(g / sqrt(2))))."""
    if ACTIVATION == 0:
        b_act = b_gate / (1.0 + gl.exp2(-LOG2E * b_gate))
    elif ACTIVATION == 1:
        b_2u = 1.5957691216057308 * (b_gate + 0.044715 * b_gate * b_gate * b_gate)
        b_act = b_gate / (1.0 + gl.exp2(-LOG2E * b_2u))
    else:
        b_act = 0.5 * b_gate * (1.0 + gl.erf(b_gate * 0.7071067811865476))
    return b_act * b_up


@gluon.jit
def _consumer(i_half, xg_smem, weight_smem, ready, empty, out_ptr, rstd_ptr, bias_ptr, n_rows,
              n_out, n_tiles_m, n_tiles_n, n_k_steps, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr):
    """Rows (2 * i_m + i_half) * ROWS ... of every tile (i_m, i_n) this program visits.
    GATED: a stage's W buffer is the gate block over the up block, so one wgmma of twice the
    width fills [gate | up] columns of one accumulator (xg read once a step), and the epilogue
    writes act(r * gate) * (r * up) (``_gated``); else silu(r * acc + b)."""
    W_ROWS: gl.constexpr = weight_smem.shape[1]
    W_BLOCKS: gl.constexpr = 2 if GATED else 1
    BLOCK_N: gl.constexpr = W_ROWS // W_BLOCKS  # output columns of a tile
    ACC_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, W_ROWS, 16])
    # the epilogue's layout: 8 consecutive columns (16 bytes) per thread
    OUT_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8],
                                                [4, 1], [1, 0])
    i_step = 0
    for i_tile in range(gl.program_id(0), n_tiles_m * n_tiles_n, gl.num_programs(0)):
        i_m, i_n = _tile_coords(i_tile, n_tiles_m, n_tiles_n, GROUP_M)
        b_acc = gl.zeros([ROWS, W_ROWS], gl.float32, ACC_LAYOUT)
        for i_k in range(n_k_steps):
            stage = i_step % STAGES
            mbarrier.wait(ready.index(stage), (i_step // STAGES) & 1)
            xg_tile = xg_smem.index(stage * 2 + i_half)
            weight_tile = weight_smem.index(stage)
            b_acc = warpgroup_mma(xg_tile, weight_tile.permute((1, 0)), b_acc, is_async=True)
            # the previous step's wgmma is done: its stage goes back to the producer
            b_acc, _, _ = warpgroup_mma_wait(1, deps=[b_acc, xg_tile, weight_tile])
            mbarrier.arrive(empty.index((i_step + STAGES - 1) % STAGES), pred=i_k > 0)
            i_step += 1
        b_acc = warpgroup_mma_wait(0, deps=[b_acc])
        mbarrier.arrive(empty.index((i_step + STAGES - 1) % STAGES))

        # epilogue, one store. (A bf16 tile converted straight from this 64 x 256 wgmma
        # layout trips an assertion in Triton 3.6's lowering; fp32 does not.)
        o_m = (i_m * 2 + i_half) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
        o_n = i_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, OUT_LAYOUT))
        if GATED:
            if rstd_ptr is not None:  # r goes inside silu: applied in the accumulator's layout
                o_m_acc = (i_m * 2 + i_half) * ROWS + gl.arange(
                    0, ROWS, layout=gl.SliceLayout(1, ACC_LAYOUT))
                b_acc = b_acc * gl.load(rstd_ptr + o_m_acc, mask=o_m_acc < n_rows,
                                        other=0.0)[:, None]
            # a thread holds column c and c + BLOCK_N alike: the split moves no data
            b_gate, b_up = gl.split(gl.permute(gl.reshape(b_acc, [ROWS, 2, BLOCK_N]), (0, 2, 1)))
            b_out = gl.convert_layout(_gated(b_gate, b_up, ACTIVATION), OUT_LAYOUT)
        else:
            b_z = gl.convert_layout(b_acc, OUT_LAYOUT)
            if rstd_ptr is not None:
                b_rstd = gl.load(rstd_ptr + o_m, mask=o_m < n_rows, other=0.0)
                b_z = b_z * b_rstd[:, None]
            if bias_ptr is not None:
                b_bias = gl.load(bias_ptr + o_n, mask=o_n < n_out, other=0.0)
                b_z = b_z + b_bias.to(gl.float32)[None, :]
            b_out = b_z / (1.0 + gl.exp2(-LOG2E * b_z))
        gl.store(out_ptr + o_m[:, None].to(gl.int64) * n_out + o_n[None, :],
                 b_out.to(out_ptr.dtype.element_ty),
                 mask=(o_m < n_rows)[:, None] & (o_n < n_out)[None, :])


@gluon.jit
def _matmul_epilogue(xg_desc, weight_desc, out_ptr, rstd_ptr, bias_ptr, n_rows, n_out, n_in,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr = False,
                     ACTIVATION: gl.constexpr = 0):
    """Persistent grid (at most one program per SM): out (n_rows, n_out) = silu(rstd * (xg @
    W.T) + b), xg (n_rows, n_in) through xg_desc in [64, BLOCK_K] blocks, W (n_out, n_in)
    through weight_desc in [BLOCK_N, BLOCK_K] blocks; out contiguous, rstd (n_rows,) fp32 or
    None (no scaling), bias (n_out,) or None. GATED: W is (2 n_out, n_in), gate rows then up
    rows, and out = act(rstd * (xg @ Wg.T)) * (rstd * (xg @ Wu.T)), no bias, act as
    ``_gated`` takes ACTIVATION."""
    BLOCK_K: gl.constexpr = xg_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = weight_desc.block_type.shape[0]
    DTYPE: gl.constexpr = xg_desc.dtype
    W_BLOCKS: gl.constexpr = 2 if GATED else 1
    n_tiles_m = gl.cdiv(n_rows, 2 * ROWS)
    n_tiles_n = gl.cdiv(n_out, BLOCK_N)
    n_k_steps = gl.cdiv(n_in, BLOCK_K)
    xg_smem = gl.allocate_shared_memory(DTYPE, [STAGES * 2, ROWS, BLOCK_K], xg_desc.layout)
    # GATED: the [128, BLOCK_K] layout's swizzle repeats every 8 rows, so two blocks stacked
    # are one [256, BLOCK_K] operand in the same layout
    weight_smem = gl.allocate_shared_memory(DTYPE, [STAGES, W_BLOCKS * BLOCK_N, BLOCK_K],
                                            weight_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i_stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(i_stage), count=1)
        mbarrier.init(empty.index(i_stage), count=2)  # one arrival per consumer warpgroup
    # each consumer's arguments written out: Triton 3.6 cannot concatenate a tuple holding
    # a None (bias_ptr without a bias) onto the warpgroup's index
    gl.warp_specialize([(_consumer, (gl.to_tensor(0), xg_smem, weight_smem, ready, empty, out_ptr,
                                     rstd_ptr, bias_ptr, n_rows, n_out, n_tiles_m, n_tiles_n,
                                     n_k_steps, GROUP_M, STAGES, GATED, ACTIVATION)),
                        (_consumer, (gl.to_tensor(1), xg_smem, weight_smem, ready, empty, out_ptr,
                                     rstd_ptr, bias_ptr, n_rows, n_out, n_tiles_m, n_tiles_n,
                                     n_k_steps, GROUP_M, STAGES, GATED, ACTIVATION)),
                        (_producer, (xg_desc, weight_desc, xg_smem, weight_smem, ready, empty,
                                     n_tiles_m, n_tiles_n, n_k_steps, n_out, GROUP_M, STAGES,
                                     GATED))],
                       [4, 1], [232, 40])


@functools.cache  # built on every launch otherwise
def _shared_layouts(dtype: torch.dtype, block_n: int = BLOCK_N):
    """The shared layouts of an xg block and a [block_n, BLOCK_K] weight block."""
    element = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([TILE_ROWS, BLOCK_K], element),
            gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], element))


def tiles(n_rows: int, weight_rows: int) -> int:
    """The matmul's 128 x 256 tiles for (n_rows, K) rows against a (weight_rows, K) weight
    (a SwiGLU tile's 256 weight rows are 128 gate and 128 up rows)."""
    return runtime.cdiv(n_rows, 2 * TILE_ROWS) * runtime.cdiv(weight_rows, BLOCK_N)


def fills_the_gpu(n_rows: int, weight_rows: int, multiprocessors: int) -> bool:
    """Whether the product has MIN_WAVES tiles per SM at least: with fewer, the persistent
    programs idle through the last wave and every tile's epilogue, and cuBLAS between
    gemslib's norm and activation kernels is faster (as for a tensor-parallel shard's few
    hundred rows; see docs/notes/matmul-mlp.md)."""
    return tiles(n_rows, weight_rows) >= MIN_WAVES * multiprocessors


def eligible(x_rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``forward`` takes x as (M, K) rows with this (N, K) weight: CUDA sm_90, fp16 or
    bf16, M >= MIN_ROWS, a weight TMA can address (16-byte aligned base and rows), and
    enough tiles to fill the GPU (``fills_the_gpu``)."""
    if not x_rows.is_cuda or x_rows.dtype not in _GL_DTYPES or x_rows.shape[0] < MIN_ROWS or \
            torch.cuda.get_device_capability(x_rows.device) != (9, 0):
        return False
    # x * g is written with rows of K elements, which TMA reads too: K in whole 16 bytes
    return layout.tma_addressable(weight) and weight.shape[1] * weight.element_size() % 16 == 0 \
        and fills_the_gpu(x_rows.shape[0], weight.shape[0],
                          runtime.multiprocessor_count(x_rows.get_device()))


def graph_site_fuses(x: torch.Tensor, weight: torch.Tensor, weight_rows=None) -> bool:
    """Whether a graph rewrite should hand a site of these (fake) x (M, K) and weight values
    to a fused op of this path (rms_norm_linear_silu, linear_swiglu, linear_geglu; a gated
    op's matmul reads ``weight_rows`` = 2I rows, gate and up, where weight is one half of
    them): on CUDA where the call
    will take it (static M >= MIN_ROWS with enough tiles to fill the GPU, fp16 or bf16, one
    dtype, sm_90: what is known before the weights' alignment), since elsewhere cuBLAS and
    gemslib's norm and activation kernels are faster than the fused op's other forms; without
    CUDA (the interpreter, where the rewrites are tested) at the same rows in any kernel
    dtype."""
    rows = x.shape[0]
    if not isinstance(rows, int) or rows < MIN_ROWS or weight.dtype != x.dtype:
        return False
    if x.device.type != "cuda":
        return x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    weight_rows = weight.shape[0] if weight_rows is None else weight_rows
    return x.dtype in _GL_DTYPES and torch.cuda.get_device_capability(x.device) == (9, 0) and \
        fills_the_gpu(rows, weight_rows, runtime.multiprocessor_count(x.device.index or 0))


def _scale_rows(x_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float):
    """The pre-pass: (x * g in x's dtype, 1/rms fp32) for x_rows (M, K)."""
    n_rows, n_in = x_rows.shape
    scaled = torch.empty((n_rows, n_in), dtype=x_rows.dtype, device=x_rows.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x_rows.device)
    _scale_rows_kernel[(n_rows,)](x_rows, norm_weight, scaled, rstd, n_in, x_rows.stride(0), eps,
                                  BLOCK_K=SCALE_BLOCK, num_warps=4)
    return scaled, rstd


def _launch_matmul(scaled, rstd, weight, bias, out_rows, n_out, block_n, gated, stages,
                   group_m, activation: int = SILU) -> None:
    """The persistent matmul over ``scaled`` (M, K) rows and weight [block_n, BLOCK_K] blocks,
    one program per SM at most."""
    n_rows, n_in = scaled.shape
    xg_layout, weight_layout = _shared_layouts(scaled.dtype, block_n)
    xg_desc = TensorDescriptor.from_tensor(scaled, [TILE_ROWS, BLOCK_K], xg_layout)
    weight_desc = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K], weight_layout)
    programs = min(runtime.multiprocessor_count(scaled.get_device()),
                   tiles(n_rows, weight.shape[0]))
    _matmul_epilogue[(programs,)](
        xg_desc=xg_desc, weight_desc=weight_desc, out_ptr=out_rows, rstd_ptr=rstd,
        bias_ptr=bias, n_rows=n_rows, n_out=n_out, n_in=n_in, GROUP_M=group_m, STAGES=stages,
        GATED=gated, ACTIVATION=activation, num_warps=4)


def forward(x_rows: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, eps: float, out_rows: torch.Tensor, *,
            stages: int = STAGES, group_m: int = GROUP_M) -> None:
    """Write silu(rms_norm(x) @ W.T + b) into out_rows (M, N), contiguous; ``eligible``
    inputs with K >= 1. ``stages`` and ``group_m``: the ring's depth and the tile order's
    group (experiments)."""
    with torch.cuda.device(x_rows.device):
        scaled, rstd = _scale_rows(x_rows, norm_weight, eps)
        _launch_matmul(scaled, rstd, weight, bias, out_rows, weight.shape[0], BLOCK_N, False,
                       stages, group_m)


def forward_gated(x_rows: torch.Tensor, norm_weight: torch.Tensor | None,
                  gate_up_weight: torch.Tensor, eps: float, out_rows: torch.Tensor,
                  normalize: bool = True, activation: int = SILU, *, stages: int = STAGES,
                  group_m: int = GROUP_M) -> None:
    """Write act(n @ Wg.T) * (n @ Wu.T) into out_rows (M, I), contiguous, for
    gate_up_weight (2I, K) = [Wg | Wu] stacked; n = rms_norm(x) * norm_weight (a pre-pass as
    ``forward``'s; norm_weight None: no weight) or, without ``normalize``, x itself (read by
    TMA: contiguous rows); act by ``activation`` (ops.silu's SILU, GELU_TANH, GELU_ERF). CUDA
    sm_90, fp16 or bf16, K in whole 16 bytes."""
    n_in = x_rows.shape[1]
    with torch.cuda.device(x_rows.device):
        scaled, rstd = x_rows, None
        if normalize:
            if norm_weight is None:
                norm_weight = torch.ones(n_in, dtype=x_rows.dtype, device=x_rows.device)
            scaled, rstd = _scale_rows(x_rows, norm_weight, eps)
        _launch_matmul(scaled, rstd, gate_up_weight, None, out_rows,
                       gate_up_weight.shape[0] // 2, GATED_BLOCK_N, True, stages, group_m,
                       activation)
