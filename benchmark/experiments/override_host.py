"""Experiment: where an aten override's host time goes (rms_norm against silu), at decode size.

    python -m benchmark.experiments.override_host

Host us per call, back to back, for each layer an F.rms_norm call crosses under enable(): the
Python functional, aten::rms_norm's composite, aten::_fused_rms_norm's autograd kernel, the
registered Python kernel, the plan's replay. Then a profile of the enable() calls, and whether
the override's plan exists. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

import gemslib
from benchmark import host as benchmark_host
from gemslib import registry
from gemslib.ops import rms_norm as rms_norm_ops


def host_us(fn, calls: int = 3000) -> float:
    return benchmark_host.host_us(fn, calls, torch.cuda.synchronize)


def main():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    fused = torch.ops.aten._fused_rms_norm.default
    rows = {
        "torch F.rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-6),
        "torch aten._fused_rms_norm": lambda: fused(x, [4096], w, 1e-6),
        "torch F.silu": lambda: F.silu(x),
        "gemslib.rms_norm": lambda: gemslib.rms_norm(x, w, 1e-6),
        "_forward(want_rstd)": lambda: rms_norm_ops._forward(x, w, 1e-6, True),
        "_aten_fused_rms_norm (Python)": lambda: rms_norm_ops._aten_fused_rms_norm(x, [4096], w, 1e-6),
    }
    results = {name: host_us(fn) for name, fn in rows.items()}
    with gemslib.enable():
        results["enable F.rms_norm"] = host_us(rows["torch F.rms_norm"])
        results["enable aten._fused_rms_norm"] = host_us(rows["torch aten._fused_rms_norm"])
        results["enable F.silu"] = host_us(rows["torch F.silu"])
        with torch.no_grad():
            results["enable no_grad F.rms_norm"] = host_us(rows["torch F.rms_norm"])
        with torch.inference_mode():
            results["enable inference_mode F.rms_norm"] = host_us(rows["torch F.rms_norm"])
        plans = registry._override_plans.get("aten::_fused_rms_norm")
        print("override plans:", None if plans is None else (len(plans._plans), dict(plans._tries)))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            F.rms_norm(x, (4096,), w, 1e-6)
        profile.disable()
        torch.cuda.synchronize()
    for name, us in results.items():
        print(f"{name:40s} {us:7.1f} us")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
