"""Experiment: host time per call at decode sizes, where the GPU work is a few microseconds.

    python -m benchmark.experiments.host_overhead

Launches N calls back to back without synchronising and divides the wall time by N: for tiny
tensors this is the host's cost per call (Python, dispatcher, Triton's launcher), the number
that decides latency when nothing hides it (no CUDA graph). Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemslib
from gemslib.ops import silu as silu_ops


@triton.jit
def _three_argument_kernel(x_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_elements
    x = tl.load(x_ptr + index, mask=mask).to(tl.float32)
    tl.store(y_ptr + index, (x / (1.0 + tl.exp(-x))).to(y_ptr.dtype.element_ty), mask=mask)


def host_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


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


if __name__ == "__main__":
    main()
