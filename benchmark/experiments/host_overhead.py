"""Experiment: host time per call at decode sizes, where the GPU work is a few microseconds.

    python -m benchmark.experiments.host_overhead

Launches N calls back to back without synchronising and divides the wall time by N: for tiny
tensors this is the host's cost per call (Python, dispatcher, Triton's launcher), the number
that decides latency when nothing hides it (no CUDA graph). Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemslib
from benchmark import host as benchmark_host
from gemslib.ops import silu as silu_ops


@triton.jit
def _three_argument_kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    x = tl.load(x_ptr + index, mask=mask).to(tl.float32)
    tl.store(y_ptr + index, (x / (1.0 + tl.exp(-x))).to(y_ptr.dtype.element_ty), mask=mask)


def host_us(fn, calls: int = 2000) -> float:
    return benchmark_host.host_us(fn, calls, torch.cuda.synchronize)


def main():
    x = torch.randn(1, 14336, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    gate_up = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    zeros = [0] * 8  # the 8 strides of the strided path, unused by the flat one
    compiled_silu = torch.compile(F.silu, dynamic=False)
    cases = {
        "torch F.silu": lambda: F.silu(x),
        "torch.compile(F.silu)": lambda: compiled_silu(x),
        "gemslib.silu": lambda: gemslib.silu(x),
        "gemslib.silu(out=)": lambda: gemslib.silu(x, out=y),
        "raw launch, shipped silu kernel (16 args)": lambda: silu_ops._silu_fwd_kernel[(14,)](
            x, y, n, 1, 1, 1, *zeros, False, False, BLOCK=1024, num_warps=4, num_stages=1),
        "raw launch, 3-argument kernel": lambda: _three_argument_kernel[(14,)](
            x, y, n, BLOCK=1024, num_warps=4, num_stages=1),
        "gemslib.silu_and_mul": lambda: gemslib.silu_and_mul(gate_up),
        "torch eager silu_and_mul": lambda: F.silu(gate_up[:, :14336]) * gate_up[:, 14336:],
        "torch.empty_like": lambda: torch.empty_like(x),
    }
    for name, fn in cases.items():
        print(f"{name:<45}{host_us(fn):7.1f} us per call", flush=True)
    with gemslib.enable():
        print(f"{'F.silu under gemslib.enable()':<45}{host_us(lambda: F.silu(x)):7.1f} us per call")
    row_operators()


def row_operators():
    """Host us per call of the row operators, beside torch's."""
    hidden = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(1, 32000, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(64, 64, device="cuda")
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cases = {
        "silu 1x14336": (lambda: gemslib.silu(hidden), lambda: F.silu(hidden)),
        "rms_norm 1x4096": (lambda: gemslib.rms_norm(hidden, weight),
                            lambda: F.rms_norm(hidden, (4096,), weight, 1e-6)),
        "add_rms_norm 1x4096": (lambda: gemslib.add_rms_norm(hidden, hidden, weight),
                                lambda: F.rms_norm(hidden + hidden, (4096,), weight, 1e-6)),
        "softmax 1x32000": (lambda: gemslib.softmax(logits), lambda: torch.softmax(logits, -1)),
        "rotary 1 token": (lambda: gemslib.apply_rotary(q, k, cos, sin), None),
    }
    print(f"\n{'host us per call':<24}{'gemslib':>8}{'torch':>8}")
    for name, (ours, theirs) in cases.items():
        torch_us = f"{host_us(theirs):8.1f}" if theirs else f"{'-':>8}"
        print(f"{name:<24}{host_us(ours):8.1f}{torch_us}", flush=True)


if __name__ == "__main__":
    main()
