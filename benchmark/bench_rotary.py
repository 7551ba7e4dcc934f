"""apply_rotary (bf16, NeoX layout) against torch eager, torch.compile, Liger-Kernel, FlagGems,
FlashInfer (``apply_rope_with_cos_sin_cache``); rotary_qk_norm (Qwen3's per-head q/k RMSNorm and
the rotary in one launch) against the same computed as a model writes it (eager,
torch.compile), Liger-Kernel's and FlashInfer's RMSNorm and rotary.

    python -m benchmark --ops rotary rotary_qk_norm [--forward-only]

Bytes moved: q and k read and written once (2 * (q + k) elements); cos, sin and the norm
weights are small. The eager peer is the Hugging Face formulation, ``x * cos + rotate_half(x)
* sin`` with cos and sin expanded to the full head dim (after Qwen3RMSNorm over each head for
rotary_qk_norm).
"""

from __future__ import annotations

import torch

import gemslib
from benchmark.harness import Case, compiled, optional_peer, outputs_close
from gemslib.ops import rotary as rotary_ops

# (batch, seq, q heads, kv heads, head dim)
QUICK_SHAPES = [(8, 4096, 32, 8, 128), (1, 4096, 32, 8, 128)]
EXTRA_SHAPES = [(1, 4096, 40, 8, 128), (16, 1, 32, 8, 128), (4, 2048, 64, 8, 64)]
# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("rotary", "rotary_backward", "rotary_qk_norm")
EPS = 1e-6
DTYPE = torch.bfloat16


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _eager_rotary(q, k, cos_full, sin_full):
    cos, sin = cos_full[:, None, :], sin_full[:, None, :]  # (S, 1, D) over (B, S, H, D)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _heads_normed(x, weight):
    """Qwen3RMSNorm over each head: fp32 arithmetic, cast back, times the (D,) weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _eager_rotary_qk_norm(q, k, q_weight, k_weight, cos_full, sin_full):
    return _eager_rotary(_heads_normed(q, q_weight), _heads_normed(k, k_weight), cos_full,
                         sin_full)


def _flashinfer_rotary(flashinfer, batch, seq, head_dim, angles):
    """FlashInfer's rotary as its API takes it, its inputs made once here: tokens flattened to
    (B*S, H*D), a position per token, and one fp32 (S, D) table of cos | sin (the table it
    requires; gemslib's is bf16 cos and sin of (S, D/2) each). Returns rotate(q, k) for
    (B, S, H, D) q and k."""
    table = torch.cat([angles.cos(), angles.sin()], -1).float().contiguous()
    positions = torch.arange(seq, device=angles.device).repeat(batch)
    return lambda q, k: flashinfer.rope.apply_rope_with_cos_sin_cache(
        positions, q.reshape(batch * seq, -1), k.reshape(batch * seq, -1), head_dim, table,
        True)


def _qk_norm_cases(q, k, cos, sin, cos_full, sin_full, shape, bytes_moved, liger_rope,
                   liger_norm, flashinfer=None, angles=None):
    """rotary_qk_norm at one shape (q, k (B, S, H, D); cos, sin (S, D/2) and full width)."""
    head_dim = q.shape[-1]
    q_weight, k_weight = (torch.rand(head_dim, device=q.device, dtype=DTYPE) + 0.5
                          for _ in range(2))
    fused = torch.ops.gemslib.rotary_qk_norm
    impls = {"gemslib": lambda: fused(q, k, cos, sin, None, False, q_weight, k_weight, EPS),
             "torch eager": lambda: _eager_rotary_qk_norm(q, k, q_weight, k_weight, cos_full,
                                                         sin_full),
             "torch.compile": (lambda f: lambda: f(q, k, q_weight, k_weight, cos_full,
                                                   sin_full))(compiled(_eager_rotary_qk_norm))}
    if liger_rope and liger_norm:  # two launches: the norm of each head, then the rotary
        def liger():
            q_normed = liger_norm.LigerRMSNormFunction.apply(q, q_weight, EPS)
            k_normed = liger_norm.LigerRMSNormFunction.apply(k, k_weight, EPS)
            return liger_rope.LigerRopeFunction.apply(
                q_normed.transpose(1, 2), k_normed.transpose(1, 2), cos_full[None],
                sin_full[None])
        impls["Liger-Kernel"] = liger
    if flashinfer:  # three launches: its RMSNorm over q's heads, over k's, then its rotary
        rotate = _flashinfer_rotary(flashinfer, q.shape[0], q.shape[1], head_dim, angles)

        def flashinfer_norm_rope():
            q_normed = flashinfer.norm.rmsnorm(q.reshape(-1, head_dim), q_weight, EPS)
            k_normed = flashinfer.norm.rmsnorm(k.reshape(-1, head_dim), k_weight, EPS)
            return rotate(q_normed, k_normed)
        impls["FlashInfer"] = flashinfer_norm_rope
    return Case("rotary_qk_norm", shape, "bf16", bytes_moved, impls,
                outputs_agree=outputs_close(
                    lambda: fused(q, k, cos, sin, None, False, q_weight, k_weight, EPS)[0],
                    lambda: rotary_ops.rotary_qk_norm_reference(
                        q.float(), k.float(), cos.float(), sin.float(), None, False,
                        q_weight.float(), k_weight.float(), EPS)[0]))


def _grads(fn, q, k):
    leaves = (q.clone().requires_grad_(), k.clone().requires_grad_())
    outs = fn(*leaves)
    grads = [torch.randn_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    liger = optional_peer("liger_kernel.ops.rope")
    liger_norm = optional_peer("liger_kernel.ops.rms_norm")
    flashinfer = optional_peer("flashinfer")
    size = torch.finfo(DTYPE).bits // 8
    for batch, seq, q_heads, kv_heads, head_dim in QUICK_SHAPES + ([] if quick else EXTRA_SHAPES):
        q = torch.randn(batch, seq, q_heads, head_dim, device="cuda", dtype=DTYPE)
        k = torch.randn(batch, seq, kv_heads, head_dim, device="cuda", dtype=DTYPE)
        angles = torch.rand(seq, head_dim // 2, device="cuda") * 6.3
        cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
        cos_full, sin_full = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        shape = f"B{batch} S{seq} Hq{q_heads} Hk{kv_heads} D{head_dim}"
        impls = {"gemslib": lambda: gemslib.apply_rotary(q, k, cos, sin),
                 # Liger-Kernel rotates in place: written lines stay in L2 after the timed call
                 "gemslib in place": lambda: gemslib.apply_rotary(q, k, cos, sin, inplace=True),
                 "torch eager": lambda: _eager_rotary(q, k, cos_full, sin_full),
                 "torch.compile": (lambda f: lambda: f(q, k, cos_full, sin_full))(
                     compiled(_eager_rotary))}
        if liger:  # Liger takes (B, H, S, D) views and full-width (1, S, D) cos/sin
            impls["Liger-Kernel"] = lambda: liger.LigerRopeFunction.apply(
                q.transpose(1, 2), k.transpose(1, 2), cos_full[None], sin_full[None])
        if flag_gems:
            impls["FlagGems"] = lambda: flag_gems.apply_rotary_pos_emb(q, k, cos, sin)
        if flashinfer:
            rotate = _flashinfer_rotary(flashinfer, batch, seq, head_dim, angles)
            impls["FlashInfer"] = lambda: rotate(q, k)
        bytes_moved = 2 * (q.numel() + k.numel()) * size
        yield Case("rotary", shape, "bf16", bytes_moved, impls,
                   outputs_agree=outputs_close(
                       lambda: gemslib.apply_rotary(q, k, cos, sin)[0],
                       lambda: rotary_ops.rotary_reference(q.float(), k.float(), cos.float(),
                                                           sin.float())[0]))
        if backward:
            impls = {"gemslib": _grads(lambda a, b: gemslib.apply_rotary(a, b, cos, sin), q, k),
                     "torch eager": _grads(lambda a, b: _eager_rotary(a, b, cos_full, sin_full), q, k),
                     "torch.compile": _grads(
                         (lambda f: lambda a, b: f(a, b, cos_full, sin_full))(compiled(_eager_rotary)),
                         q, k)}
            yield Case("rotary_backward", shape, "bf16", bytes_moved, impls)
        yield _qk_norm_cases(q, k, cos, sin, cos_full, sin_full, shape, bytes_moved, liger,
                             liger_norm, flashinfer, angles)
        del q, k


