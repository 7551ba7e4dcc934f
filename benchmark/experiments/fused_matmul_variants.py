"""Experiment: what does fusing RMSNorm into the matmul cost, and where does the rest go?

    python -m benchmark.experiments.fused_matmul_variants

First GPU contact (2026-11-30): the fused kernel took 2325.8 us at M4096 K4096 N14336 (207
TFLOP/s), cuBLAS's matmul alone 698.8. Its x tiles go through registers (scaled by the norm
weight, squares summed), so every wgmma takes its A operand from registers, which Triton 3.6
cannot overlap like a shared-memory operand. Timed here, same shapes, same run:

1. cuBLAS ``x @ W.T`` (the bound);
2. a plain Triton matmul (A and B from shared memory, nothing fused) at each tile config: what
   Triton reaches at all with these tiles;
3. the same matmul with the rstd + silu epilogue, fed by a pre-pass kernel that writes x * g
   and rstd (two launches; the pre-pass moves 2 * M * K * 2 bytes, ~16 us at M 4096);
4. the shipped fused kernel forced to each tile config.

If 3 is within 5% of 1 and 4 is not, the fusion's register path is the cost and the two-launch
form (or a one-kernel form whose A operand stays in shared memory) is the way to 1.05x; if 2 is
far from 1 too, the tiles and pipelining come first. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmark.harness import median_ms
from gemslib import runtime
from gemslib.fused import rms_norm_linear_silu as fused_ops

EPS = 1e-6


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, rstd_ptr, c_ptr, M, N, K, a_row_stride, b_row_stride,
                   c_row_stride, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c = a @ b.T (EPILOGUE: silu(rstd[:, None] * (a @ b.T))), grouped tile order."""
    pid = tl.program_id(0)
    n_m_tiles = tl.cdiv(M, BLOCK_M)
    n_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * n_n_tiles
    first_m_tile = (pid // tiles_per_group) * GROUP_M
    group_m_tiles = tl.minimum(n_m_tiles - first_m_tile, GROUP_M)
    m_tile = first_m_tile + (pid % tiles_per_group) % group_m_tiles
    n_tile = (pid % tiles_per_group) // group_m_tiles
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * a_row_stride
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * b_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    if EPILOGUE:
        acc = acc * tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)[:, None]
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * c_row_stride + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _scale_rows_kernel(x_ptr, g_ptr, xg_ptr, rstd_ptr, K, eps, BLOCK_K: tl.constexpr):
    """One row per program: rstd = 1 / sqrt(mean(x^2) + eps), xg = x * g."""
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    mask = ks < K
    x = tl.load(x_ptr + row * K + ks, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + ks, mask=mask, other=0.0).to(tl.float32)
    tl.store(rstd_ptr + row, 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps))
    tl.store(xg_ptr + row * K + ks, (x * g).to(xg_ptr.dtype.element_ty), mask=mask)


TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 4, 3),
         (128, 256, 64, 8, 4)]


def plain_matmul(a, b, tile, rstd=None):
    block_m, block_n, block_k, warps, stages = tile
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid = (runtime.cdiv(M, block_m) * runtime.cdiv(N, block_n),)
    _matmul_kernel[grid](a, b, rstd if rstd is not None else a, c, M, N, K, a.stride(0),
                         b.stride(0), c.stride(0), rstd is not None, BLOCK_M=block_m,
                         BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps,
                         num_stages=stages)
    return c


def two_launches(x, norm_weight, weight, tile):
    M, K = x.shape
    xg = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    _scale_rows_kernel[(M,)](x, norm_weight, xg, rstd, K, EPS,
                             BLOCK_K=runtime.next_power_of_2(K), num_warps=8)
    return plain_matmul(xg, weight, tile, rstd)


def fused(x, norm_weight, weight, tile):
    block_m, block_n, block_k, warps, stages = tile
    config = runtime.LaunchConfig((("BLOCK_K", block_k), ("BLOCK_M", block_m),
                                   ("BLOCK_N", block_n), ("GROUP_M", 8), ("USE_TMA", 0),
                                   ("SPLIT_K", 1)), warps, stages)
    with fused_ops.RMS_NORM_LINEAR_SILU.forced(config):
        return fused_ops.rms_norm_linear_silu(x, norm_weight, weight)


def main() -> None:
    for M, K, N in [(4096, 4096, 14336), (16384, 4096, 14336)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        norm_weight = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        expected = fused_ops.rms_norm_linear_silu_reference(x.float(), norm_weight.float(),
                                                            weight.float(), eps=EPS)
        flops = 2 * M * N * K

        def report(name, fn, check=True):
            try:
                out = fn()
                us = median_ms(fn) * 1e3
            except Exception as err:  # e.g. out of shared memory at this tile
                print(f"M{M} N{N} {name:<44} does not run ({type(err).__name__})", flush=True)
                return
            wrong = check and not torch.allclose(out.float(), expected, rtol=3e-2, atol=3e-2)
            print(f"M{M} N{N} {name:<44} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s"
                  f"{'  WRONG' if wrong else ''}", flush=True)

        report("cuBLAS x @ W.T (bound)", lambda: x @ weight.T, check=False)
        report("gemslib shipped", lambda: fused_ops.rms_norm_linear_silu(x, norm_weight, weight))
        for tile in TILES:
            label = "{}x{}x{} w{} s{}".format(*tile)
            report(f"plain Triton matmul {label}", lambda t=tile: plain_matmul(x, weight, t),
                   check=False)
            report(f"pre-pass + matmul epilogue {label}",
                   lambda t=tile: two_launches(x, norm_weight, weight, t))
            report(f"fused (shipped kernel) {label}",
                   lambda t=tile: fused(x, norm_weight, weight, t))


if __name__ == "__main__":
    main()
