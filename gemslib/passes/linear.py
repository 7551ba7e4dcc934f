"""Linear layers: projections of one input -> one merged_linear GEMM (a rewrite that merges
the parameters once, when the graph is compiled), and the epilogues fused onto a GEMM where
gemslib's fused path takes the site: silu_and_mul of a merged gate | up projection ->
linear_swiglu, gelu_and_mul of one -> linear_geglu, silu of a projection of an rms_norm ->
rms_norm_linear_silu."""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict

import torch

from gemslib.fused import rms_norm_linear_silu as _rms_norm_linear_silu_ops  # noqa: F401
from gemslib.fused import rms_norm_swiglu as _rms_norm_swiglu_ops  # noqa: F401  (linear_*glu)
from gemslib.fused.merged_linear import MERGED_ROWS, end_to_end
from gemslib.passes.base import GraphRewrite, in_flight
from gemslib.passes.forms import (call_node, live_users, projection, replace_if,
                                  silu_source)

try:  # the fused path's verdict on a site comes from its Hopper path (Gluon, Triton >= 3.4)
    from gemslib.fused import _rms_norm_linear_silu_hopper
except ImportError:  # pragma: no cover - older Triton: no site is handed to the fused ops
    _rms_norm_linear_silu_hopper = None

_aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Projections of one input -> merged_linear
# --------------------------------------------------------------------------------------------

# id -> weak reference of each parameter merged by a rewrite, in any group (a WeakSet would
# compare tensors with == on a hash match, which is elementwise)
_merged: dict[int, weakref.ref] = {}


def _was_merged(t: torch.Tensor) -> bool:
    ref = _merged.get(id(t))
    return ref is not None and ref() is t


def _remember_merged(t: torch.Tensor) -> None:
    key = id(t)
    _merged[key] = weakref.ref(t, lambda _, key=key: _merged.pop(key, None))


def _site_key(x2d: torch.fx.Node, source: torch.fx.Node, weight, bias):
    x_val, w_val = x2d.meta["val"], weight.meta["val"]
    return (source, tuple(map(str, x_val.shape)), x_val.dtype, w_val.dtype, bias is None)


def merge_once(tensors: list[torch.Tensor]) -> bool:
    """Point ``tensors`` at consecutive rows of one new buffer, unless they lie end to end
    already; False when one of them belongs to another merged group. A parameter's ``.data``
    becomes a view of its rows. A tensor subclass's inner tensor (a DTensor shard's local
    tensor, which is not a Parameter) gets a storage of its own over its rows instead, the
    buffer kept alive by an attribute: dynamo cannot fakeify subclass tensors whose inner
    tensors share one storage, so a sharded model's next compile would crash. The compile in
    flight records the group, so that a warm compile (its graph from inductor's cache, the
    passes skipped) merges it again."""
    if end_to_end(tensors) is None:
        if any(_was_merged(t) for t in tensors) or len({id(t) for t in tensors}) != len(tensors):
            return False
        _merge(tensors)
    record = in_flight()
    if record is not None:
        record.record_merge(tensors)
    return True


def merge_state(inputs) -> str:
    """What decides which groups of ``inputs`` :func:`merge_once` can merge: for each tensor
    merged before, its position and the first input that shares its buffer."""
    buffers: dict[int, int] = {}
    state = []
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and _was_merged(value):
            buffer = getattr(value, MERGED_ROWS, None)
            key = id(buffer) if buffer is not None else value.untyped_storage().data_ptr()
            state.append(f"{i}:{buffers.setdefault(key, i)}")
    return ",".join(state)


def _merge(tensors: list[torch.Tensor]) -> None:
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
                setattr(t, MERGED_ROWS, merged)
            start += t.shape[0]
            _remember_merged(t)


def _merge_projections(graph: torch.fx.Graph, real_value) -> list[str]:
    """Every set of two or more projections of one input (same dtypes, all with biases or
    none, weights that are the compiled graph's real parameters) becomes one merged_linear
    and a slice of its output per projection."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (_aten.mm.default, _aten.addmm.default):
            found = projection(node)
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
        if not merge_once(weights) or (biases and not merge_once(biases)):
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


# --------------------------------------------------------------------------------------------
# silu_and_mul / gelu_and_mul of a merged [gate | up] projection -> linear_swiglu /
# linear_geglu, the GEMM with the gated epilogue
# --------------------------------------------------------------------------------------------
#
# A model's MLP reaches the rewrites as (add_)rms_norm -> merged_linear([Wg, Wu]) ->
# silu_and_mul (gelu_and_mul in Gemma's). The norm stays the model's own kernel: its
# normalised rows are what the Hopper matmul reads, where rms_norm_swiglu's own pre-pass would
# write them again.


def _takes_graph_site(x: torch.Tensor, weight: torch.Tensor, weight_rows=None) -> bool:
    """The Hopper path's verdict on a site; ``weight_rows``: the rows its matmul reads when
    ``weight`` is a part of them (a gated op's gate half: 2I, as the op itself counts them)."""
    hopper = _rms_norm_linear_silu_hopper
    return hopper is not None and hopper.graph_site_fuses(x, weight, weight_rows)


def _fuse_linear_swiglu(graph: torch.fx.Graph, real_value) -> list[str]:
    """``silu_and_mul(merged_linear(x, [Wg, Wu], [None, None]))`` whose merged output feeds
    nothing else -> ``linear_swiglu(x, [Wg, Wu])``; and the same over one linear layer whose
    weight holds both (Phi-3's ``gate_up_proj``, its output chunked in the model's code):
    ``silu_and_mul(linear(x, W))`` -> ``linear_swiglu(x, [W[:I], W[I:]])``."""
    return _fuse_linear_gated(graph, torch.ops.gemslib.silu_and_mul.default,
                              torch.ops.gemslib.linear_swiglu.default)


def _fuse_linear_geglu(graph: torch.fx.Graph, real_value) -> list[str]:
    """``gelu_and_mul(merged_linear(x, [Wg, Wu], [None, None]), tanh)`` -> ``linear_geglu(x,
    [Wg, Wu], tanh)`` (Gemma's MLP), in every form :func:`_fuse_linear_swiglu` takes."""
    return _fuse_linear_gated(graph, torch.ops.gemslib.gelu_and_mul.default,
                              torch.ops.gemslib.linear_geglu.default)


def _fuse_linear_gated(graph: torch.fx.Graph, activation_op, fused_op) -> list[str]:
    """Each ``activation_op(projection, *form)`` node -> ``fused_op(x, [Wg, Wu], *form)`` (the
    activation's arguments after its input, such as gelu_and_mul's ``tanh``, carried over)."""
    sites = []
    for act in graph.find_nodes(op="call_function", target=activation_op):
        merged, form = act.args[0], tuple(act.args[1:])
        if act.kwargs or not isinstance(merged, torch.fx.Node):
            continue
        if merged.target is not torch.ops.gemslib.merged_linear.default:
            site = _fuse_one_gate_up_weight(graph, act, merged, fused_op, form)
            if site:
                sites.append(site)
            continue
        x, weights, biases = merged.args
        if len(weights) != 2 or any(b is not None for b in biases) or \
                weights[0].meta["val"].shape != weights[1].meta["val"].shape or \
                any(user is not act for user in live_users(merged)) or \
                not _takes_graph_site(x.meta["val"], weights[0].meta["val"],
                                      2 * weights[0].meta["val"].shape[0]):
            continue
        with graph.inserting_before(act):
            fused = call_node(graph, fused_op, x, list(weights), *form)
        act.replace_all_uses_with(fused)
        graph.erase_node(act)
        sites.append(f"{act.name} over {merged.name}")
    return sites


def _fuse_one_gate_up_weight(graph: torch.fx.Graph, act: torch.fx.Node, source: torch.fx.Node,
                             fused_op, form: tuple) -> str | None:
    """``act = activation(source, *form)`` with ``source`` a bias-free linear layer (possibly
    reshaped) of a weight (2I, K) feeding nothing else -> ``fused_op`` over the weight's two
    halves (views: one GEMM over the parameter as it lies); the site's name, or None."""
    mm = source.args[0] if source.target in (_aten.reshape.default, _aten.view.default) \
        else source
    found = projection(mm) if isinstance(mm, torch.fx.Node) else None
    if found is None:
        return None
    x2d, x, weight, bias = found
    w_val, out_val = weight.meta["val"], act.meta["val"]
    half = out_val.shape[-1]
    if bias is not None or w_val.dim() != 2 or w_val.shape[0] != 2 * half or \
            any(u is not (act if mm is source else source) for u in live_users(mm)) or \
            (mm is not source and any(u is not act for u in live_users(source))):
        return None
    x_in = x if mm is not source else x2d
    values = (x_in.meta["val"], w_val)
    if values[0].dtype != w_val.dtype or not _takes_graph_site(x2d.meta["val"], w_val):
        return None
    with graph.inserting_before(act):
        gate = call_node(graph, _aten.slice.Tensor, weight, 0, 0, half)
        up = call_node(graph, _aten.slice.Tensor, weight, 0, half, 2 * half)
        fused = call_node(graph, fused_op, x_in, [gate, up], *form)
    if not replace_if(graph, act, fused, fused.meta["val"].shape == out_val.shape, (up, gate)):
        return None
    return f"{act.name} over {mm.name} (one gate/up weight)"


# --------------------------------------------------------------------------------------------
# silu of a projection of an rms_norm -> rms_norm_linear_silu
# --------------------------------------------------------------------------------------------


def _silu_chain(act: torch.fx.Node, source: torch.fx.Node) -> set[torch.fx.Node]:
    """The nodes between ``source`` and ``act`` (silu(source) as inductor decomposes it)."""
    chain, todo = set(), [act]
    while todo:
        node = todo.pop()
        if node is source or node in chain:
            continue
        chain.add(node)
        todo += [a for a in node.all_input_nodes]
    return chain


def _fuse_rms_norm_linear_silu(graph: torch.fx.Graph, real_value) -> list[str]:
    """``silu(linear(rms_norm(x, g, eps), W, b))`` (after the patterns: the norm is gemslib's
    rms_norm node, the linear inductor's mm / addmm, possibly between reshapes) whose
    intermediates feed nothing else -> ``rms_norm_linear_silu(x, g, W, b, eps)``, where the
    fused path takes the site."""
    sites = []
    for act in list(graph.nodes):
        if act.op != "call_function" or not isinstance(act.meta.get("val"), torch.Tensor):
            continue
        source = silu_source(act)
        if source is None:
            continue
        mm = source.args[0] if source.target in (torch.ops.aten.reshape.default,
                                                 torch.ops.aten.view.default) else source
        found = projection(mm) if isinstance(mm, torch.fx.Node) else None
        if found is None:
            continue
        x2d, normed, weight, bias = found
        norm = normed.args[0] if normed.target is operator.getitem and normed.args[1] == 0 \
            else None
        if not (isinstance(norm, torch.fx.Node)
                and norm.target is torch.ops.gemslib.rms_norm_forward.default
                and len(norm.args) == 3 and not norm.kwargs):  # no weight_offset: its kernel's
            continue
        x, norm_weight, eps = norm.args
        chain = _silu_chain(act, source)
        if norm_weight is None or not isinstance(eps, float) or \
                any(u is not normed for u in live_users(norm)) or \
                live_users(normed) != [x2d if x2d is not normed else mm] or \
                (x2d is not normed and live_users(x2d) != [mm]) or \
                (source is not mm and live_users(mm) != [source]) or \
                any(u not in chain for n in [source, *chain - {act}] for u in live_users(n)):
            continue
        values = [n.meta["val"] for n in (x, norm_weight, weight) + ((bias,) if bias else ())]
        if len({v.dtype for v in values}) != 1 or not (
                _takes_graph_site(x2d.meta["val"], values[2])):
            continue
        with graph.inserting_before(act):
            fused = call_node(graph, torch.ops.gemslib.rms_norm_linear_silu.default, x,
                              norm_weight, weight, bias, eps)
        if replace_if(graph, act, fused, fused.meta["val"].shape == act.meta["val"].shape):
            sites.append(f"{act.name} over {mm.name} of {norm.name}")
    return sites



# merged_linear first: linear_swiglu and linear_geglu read the merged projection (the rounds
# of rewrites give them the silu_and_mul or gelu_and_mul over it); rms_norm_linear_silu reads
# the patterns' rms_norm
GRAPH_REWRITES = (
    GraphRewrite("merged_linear", _merge_projections),
    GraphRewrite("linear_swiglu", _fuse_linear_swiglu),
    GraphRewrite("linear_geglu", _fuse_linear_geglu),
    GraphRewrite("rms_norm_linear_silu", _fuse_rms_norm_linear_silu, after_patterns=True),
)
