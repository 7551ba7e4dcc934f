"""silu and silu_and_mul (bf16) against torch eager, torch.compile, Liger-Kernel and FlagGems.

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
OPS = ("silu", "silu_backward", "silu_and_mul", "silu_and_mul_backward")
DTYPE = torch.bfloat16


def _eager_silu_and_mul(x):
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def _aten_silu_backward(grad, x):
    return torch.ops.aten.silu_backward(grad, x)


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    liger_swiglu = optional_peer("liger_kernel.ops.swiglu")
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


if __name__ == "__main__":
    from benchmark.__main__ import main

    raise SystemExit(main(["--ops", "silu", "silu_and_mul", "silu_backward",
                           "silu_and_mul_backward", *__import__("sys").argv[1:]]))
