"""Experiment: can the o projection's weights be in L2 before its GEMM, fetched while the
decode attention runs?

    python -m benchmark.experiments.decode_l2_prefetch

At B16 the decode step's small GEMMs stream their weights at half the copy rate (cuBLAS at
M 16: q|k|v 51%, o 41%; benchmark/NOTES.md), bound by their ramp and tail, while the
attention before o reads a few MB of K/V and leaves the memory system mostly idle. A side
stream that reads o's weights (Llama-3-8B: 4096 x 4096 bf16, 33.5 MB, within the H200's L2)
during the attention could hand the GEMM a warm L2. Timed here with CUDA events (median of
100, each after an L2 flush that reads 512 MB), at cache lengths 192 and 2048:

* the attention alone, o's GEMM alone with a cold L2, and with W_o just read (the bound);
* the attention, then o's GEMM (the step's order today);
* the same with a prefetch kernel on a side stream, started with the attention and waited
  for before the GEMM, at several program counts (it shares the SMs with the attention);
* a kernel of sm_90 bulk L2 prefetches (``cp.async.bulk.prefetch.L2``, 4 KB each, nothing
  waits for them) on the same stream just before the attention: the form a graph pass could
  put in the kernel before the GEMM without a second stream.

If the last rows come close to attention + warm GEMM, the prefetch is worth a graph pass
(o and, in the same way, q|k|v during the previous layer's norm). Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import gemslib
from benchmark.experiments.decode_flush import timed_us


@triton.jit
def _read_into_l2(w_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    """Each program reads a strided share of w (kept in L2: evict_last) and writes one sum,
    so the loads are not dropped."""
    i_program = tl.program_id(0)
    b_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(i_program * BLOCK, n_elements, tl.num_programs(0) * BLOCK):
        o = start + tl.arange(0, BLOCK)
        b_sum += tl.load(w_ptr + o, mask=o < n_elements, other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
    tl.store(out_ptr + i_program, tl.sum(b_sum, axis=0))


def read_into_l2(weight: torch.Tensor, sums: torch.Tensor) -> None:
    """``weight`` read once by ``sums.numel()`` programs."""
    _read_into_l2[(sums.numel(),)](weight, sums, weight.numel(), BLOCK=4096, num_warps=8)


# sm_90's bulk L2 prefetch of PREFETCH_BYTES at an address (the size is written into the
# instruction; a hint: nothing waits for it, so the kernel that issues it ends at once and L2
# fills while the next kernels run); address 0: none
PREFETCH_BYTES = 4096
_BULK_PREFETCH = tl.constexpr("{ .reg .pred p; setp.ne.b64 p, $1, 0; "
                              "@p cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0; }")


@triton.jit
def _bulk_prefetch_into_l2(w_ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """One bulk prefetch a thread: chunk i (CHUNK elements, 4 KB) of w for i in this program's
    BLOCK."""
    o_chunk = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p_chunk = w_ptr + o_chunk.to(tl.int64) * CHUNK
    addresses = tl.where(o_chunk < n_chunks, p_chunk.to(tl.int64, bitcast=True), 0)
    tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l", [addresses], dtype=tl.int32, is_pure=False,
                              pack=1)


def bulk_prefetch_into_l2(weight: torch.Tensor) -> None:
    """All of ``weight`` (contiguous, a multiple of 4 KB) asked into L2, 128 chunks a program."""
    n_chunks = weight.numel() * weight.element_size() // PREFETCH_BYTES
    _bulk_prefetch_into_l2[(triton.cdiv(n_chunks, 128),)](
        weight, n_chunks, CHUNK=PREFETCH_BYTES // weight.element_size(), BLOCK=128, num_warps=4)


def main():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    flush_buffer = torch.empty(512 * 2 ** 20 // 4, device="cuda", dtype=torch.float32)

    def flush():
        flush_buffer.sum()

    x = torch.randn(16, 4096, **bf16)
    w_o = torch.randn(4096, 4096, **bf16) * 0.02
    q = torch.randn(16, 32, 128, **bf16)
    side = torch.cuda.Stream()
    print(f"L2 {torch.cuda.get_device_properties(0).L2_cache_size / 2 ** 20:.0f} MB; "
          f"W_o {w_o.numel() * 2 / 2 ** 20:.1f} MB; us, median of 100, each after a 512 MB flush")
    for cache_len in (192, 2048):
        k, v = (torch.randn(16, 8, cache_len, 128, **bf16) for _ in range(2))

        def attention():
            return gemslib.decode_attention(q, k, v)

        def o_gemm():
            return F.linear(x, w_o)

        def warm_o_gemm():
            read_into_l2(w_o, torch.empty(132, device="cuda"))
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return o_gemm(), start

        rows = {"attention": attention, "o GEMM, cold L2": o_gemm,
                "attention, then o GEMM": lambda: (attention(), o_gemm())}
        for programs in (8, 16, 32, 66, 132):
            sums = torch.empty(programs, device="cuda")

            def prefetched(sums=sums):
                ready = torch.cuda.Event()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    read_into_l2(w_o, sums)
                    ready.record(side)
                out = attention()
                torch.cuda.current_stream().wait_event(ready)
                return out, o_gemm()

            rows[f"attention with W_o read by {programs} programs, then o GEMM"] = prefetched
        rows["W_o bulk-prefetched (same stream), attention, o GEMM"] = lambda: (
            bulk_prefetch_into_l2(w_o), attention(), o_gemm())
        figures = {name: timed_us(fn, flush, reps=100) for name, fn in rows.items()}
        # o's GEMM right after W_o was read: timed from after the read
        warm = []
        for _ in range(100):
            flush()
            _, start = warm_o_gemm()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
            warm.append(start.elapsed_time(end) * 1e3)
        figures["o GEMM, W_o just read"] = statistics.median(warm)
        print(f"\nB16 Hq32 Hkv8 D128, cache {cache_len}:")
        for name, value in figures.items():
            print(f"  {name:<58} {value:8.1f}")


if __name__ == "__main__":
    main()
