"""Experiment: the Hopper path's warp-specialised Gluon matmul at other tiles and depths.

    python -m benchmark.experiments.gluon_matmul            # GPU: check and time against cuBLAS
    python -m benchmark.experiments.gluon_matmul --compile  # CPU: compile for sm_90 only

The kernel is ``fused/_rms_norm_linear_silu_hopper.py``'s ``_matmul_epilogue`` (it was first
written here; NOTES, issue 5): silu(row_scale * (A @ B.T) + bias) over a persistent grid, a
producer warp and two consumer warpgroups of 64 rows. Its tile width and K step follow the
descriptors' blocks, and STAGES and GROUP_M are constexprs, so this script times other choices
than the shipped ones against cuBLAS's matmul alone, and checks each against fp32.
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental.gluon import language as gl

from gemslib.fused._rms_norm_linear_silu_hopper import TILE_ROWS, _matmul_epilogue


def _layouts(block_n, block_k, dtype):
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return (gl.NVMMASharedLayout.get_default_for([TILE_ROWS, block_k], element),
            gl.NVMMASharedLayout.get_default_for([block_n, block_k], element))


def gluon_matmul(a, b, row_scale, bias, block_n=256, block_k=64, stages=3, group_m=8):
    """silu(row_scale[:, None] * (a @ b.T) + bias): a (M, K), b (N, K), row_scale (M,) fp32,
    bias (N,)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    a_layout, b_layout = _layouts(block_n, block_k, a.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [TILE_ROWS, block_k], a_layout)
    b_desc = TensorDescriptor.from_tensor(b, [block_n, block_k], b_layout)
    tiles = -(-M // (2 * TILE_ROWS)) * -(-N // block_n)
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    _matmul_epilogue[(min(sms, tiles),)](
        xg_desc=a_desc, weight_desc=b_desc, out_ptr=c, rstd_ptr=row_scale, bias_ptr=bias,
        n_rows=M, n_out=N, n_in=K, GROUP_M=group_m, STAGES=stages, num_warps=4)
    return c


def compile_for_sm90(block_n=256, block_k=64, stages=3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a_layout, b_layout = _layouts(block_n, block_k, torch.bfloat16)
    signature = {"xg_desc": f"tensordesc<bf16[{TILE_ROWS}, {block_k}],{a_layout!r}>",
                 "weight_desc": f"tensordesc<bf16[{block_n}, {block_k}],{b_layout!r}>",
                 "out_ptr": "*bf16", "rstd_ptr": "*fp32", "bias_ptr": "*bf16",
                 "n_rows": "i32", "n_out": "i32", "n_in": "i32", "GROUP_M": "constexpr",
                 "STAGES": "constexpr"}
    source = GluonASTSource(_matmul_epilogue, signature, {"GROUP_M": 8, "STAGES": stages})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


CONFIGS = (("n256 k64 s3", dict(block_n=256, block_k=64, stages=3)),
           ("n256 k64 s4", dict(block_n=256, block_k=64, stages=4)),
           ("n128 k64 s5", dict(block_n=128, block_k=64, stages=5)),
           ("n256 k64 s3 g16", dict(block_n=256, block_k=64, stages=3, group_m=16)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU)")
    args = parser.parse_args()
    if args.compile:
        for name, options in CONFIGS:
            options = {k: v for k, v in options.items() if k != "group_m"}
            try:
                compiled = compile_for_sm90(**options)
                print(f"{name}: shared {compiled.metadata.shared} B", flush=True)
            except Exception as err:
                print(f"{name}: failed: {str(err)[-300:]}", flush=True)
        return

    import torch.nn.functional as F

    from benchmark.harness import median_ms
    for M, N, K in ((4096, 14336, 4096), (16384, 14336, 4096), (4096, 4096, 4096),
                    (4096, 11008, 4096), (4000, 14000, 4096)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
        scale = torch.rand(M, device="cuda") + 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        expected = F.silu(scale[:, None] * (a.float() @ b.float().T) + bias.float())
        flops = 2 * M * N * K
        cublas = median_ms(lambda: F.linear(a, b))
        print(f"M{M} N{N} K{K} cuBLAS matmul alone: {cublas * 1e3:8.1f} us "
              f"{flops / cublas / 1e9:5.0f} TFLOP/s", flush=True)
        for name, options in CONFIGS:
            try:
                out = gluon_matmul(a, b, scale, bias, **options)
                error = ((out.float() - expected).norm() / expected.norm()).item()
                ms = median_ms(lambda: gluon_matmul(a, b, scale, bias, **options))
                print(f"  {name} (matmul + epilogue): {ms * 1e3:8.1f} us "
                      f"{flops / ms / 1e9:5.0f} TFLOP/s ({ms / cublas:.3f}x cuBLAS), "
                      f"rel err {error:.2e}", flush=True)
            except Exception as err:  # report and go on
                print(f"  {name}: failed: {str(err)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
