"""Projections of one input in one GEMM: the horizontal fusion of a decoder layer's q, k and v
(or gate and up) projections.

    out = x @ [W_0; W_1; ...; W_{n-1}].T + [b_0, b_1, ..., b_{n-1}]

x (M, K); W_i (N_i, K) as in ``nn.Linear``; b_i (N_i,) or no biases; out (M, sum_i N_i), whose
column block i is ``F.linear(x, W_i, b_i)``. The GEMM is cuBLAS's: what the fusion buys is one
launch reading x once and streaming one weight matrix, with a wider N for the tiles.

The weights must not be concatenated at every call (that copies them all), nor kept twice. The
graph rewrite (``gemslib.passes.linear``) therefore merges a site's parameters once, when the graph is compiled: it
copies them into one buffer and points each parameter's ``.data`` at its rows of that buffer
(a DTensor shard: see ``gemslib.passes.linear.merge_once``), so the model keeps one copy, its eager forward is
unchanged, and an in-place update of a parameter (``load_state_dict``, an optimizer step)
updates the merged matrix too. At every call
the operator checks that its weights still lie end to end in one buffer and runs one GEMM over
them; weights that do not (a parameter replaced since) are computed one by one, correct and
slower. The file reads top-down: the operator, its reference, self-checks.
"""

from __future__ import annotations

from typing import Optional

import torch

from gemslib import runtime
from gemslib.registry import SelfCheck


# --------------------------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------------------------


MERGED_ROWS = "_gemslib_merged_rows"  # attribute of a merged shard: the buffer it aliases


def end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` when they lie end to end in memory (contiguous, the same
    trailing shape, each starting where the previous one ends), in one storage or in the one
    buffer their merge made (see ``gemslib.passes.linear.merge_once``), else None.

    Tensors of shapes (N_i, *rest) give a view of shape (sum_i N_i, *rest)."""
    first = tensors[0]
    buffer = getattr(first, MERGED_ROWS, None)
    if buffer is not None and any(getattr(t, MERGED_ROWS, None) is not buffer for t in tensors):
        buffer = None
    base = first if buffer is None else buffer
    base_address = base.untyped_storage().data_ptr()
    start = (first.data_ptr() - base_address) // first.element_size()
    offset = start
    for t in tensors:
        if (t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.is_contiguous()
                or t.data_ptr() != base_address + offset * t.element_size()
                or (buffer is None and t.untyped_storage().data_ptr() != base_address)):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return base.as_strided((rows, *first.shape[1:]), first.stride(), start)


def _merged_linear_impl(x: torch.Tensor, weights: list[torch.Tensor],
                        biases: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """biases: one per weight, each a tensor or None (the schema has no optional list)."""
    weight = end_to_end(weights)
    if weight is None:  # the parameters were replaced since they were merged
        return torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)],
                         dim=-1)
    bias = None
    if any(b is not None for b in biases):
        bias = end_to_end(biases) if all(b is not None for b in biases) else None
        if bias is None:
            bias = torch.cat([torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                              if b is None else b for w, b in zip(weights, biases)])
    return torch.nn.functional.linear(x, weight, bias)


def _merged_linear_fake(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


_merged_linear_op = runtime.CustomOp("merged_linear", _merged_linear_impl,
                                     fake=_merged_linear_fake)


def merged_linear_reference(x, weights, biases):
    return torch.cat([x @ w.T + (0 if b is None else b) for w, b in zip(weights, biases)], -1)


# --------------------------------------------------------------------------------------------
# Graph rewrite (torch.compile(backend="gemslib")): projections of one input -> one GEMM
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _check_inputs(device, dtype, rows, widths=(96, 32, 32), k=80):
    x = torch.randn(rows, k, device=device, dtype=dtype)
    merged = torch.randn(sum(widths), k, device=device, dtype=dtype) / k ** 0.5
    bias = torch.randn(sum(widths), device=device, dtype=dtype)
    return x, merged, bias


def _split(t, widths=(96, 32, 32)):
    return list(t.split(widths))


SELF_CHECKS = (
    SelfCheck("merged_linear", _check_inputs,
              run=lambda x, w, b: _merged_linear_op(x, _split(w), _split(b)),
              reference=lambda x, w, b: merged_linear_reference(x, _split(w), _split(b)),
              torch_peer=lambda x, w, b: torch.nn.functional.linear(x, w, b)),
)
