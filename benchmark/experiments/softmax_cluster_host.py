"""Experiment: host time of softmax calls on the Hopper cluster path against the Triton path,
at the few-rows shapes whose calls the host bounds (the H200 file keeps them off the cluster).

    python -m benchmark.experiments.softmax_cluster_host

Prints host us per call (calls issued back to back, planned as a user's repeated calls are)
for the forward and, through ``torch.autograd.grad``, the backward: with the shipped file
(the Triton kernels up to its rows bounds), with the same file less its rows bounds (the
cluster kernels), and torch. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

import gemslib
from benchmark.experiments.host_overhead import host_us
from gemslib import runtime

_SHAPES = ((16, 128256), (64, 151936), (256, 152064))
_ROWS_BOUNDS = ("      - max: {rows: 64}", "      - max: {rows: 256}")


def _without_rows_bounds(text: str) -> str:
    """The yaml less each softmax_cluster_* section's leading rows bucket (two lines)."""
    lines = text.splitlines()
    kept, skip = [], False
    for line in lines:
        if skip:
            skip = False
            continue
        if any(line.startswith(bound) for bound in _ROWS_BOUNDS):
            skip = True
            continue
        kept.append(line)
    if len(kept) != len(lines) - 4:
        raise SystemExit("the H200 file's rows bounds are not where this experiment expects")
    return "\n".join(kept) + "\n"


def _figures(rows: int, cols: int) -> tuple[float, float]:
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = gemslib.softmax(x, -1)
    grad = torch.randn_like(out)
    forward = host_us(lambda: gemslib.softmax(x.detach(), -1), 500)
    backward = host_us(lambda: torch.autograd.grad(out, (x,), grad, retain_graph=True), 500)
    return forward, backward


def main() -> None:
    shipped = runtime.config_path()
    edited = Path(tempfile.mkdtemp()) / shipped.name
    edited.write_text(_without_rows_bounds(shipped.read_text()))
    table = {}
    for label, path in (("Triton", None), ("cluster", edited)):
        if path is None:
            os.environ.pop(runtime.CONFIG_ENV, None)
        else:
            os.environ[runtime.CONFIG_ENV] = str(path)
        runtime.reload_configs()
        for rows, cols in _SHAPES:
            table[label, rows, cols] = _figures(rows, cols)
    print(f"{'host us per call':<20}{'Triton':>9}{'cluster':>9}{'torch':>9}")
    for rows, cols in _SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = torch.softmax(x, -1)
        grad = torch.randn_like(out)
        torch_figures = (host_us(lambda: torch.softmax(x.detach(), -1), 500),
                         host_us(lambda: torch.autograd.grad(out, (x,), grad, retain_graph=True),
                                 500))
        for i, name in enumerate(("fwd", "bwd")):
            print(f"{name} {rows}x{cols:<10}{table['Triton', rows, cols][i]:9.1f}"
                  f"{table['cluster', rows, cols][i]:9.1f}{torch_figures[i]:9.1f}", flush=True)


if __name__ == "__main__":
    main()
