"""What attention.py and decode_attention.py share: input checks, SDPA's default scale, which
calls the kernels take, and the plain PyTorch reference both are tested against.

    attention_reference(q, k, v)[b, h, i] = sum_j p_ij v[b, g(h), j],
    p_ij = softmax_j(scale * q[b, h, i] . k[b, g(h), j])  (causal: over the keys j <= i;
                                                            with a window, i - window < j)

with g(h) = h // (Hq / Hkv), computed by the definition in whatever dtype it is given.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gemslib import checks, runtime


def default_scale(head_dim: int) -> float:
    """SDPA's default scale 1 / sqrt(D). With D = 0 every score is an empty sum, 0, whatever
    the scale (torch gives uniform weights), so any finite scale serves."""
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0


def _check(q, k, v, scale, name: str = "gemslib.attention") -> None:
    for arg, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, arg, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} must be (B, H, S, D), got shape {tuple(t.shape)}")
        checks.float_tensor(name, arg, t, expected="floating-point")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(f"{name}: k and v must be {q.dtype} on {q.device} like q, got "
                         f"{k.dtype} on {k.device} and {v.dtype} on {v.device}")
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must share the batch, and k and v their heads and "
                         "sequence length")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{name}: k's head dim {k.shape[3]} must equal q's {q.shape[3]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: q's {q.shape[1]} heads must be a multiple of k and v's "
                         f"{k.shape[1]} (grouped-query attention)")
    checks.as_float(name, "scale", scale, optional=True)


@triton.jit
def soft_tanh(b_x, cap):
    """tanh(b_x / cap), as 2 sigmoid(2x) - 1: the kernels' logit soft-capping is
    cap * soft_tanh(s, cap) (in whatever units s and cap share), its slope 1 - soft_tanh^2."""
    return 2.0 * tl.sigmoid(2.0 * b_x / cap) - 1.0


def band_arguments(name: str, window, softcap) -> tuple[int, float]:
    """(window, softcap) as the kernels take them, 0 for None, checked: a window an int >= 1,
    a softcap a finite number > 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"{name}: window must be an int >= 1 (or None), got {window!r}")
    if softcap is not None:
        softcap = checks.as_float(name, "softcap", softcap)
        if not 0 < softcap < float("inf"):
            raise ValueError(f"{name}: softcap must be a finite number > 0 (or None), got "
                             f"{softcap!r}")
    return int(window or 0), float(softcap or 0.0)


MAX_HEAD_DIM = 256  # the widest head the kernels' tiles hold; wider ones run torch's math


def _kernels_take(q, k, v, *others) -> bool:
    """The attention kernels take these (else torch): head dims 1 to MAX_HEAD_DIM, kernel
    dtypes on the kernel device (and not bf16 under the interpreter)."""
    return runtime.dot_kernel_runs(q, k, v, *others) and 0 < min(q.shape[-1], v.shape[-1]) \
        and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM


def attention_reference(q, k, v, causal=False, scale=None, window=0, softcap=0.0):
    """(o, lse) by the definition, K/V repeated over each group of query heads. ``softcap``
    > 0: each score s becomes softcap * tanh(s / softcap) (Gemma-2's logit soft-capping);
    ``window`` > 0 (causal only): query i sees the keys i - window < j <= i (a sliding
    window, as Mistral's and Gemma-2's masks)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if window:
            visible = visible & ~visible.tril(-window)
        scores = scores.masked_fill(~visible, -float("inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


# bf16 tl.dot is wrong in Triton 3.6's interpreter, so the CPU run checks fp16 and fp32
_CHECK_DTYPES = (torch.float16, torch.float32) if runtime.INTERPRETER else \
    (torch.float16, torch.bfloat16, torch.float32)
