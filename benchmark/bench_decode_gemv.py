"""decode_gemv (bf16) at decode's 1 and 16 rows: the three projections of a decoder layer it
folds small ops into, at Llama-3.2-1B's, Llama-3-8B's and Qwen3-8B's widths, against the
unfused torch path and torch.compile of it.

    python -m benchmark --ops decode_gemv

- o_proj + residual:  decode_gemv(x, Wo, residual=h)              x (M, heads * head_dim)
                      torch: h + x @ Wo.T
- gate/up with norm:  decode_gemv(x, Wgu, norm_weight=g)          x (M, hidden), Wgu (2I, hidden)
                      torch: F.rms_norm(x, g) @ Wgu.T
- down, gated:        decode_gemv(gu, Wd, residual=h, gated="silu")   gu (M, 2I) = [gate | up]
                      torch: h + (silu(gate) * up) @ Wd.T

Also the matmul alone ``(bound)``: what the torch path costs without its small ops. Bytes
moved: the weight, x, the norm weight or the residual, and the output, once each (the weight
is almost all of it); the figure is the fraction of the run's copy bandwidth (no FLOPs are
counted: a GEMV is judged by its bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import BOUND, Case, compiled, outputs_close
from gemslib.fused import decode_gemv as gemv_ops

OPS = ("decode_gemv",)
DTYPE = torch.bfloat16
EPS = 1e-6
# (family, hidden, heads * head_dim, I)
MODELS = (("llama3.2-1b", 2048, 32 * 64, 8192), ("llama3-8b", 4096, 32 * 128, 14336),
          ("qwen3-8b", 4096, 32 * 128, 12288))
ROWS = (1, 16)
PROJECTIONS = ("o_proj+residual", "gate_up+norm", "down+gated+residual")
QUICK = ("llama3-8b",)


def _o_proj(x, weight, residual):
    return residual + x @ weight.t()


def _gate_up(x, weight, norm_weight):
    return F.rms_norm(x, (x.shape[-1],), norm_weight, EPS) @ weight.t()


def _down(gate_up, weight, residual):
    gate, up = gate_up.chunk(2, dim=-1)
    return residual + (F.silu(gate) * up) @ weight.t()


def _projection(name: str, hidden: int, attention: int, inter: int, rows: int):
    """(x, weight, decode_gemv's keyword arguments, the torch path's arguments, the matmul
    alone) of one projection at ``rows`` rows."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=DTYPE) * scale

    if name == "o_proj+residual":
        x, residual = randn(rows, attention), randn(rows, hidden)
        weight = randn(hidden, attention, scale=attention ** -0.5)
        return x, weight, {"residual": residual}, (x, weight, residual), lambda: x @ weight.t()
    if name == "gate_up+norm":
        x, weight = randn(rows, hidden), randn(2 * inter, hidden, scale=hidden ** -0.5)
        norm_weight = torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5
        return (x, weight, {"norm_weight": norm_weight, "eps": EPS}, (x, weight, norm_weight),
                lambda: x @ weight.t())
    gate_up, residual = randn(rows, 2 * inter), randn(rows, hidden)
    weight = randn(hidden, inter, scale=inter ** -0.5)
    up = gate_up[:, inter:]
    return (gate_up, weight, {"residual": residual, "gated": "silu"}, (gate_up, weight, residual),
            lambda: up @ weight.t())


TORCH_PATHS = {"o_proj+residual": _o_proj, "gate_up+norm": _gate_up,
               "down+gated+residual": _down}


def cases(quick: bool = False, backward: bool = False):
    size = torch.finfo(DTYPE).bits // 8
    compiled_paths = {name: compiled(path) for name, path in TORCH_PATHS.items()}
    for family, hidden, attention, inter in MODELS:
        if quick and family not in QUICK:
            continue
        for rows in ROWS:
            for name in PROJECTIONS:
                x, weight, options, torch_args, matmul_only = _projection(
                    name, hidden, attention, inter, rows)
                others = [t for t in options.values() if isinstance(t, torch.Tensor)]
                n_out, n_in = weight.shape
                bytes_moved = (weight.numel() + x.numel() + sum(t.numel() for t in others)
                               + rows * n_out) * size
                path, compiled_path = TORCH_PATHS[name], compiled_paths[name]
                impls = {
                    "gemslib": lambda: gemslib.decode_gemv(x, weight, **options),
                    "torch eager": lambda: path(*torch_args),
                    "torch.compile": lambda: compiled_path(*torch_args),
                    f"torch.matmul only {BOUND}": matmul_only}
                wide = {key: value.float() if isinstance(value, torch.Tensor) else value
                        for key, value in options.items()}
                yield Case("decode_gemv", f"{family} {name} M{rows} N{n_out} K{n_in}", "bf16",
                           bytes_moved, impls,
                           outputs_agree=outputs_close(
                               impls["gemslib"],
                               lambda: gemv_ops.decode_gemv_reference(x.float(), weight.float(),
                                                                      **wide),
                               rtol=1e-2, normwise=True))
                del x, weight, options, torch_args, others, wide, matmul_only
