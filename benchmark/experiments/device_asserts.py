"""What the device-side checks of rotary positions and decode lengths cost (issue 20, 2 and 3).

The rotary and decode kernels assert their positions / lengths on the device
(``tl.device_assert`` compiled in through ``TunedKernel(device_asserts=True)``). Expected:
no measurable change (one compare and a branch per program, never taken). This times both
kernels with the asserts compiled in and out, interleaved, in one process.

    python -m benchmark.experiments.device_asserts
"""

from __future__ import annotations

import torch
import triton.testing

import gemslib
from gemslib.fused import decode_attention as decode_ops
from gemslib.ops import rotary as rotary_ops


def _time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def main() -> None:
    device = "cuda"
    q = torch.randn(16, 32, 128, device=device, dtype=torch.bfloat16)
    cache = torch.randn(16, 8, 4096, 128, device=device, dtype=torch.bfloat16)
    lengths = torch.full((16,), 4000, device=device)
    rq = torch.randn(1, 4096, 32, 128, device=device, dtype=torch.bfloat16)
    rk = torch.randn(1, 4096, 8, 128, device=device, dtype=torch.bfloat16)
    angles = torch.rand(8192, 64, device=device)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    positions = torch.randint(0, 8192, (1, 4096), device=device)
    cases = {
        "decode B16 L4096 (seqlens)": (decode_ops.DECODE,
                                       lambda: gemslib.decode_attention(q, cache, cache, lengths)),
        "rotary B1 S4096 (positions)": (rotary_ops.ROTARY, lambda: gemslib.apply_rotary(
            rq, rk, cos, sin, positions=positions, inplace=True)),
    }
    print(f"{'kernel':<30}{'asserts on us':>15}{'asserts off us':>16}")
    for name, (kernel, call) in cases.items():
        timings = {True: [], False: []}
        for _ in range(3):
            for asserts in (True, False):
                kernel.options = {"debug": True, "sanitize_overflow": False} if asserts else {}
                kernel.clear_cache()
                decode_ops._decode_layouts.clear()
                call()
                torch.cuda.synchronize()
                timings[asserts].append(_time(call))
        kernel.options = {"debug": True, "sanitize_overflow": False}
        kernel.clear_cache()
        print(f"{name:<30}{min(timings[True]):>15.2f}{min(timings[False]):>16.2f}")


if __name__ == "__main__":
    main()
