"""Experiment: a persistent, warp-specialised matmul in Gluon, for rms_norm_linear_silu at large M.

    python -m benchmark.experiments.gluon_matmul            # GPU: check and time against cuBLAS
    python -m benchmark.experiments.gluon_matmul --compile  # CPU: compile for sm_90 only

Why: the best plain Triton matmul measured 1.29x cuBLAS at M4096 N14336 K4096 (NOTES), and the
fused op cannot be faster than the matmul under it. The attention kernel got from Triton's
~500 TFLOP/s to cuDNN's ~600 by warp specialisation (a producer warp for TMA, consumer
warpgroups handing stages over by mbarriers only); the same recipe is how cuBLAS/CUTLASS reach
~750 on Hopper. Here: C = A @ B.T (+ the fused op's epilogue: per-row scale, bias, SiLU),
A (M, K), B (N, K) as nn.Linear keeps its weight, 128 x BLOCK_N tiles in grouped order over a
persistent grid; each of two consumer warpgroups owns 64 rows of the tile (cooperative).
First measured on 2026-11-30: benchmark/NOTES.md, issue 5.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

TILE_ROWS = 64  # rows of a tile per consumer warpgroup (two per tile)
ROWS = gl.constexpr(TILE_ROWS)


@gluon.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row tiles sweep the column tiles together (L2 reuse of B)."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_m, (tile % per_group) // group_m


@gluon.jit
def _mm_producer(a_desc, b_desc, a_smem, b_smem, ready, empty, tiles_m, tiles_n, k_steps,
                 GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    step = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        for kk in range(k_steps):
            stage = step % STAGES
            mbarrier.wait(empty.index(stage), ((step // STAGES) + 1) & 1, pred=step >= STAGES)
            mbarrier.expect(ready.index(stage),
                            2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            for half in gl.static_range(2):
                tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * ROWS + half * ROWS,
                                                         kk * BLOCK_K], ready.index(stage),
                                                a_smem.index(stage * 2 + half))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kk * BLOCK_K],
                                            ready.index(stage), b_smem.index(stage))
            step += 1


@gluon.jit
def _mm_consumer(half, a_smem, b_smem, ready, empty, c_ptr, row_scale_ptr, bias_ptr, M, N,
                 tiles_m, tiles_n, k_steps, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    BLOCK_N: gl.constexpr = b_smem.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    # 16-byte stores: 8 consecutive columns per thread
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8],
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

        # the fused op's epilogue, silu(row_scale * acc + bias), stored 16 bytes per thread
        out = gl.convert_layout(acc, store_layout)
        rows = pid_m * 2 * ROWS + half * ROWS + gl.arange(0, ROWS,
                                                         layout=gl.SliceLayout(1, store_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
        row_scale = gl.load(row_scale_ptr + rows, mask=rows < M, other=0.0)
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)
        out = out * row_scale[:, None] + bias[None, :]
        out = out / (1.0 + gl.exp2(-1.4426950408889634 * out))
        gl.store(c_ptr + rows[:, None].to(gl.int64) * N + cols[None, :],
                 out.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@gluon.jit
def _gluon_matmul(a_desc, b_desc, c_ptr, row_scale_ptr, bias_ptr, M, N, K,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr):
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
        mbarrier.init(empty.index(i), count=2)  # both consumers
    consumer_args = (a_smem, b_smem, ready, empty, c_ptr, row_scale_ptr, bias_ptr, M, N,
                     tiles_m, tiles_n, k_steps, GROUP_M, STAGES)
    gl.warp_specialize([(_mm_consumer, (gl.to_tensor(0),) + consumer_args),
                        (_mm_consumer, (gl.to_tensor(1),) + consumer_args),
                        (_mm_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, tiles_m,
                                        tiles_n, k_steps, GROUP_M, STAGES))],
                       [4, 1], [232, 40])


def _layouts(block_n, block_k, dtype):
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return (gl.NVMMASharedLayout.get_default_for([TILE_ROWS, block_k], element),
            gl.NVMMASharedLayout.get_default_for([block_n, block_k], element))


def gluon_matmul(a, b, row_scale, bias, block_n=256, block_k=64, stages=3, group_m=8):
    """silu(row_scale[:, None] * (a @ b.T) + bias): a (M, K), b (N, K), row_scale (M,) fp32,
    bias (N,)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    a_layout, b_layout = _layouts(block_n, block_k, a.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [TILE_ROWS, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(b, [block_n, block_k], b_layout)
    tiles = -(-M // (2 * TILE_ROWS)) * -(-N // block_n)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _gluon_matmul[(min(sms, tiles),)](a_desc, b_desc, c, row_scale, bias, M, N, K,
                                      GROUP_M=group_m, STAGES=stages, num_warps=4)
    return c


def compile_for_sm90(block_n=256, block_k=64, stages=3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_layout, b_layout = _layouts(block_n, block_k, torch.bfloat16)
    signature = {"a_desc": f"tensordesc<bf16[{TILE_ROWS}, {block_k}],{a_layout!r}>",
                 "b_desc": f"tensordesc<bf16[{block_n}, {block_k}],{b_layout!r}>",
                 "c_ptr": "*bf16", "row_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                 "M": "i32", "N": "i32", "K": "i32", "GROUP_M": "constexpr", "STAGES": "constexpr"}
    source = GluonASTSource(_gluon_matmul, signature, {"GROUP_M": 8, "STAGES": stages})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


CONFIGS = (("n256 k64 s3", dict(block_n=256, block_k=64, stages=3)),
           ("n256 k64 s4", dict(block_n=256, block_k=64, stages=4)),
           ("n128 k64 s5", dict(block_n=128, block_k=64, stages=5)),
           ("n256 k64 s3 g16", dict(block_n=256, block_k=64, stages=3, group_m=16)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU)")
    args = parser.parse_args()
    if args.compile:
        for name, options in CONFIGS:
            options = {k: v for k, v in options.items() if k != "group_m"}
            try:
                compiled = compile_for_sm90(**options)
                print(f"{name}: shared {compiled.metadata.shared} B", flush=True)
            except Exception as err:
                print(f"{name}: failed: {str(err)[-300:]}", flush=True)
        return

    import torch.nn.functional as F

    from benchmark.harness import median_ms
    for M, N, K in ((4096, 14336, 4096), (16384, 14336, 4096), (4096, 4096, 4096),
                    (4096, 11008, 4096), (4000, 14000, 4096)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
        scale = torch.rand(M, device="cuda") + 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        expected = F.silu(scale[:, None] * (a.float() @ b.float().T) + bias.float())
        flops = 2 * M * N * K
        cublas = median_ms(lambda: F.linear(a, b))
        print(f"M{M} N{N} K{K} cuBLAS matmul alone: {cublas * 1e3:8.1f} us "
              f"{flops / cublas / 1e9:5.0f} TFLOP/s", flush=True)
        for name, options in CONFIGS:
            try:
                out = gluon_matmul(a, b, scale, bias, **options)
                error = ((out.float() - expected).norm() / expected.norm()).item()
                ms = median_ms(lambda: gluon_matmul(a, b, scale, bias, **options))
                print(f"  {name} (matmul + epilogue): {ms * 1e3:8.1f} us "
                      f"{flops / ms / 1e9:5.0f} TFLOP/s ({ms / cublas:.3f}x cuBLAS), "
                      f"rel err {error:.2e}", flush=True)
            except Exception as err:  # report and go on
                print(f"  {name}: failed: {str(err)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
