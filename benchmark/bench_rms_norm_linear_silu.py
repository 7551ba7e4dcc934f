"""rms_norm_linear_silu (bf16) against torch eager (F.rms_norm, F.linear, F.silu), torch.compile
of the same, and cuBLAS's matmul alone as the lower bound: at K 4096 (M 1 to 16384), and at
the MLP shapes of rms_norm_swiglu's benchmark (four families, N their intermediate width, its
tensor-parallel halves and quarters, M 1 to 4096).

    python -m benchmark --ops rms_norm_linear_silu

FLOPs 2 * M * N * K; bytes moved: the weight once, x once, the output once (what decides the
small-M shapes, where the weight read is the whole cost).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.bench_rms_norm_swiglu import mlp_shapes
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


def _shapes(quick: bool):
    """(label, M, K, N) of every case."""
    for rows, n_out in QUICK_SHAPES + ([] if quick else EXTRA_SHAPES):
        yield "", rows, K, n_out
    if not quick:
        for name, n_in, inter, rows in mlp_shapes():
            yield f"{name} ", rows, n_in, inter


def cases(quick: bool = False, backward: bool = False):
    size = torch.finfo(DTYPE).bits // 8
    compiled_eager = compiled(_eager)
    for label, rows, n_in, n_out in _shapes(quick):
        x = torch.randn(rows, n_in, device="cuda", dtype=DTYPE)
        norm_weight = torch.randn(n_in, device="cuda", dtype=DTYPE)
        weight = torch.randn(n_out, n_in, device="cuda", dtype=DTYPE) * n_in ** -0.5
        impls = {"gemslib": lambda: gemslib.rms_norm_linear_silu(x, norm_weight, weight, eps=EPS),
                 "torch eager": lambda: _eager(x, norm_weight, weight),
                 "torch.compile": lambda: compiled_eager(x, norm_weight, weight),
                 f"cuBLAS matmul only {BOUND}": lambda: F.linear(x, weight)}
        yield Case("rms_norm_linear_silu", f"{label}M{rows} K{n_in} N{n_out}", "bf16",
                   (x.numel() + weight.numel() + rows * n_out) * size, impls,
                   flops=2 * rows * n_out * n_in,
                   outputs_agree=outputs_close(
                       impls["gemslib"],
                       lambda: fused_ops.rms_norm_linear_silu_reference(
                           x.float(), norm_weight.float(), weight.float(), None, EPS),
                       rtol=1e-2, normwise=True))
        del x, weight


