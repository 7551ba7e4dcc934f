"""Experiment: where the SDPA override's host time goes at a prefill shape (issue 23).

    python -m benchmark.experiments.prefill_sdpa_host

Qwen2-7B's attention at B16 S128 (28 query heads, 4 KV heads, head dim 128, causal): the
override took ~390 us of host time a call under enable() on 2026-12-04 against ~31 us of GPU
time (cuDNN's eager call: ~21 us), which is what made Qwen2's prefill 0.76x eager's under
enable(). Host us per call, back to back: the override (GQA and repeated K/V) and the Hopper
forward called directly, with Triton's launch of the forward and with its launch kept
(``KEEP_FORWARD_LAUNCH``, the default: the override's calls then replay from call plans),
and eager; then a cProfile of the override's calls, sorted by own time. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

import gemslib
from gemslib import runtime
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
    figures, outputs, default = {}, {}, hopper.KEEP_FORWARD_LAUNCH
    for kept in (False, True):  # Triton's launch of the Hopper forward, then the kept one
        way = "kept launch" if kept else "Triton's launch"
        hopper.KEEP_FORWARD_LAUNCH = kept
        runtime.clear_call_plans()  # a signature's plan is made (or given up) per way
        with gemslib.enable():
            for name, fn in (("GQA", gqa), ("K/V repeated", repeated)):
                figures[f"enable(), {name}, {way}"] = host_us(fn)
            outputs[kept] = gqa()
        figures[f"Hopper forward, direct, {way}"] = host_us(
            lambda: hopper.forward(q, k, v, True, scale))
    planned = {op: counts for op, counts in runtime.call_plan_counts().items()
               if "scaled_dot_product" in op}
    hopper.KEEP_FORWARD_LAUNCH = default
    figures.update({"eager, GQA": host_us(gqa), "eager, K/V repeated": host_us(repeated)})
    error = (outputs[True].float() - outputs[False].float()).abs().max().item()
    print(f"kept launch under enable(): largest difference to Triton's launch {error:.3g};"
          f" signatures (planned, not planned) {planned}")
    for name, value in figures.items():
        print(f"{name:<40} {value:8.1f} us a call")
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
