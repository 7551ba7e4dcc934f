"""Experiment: an MLP's up half in one Hopper matmul, silu(x @ Wg.T) * (x @ Wu.T), against
cuBLAS's merged gate|up GEMM followed by gemslib's silu_and_mul (what the backend runs today).

    python -m benchmark.experiments.swiglu_gemm [--quick | --decode | --counters]

``_rms_norm_linear_silu_hopper.forward_gated`` (the warp-specialised Gluon matmul with its
SWIGLU epilogue: a stage's gate and up blocks as one 256-wide operand, only the (M, I) result
written) at the prefill MLP shapes of Llama-2-7B, Llama-3-8B / Mistral-7B, Qwen2-7B and
Qwen2.5-14B, M = 2048 and 4096, without and with the RMSNorm pre-pass, and at other ring
depths and tile groups (``VARIANTS``). Per shape: the relative error of each against a
float64 reference (beside cuBLAS + silu_and_mul's own), the times of cuBLAS's
GEMM alone, GEMM + silu_and_mul, the fused kernel, and their TFLOP/s (2 M K 2I FLOPs). The
question it answers: does dropping the (M, 2I) write and the silu_and_mul pass (Qwen2-7B, M
4096: 310 MB read + 155 MB written, ~0.11 ms at the copy rate) pay more than the matmul loses
against cuBLAS? ``--decode``: M 1 and 16, the split-K Triton kernel (as linear_swiglu, the
config in use) against cuBLAS's GEMM alone and + silu_and_mul, with the weights' bytes as a
share of the copy rate. ``--counters``: the fused kernel and cuBLAS's GEMM at Llama-3-8B's
M 4096, a few calls each inside NVTX ranges, for Nsight Compute to read their counters (L2 and
DRAM throughput, tensor-pipe activity, warp stalls):

    ncu --clock-control none --nvtx --nvtx-include "swiglu/" --nvtx-include "cublas/" \\
        --set full -c 4 -o swiglu python -m benchmark.experiments.swiglu_gemm --counters

Needs an sm_90 GPU. Results and the open questions: docs/notes/matmul-mlp.md.
"""

from __future__ import annotations

import sys

import torch

SHAPES = {"llama2-7b": (4096, 11008), "llama3-8b": (4096, 14336), "qwen2-7b": (3584, 18944),
          "qwen2.5-14b": (5120, 13824)}  # (K, I)
VARIANTS = ((4, 8), (3, 16), (4, 16))  # (stages, group_m) timed beside the shipped (3, 8)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def run(quick: bool = False) -> None:
    import triton.testing

    import gemslib
    from gemslib.fused import _rms_norm_linear_silu_hopper as hopper

    rows = (4096,) if quick else (2048, 4096)
    for name, (k, inter) in SHAPES.items():
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            norm_weight = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            weight = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
            expected = torch.nn.functional.silu(gate) * up
            out = torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)
            hopper.forward_gated(x, None, weight, 1e-6, out, normalize=False)
            unfused = gemslib.silu_and_mul(x @ weight.T)
            errors = (_relative_error(out, expected), _relative_error(unfused, expected))
            xn = torch.nn.functional.rms_norm(x.double(), (k,), norm_weight.double(), 1e-6)
            gate_n, up_n = (xn @ weight.double().T).chunk(2, dim=-1)
            hopper.forward_gated(x, norm_weight, weight, 1e-6, out)
            normed_error = _relative_error(out, torch.nn.functional.silu(gate_n) * up_n)

            def bench(fn):
                return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

            gemm = bench(lambda: x @ weight.T)
            unfused_ms = bench(lambda: gemslib.silu_and_mul(x @ weight.T))
            fused_ms = bench(lambda: hopper.forward_gated(x, None, weight, 1e-6, out,
                                                           normalize=False))
            normed_ms = bench(lambda: hopper.forward_gated(x, norm_weight, weight, 1e-6, out))
            variants = {f"s{stages} g{group}": bench(
                lambda: hopper.forward_gated(x, None, weight, 1e-6, out, normalize=False,
                                              stages=stages, group_m=group))
                for stages, group in VARIANTS}
            flops = 2 * m * k * 2 * inter
            print(f"{name:12s} M{m:5d}  GEMM {gemm * 1e3:7.1f} us ({flops / gemm / 1e9:5.0f} "
                  f"TFLOP/s)  GEMM+silu_and_mul {unfused_ms * 1e3:7.1f}  fused "
                  f"{fused_ms * 1e3:7.1f} ({flops / fused_ms / 1e9:5.0f} TFLOP/s, "
                  f"{unfused_ms / fused_ms:.3f}x)  with the norm {normed_ms * 1e3:7.1f}  "
                  f"rel. error fused {errors[0]:.2e} unfused {errors[1]:.2e} normed "
                  f"{normed_error:.2e}  " + "  ".join(
                      f"{variant} {ms * 1e3:.1f}" for variant, ms in variants.items()),
                  flush=True)


def run_decode(rows=(1, 16)) -> None:
    """The decode rows: rms_norm_swiglu's split-K Triton kernel (the config in use) as
    linear_swiglu, against cuBLAS's merged GEMM alone and + silu_and_mul; the weights' bytes
    over the time, as a share of the copy rate measured here."""
    import triton.testing

    import gemslib

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")

    source = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_ms = bench(lambda: source.clone())
    copy_rate = 2 * source.numel() / copy_ms / 1e6  # GB/s, read + written
    print(f"copy {copy_rate:.0f} GB/s", flush=True)
    for name, (k, inter) in SHAPES.items():
        weight = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        weights = list(weight.chunk(2))
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = torch.nn.functional.silu((x.double() @ weight.double().T)[:, :inter]) \
                * (x.double() @ weight.double().T)[:, inter:]
            error = _relative_error(torch.ops.gemslib.linear_swiglu(x, weights), expected)
            gemm = bench(lambda: x @ weight.T)
            unfused = bench(lambda: gemslib.silu_and_mul(x @ weight.T))
            fused = bench(lambda: torch.ops.gemslib.linear_swiglu(x, weights))
            nbytes = weight.numel() * 2
            print(f"{name:12s} M{m:3d}  GEMM {gemm * 1e3:6.1f} us "
                  f"({nbytes / gemm / 1e6 / copy_rate:4.0%} of copy)  GEMM+silu_and_mul "
                  f"{unfused * 1e3:6.1f}  fused {fused * 1e3:6.1f} "
                  f"({nbytes / fused / 1e6 / copy_rate:4.0%}; {gemm / fused:.3f}x the GEMM "
                  f"alone)  rel. error {error:.2e}", flush=True)


def run_counters(name: str = "llama3-8b", m: int = 4096, calls: int = 2) -> None:
    """``calls`` of the fused kernel and of cuBLAS's GEMM at one shape, after a warm-up, each
    call in an NVTX range of its own (``swiglu`` / ``cublas``) for ncu's ``--nvtx-include``."""
    from gemslib.fused import _rms_norm_linear_silu_hopper as hopper

    k, inter = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    out = torch.empty(m, inter, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # compiled and warm before any range
        hopper.forward_gated(x, None, weight, 1e-6, out, normalize=False)
        x @ weight.T
    torch.cuda.synchronize()
    for _ in range(calls):
        with torch.cuda.nvtx.range("swiglu"):
            hopper.forward_gated(x, None, weight, 1e-6, out, normalize=False)
        with torch.cuda.nvtx.range("cublas"):
            x @ weight.T
    torch.cuda.synchronize()
    print(f"swiglu_gemm --counters: {name} M{m}, {calls} calls of each", flush=True)


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("swiglu_gemm: needs an sm_90 GPU", file=sys.stderr)
        return 1
    if "--decode" in argv:
        run_decode()
    elif "--counters" in argv:
        run_counters()
    else:
        run(quick="--quick" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
