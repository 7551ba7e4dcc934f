"""Experiment: where the SDPA override's host time goes at a prefill shape (issue 23).

    python -m benchmark.experiments.prefill_sdpa_host

Qwen2-7B's attention at B16 S128 (28 query heads, 4 KV heads, head dim 128, causal): the
override took ~390 us of host time a call under enable() on 2026-12-04 against ~31 us of GPU
time (cuDNN's eager call: ~21 us), which is what made Qwen2's prefill 0.76x eager's under
enable(). Host us per call, back to back, for eager, the override (GQA and repeated K/V),
the Hopper forward called directly, the same with its launch kept (``KEEP_FORWARD_LAUNCH``,
whose SDPA calls then replay from call plans); then a cProfile of the override's calls,
sorted by own time. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

import gemslib
from benchmark import host as benchmark_host


def host_us(fn, calls: int = 300) -> float:
    return benchmark_host.host_us(fn, calls, torch.cuda.synchronize, warmup=10)


def main():
    from gemslib.fused import _attention_hopper as hopper

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(16, 28, 128, 128, **bf16)
    k, v = (torch.randn(16, 4, 128, 128, **bf16) for _ in range(2))
    k_full, v_full = k.repeat_interleave(7, 1), v.repeat_interleave(7, 1)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def repeated():
        return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True)

    scale = q.shape[-1] ** -0.5
    rows = {"eager, GQA": gqa, "eager, K/V repeated": repeated}
    with gemslib.enable():
        rows_enabled = {"enable(), GQA": gqa, "enable(), K/V repeated": repeated}
        figures = {name: host_us(fn) for name, fn in rows_enabled.items()}
    figures.update({name: host_us(fn) for name, fn in rows.items()})
    figures["Hopper forward, direct"] = host_us(lambda: hopper.forward(q, k, v, True, scale))
    # the kept launch and its call plans (hopper.KEEP_FORWARD_LAUNCH), checked against the
    # shipped path's output first
    with gemslib.enable():
        expected = gqa()
    hopper.KEEP_FORWARD_LAUNCH = True
    try:
        figures["Hopper forward, direct, kept launch"] = host_us(
            lambda: hopper.forward(q, k, v, True, scale))
        with gemslib.enable():
            for _ in range(4):  # planned from the second call, replayed from the third
                got = gqa()
            error = (got.float() - expected.float()).abs().max().item()
            figures["enable(), GQA, kept launch"] = host_us(gqa)
    finally:
        hopper.KEEP_FORWARD_LAUNCH = False
    print(f"kept launch under enable(): largest difference to the shipped path {error:.3g}")
    for name, value in figures.items():
        print(f"{name:<28} {value:8.1f} us a call")
    profile = cProfile.Profile()
    with gemslib.enable():
        for _ in range(20):
            gqa()
        torch.cuda.synchronize()
        profile.enable()
        for _ in range(200):
            gqa()
        profile.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
