"""Experiment: what a kernel boundary costs inside a decode step's CUDA graph, and how much of
it programmatic dependent launch (PDL) takes back.

    python -m benchmark.experiments.decode_pdl

A B16 decode step of a Llama-3-8B-shaped model is ~10 kernels a layer in one CUDA graph, half
of them gemslib's small kernels (norms, rotary, attention, silu * mul) right after a cuBLAS
GEMM. Each such boundary waits for the GEMM's last blocks to finish and its writes to land
before the next kernel's blocks start. A kernel launched with PDL (Triton's ``launch_pdl``)
starts its blocks while the GEMM's tail runs and waits in ``gdc_wait`` (griddepcontrol.wait)
before it reads; nothing else changes. Here, in a CUDA graph of 64 pairs (replayed, median of
50 replays, divided by 64):

* o's GEMM (16 x 4096 @ 4096 x 4096, cuBLAS) alone;
* the same GEMM followed by a row-normalising kernel over its output (an RMSNorm's
  arithmetic: one program a row), launched plainly and with PDL;
* the kernel alone, plainly and with PDL (its own launch in a graph).

The saving a boundary is (plain pair - PDL pair); times the ~5 such boundaries a layer and the
layers, it says whether PDL is worth carrying through gemslib's launchers. Results:
benchmark/NOTES.md.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _normalise_rows(x_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, WAIT: tl.constexpr):
    """out[row] = x[row] / rms(x[row]); WAIT: griddepcontrol.wait before the first load (what a
    kernel launched with PDL must do before it reads its predecessor's output)."""
    i_row = tl.program_id(0)
    if WAIT:
        gdc_wait()
    o = tl.arange(0, BLOCK)
    m = o < n_cols
    b_x = tl.load(x_ptr + i_row * n_cols + o, mask=m, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / n_cols + eps)
    tl.store(out_ptr + i_row * n_cols + o, (b_x * b_rstd).to(out_ptr.dtype.element_ty), mask=m)


def normalise_rows(x: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    _normalise_rows[(x.shape[0],)](x, out, x.shape[1], 1e-6, BLOCK=triton.next_power_of_2(x.shape[1]),
                                   WAIT=pdl, launch_pdl=pdl, num_warps=8)


def graph_us(body, repeats: int = 64, replays: int = 50) -> float:
    """Microseconds of GPU time for one ``body()``: a CUDA graph of ``repeats`` of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            body()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times)


def main():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 4096, **bf16)
    w_o = torch.randn(4096, 4096, **bf16) * 0.02
    y = torch.empty(16, 4096, **bf16)
    normed = torch.empty_like(y)

    def gemm():
        torch.matmul(x, w_o.t(), out=y)

    figures = {"o GEMM alone (cuBLAS, M 16)": graph_us(gemm)}
    for pdl in (False, True):
        way = "PDL" if pdl else "plain"
        figures[f"row kernel alone, {way}"] = graph_us(lambda: normalise_rows(y, normed, pdl))
        figures[f"GEMM then row kernel, {way}"] = graph_us(
            lambda: (gemm(), normalise_rows(y, normed, pdl)))
    # the two ways give the same rows
    gemm()
    normalise_rows(y, normed, False)
    plain = normed.clone()
    normalise_rows(y, normed, True)
    torch.cuda.synchronize()
    print(f"PDL rows equal to plain: {torch.equal(plain, normed)}; reference error "
          f"{(F.rms_norm(y.float(), (4096,), eps=1e-6) - normed.float()).abs().max().item():.3g}")
    print("us a body, in a CUDA graph of 64 (median of 50 replays):")
    for name, value in figures.items():
        print(f"  {name:<36} {value:7.2f}")
    saving = figures["GEMM then row kernel, plain"] - figures["GEMM then row kernel, PDL"]
    print(f"saving a boundary: {saving:.2f} us")


if __name__ == "__main__":
    main()
