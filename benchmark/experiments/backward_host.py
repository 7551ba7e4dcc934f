"""Experiment: host time of the backward calls, where the benchmark's mid-size backward rows
(rms_norm 4096x4096, softmax 4096x4096, rotary B1) take 2-4x their kernel time.

    python -m benchmark.experiments.backward_host

Prints host us per ``torch.autograd.grad`` call (calls issued back to back, no sync) for
gemslib and torch eager on small tensors, then a cProfile of gemslib's calls: which Python
functions the time goes to. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import torch.nn.functional as F

import gemslib
from benchmark.experiments.host_overhead import host_us


def _grad_call(fn, *leaves):
    out = fn(*leaves)
    out = out if isinstance(out, torch.Tensor) else out[0]
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def main() -> None:
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(1, 16, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 16, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    angles = torch.rand(16, 64, device="cuda")
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    cases = {
        "rms_norm bwd": (_grad_call(lambda a, w: gemslib.rms_norm(a, w), x, weight),
                         _grad_call(lambda a, w: F.rms_norm(a, (4096,), w, 1e-6), x, weight)),
        "softmax bwd": (_grad_call(lambda a: gemslib.softmax(a, -1), logits),
                        _grad_call(lambda a: torch.softmax(a, -1), logits)),
        "log_softmax bwd": (_grad_call(lambda a: gemslib.log_softmax(a, -1), logits),
                            _grad_call(lambda a: torch.log_softmax(a, -1), logits)),
        "rotary bwd": (_grad_call(lambda a, b: gemslib.apply_rotary(a, b, cos, sin)[0], q, k),
                       None),
        "rms_norm fwd": (lambda: gemslib.rms_norm(x.detach(), weight.detach()),
                         lambda: F.rms_norm(x.detach(), (4096,), weight.detach(), 1e-6)),
        "rotary fwd": (lambda: gemslib.apply_rotary(q.detach(), k.detach(), cos, sin), None),
    }
    print(f"{'host us per call':<24}{'gemslib':>8}{'torch':>8}")
    for name, (ours, theirs) in cases.items():
        torch_us = f"{host_us(theirs):8.1f}" if theirs else f"{'-':>8}"
        print(f"{name:<24}{host_us(ours):8.1f}{torch_us}", flush=True)
    for name in ("rms_norm bwd", "softmax bwd", "rotary bwd", "rotary fwd"):
        fn = cases[name][0]
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"\n--- {name}: 500 calls, by own time ---")
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
