"""softmax and log_softmax (bf16, last dim) against torch eager, torch.compile, FlagGems and
quack (its softmax, forward and backward, at widths divisible by 8; it has no log_softmax).

    python -m benchmark --ops softmax log_softmax [--forward-only]

Bytes moved: read x and write y (2*M*N); the backward reads dy and y and writes dx (3*M*N).
Wide rows (vocabulary sizes) take an online pass, which reads x twice: its floor is 3*M*N
bytes, but the table counts the 2*M*N a single-read kernel would need, as the peers' do.
"""

from __future__ import annotations

import torch

import gemslib
from benchmark.harness import Case, compiled, optional_peer, outputs_close

QUICK_SHAPES = [(16384, 4096), (1024, 131072), (512, 262144)]
EXTRA_SHAPES = [(4096, 4096), (2048, 50257), (1, 131072), (65536, 1024), (8192, 32000),
                (256, 152064), (4096, 128256)]
# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
DTYPE = torch.bfloat16


def _torch_softmax(x):
    return torch.softmax(x, -1)


def _torch_log_softmax(x):
    return torch.log_softmax(x, -1)


def _grads(fn, x):
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaf, grad, retain_graph=True)


def _quack_softmax():
    """quack's (forward, backward(dy, y)) if it imports, else None."""
    module = optional_peer("quack.softmax")
    return None if module is None else (module.softmax_fwd, module.softmax_bwd)


def cases(quick: bool = False, backward: bool = False):
    flag_gems = optional_peer("flag_gems")
    quack = _quack_softmax()
    size = torch.finfo(DTYPE).bits // 8
    for rows, cols in QUICK_SHAPES + ([] if quick else EXTRA_SHAPES):
        x = torch.randn(rows, cols, device="cuda", dtype=DTYPE)
        for op, ours, theirs in (("softmax", gemslib.softmax, _torch_softmax),
                                 ("log_softmax", gemslib.log_softmax, _torch_log_softmax)):
            impls = {"gemslib": lambda ours=ours: ours(x, -1),
                     "torch eager": lambda theirs=theirs: theirs(x),
                     "torch.compile": (lambda f: lambda: f(x))(compiled(theirs))}
            if flag_gems:
                peer = getattr(flag_gems, op, None)
                if peer is not None:
                    impls["FlagGems"] = lambda peer=peer: peer(x, -1)
            if quack and op == "softmax" and cols % 8 == 0:
                impls["quack"] = lambda: quack[0](x)
            yield Case(op, f"{rows}x{cols}", "bf16", 2 * x.numel() * size, impls,
                       outputs_agree=outputs_close(impls["gemslib"],
                                                   lambda theirs=theirs: theirs(x.float())))
            if backward:
                impls = {"gemslib": _grads(lambda t, ours=ours: ours(t, -1), x),
                         "torch eager": _grads(theirs, x),
                         "torch.compile": _grads(compiled(theirs), x)}
                if quack and op == "softmax" and cols % 8 == 0:
                    y, dy = torch.softmax(x, -1), torch.randn_like(x)
                    impls["quack"] = lambda y=y, dy=dy: quack[1](dy, y)
                yield Case(f"{op}_backward", f"{rows}x{cols}", "bf16", 3 * x.numel() * size, impls)
        del x


