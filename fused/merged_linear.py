"""Projections of one input in one GEMM: the horizontal fusion of a decoder layer's q, k and v
(or gate and up) projections.

    out = x @ [W_0; W_1; ...; W_{n-1}].T + [b_0, b_1, ..., b_{n-1}]

x (M, K); W_i (N_i, K) as in ``nn.Linear``; b_i (N_i,) or no biases; out (M, sum_i N_i), whose
column block i is ``F.linear(x, W_i, b_i)``. The GEMM is cuBLAS's: what the fusion buys is one
launch reading x once and streaming one weight matrix, with a wider N for the tiles.

The weights must not be concatenated at every call (that copies them all), nor kept twice. The
graph rewrite below therefore merges a site's parameters once, when the graph is compiled: it
copies them into one buffer and points each parameter's ``.data`` at its rows of that buffer
(a DTensor shard: see ``_merge_once``), so the model keeps one copy, its eager forward is
unchanged, and an in-place update of a parameter (``load_state_dict``, an optimizer step)
updates the merged matrix too. At every call
the operator checks that its weights still lie end to end in one buffer and runs one GEMM over
them; weights that do not (a parameter replaced since) are computed one by one, correct and
slower. The file reads top-down: the operator, its reference, the graph rewrite, self-checks.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Optional

import torch

from gemslib.graph import call_node
from gemslib.registry import GraphRewrite, SelfCheck


# --------------------------------------------------------------------------------------------
# The operator
# --------------------------------------------------------------------------------------------


_MERGED_ROWS = "_gemslib_merged_rows"  # attribute of a merged shard: the buffer it aliases


def end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` when they lie end to end in memory (contiguous, the same
    trailing shape, each starting where the previous one ends), in one storage or in the one
    buffer their merge made (see ``_merge_once``), else None.

    Tensors of shapes (N_i, *rest) give a view of shape (sum_i N_i, *rest)."""
    first = tensors[0]
    buffer = getattr(first, _MERGED_ROWS, None)
    if buffer is not None and any(getattr(t, _MERGED_ROWS, None) is not buffer for t in tensors):
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


_merged_linear_op = torch.library.custom_op("gemslib::merged_linear", _merged_linear_impl,
                                            mutates_args=())
_merged_linear_op.register_fake(_merged_linear_fake)


def merged_linear_reference(x, weights, biases):
    return torch.cat([x @ w.T + (0 if b is None else b) for w, b in zip(weights, biases)], -1)


# --------------------------------------------------------------------------------------------
# Graph rewrite (torch.compile(backend="gemslib")): projections of one input -> one GEMM
# --------------------------------------------------------------------------------------------

_aten = torch.ops.aten
# id -> weak reference of each parameter merged by a rewrite, in any group (a WeakSet would
# compare tensors with == on a hash match, which is elementwise)
_merged: dict[int, weakref.ref] = {}


def _was_merged(t: torch.Tensor) -> bool:
    ref = _merged.get(id(t))
    return ref is not None and ref() is t


def _remember_merged(t: torch.Tensor) -> None:
    key = id(t)
    _merged[key] = weakref.ref(t, lambda _, key=key: _merged.pop(key, None))


def _projection(mm: torch.fx.Node):
    """(x 2-d node, its source, W placeholder, b placeholder or None) when ``mm`` is a linear
    layer as inductor's post-grad graph holds it: ``mm(x, permute(W, [1, 0]))`` or
    ``addmm(b, x, permute(W, [1, 0]))`` (beta = alpha = 1), with W (N, K) and b (N,) graph
    inputs, x either a graph value or its ``reshape`` to (M, K)."""
    if mm.target is _aten.mm.default and len(mm.args) == 2 and not mm.kwargs:
        bias, x2d, weight_t = None, *mm.args
    elif mm.target is _aten.addmm.default and len(mm.args) == 3 and not mm.kwargs:
        bias, x2d, weight_t = mm.args
        if not (isinstance(bias, torch.fx.Node) and bias.op == "placeholder"):
            return None
    else:
        return None
    if not (isinstance(weight_t, torch.fx.Node) and weight_t.target is _aten.permute.default
            and list(weight_t.args[1]) == [1, 0]
            and isinstance(weight_t.args[0], torch.fx.Node)
            and weight_t.args[0].op == "placeholder"):
        return None
    source = x2d
    if x2d.target in (_aten.reshape.default, _aten.view.default):
        source = x2d.args[0]
    return x2d, source, weight_t.args[0], bias


def _site_key(x2d: torch.fx.Node, source: torch.fx.Node, weight, bias):
    x_val, w_val = x2d.meta["val"], weight.meta["val"]
    return (source, tuple(map(str, x_val.shape)), x_val.dtype, w_val.dtype, bias is None)


def _merge_once(tensors: list[torch.Tensor]) -> bool:
    """Point ``tensors`` at consecutive rows of one new buffer, unless they lie end to end
    already; False when one of them belongs to another merged group. A parameter's ``.data``
    becomes a view of its rows. A tensor subclass's inner tensor (a DTensor shard's local
    tensor, which is not a Parameter) gets a storage of its own over its rows instead, the
    buffer kept alive by an attribute: dynamo cannot fakeify subclass tensors whose inner
    tensors share one storage, so a sharded model's next compile would crash."""
    if end_to_end(tensors) is not None:
        return True
    if any(_was_merged(t) for t in tensors) or len({id(t) for t in tensors}) != len(tensors):
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        merged = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            rows = merged[start:start + t.shape[0]]
            if isinstance(t, torch.nn.Parameter):
                t.data = rows
            else:
                storage = torch._C._construct_storage_from_data_pointer(
                    rows.data_ptr(), rows.device, rows.numel() * rows.element_size())
                t.set_(storage, 0, rows.shape, rows.stride())
                setattr(t, _MERGED_ROWS, merged)
            start += t.shape[0]
            _remember_merged(t)
    return True


def _merge_projections(graph: torch.fx.Graph, real_value) -> list[str]:
    """Every set of two or more projections of one input (same dtypes, all with biases or
    none, weights that are the compiled graph's real parameters) becomes one merged_linear
    and a slice of its output per projection."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (_aten.mm.default, _aten.addmm.default):
            found = _projection(node)
            if found is not None:
                groups[_site_key(*found[:2], *found[2:])].append((node, *found))
    sites = []
    for members in groups.values():
        if len(members) < 2:
            continue
        weights = [real_value(w) for _, _, _, w, _ in members]
        biases = [real_value(b) for _, _, _, _, b in members if b is not None]
        if any(t is None for t in weights + biases) or any(
                w.dim() != 2 or w.device != weights[0].device for w in weights):
            continue
        if not _merge_once(weights) or (biases and not _merge_once(biases)):
            continue
        members.sort(key=lambda member: order[member[0]])
        first, x2d = members[0][0], members[0][1]
        weight_nodes = [w for _, _, _, w, _ in members]
        bias_nodes = [b for _, _, _, _, b in members]
        with graph.inserting_before(first):
            merged = call_node(graph, torch.ops.gemslib.merged_linear.default, x2d,
                               weight_nodes, bias_nodes)
            start = 0
            for mm, *_ in members:
                width = mm.meta["val"].shape[-1]
                part = call_node(graph, _aten.slice.Tensor, merged, 1, start, start + width)
                start += width
                mm.replace_all_uses_with(part)
        for mm, *_ in members:  # outside the insertion point: the first of them is that point
            graph.erase_node(mm)
        sites.append(f"{', '.join(mm.name for mm, *_ in members)} of {members[0][2].name}")
    return sites


GRAPH_REWRITES = (GraphRewrite("merged_linear", _merge_projections),)


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
