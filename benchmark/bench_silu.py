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


# Candidate launch configs for benchmark/sweep.py, and the problems to time them on.
SWEEP_CANDIDATES = {
    "silu_fwd": [{"BLOCK": b, "num_warps": w} for b in (1024, 2048, 4096, 8192)
                 for w in (4, 8, 16) if b // (32 * w) >= 4],
    "silu_bwd": [{"BLOCK": b, "num_warps": w} for b in (1024, 2048, 4096, 8192)
                 for w in (4, 8, 16) if b // (32 * w) >= 4],
    "silu_and_mul_fwd": [{"BLOCK_N": b, "num_warps": w} for b in (512, 1024, 2048, 4096)
                         for w in (2, 4, 8, 16) if b // (32 * w) >= 4],
    "silu_and_mul_bwd": [{"BLOCK_N": b, "num_warps": w} for b in (512, 1024, 2048, 4096)
                         for w in (2, 4, 8, 16) if b // (32 * w) >= 4],
}


def sweep_problems():
    """(kernel, label, bytes moved, callable) for benchmark/sweep.py."""
    size = torch.finfo(DTYPE).bits // 8
    for rows, cols in [(256, 4096), (4096, 14336), (16384, 14336)]:
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        grad = torch.randn_like(x)
        gate_up = torch.randn(rows, 2 * cols, device="cuda", dtype=DTYPE)
        label = f"{rows}x{cols}"
        yield silu_ops.SILU_FWD, label, 2 * x.numel() * size, lambda: gemslib.silu(x)
        # the launchers directly: through torch.ops the custom-op dispatch (tens of us on the
        # host) would hide the kernel at small sizes
        yield (silu_ops.SILU_BWD, label, 3 * x.numel() * size,
               lambda: silu_ops._silu_backward(grad, x))
        yield (silu_ops.SILU_AND_MUL_FWD, label, 3 * x.numel() * size,
               lambda: gemslib.silu_and_mul(gate_up))
        yield (silu_ops.SILU_AND_MUL_BWD, label, 5 * x.numel() * size,
               lambda: silu_ops._silu_and_mul_backward(grad, gate_up))


if __name__ == "__main__":
    from benchmark.__main__ import main

    raise SystemExit(main(["--ops", "silu", "silu_and_mul", "silu_backward",
                           "silu_and_mul_backward", *__import__("sys").argv[1:]]))
