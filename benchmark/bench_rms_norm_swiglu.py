"""rms_norm_swiglu (bf16), an MLP's up half, at the MLP shapes of the common model families and
their tensor-parallel halves and quarters, against cuBLAS's merged [gate | up] GEMM alone (the
bound) and the compositions that compute the same: torch eager (F.rms_norm, F.linear, silu *
mul), torch.compile of it, gemslib's rms_norm + cuBLAS + silu_and_mul, and Liger-Kernel's
(LigerRMSNorm, the gate and up projections, LigerSiLUMul, as its LigerSwiGLUMLP runs them).

    python -m benchmark --ops rms_norm_swiglu

out = silu(n @ Wg.T) * (n @ Wu.T), n = rms_norm(x) * g; x (M, K), [Wg | Wu] (2I, K). FLOPs
2 * M * K * 2I; bytes moved: x, the weights and the output once each (the weights are the
whole cost at decode sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import BOUND, Case, compiled, optional_peer, outputs_close
from gemslib.fused import rms_norm_swiglu as fused_ops

OPS = ("rms_norm_swiglu",)
DTYPE = torch.bfloat16
EPS = 1e-6
# (family, K, I): Llama-2-7B; Llama-3-8B and Mistral-7B; Qwen2-7B; Qwen2.5-14B
MLPS = (("llama2-7b", 4096, 11008), ("llama3-8b", 4096, 14336), ("qwen2-7b", 3584, 18944),
        ("qwen2.5-14b", 5120, 13824))
ROWS = (1, 16, 128, 512, 2048, 4096)
TP_PARTS = (1, 2, 4)  # the whole I, a tensor-parallel half, a quarter
QUICK = (("llama3-8b", 4096, 14336, 1), ("llama3-8b", 4096, 14336, 16),
         ("llama3-8b", 4096, 14336, 4096))


def _eager(x, norm_weight, gate_up_weight):
    gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), norm_weight, EPS),
                        gate_up_weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp_shapes():
    """(label, K, I, M) of every MLP shape: each family at its whole I and TP parts of it."""
    for name, n_in, inter in MLPS:
        for part in TP_PARTS:
            for rows in ROWS:
                yield name if part == 1 else f"{name} I/{part}", n_in, inter // part, rows


def cases(quick: bool = False, backward: bool = False):
    liger_norm = optional_peer("liger_kernel.ops.rms_norm")
    liger_swiglu = optional_peer("liger_kernel.ops.swiglu")
    size = torch.finfo(DTYPE).bits // 8
    compiled_eager = compiled(_eager)
    for name, n_in, inter, rows in (QUICK if quick else mlp_shapes()):
        x = torch.randn(rows, n_in, device="cuda", dtype=DTYPE)
        norm_weight = torch.rand(n_in, device="cuda", dtype=DTYPE) + 0.5
        weight = torch.randn(2 * inter, n_in, device="cuda", dtype=DTYPE) * n_in ** -0.5
        gate_weight, up_weight = weight[:inter], weight[inter:]
        impls = {
            "gemslib": lambda: gemslib.rms_norm_swiglu(x, norm_weight, weight, eps=EPS),
            "torch eager": lambda: _eager(x, norm_weight, weight),
            "torch.compile": lambda: compiled_eager(x, norm_weight, weight),
            "rms_norm + cuBLAS + silu_and_mul": lambda: gemslib.silu_and_mul(
                F.linear(gemslib.rms_norm(x, norm_weight, EPS), weight)),
            f"cuBLAS GEMM only {BOUND}": lambda: F.linear(x, weight)}
        if liger_norm and liger_swiglu:
            def liger_up_half():
                normed = liger_norm.LigerRMSNormFunction.apply(x, norm_weight, EPS)
                return liger_swiglu.LigerSiLUMulFunction.apply(F.linear(normed, gate_weight),
                                                               F.linear(normed, up_weight))

            impls["Liger-Kernel"] = liger_up_half
        yield Case("rms_norm_swiglu", f"{name} M{rows} K{n_in} I{inter}", "bf16",
                   (x.numel() + weight.numel() + rows * inter) * size, impls,
                   flops=2 * rows * n_in * 2 * inter,
                   outputs_agree=outputs_close(
                       impls["gemslib"],
                       lambda: fused_ops.rms_norm_swiglu_reference(
                           x.float(), norm_weight.float(), weight.float(), EPS),
                       rtol=1e-2, normwise=True))
        del x, weight, gate_weight, up_weight
