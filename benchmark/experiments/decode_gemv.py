"""Experiment: can a Triton split-K GEMV beat cuBLAS at decode sizes, where the work is
streaming the weights?

    python -m benchmark.experiments.decode_gemv [--quick]

A decode step of a Llama-3-8B-shaped model reads ~4.5 GB of weights at B16 through GEMMs with
M = 16 rows; cuBLAS reaches ~79% of the copy bandwidth there (issue 24's table), so a kernel
that streams W at ~90% would take the GEMMs, and with them the step, ~1.15x faster. Here:

    y (M, N) = x (M, K) @ W (N, K).T

one program per (BLOCK_N columns, one of SPLIT_K slices of K): it streams its W tile once,
multiplies by x's (M padded to 16) with ``tl.dot`` and writes an fp32 partial; a second kernel
sums the SPLIT_K partials and casts (for the merged gate | up output it writes
``silu(gate) * up`` instead, the epilogue the MLP op would fuse). SPLIT_K = 1 writes y directly.
Prints, per shape (Llama-3-8B's q|k|v, o, gate|up, down at M = 1 and 16), cuBLAS's time, the
best config's time over a small sweep, both as GB/s of weights and as a share of the run's copy
bandwidth. Results: benchmark/NOTES.md. ``check()`` runs first (and runs in the interpreter).
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                 stride_os, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DIRECT: tl.constexpr):
    """Program (n block, k split): out[split, :, n block] = x[:, ks] @ W[n block, ks].T in fp32
    (``DIRECT``: one split, out is y in its dtype)."""
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = i_s * k_per_split
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K)
        m_k = o_k < tl.minimum(k_start + k_per_split, K)
        b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + o_k[None, :],
                      mask=(o_m[:, None] < M) & m_k[None, :], other=0.0)
        b_w = tl.load(w_ptr + o_n[:, None] * stride_wn + o_k[None, :],
                      mask=(o_n[:, None] < N) & m_k[None, :], other=0.0)
        b_acc = tl.dot(b_x, tl.trans(b_w), b_acc)
    m_out = (o_m[:, None] < M) & (o_n[None, :] < N)
    p_out = out_ptr + i_s * stride_os + o_m[:, None] * stride_om + o_n[None, :]
    if DIRECT:
        tl.store(p_out, b_acc.to(out_ptr.dtype.element_ty), mask=m_out)
    else:
        tl.store(p_out, b_acc, mask=m_out)


@triton.jit
def _reduce_kernel(part_ptr, y_ptr, M, N, n_out, n_splits, stride_ps, stride_pm, stride_ym,
                   SWIGLU: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, j] = sum over splits of part[:, m, j] (``SWIGLU``: silu of columns j < N/2 times
    column j + N/2, for j < n_out = N / 2)."""
    i_m = tl.program_id(0)
    o_j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_j = o_j < n_out
    b_a = tl.zeros((BLOCK,), dtype=tl.float32)
    b_b = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(n_splits):
        p_row = part_ptr + s * stride_ps + i_m * stride_pm
        b_a += tl.load(p_row + o_j, mask=m_j, other=0.0)
        if SWIGLU:
            b_b += tl.load(p_row + n_out + o_j, mask=m_j, other=0.0)
    if SWIGLU:
        b_a = b_a / (1.0 + tl.exp(-b_a)) * b_b
    tl.store(y_ptr + i_m * stride_ym + o_j, b_a.to(y_ptr.dtype.element_ty), mask=m_j)


def gemv(x, w, block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=3, swiglu=False):
    """x (M, K) @ w (N, K).T with M <= 16; ``swiglu``: silu(y[:, :N/2]) * y[:, N/2:]."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= 16 and x.stride(1) == 1 and w.stride(1) == 1
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    n_out = n // 2 if swiglu else n
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    direct = split_k == 1 and not swiglu
    part = y if direct else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, part, m, n, k, k_per_split, x.stride(0), w.stride(0), part.stride(-2),
        0 if direct else part.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        DIRECT=direct, num_warps=num_warps, num_stages=num_stages)
    if not direct:
        block = 1024
        _reduce_kernel[(m, triton.cdiv(n_out, block))](
            part, y, m, n, n_out, split_k, part.stride(0), part.stride(1), y.stride(0),
            SWIGLU=swiglu, BLOCK=block, num_warps=4)
    return y


def reference(x, w, swiglu=False):
    y = x.double() @ w.double().T
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


def check(device, dtype) -> None:
    """Odd sizes, every path (direct, split, swiglu), against float64."""
    torch.manual_seed(0)
    for m, n, k, split, swiglu in ((1, 40, 70, 1, False), (5, 96, 300, 3, False),
                                   (16, 64, 257, 2, True), (3, 130, 64, 1, True)):
        x = torch.randn(m, k, device=device).to(dtype)
        w = torch.randn(n, k, device=device).to(dtype)
        got = gemv(x, w, block_n=32, block_k=64, split_k=split, swiglu=swiglu).double()
        want = reference(x, w, swiglu)
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < (1e-5 if dtype == torch.float32 else 5e-3), (m, n, k, split, swiglu, error)


LLAMA3_8B = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096),
             "down": (4096, 14336)}


def main(quick: bool) -> None:
    import triton.testing

    from benchmark.harness import measure_ceilings

    check("cuda", torch.float16)
    copy = measure_ceilings().copy_gbps
    print(f"copy bandwidth this run: {copy:.0f} GB/s", flush=True)
    sweep = list(itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4)))
    if quick:
        sweep = sweep[::5]
    for (name, (n, k)), m in itertools.product(LLAMA3_8B.items(), (1, 16)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        weight_gb = w.numel() * w.element_size() / 1e9
        cublas = triton.testing.do_bench(lambda: x @ w.T, warmup=10, rep=50)
        best = None
        for block_n, block_k, split, warps, stages in sweep:
            try:
                ms = triton.testing.do_bench(lambda: gemv(x, w, block_n, block_k, split, warps,
                                                          stages), warmup=5, rep=25)
            except Exception:  # a config over the resources
                continue
            if best is None or ms < best[0]:
                best = (ms, (block_n, block_k, split, warps, stages))
        def share(ms):
            return f" ({weight_gb / ms * 1e3 / copy:.0%} of copy)"

        print(f"{name:8s} M{m:<3d} cuBLAS {cublas * 1e3:7.1f} us "
              f"{weight_gb / cublas * 1e3:6.0f} GB/s{share(cublas)}   gemv "
              f"{best[0] * 1e3:7.1f} us {weight_gb / best[0] * 1e3:6.0f} GB/s{share(best[0])} "
              f"{best[1]}  {cublas / best[0]:.2f}x", flush=True)


if __name__ == "__main__":
    main("--quick" in sys.argv)
