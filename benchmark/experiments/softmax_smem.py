"""Experiment: softmax over rows that fit one SM's shared memory, read from HBM once.

    python -m benchmark.experiments.softmax_smem             # GPU: check and time
    python -m benchmark.experiments.softmax_smem --compile   # CPU: compile for sm_90 only

At 8192 x 32000 (bf16 rows of 64 KB) the shipped softmax reads each row twice (an online
statistics pass, then the output pass: 369 us, 67% of the copy rate), quack reads it once
(255 us, 97%). A Triton kernel cannot keep 32000 values per program anywhere but registers (a
32768-wide block: one program per SM, nothing overlapping its reductions). This Gluon kernel
keeps the row in shared memory instead: every thread issues asynchronous copies (cp.async) of
its own 16-byte pieces of the whole row at once (N_CHUNKS groups of one CHUNK-wide layout),
waits for them group by group while it folds them into a running max and a rescaled sum, and
reads the same pieces back for the output pass. Each thread reads back only what it copied,
so no barrier is needed anywhere; a 64 KB row leaves room for three programs per SM, each
with its whole row in flight. Persistent grid, rows 16-byte aligned, 16-bit inputs.

Expected at 8192 x 32000: 1.05 GB moved (524 MB read once, as much written) at ~90% of the
copy rate, ~275 us, against the shipped 369 (1.35x) and quack's 255; the compiler's barriers
around the shared-memory reads (it cannot tell that each thread reads back its own copies)
are the risk. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

LOG2E = gl.constexpr(1.4426950408889634)
VEC = 8  # 16-bit elements per 16-byte copy (host side)


@gluon.jit
def _softmax_smem_kernel(x_ptr, out_ptr, n_rows, n_cols, stride_x_row, stride_out_row,
                         LOG: gl.constexpr, CHUNK: gl.constexpr, N_CHUNKS: gl.constexpr):
    """softmax (or log_softmax, LOG) of rows of n_cols <= N_CHUNKS * CHUNK, one row at a time
    per program, the row held in shared memory between its two passes."""
    LAYOUT: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    SHARED: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    row_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [N_CHUNKS, CHUNK], SHARED)
    o_chunk = gl.arange(0, CHUNK, layout=LAYOUT)
    # the launcher's rows are multiples of 8 elements: written so, the compiler knows it, and
    # every copy moves 16 bytes (cp.async moves at least 4)
    n_cols = n_cols // 8 * 8
    stride_x_row = stride_x_row // 8 * 8
    stride_out_row = stride_out_row // 8 * 8
    for i_row in range(gl.program_id(0), n_rows, gl.num_programs(0)):
        p_x = x_ptr + i_row.to(gl.int64) * stride_x_row
        for i_chunk in gl.static_range(N_CHUNKS):
            o_n = i_chunk * CHUNK + o_chunk
            async_copy.async_copy_global_to_shared(row_smem.index(i_chunk), p_x + o_n,
                                                   mask=o_n < n_cols)
            async_copy.commit_group()
        b_max = gl.full([CHUNK], float("-inf"), gl.float32, LAYOUT)
        b_sum = gl.zeros([CHUNK], gl.float32, LAYOUT)
        for i_chunk in gl.static_range(N_CHUNKS):
            async_copy.wait_group(N_CHUNKS - 1 - i_chunk)
            o_n = i_chunk * CHUNK + o_chunk
            b_x = gl.where(o_n < n_cols, row_smem.index(i_chunk).load(LAYOUT).to(gl.float32),
                           float("-inf"))
            b_new_max = gl.maximum(b_max, b_x)
            # lanes still at -inf (past the row's end) keep a zero sum, not a NaN
            b_scale = gl.where(b_new_max == float("-inf"), 0.0,
                               gl.exp2((b_max - b_new_max) * LOG2E))
            b_sum = b_sum * b_scale + gl.where(b_new_max == float("-inf"), 0.0,
                                               gl.exp2((b_x - b_new_max) * LOG2E))
            b_max = b_new_max
        row_max = gl.max(b_max, axis=0)
        row_sum = gl.sum(b_sum * gl.exp2((b_max - row_max) * LOG2E), axis=0)
        p_out = out_ptr + i_row.to(gl.int64) * stride_out_row
        for i_chunk in gl.static_range(N_CHUNKS):
            o_n = i_chunk * CHUNK + o_chunk
            b_x = row_smem.index(i_chunk).load(LAYOUT).to(gl.float32)
            if LOG:
                b_y = b_x - row_max - gl.log(row_sum)
            else:
                b_y = gl.exp2((b_x - row_max) * LOG2E) / row_sum
            gl.store(p_out + o_n, b_y.to(out_ptr.dtype.element_ty), mask=o_n < n_cols)


def softmax_smem(x: torch.Tensor, log: bool = False, num_warps: int = 8,
                 programs_per_sm: int | None = None) -> torch.Tensor:
    """softmax over the last dim of a contiguous 2-d 16-bit CUDA tensor whose rows start on
    16 bytes, through ``_softmax_smem_kernel``."""
    n_rows, n_cols = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16) or n_cols % VEC or not x.is_contiguous():
        raise ValueError("softmax_smem: 16-bit, contiguous rows of a multiple of 8 elements")
    chunk = VEC * 32 * num_warps
    n_chunks = math.ceil(n_cols / chunk)
    out = torch.empty_like(x)
    row_bytes = n_chunks * chunk * x.element_size()
    properties = torch.cuda.get_device_properties(x.device)
    fits = max(1, properties.shared_memory_per_multiprocessor // (row_bytes + 1024))
    programs = min(n_rows, properties.multi_processor_count * (programs_per_sm or fits))
    _softmax_smem_kernel[(programs,)](x, out, n_rows, n_cols, x.stride(0), out.stride(0),
                                      LOG=log, CHUNK=chunk, N_CHUNKS=n_chunks,
                                      num_warps=num_warps)
    return out


def compile_for_sm90(n_cols: int = 32000, num_warps: int = 8, log: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    chunk = VEC * 32 * num_warps
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n_rows": "i32", "n_cols": "i32",
                 "stride_x_row": "i32", "stride_out_row": "i32", "LOG": "constexpr",
                 "CHUNK": "constexpr", "N_CHUNKS": "constexpr"}
    source = GluonASTSource(_softmax_smem_kernel, signature,
                            {"LOG": log, "CHUNK": chunk, "N_CHUNKS": math.ceil(n_cols / chunk)},
                            attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


SHAPES = ((8192, 32000), (4096, 32768), (2048, 50256), (16384, 16384))
VARIANTS = ((8, None), (4, None), (16, None), (8, 2))  # (num_warps, programs per SM)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU)")
    args = parser.parse_args()
    if args.compile:
        for warps in (4, 8, 16):
            for log in (False, True):
                compiled = compile_for_sm90(num_warps=warps, log=log)
                ptx = compiled.asm["ptx"]
                print(f"{warps} warps log={log}: shared {compiled.metadata.shared} B, "
                      f"cp.async {ptx.count('cp.async.cg') + ptx.count('cp.async.ca')}, "
                      f"bar.sync {ptx.count('bar.sync')}", flush=True)
        return
    import gemslib
    from benchmark.harness import measure_ceilings, median_ms

    copy = measure_ceilings().copy_gbps
    print(f"copy {copy:.0f} GB/s", flush=True)
    for rows, cols in SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 4
        reference = torch.softmax(x.double(), -1)
        moved = 2 * x.numel() * x.element_size()
        shipped = median_ms(lambda: gemslib.softmax(x))
        line = [f"{rows}x{cols}: shipped {shipped * 1e3:.1f} us "
                f"({moved / shipped / 1e6 / copy:.0%})"]
        for warps, per_sm in VARIANTS:
            out = softmax_smem(x, num_warps=warps, programs_per_sm=per_sm)
            error = ((out.double() - reference).norm() / reference.norm()).item()
            log_error = ((softmax_smem(x, log=True, num_warps=warps).double()
                          - torch.log_softmax(x.double(), -1)).abs().max()).item()
            ms = median_ms(lambda: softmax_smem(x, num_warps=warps, programs_per_sm=per_sm))
            line.append(f"{warps}w/{per_sm or 'fit'} {ms * 1e3:.1f} us "
                        f"({moved / ms / 1e6 / copy:.0%}, err {error:.1e}, log {log_error:.1e})")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
