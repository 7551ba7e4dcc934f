"""Experiment: where decode_attention's time goes at the benchmark's decode shapes.

    python -m benchmark.experiments.decode_latency

For gemslib and SDPA: the host's time per call (back-to-back calls, no sync), the GPU's kernel
time per call (torch.profiler, an L2 flush before each call, flush kernels left out), and the
benchmark's figure (do_bench median with its flush), which shows host time only past what the
flush hides. gemslib also runs without ``TunedKernel.replay`` (Triton's full launch path).
Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import gemslib
from benchmark.bench_decode_attention import (DECODE_DIM, DECODE_HEADS, DECODE_KV_HEADS, DTYPE,
                                              EXTRA_DECODE, QUICK_DECODE)
from benchmark.experiments.host_overhead import host_us
from benchmark.harness import median_ms
from gemslib.fused import decode_attention as decode_ops


def without_replay(fn):
    """``fn`` with decode launching through Triton's full path, as before TunedKernel.replay."""
    def call():
        kernel = decode_ops.DECODE
        kernel.replay = lambda key, config, grid, args: kernel.run(config, lambda meta: grid,
                                                                   args)
        try:
            return fn()
        finally:
            del kernel.replay
    return call


def kernel_us(fn, calls: int = 20) -> float:
    """GPU kernel time per call, L2 flushed before each call (the flush's fill kernel not
    counted)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = sum(event.device_time_total for event in prof.key_averages()
                if "fill" not in event.key.lower() and event.device_time_total > 0
                and "memset" not in event.key.lower())
    return total / calls


def main():
    for batch, cache_len in QUICK_DECODE + EXTRA_DECODE:
        q = torch.randn(batch, DECODE_HEADS, DECODE_DIM, device="cuda", dtype=DTYPE)
        k_cache, v_cache = (torch.randn(batch, DECODE_KV_HEADS, cache_len, DECODE_DIM,
                                        device="cuda", dtype=DTYPE) for _ in range(2))
        calls = {"gemslib": lambda: gemslib.decode_attention(q, k_cache, v_cache),
                 "no replay": without_replay(lambda: gemslib.decode_attention(q, k_cache,
                                                                              v_cache)),
                 "SDPA": lambda: F.scaled_dot_product_attention(q[:, :, None], k_cache, v_cache,
                                                                enable_gqa=True)}
        gigabytes = 2 * k_cache.numel() * k_cache.element_size() / 1e9
        for name, fn in calls.items():
            kernel = kernel_us(fn)
            print(f"B{batch} L{cache_len:<7} {name:<9} host {host_us(fn, 300):6.1f} us/call, "
                  f"kernels {kernel:7.1f} us ({gigabytes / kernel * 1e6:5.0f} GB/s), "
                  f"benchmark {median_ms(fn) * 1e3:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
