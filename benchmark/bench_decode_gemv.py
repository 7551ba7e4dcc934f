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
- q/k/v with norm, rotary and cache write: decode_gemv_rotary(x, [Wq, Wk, Wv], ...) at M
  sequences of one token, caches (M, Hk, 1024, D) written at row 1000 (Qwen3: the per-head
  q/k norm too); against gemslib's two launches (decode_gemv with the norm, then
  rotary_into_cache: the graph's form without the fold), transformers' torch path (rms_norm,
  one matmul, rotate_half, the caches' index_copy_) and its torch.compile

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
# (family, hidden, q heads, kv heads, head_dim, I, per-head q/k norm)
MODELS = (("llama3.2-1b", 2048, 32, 8, 64, 8192, False),
          ("llama3-8b", 4096, 32, 8, 128, 14336, False),
          ("qwen3-8b", 4096, 32, 8, 128, 12288, True))
ROWS = (1, 16)
PROJECTIONS = ("o_proj+residual", "gate_up+norm", "down+gated+residual", "qkv+norm+rotary")
CACHE_LEN, CACHE_ROW = 1024, 1000
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


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _qkv_rotary_torch(x, weight, norm_weight, cos, sin, cache_position, k_cache, v_cache,
                      n_q_heads, q_weight, k_weight):
    """transformers' path: the norm, the q/k/v projection (one matmul over the merged
    weight), the heads (Qwen3: each q and k head normed), rotate_half, the static cache's
    update (index_copy_ along the sequence)."""
    batch, n_kv_heads, _, head_dim = k_cache.shape
    y = F.rms_norm(x, (x.shape[-1],), norm_weight, EPS) @ weight.t()
    q, k, v = gemv_ops._heads(y, batch, n_q_heads, n_kv_heads, head_dim)
    if q_weight is not None:
        q = F.rms_norm(q, (head_dim,), q_weight, EPS)
        k = F.rms_norm(k, (head_dim,), k_weight, EPS)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.index_copy_(2, cache_position, k.transpose(1, 2))
    v_cache.index_copy_(2, cache_position, v.transpose(1, 2))
    return q.reshape(x.shape[0], -1)


def _qkv_rotary_case(family, hidden, n_q_heads, n_kv_heads, head_dim, qk_norm, rows, size):
    """The q/k/v projection with its norm, rotary and cache write at ``rows`` sequences."""
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=DTYPE) * scale

    widths = (n_q_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim)
    weight = randn(sum(widths), hidden, scale=hidden ** -0.5)
    weights = list(weight.split(widths))  # views of one buffer, as merged_linear keeps them
    x, norm_weight = randn(rows, hidden), torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5
    angles = torch.rand(rows, 1, head_dim, device="cuda") * 6.3
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
    position = torch.tensor([CACHE_ROW], device="cuda")
    k_cache, v_cache = (randn(rows, n_kv_heads, CACHE_LEN, head_dim) for _ in range(2))
    q_weight, k_weight = ((torch.rand(head_dim, device="cuda", dtype=DTYPE) + 0.5
                           for _ in range(2)) if qk_norm else (None, None))
    qk = (q_weight, k_weight, EPS, 0.0) if qk_norm else ()
    fused = torch.ops.gemslib.decode_gemv_rotary
    unfused_rotary = torch.ops.gemslib.rotary_into_cache
    torch_path = compiled(_qkv_rotary_torch)

    def two_launches():
        y = gemslib.decode_gemv(x, weight, norm_weight=norm_weight, eps=EPS)
        q, k, v = gemv_ops._heads(y, rows, n_q_heads, n_kv_heads, head_dim)
        return unfused_rotary(q, k, v, cos, sin, False, position, k_cache, v_cache, *qk)

    torch_args = (x, weight, norm_weight, cos, sin, position, k_cache, v_cache, n_q_heads,
                  q_weight, k_weight)
    impls = {
        "gemslib": lambda: fused(x, weights, [None] * 3, norm_weight, EPS, 0.0, cos, sin,
                                 False, position, k_cache, v_cache, n_q_heads, *qk),
        "gemslib, 2 launches": two_launches,
        "torch eager": lambda: _qkv_rotary_torch(*torch_args),
        "torch.compile": lambda: torch_path(*torch_args),
        f"torch.matmul only {BOUND}": lambda: x @ weight.t()}
    # the weight, x, the norm weight, q written, k and v written into the caches
    bytes_moved = (weight.numel() + x.numel() + hidden + rows * sum(widths)) * size

    def reference():
        wide = [t.float() if t is not None else None for t in
                (x, weight, norm_weight, cos, sin, k_cache.clone(), v_cache.clone(), q_weight,
                 k_weight)]
        return gemv_ops.decode_gemv_rotary_reference(
            wide[0], wide[1], None, wide[2], EPS, 0.0, wide[3], wide[4], False, position,
            wide[5], wide[6], n_q_heads, wide[7], wide[8], EPS, 0.0)

    what = "qkv+norm+rotary" + ("+qk_norm" if qk_norm else "")
    return Case("decode_gemv", f"{family} {what} M{rows} N{sum(widths)} K{hidden}", "bf16",
                bytes_moved, impls,
                outputs_agree=outputs_close(impls["gemslib"], reference, rtol=1e-2,
                                            normwise=True))


def cases(quick: bool = False, backward: bool = False):
    size = torch.finfo(DTYPE).bits // 8
    compiled_paths = {name: compiled(path) for name, path in TORCH_PATHS.items()}
    for family, hidden, n_q_heads, n_kv_heads, head_dim, inter, qk_norm in MODELS:
        if quick and family not in QUICK:
            continue
        attention = n_q_heads * head_dim
        for rows in ROWS:
            for name in PROJECTIONS:
                if name == "qkv+norm+rotary":
                    yield _qkv_rotary_case(family, hidden, n_q_heads, n_kv_heads, head_dim,
                                           qk_norm, rows, size)
                    continue
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
