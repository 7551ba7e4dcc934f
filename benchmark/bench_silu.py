"""silu and silu_and_mul (bf16) against torch eager, torch.compile, Liger-Kernel, FlagGems and
FlashInfer; gelu_and_mul (tanh, Gemma's) against eager, torch.compile, Liger-Kernel's GeGLU and
FlashInfer's gelu_tanh_and_mul.

    python -m benchmark.bench_silu [--quick] [--forward-only]

Bytes moved: silu reads and writes M*N elements; silu_and_mul reads M*2N and writes M*N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import Case, compiled, optional_peer, outputs_close
from gemslib.ops import silu as silu_ops

QUICK_SHAPES = [(4096, 14336), (16384, 14336)]
EXTRA_SHAPES = [(1, 14336), (1024, 4096), (8192, 5120), (4096, 14337)]
# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("silu", "silu_backward", "silu_and_mul", "silu_and_mul_backward", "gelu_and_mul")
GELU_SHAPES = [(4096, 24576)]  # Gemma-7B's intermediate width
EXTRA_GELU_SHAPES = [(1, 24576), (16384, 16384)]
DTYPE = torch.bfloat16


def _eager_silu_and_mul(x):
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def _eager_gelu_and_mul(x):
    half = x.shape[-1] // 2
    return F.gelu(x[..., :half], approximate="tanh") * x[..., half:]


def _aten_silu_backward(grad, x):
    return torch.ops.aten.silu_backward(grad, x)


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    liger_swiglu = optional_peer("liger_kernel.ops.swiglu")
    flashinfer = optional_peer("flashinfer")
    shapes = QUICK_SHAPES + ([] if quick else EXTRA_SHAPES)
    size = torch.finfo(DTYPE).bits // 8
    for rows, cols in shapes:
        shape = f"{rows}x{cols}"
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        impls = {"gemslib": lambda: gemslib.silu(x), "torch eager": lambda: F.silu(x),
                 "torch.compile": (lambda f: lambda: f(x))(compiled(F.silu))}
        if flag_gems:
            impls["FlagGems"] = lambda: flag_gems.silu(x)
        yield Case("silu", shape, "bf16", 2 * x.numel() * size, impls,
                   outputs_agree=outputs_close(impls["gemslib"], lambda: F.silu(x.float())))

        if backward:
            grad = torch.randn_like(x)
            impls = {"gemslib": lambda: silu_ops._silu_backward(grad, x),
                     "torch eager": lambda: torch.ops.aten.silu_backward(grad, x),
                     "torch.compile": (lambda f: lambda: f(grad, x))(
                         compiled(_aten_silu_backward))}
            if flag_gems:
                impls["FlagGems"] = lambda: flag_gems.silu_backward(grad, x)
            yield Case("silu_backward", shape, "bf16", 3 * x.numel() * size, impls,
                       outputs_agree=outputs_close(impls["gemslib"], lambda: torch.ops.aten.silu_backward(
                           grad.float(), x.float())))
            del grad
        del x

        gate_up = torch.randn(rows, 2 * cols, device="cuda", dtype=DTYPE)
        impls = {"gemslib": lambda: gemslib.silu_and_mul(gate_up),
                 "torch eager": lambda: _eager_silu_and_mul(gate_up),
                 "torch.compile": (lambda f: lambda: f(gate_up))(compiled(_eager_silu_and_mul))}
        if liger_swiglu:
            impls["Liger-Kernel"] = lambda: liger_swiglu.LigerFusedGateUpSiLUMulFunction.apply(gate_up)
        if flag_gems:
            impls["FlagGems"] = lambda: flag_gems.silu_and_mul(gate_up[:, :cols], gate_up[:, cols:])
        if flashinfer:
            impls["FlashInfer"] = lambda: flashinfer.activation.silu_and_mul(gate_up)
        yield Case("silu_and_mul", shape, "bf16", 3 * rows * cols * size, impls,
                   outputs_agree=outputs_close(impls["gemslib"],
                                               lambda: _eager_silu_and_mul(gate_up.float())))

        if backward:
            grad = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
            impls = {"gemslib": lambda: silu_ops._silu_and_mul_backward(grad, gate_up),
                     "torch eager": lambda: silu_ops.silu_and_mul_backward_reference(grad, gate_up),
                     "torch.compile": (lambda f: lambda: f(grad, gate_up))(
                         compiled(silu_ops.silu_and_mul_backward_reference))}
            yield Case("silu_and_mul_backward", shape, "bf16", 5 * rows * cols * size, impls,
                       outputs_agree=outputs_close(impls["gemslib"], lambda: (
                           silu_ops.silu_and_mul_backward_reference(grad.float(), gate_up.float()))))
            del grad
        del gate_up

    liger_geglu = optional_peer("liger_kernel.ops.geglu")
    for rows, cols in GELU_SHAPES + ([] if quick else EXTRA_GELU_SHAPES):
        gate_up = torch.randn(rows, 2 * cols, device="cuda", dtype=DTYPE)
        impls = {"gemslib": lambda: gemslib.gelu_and_mul(gate_up, "tanh"),
                 "torch eager": lambda: _eager_gelu_and_mul(gate_up),
                 "torch.compile": (lambda f: lambda: f(gate_up))(compiled(_eager_gelu_and_mul))}
        if liger_geglu:
            impls["Liger-Kernel"] = lambda: liger_geglu.LigerGELUMulFunction.apply(
                gate_up[:, :cols], gate_up[:, cols:])
        if flashinfer:
            impls["FlashInfer"] = lambda: flashinfer.activation.gelu_tanh_and_mul(gate_up)
        yield Case("gelu_and_mul", f"{rows}x{cols} tanh", "bf16", 3 * rows * cols * size, impls,
                   outputs_agree=outputs_close(impls["gemslib"],
                                               lambda: _eager_gelu_and_mul(gate_up.float())))
        del gate_up


if __name__ == "__main__":
    from benchmark.__main__ import main

    raise SystemExit(main(["--ops", *OPS, *__import__("sys").argv[1:]]))
