"""rms_norm and add_rms_norm (bf16) against torch eager, torch.compile, Liger-Kernel, FlagGems,
FlashInfer; rms_norm with Gemma's ``(1 + weight)`` (``weight_offset=1``) against Gemma's own
form, eager and compiled, Liger-Kernel's offset norm and FlashInfer's gemma_rmsnorm.

    python -m benchmark --ops rms_norm add_rms_norm [--forward-only]

Bytes moved: rms_norm reads x and writes y (2*M*N); add_rms_norm reads x and residual and
writes both outputs (4*M*N); the backward reads x and dy and writes dx (3*M*N). The weight and
the per-row statistics are negligible at these shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import Case, compiled, optional_peer, outputs_close

QUICK_RMS_NORM = [(65536, 4096), (4096, 4096), (8192, 5120)]
EXTRA_RMS_NORM = [(1, 4096), (16384, 8192), (2048, 12288), (512, 65536)]
QUICK_GEMMA_RMS_NORM = [(4096, 3072)]  # Gemma-7B's width
EXTRA_GEMMA_RMS_NORM = [(1, 3072), (16384, 3584)]
QUICK_ADD_RMS_NORM = [(16384, 8192)]
EXTRA_ADD_RMS_NORM = [(4096, 4096), (1, 8192)]
# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("rms_norm", "rms_norm_backward", "add_rms_norm")
DTYPE = torch.bfloat16
EPS = 1e-6


def _eager_rms_norm(x, weight):
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


def _gemma_rms_norm(x, weight):
    from gemslib.passes.forms import gemma_rms_norm

    return gemma_rms_norm(x, weight, EPS)


def _eager_add_rms_norm(x, residual, weight):
    total = x + residual
    return F.rms_norm(total, (x.shape[-1],), weight, EPS), total


def _grads(fn, *leaves):
    """Backward only: a fresh graph is built once, then torch.autograd.grad is timed."""
    out = fn(*leaves)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    liger = optional_peer("liger_kernel.ops.rms_norm")
    flashinfer = optional_peer("flashinfer")
    size = torch.finfo(DTYPE).bits // 8
    for rows, cols in QUICK_RMS_NORM + ([] if quick else EXTRA_RMS_NORM):
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        weight = torch.randn(cols, device="cuda", dtype=DTYPE)
        impls = {"gemslib": lambda: gemslib.rms_norm(x, weight, EPS),
                 "torch eager": lambda: _eager_rms_norm(x, weight),
                 "torch.compile": (lambda f: lambda: f(x, weight))(compiled(_eager_rms_norm))}
        if liger:
            impls["Liger-Kernel"] = lambda: liger.LigerRMSNormFunction.apply(x, weight, EPS)
        if flag_gems:
            impls["FlagGems"] = lambda: flag_gems.rms_norm(x, [cols], weight, EPS)
        if flashinfer:
            impls["FlashInfer"] = lambda: flashinfer.norm.rmsnorm(x, weight, EPS)
        yield Case("rms_norm", f"{rows}x{cols}", "bf16", 2 * x.numel() * size, impls,
                   outputs_agree=outputs_close(impls["gemslib"],
                                               lambda: _eager_rms_norm(x.float(), weight.float())))
        if backward:
            leaves = (x.clone().requires_grad_(), weight.clone().requires_grad_())
            impls = {"gemslib": _grads(lambda a, w: gemslib.rms_norm(a, w, EPS), *leaves),
                     "torch eager": _grads(_eager_rms_norm, *leaves),
                     "torch.compile": _grads(compiled(_eager_rms_norm), *leaves)}
            if liger:
                impls["Liger-Kernel"] = _grads(
                    lambda a, w: liger.LigerRMSNormFunction.apply(a, w, EPS, 0.0, "llama", False),
                    *leaves)
            if flag_gems:
                impls["FlagGems"] = _grads(lambda a, w: flag_gems.rms_norm(a, [cols], w, EPS), *leaves)
            yield Case("rms_norm_backward", f"{rows}x{cols}", "bf16", 3 * x.numel() * size, impls)
            del leaves
        del x

    for rows, cols in QUICK_GEMMA_RMS_NORM + ([] if quick else EXTRA_GEMMA_RMS_NORM):
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        weight = torch.randn(cols, device="cuda", dtype=DTYPE) * 0.3
        impls = {"gemslib": lambda: gemslib.rms_norm(x, weight, EPS, weight_offset=1.0),
                 "torch eager": lambda: _gemma_rms_norm(x, weight),
                 "torch.compile": (lambda f: lambda: f(x, weight))(compiled(_gemma_rms_norm))}
        if liger:
            impls["Liger-Kernel"] = lambda: liger.LigerRMSNormFunction.apply(
                x, weight, EPS, 1.0, "gemma", False)
        if flashinfer:
            impls["FlashInfer"] = lambda: flashinfer.norm.gemma_rmsnorm(x, weight, EPS)
        yield Case("rms_norm", f"{rows}x{cols} (1 + w)", "bf16", 2 * x.numel() * size, impls,
                   outputs_agree=outputs_close(impls["gemslib"],
                                               lambda: _gemma_rms_norm(x.float(), weight.float())))
        del x

    for rows, cols in QUICK_ADD_RMS_NORM + ([] if quick else EXTRA_ADD_RMS_NORM):
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        residual = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        weight = torch.randn(cols, device="cuda", dtype=DTYPE)
        impls = {"gemslib": lambda: gemslib.add_rms_norm(x, residual, weight, EPS),
                 "gemslib in place": lambda: gemslib.add_rms_norm(x, residual, weight, EPS,
                                                                  inplace=True),
                 "torch eager": lambda: _eager_add_rms_norm(x, residual, weight),
                 "torch.compile": (lambda f: lambda: f(x, residual, weight))(
                     compiled(_eager_add_rms_norm))}
        if flag_gems:  # in place, like vLLM's fused_add_rms_norm
            impls["FlagGems"] = lambda: flag_gems.fused_add_rms_norm(x, residual, [cols], weight, EPS)
        if flashinfer:  # in place too
            impls["FlashInfer"] = lambda: flashinfer.norm.fused_add_rmsnorm(x, residual, weight, EPS)
        fresh = (x.clone(), residual.clone())
        yield Case("add_rms_norm", f"{rows}x{cols}", "bf16", 4 * x.numel() * size, impls,
                   outputs_agree=outputs_close(
                       lambda: gemslib.add_rms_norm(*fresh, weight, EPS)[0],
                       lambda: _eager_add_rms_norm(fresh[0].float(), fresh[1].float(),
                                                   weight.float())[0]))
        del x, residual, fresh


