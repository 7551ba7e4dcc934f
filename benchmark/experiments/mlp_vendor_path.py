"""Experiment: the MLP ops' three-kernel form (VENDOR_GEMM 1) against the same three kernels
called by hand, at the tensor-parallel shapes where the 2026-12-02 18:05 UTC benchmark had
gemslib at 0.23-0.6x of them.

    python -m benchmark.experiments.mlp_vendor_path

Per shape and way: do_bench's GPU time, the host's time per call (back to back, no sync), and
the kernels a call launches (torch.profiler), so a host-bound call, a different GEMM kernel and
an extra kernel tell apart. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

import gemslib
from benchmark import host as benchmark_host
from gemslib.fused import rms_norm_linear_silu as rnls_ops
from gemslib.fused import rms_norm_swiglu as swiglu_ops

SHAPES = ((128, 4096, 5504), (128, 3584, 4736), (512, 3584, 4736), (128, 4096, 11008),
          (4096, 4096, 2752))  # (M, K, I)


def kernels_of(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name[:60] for event in prof.events() if event.device_type.name == "CUDA"]


def main():
    torch.manual_seed(0)
    for rows, n_in, inter in SHAPES:
        x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(n_in, device="cuda", dtype=torch.bfloat16) + 0.5
        w = torch.randn(2 * inter, n_in, device="cuda", dtype=torch.bfloat16) * n_in ** -0.5
        w1 = w[:inter]
        shape = (rows, inter, n_in, 2)
        print(f"M{rows} K{n_in} I{inter}: swiglu config "
              f"{swiglu_ops.RMS_NORM_SWIGLU.planned_config(shape)}; rnls config "
              f"{rnls_ops.RMS_NORM_LINEAR_SILU.planned_config((rows, inter, n_in, 2))}")
        ways = {
            "swiglu gemslib": lambda: gemslib.rms_norm_swiglu(x, g, w, eps=1e-6),
            "swiglu by hand": lambda: gemslib.silu_and_mul(F.linear(gemslib.rms_norm(x, g, 1e-6), w)),
            "rnls gemslib": lambda: gemslib.rms_norm_linear_silu(x, g, w1, eps=1e-6),
            "rnls by hand": lambda: gemslib.silu(F.linear(gemslib.rms_norm(x, g, 1e-6), w1)),
            "GEMM alone": lambda: F.linear(x, w),
        }
        for name, fn in ways.items():
            fn()
            gpu = triton.testing.do_bench(fn, warmup=50, rep=200)
            host = benchmark_host.host_us(fn, 300, torch.cuda.synchronize)
            print(f"  {name:16s} do_bench {gpu * 1e3:8.1f} us  host {host:7.1f} us/call  "
                  f"kernels {kernels_of(fn)}")


if __name__ == "__main__":
    main()
