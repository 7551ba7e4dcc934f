"""Experiment (2026-11-29, H200): which silu_and_mul kernel shape beats torch.compile's?

    python -m benchmark.experiments.silu_and_mul_variants

Times, at M x 14336 outputs (bf16), the shipped kernel against variants that change one thing:
cache hints on the loads/stores, a persistent grid-stride loop, and inductor's flat indexing.
Every variant is checked against torch eager before it is timed. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmark.harness import compiled, measure_ceilings, median_ms
from gemslib.ops import silu as silu_ops


@triton.jit
def _hinted_kernel(x_ptr, out_ptr, half_width, x_row_stride, out_row_stride,
                   BLOCK_N: tl.constexpr, LOAD_HINT: tl.constexpr, STORE_HINT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_col_blocks = tl.cdiv(half_width, BLOCK_N)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks).to(tl.int32) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < half_width
    gate_ptrs = x_ptr + row * x_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, eviction_policy=LOAD_HINT).to(tl.float32)
    up = tl.load(gate_ptrs + half_width, mask=mask, eviction_policy=LOAD_HINT).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE_HINT)


@triton.jit
def _persistent_kernel(x_ptr, out_ptr, half_width, n_tiles, x_row_stride, out_row_stride,
                       BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    n_col_blocks = tl.cdiv(half_width, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        tile64 = tile.to(tl.int64)
        row = tile64 // n_col_blocks
        cols = (tile64 % n_col_blocks).to(tl.int32) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < half_width
        gate_ptrs = x_ptr + row * x_row_stride + cols
        gate = tl.load(gate_ptrs, mask=mask).to(tl.float32)
        up = tl.load(gate_ptrs + half_width, mask=mask).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_kernel(x_ptr, out_ptr, n_out, half_width, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < n_out
    row = index // half_width
    col = index % half_width
    gate = tl.load(x_ptr + row * 2 * half_width + col, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * half_width + half_width + col, mask=mask).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + index, out.to(out_ptr.dtype.element_ty), mask=mask)


def _eager(x):
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def variants(x, out):
    rows, width = x.shape
    half = width // 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def hinted(block, warps, load_hint, store_hint):
        grid = (rows * triton.cdiv(half, block),)
        return lambda: _hinted_kernel[grid](x, out, half, x.stride(0), out.stride(0), BLOCK_N=block,
                                            LOAD_HINT=load_hint, STORE_HINT=store_hint,
                                            num_warps=warps)

    def persistent(block, warps, ctas_per_sm, stages):
        n_tiles = rows * triton.cdiv(half, block)
        grid = (min(n_tiles, sms * ctas_per_sm),)
        return lambda: _persistent_kernel[grid](x, out, half, n_tiles, x.stride(0), out.stride(0),
                                                BLOCK_N=block, STAGES=stages, num_warps=warps)

    def flat(block, warps):
        grid = (triton.cdiv(rows * half, block),)
        return lambda: _flat_kernel[grid](x, out, rows * half, half, BLOCK=block, num_warps=warps)

    yield "shipped (gemslib.silu_and_mul)", lambda: silu_ops.silu_and_mul(x, out=out)
    for block, warps in ((2048, 8), (4096, 16), (1024, 4)):
        yield f"plain {block}/{warps}", hinted(block, warps, "", "")
        yield f"evict_first loads {block}/{warps}", hinted(block, warps, "evict_first", "")
        yield f"evict_first + .cs store {block}/{warps}", hinted(block, warps, "evict_first", ".cs")
    for block, warps, ctas, stages in ((2048, 8, 4, 2), (2048, 8, 8, 1), (1024, 4, 16, 3),
                                       (4096, 16, 2, 2)):
        yield f"persistent {block}/{warps} x{ctas}/SM stages {stages}", persistent(block, warps, ctas, stages)
    for block, warps in ((1024, 4), (2048, 8)):
        yield f"flat index {block}/{warps}", flat(block, warps)


def main():
    ceilings = measure_ceilings()
    print(f"copy {ceilings.copy_gbps:.0f} GB/s")
    for rows in (4096, 16384):
        x = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, 14336, device="cuda", dtype=torch.bfloat16)
        expected = _eager(x)
        bytes_moved = 3 * rows * 14336 * 2
        compile_fn = compiled(_eager)
        base = median_ms(lambda: compile_fn(x))
        print(f"\n{rows}x14336: torch.compile {base * 1e3:.1f} us ({bytes_moved / base / 1e6:.0f} GB/s)")
        for name, fn in variants(x, out):
            out.fill_(float("nan"))
            fn()
            ok = torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=1e-2)
            ms = median_ms(fn)
            again = median_ms(fn)
            print(f"  {name:<42}{ms * 1e3:8.1f} us (repeat {again * 1e3:6.1f}) "
                  f"{bytes_moved / ms / 1e6:6.0f} GB/s  vs compile {base / ms:5.3f}x  {'ok' if ok else 'WRONG'}",
                  flush=True)
        del x, out


if __name__ == "__main__":
    main()
