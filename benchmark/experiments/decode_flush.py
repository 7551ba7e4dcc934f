"""Experiment: how much of a B1 decode step's "fixed cost" is the benchmark's L2 flush?

    python -m benchmark.experiments.decode_flush

``triton.testing.do_bench`` empties L2 before every timed call by zeroing a 256 MB buffer,
which leaves L2 full of dirty lines; the next kernel pays for writing them back (tens of MB)
while it reads. For a kernel that streams ~134 MB (decode B1 L32768) that could be ~10 us of
its ~47. Here each call is timed (CUDA events, median of 200) after one of three flushes:
``zero`` (do_bench's), ``read`` (a sum over the same 256 MB: L2 ends up holding clean lines
only) and ``none``; for gemslib's decode, SDPA and a plain copy of the same bytes.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

import gemslib


def timed_us(fn, flush, reps: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    scratch = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    flushes = {"zero": scratch.zero_,
               "read": lambda: scratch.sum(),
               "none": lambda: None}
    print(f"{'shape':<22}{'flush':<6}{'gemslib us':>11}{'SDPA us':>9}{'copy us':>9}"
          f"{'gemslib GB/s':>14}{'copy GB/s':>11}")
    for batch, length in ((1, 8192), (1, 32768), (1, 131072), (16, 32768)):
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        kv_bytes = 2 * k.numel() * k.element_size()
        # a copy that reads the same bytes (and writes as many: counted as read + write)
        src = torch.randn(kv_bytes // 4, device="cuda")
        dst = torch.empty_like(src)
        for name, flush in flushes.items():
            ours = timed_us(lambda: gemslib.decode_attention(q, k, v), flush)
            sdpa = timed_us(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v,
                                                                   enable_gqa=True), flush)
            copy = timed_us(lambda: dst.copy_(src), flush)
            print(f"{f'B{batch} L{length}':<22}{name:<6}{ours:>11.1f}{sdpa:>9.1f}{copy:>9.1f}"
                  f"{kv_bytes / ours / 1e3:>14.0f}{2 * kv_bytes / copy / 1e3:>11.0f}", flush=True)


if __name__ == "__main__":
    main()
