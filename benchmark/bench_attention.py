"""attention (prefill, bf16) against SDPA with each backend forced, SDPA's default choice, and
FlagGems.

    python -m benchmark --ops attention [--forward-only]

Prefill reports TFLOP/s at 4 * B * H * Sq * Skv * D (half that when causal). Unless
``--forward-only``, attention_backward cases follow: the backward alone (dq, dk, dv from a
graph built once), at 2.5x the forward's FLOPs (five matmuls of the forward's size against two).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import Case, optional_peer, outputs_close
from gemslib.fused import attention as attention_ops

# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("attention", "attention_causal", "attention_backward",
       "attention_backward_causal")
DTYPE = torch.bfloat16
# (batch, heads, seq, head dim)
QUICK_PREFILL = [(1, 32, 8192, 128), (2, 16, 4096, 64)]
# and the other families' head dims: Phi-3's 96 (32 heads), Gemma's 256 (16 heads)
EXTRA_PREFILL = [(4, 32, 2048, 128), (1, 32, 16384, 128), (1, 32, 3001, 128),
                 (1, 32, 4096, 96), (1, 16, 4096, 256)]


def _sdpa_with(backend):
    """SDPA with one backend forced (None: torch's own choice)."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        context = sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()
        with context:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return run


def _sdpa_peers():
    from torch.nn.attention import SDPBackend

    return {"SDPA default": _sdpa_with(None),
            "SDPA cuDNN": _sdpa_with(SDPBackend.CUDNN_ATTENTION),
            "SDPA flash": _sdpa_with(SDPBackend.FLASH_ATTENTION),
            "SDPA efficient": _sdpa_with(SDPBackend.EFFICIENT_ATTENTION)}


def _backward_only(fn, q, k, v):
    """Time torch.autograd.grad of a graph built once (retain_graph)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def _with_hopper_backward(run, on: bool):
    """``run`` with the Gluon dK/dV kernel where it applies (``on``) or without (the choice is
    read at backward time)."""
    def timed():
        with contextlib.nullcontext() if on else attention_ops.HOPPER_BACKWARD.switched_off():
            return run()
    return timed


def _pin_flag_gems_backward(flag_gems) -> bool:
    """FlagGems 5.0.2's attention backward autotunes over 18 configs, some of which fault on
    the H200 under Triton 3.6 (an illegal address that ends the process; triton-lang/triton
    #10573 reports it on this kernel) and two of whose three block layouts leave half of dq
    unwritten (its grid follows BLOCK_N1, its dq tiles BLOCK_M2). Pinned to the layout of its
    own set that covers dq (BLOCK_M1 32, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 32). False when
    the module is not laid out as in 5.0.2 (then FlagGems' backward is left out)."""
    import triton

    module = getattr(getattr(flag_gems, "ops", None), "attention", None)
    configs = getattr(module, "config_backward", None)
    if not isinstance(configs, list):
        return False
    configs[:] = [triton.Config({"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128,
                                 "BLOCK_N2": 32}, num_warps=4, num_stages=2)]
    return True


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    flag_gems_backward = backward and flag_gems is not None and _pin_flag_gems_backward(flag_gems)
    peers = _sdpa_peers()
    for batch, heads, seq, dim in QUICK_PREFILL + ([] if quick else EXTRA_PREFILL):
        q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=DTYPE)
                   for _ in range(3))
        for causal in (False, True):
            flops = 4 * batch * heads * seq * seq * dim // (2 if causal else 1)
            impls = {"gemslib": lambda c=causal: gemslib.attention(q, k, v, causal=c)}
            for name, run in peers.items():
                impls[name] = lambda run=run, c=causal: run(q, k, v, c)
            sdpa = getattr(flag_gems, "scaled_dot_product_attention", None) if flag_gems else None
            if sdpa is not None:
                impls["FlagGems"] = lambda c=causal: sdpa(q, k, v, is_causal=c)
            yield Case("attention" + ("_causal" if causal else ""),
                       f"B{batch} H{heads} S{seq} D{dim}", "bf16", 0, impls, flops=flops,
                       outputs_agree=outputs_close(
                           lambda c=causal: gemslib.attention(q, k, v, causal=c),
                           lambda c=causal: F.scaled_dot_product_attention(
                               q.float(), k.float(), v.float(), is_causal=c)))
            if backward:
                impls = {"gemslib": _backward_only(
                    lambda q, k, v, c=causal: gemslib.attention(q, k, v, causal=c), q, k, v)}
                if dim == 128:  # gemslib's own fallback where the Gluon dK/dV kernel can't go
                    impls["gemslib Triton dK/dV"] = _with_hopper_backward(impls["gemslib"],
                                                                          False)
                for name, run in peers.items():
                    if name != "SDPA efficient":  # far behind in the forward already
                        impls[name] = _backward_only(lambda q, k, v, run=run, c=causal:
                                                     run(q, k, v, c), q, k, v)
                # FlagGems 5.0.2 ignores is_causal in its backward (always causal gradients):
                # timed only where it computes the same thing
                if sdpa is not None and flag_gems_backward and causal:
                    impls["FlagGems"] = _backward_only(
                        lambda q, k, v, c=causal: sdpa(q, k, v, is_causal=c), q, k, v)
                yield Case("attention_backward" + ("_causal" if causal else ""),
                           f"B{batch} H{heads} S{seq} D{dim}", "bf16", 0, impls,
                           flops=flops * 5 // 2)
        del q, k, v
