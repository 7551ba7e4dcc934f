"""Experiment: can the two-pass softmax over vocabulary-wide rows read x from HBM only once,
by keeping each row in L2 between its statistics pass and its output pass?

    python -m benchmark.experiments.softmax_l2_reuse      (or EXPERIMENT=softmax_l2_reuse
                                                            bash benchmark/gpu_session.sh)

With one program per row and about one program per SM, the rows in flight are 132 x 256 KB =
33 MB at 131072 bf16 columns, under the H200's 50 MB L2, yet the shipped loop kernel moves
805 MB at 3.9 TB/s: its second read goes to HBM. Cache hints that keep the first pass's lines
(evict_last) and drop what is read or written for the last time (evict_first) might change
that. If the second read hits L2, 1024x131072 should fall from ~205 us towards the 537 MB it
must move (~135 us at 4 TB/s); at 262144 columns the rows in flight (67 MB) exceed L2, so
less. The kernel here is the shipped loop kernel's structure (online first pass, second pass
from the row's end) with the hints as constexpr parameters. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

import gemslib
from benchmark.harness import measure_ceilings, median_ms
from gemslib import runtime
from gemslib.ops import softmax as softmax_ops

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softmax_hinted_kernel(x_ptr, y_ptr, n_cols, row_stride, BLOCK_N: tl.constexpr,
                           FIRST: tl.constexpr, SECOND: tl.constexpr, STORE: tl.constexpr):
    """softmax of one row per program; assumes n_cols >= BLOCK_N and finite inputs."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_stride
    y_row = y_ptr + row * row_stride
    lane_max = tl.full([BLOCK_N], -float("inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf"),
                    eviction_policy=FIRST).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        lane_sum = lane_sum * tl.exp2((lane_max - new_max) * LOG2E) + \
            tl.exp2((x - new_max) * LOG2E)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * tl.exp2((lane_max - row_max) * LOG2E), axis=0)
    n_blocks = tl.cdiv(n_cols, BLOCK_N)
    for block in range(0, n_blocks):
        cols = (n_blocks - 1 - block) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=SECOND).to(tl.float32)
        y = tl.exp2((x - row_max) * LOG2E) / row_sum
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask, eviction_policy=STORE)


def _hinted(x, block_n, warps, first, second, store):
    y = torch.empty_like(x)
    _softmax_hinted_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0), BLOCK_N=block_n,
                                          FIRST=first, SECOND=second, STORE=store,
                                          num_warps=warps)
    return y


def _shipped(x, chunk):
    config = runtime.LaunchConfig((("CHUNK", chunk),), 4 if chunk else 8, 1)
    with softmax_ops.SOFTMAX_SPLIT_FWD.forced(config):
        return gemslib.softmax(x, -1)


HINTS = [("", "", ""), ("evict_last", "evict_first", ""),
         ("evict_last", "evict_first", "evict_first"), ("", "evict_first", "evict_first"),
         ("evict_last", "", "evict_first")]


def main() -> None:
    copy = measure_ceilings().copy_gbps
    print(f"copy bandwidth {copy:.0f} GB/s")
    for rows, cols in [(1024, 131072), (512, 262144), (2048, 50257)]:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        expected = torch.softmax(x.float(), -1)
        moved = 2 * x.numel() * x.element_size()

        def report(name, fn):
            out = fn()
            ok = torch.allclose(out.float(), expected, rtol=2e-2, atol=1e-6)
            us = median_ms(fn) * 1e3
            print(f"{rows}x{cols:<7} {name:<58} {us:7.1f} us {moved / us / 1e3 / copy:6.1%}"
                  f"{'' if ok else '  WRONG'}", flush=True)

        report("shipped loop (CHUNK 0)", lambda: _shipped(x, 0))
        report("shipped split (CHUNK 8192)", lambda: _shipped(x, 8192))
        # 32 warps: one program (one row) per SM, the fewest rows in flight
        for (first, second, store), block_n, warps in itertools.product(
                HINTS, (4096, 8192, 16384), (8, 16, 32)):
            name = f"hinted {first or '-'}/{second or '-'}/{store or '-'} {block_n}x{warps}w"
            report(name, lambda f=first, s=second, st=store, b=block_n, w=warps:
                   _hinted(x, b, w, f, s, st))


if __name__ == "__main__":
    main()
