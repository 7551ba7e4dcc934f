"""rms_norm_linear_silu (bf16) against torch eager (F.rms_norm, F.linear, F.silu), torch.compile
of the same, and cuBLAS's matmul alone as the lower bound.

    python -m benchmark --ops rms_norm_linear_silu

FLOPs 2 * M * N * K; bytes moved: the weight once, x once, the output once (what decides the
small-M shapes, where the weight read is the whole cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import BOUND, Case, compiled, outputs_close
from gemslib.fused import rms_norm_linear_silu as fused_ops

# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("rms_norm_linear_silu",)
DTYPE = torch.bfloat16
K = 4096
# (M, N)
QUICK_SHAPES = [(1, 14336), (16, 14336), (4096, 14336)]
EXTRA_SHAPES = [(64, 14336), (512, 14336), (16384, 14336), (4096, 11008), (4096, 4096),
                (1, 11008), (16, 4096), (4096, 14335)]
EPS = 1e-6


def _eager(x, norm_weight, weight):
    return F.silu(F.linear(F.rms_norm(x, (x.shape[-1],), norm_weight, EPS), weight))


def cases(quick: bool = False, backward: bool = False):
    size = torch.finfo(DTYPE).bits // 8
    compiled_eager = compiled(_eager)
    for rows, n_out in QUICK_SHAPES + ([] if quick else EXTRA_SHAPES):
        x = torch.randn(rows, K, device="cuda", dtype=DTYPE)
        norm_weight = torch.randn(K, device="cuda", dtype=DTYPE)
        weight = torch.randn(n_out, K, device="cuda", dtype=DTYPE) * K ** -0.5
        impls = {"gemslib": lambda: gemslib.rms_norm_linear_silu(x, norm_weight, weight, eps=EPS),
                 "torch eager": lambda: _eager(x, norm_weight, weight),
                 "torch.compile": lambda: compiled_eager(x, norm_weight, weight),
                 f"cuBLAS matmul only {BOUND}": lambda: F.linear(x, weight)}
        yield Case("rms_norm_linear_silu", f"M{rows} K{K} N{n_out}", "bf16",
                   (x.numel() + weight.numel() + rows * n_out) * size, impls,
                   flops=2 * rows * n_out * K,
                   outputs_agree=outputs_close(
                       impls["gemslib"],
                       lambda: fused_ops.rms_norm_linear_silu_reference(
                           x.float(), norm_weight.float(), weight.float(), None, EPS)))
        del x, weight


SWEEP_CANDIDATES = {
    "rms_norm_linear_silu":
        # matmul tiles for large M
        [{"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "USE_TMA": t, "SPLIT_K": 1,
          "num_warps": w, "num_stages": s}
         for m, n, k in ((128, 128, 64), (128, 256, 64), (64, 256, 64), (128, 128, 128))
         for t in (0, 1) for w in (4, 8) for s in (3, 4)]
        # decode tiles: 16 rows, narrow column tiles, long K steps (the 2026-11-30 sweep: 64
        # columns, 2 warps, TMA best; 16-32 columns 1.5-2.5x slower, dropped)
        + [{"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 1, "USE_TMA": t, "SPLIT_K": 1,
            "num_warps": w, "num_stages": s}
           for n, k in ((64, 128), (64, 256), (128, 128))
           for t in (0, 1) for w in (2, 4) for s in (3, 4)]
        # decode, K split into SPLIT_K ranges: more programs in flight over W
        + [{"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": 128, "GROUP_M": 1, "USE_TMA": t,
            "SPLIT_K": split, "num_warps": w, "num_stages": 3}
           for n in (64, 128) for split in (2, 4, 8) for t in (0, 1) for w in (2, 4)],
}


def sweep_problems():
    """(kernel, label, bytes moved, callable) for benchmark/sweep.py."""
    size = torch.finfo(DTYPE).bits // 8
    for rows, n_out in [(1, 14336), (16, 14336), (4096, 14336)]:
        x = torch.randn(rows, K, device="cuda", dtype=DTYPE)
        norm_weight = torch.randn(K, device="cuda", dtype=DTYPE)
        weight = torch.randn(n_out, K, device="cuda", dtype=DTYPE) * K ** -0.5
        yield (fused_ops.RMS_NORM_LINEAR_SILU, f"M{rows} N{n_out}",
               (x.numel() + weight.numel() + rows * n_out) * size,
               lambda: gemslib.rms_norm_linear_silu(x, norm_weight, weight, eps=EPS))
