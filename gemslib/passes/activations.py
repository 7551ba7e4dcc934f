"""silu(gate) * up and gelu(gate) * up over two column blocks of one tensor (the merged gate |
up projection's output, as ``chunk(2, -1)`` or slices read it) -> gemslib's silu_and_mul and
gelu_and_mul (rewrites)."""

from __future__ import annotations

import operator

import torch

from gemslib import runtime
from gemslib.ops import silu as _silu_ops  # noqa: F401  (defines torch.ops.gemslib.silu_and_mul)
from gemslib.passes.base import GraphRewrite, verdict_allows
from gemslib.passes.forms import call_node, gelu_source, silu_source, slice_bounds

_aten = torch.ops.aten


def _columns_of(node):
    """(whole, start, end, shape) when ``node`` is the columns [start, end) of ``whole``'s
    last dim (static sizes), possibly reshaped (to ``shape``, else None): a slice with step 1,
    or a piece of ``split`` / ``split_with_sizes`` over the last dim (``chunk(2, -1)`` in a
    model's code); else None."""
    shape = None
    if node.target in (_aten.reshape.default, _aten.view.default):
        node, shape = node.args[0], node.args[1]
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is operator.getitem:
        return _piece_of_split(node, shape)
    if node.target is not _aten.slice.Tensor:
        return None
    bounds = slice_bounds(node)
    if bounds is None or bounds[0] != node.args[0].meta["val"].dim() - 1 or bounds[3] != 1:
        return None
    return node.args[0], bounds[1], bounds[2], shape


def _last_width(whole, dim):
    """The static size of ``whole``'s last dim when ``dim`` is that dim, else None."""
    value = whole.meta.get("val") if isinstance(whole, torch.fx.Node) else None
    if value is None or not isinstance(dim, int) or value.dim() == 0 or \
            dim % value.dim() != value.dim() - 1:
        return None
    width = value.shape[-1]
    return width if isinstance(width, int) else None


def _piece_of_split(getitem, shape):
    split, index = getitem.args
    if not isinstance(split, torch.fx.Node) or not isinstance(index, int) or \
            split.target not in (_aten.split.Tensor, _aten.split_with_sizes.default):
        return None
    whole, size, dim = (*split.args, split.kwargs.get("dim", 0))[:3]
    width = _last_width(whole, dim)
    if width is None:
        return None
    if split.target is _aten.split.Tensor:
        if not isinstance(size, int) or size <= 0:
            return None
        sizes = [size] * (width // size) + ([width % size] if width % size else [])
    else:
        sizes = list(size)
    if not all(isinstance(n, int) for n in sizes) or sum(sizes) != width or \
            not 0 <= index < len(sizes):
        return None
    start = sum(sizes[:index])
    return whole, start, start + sizes[index], shape


def _fuse_silu_and_mul(graph: torch.fx.Graph, real_value) -> list[str]:
    """``silu(x[..., a:a+n]) * x[..., a+n:a+2n]`` (each part possibly reshaped alike; the
    parts slices or split pieces of x's last dim) -> silu_and_mul of x[..., a:a+2n]: the
    merged gate/up output, or the gate/up columns of a wider merged projection."""
    return _fuse_gated(graph, "silu_and_mul",
                       lambda node: (lambda s: s and (s, ()))(silu_source(node)),
                       torch.ops.gemslib.silu_and_mul.default)


def _fuse_gelu_and_mul(graph: torch.fx.Graph, real_value) -> list[str]:
    """``gelu(x[..., a:a+n]) * x[..., a+n:a+2n]``, either of F.gelu's forms, as
    :func:`_fuse_silu_and_mul` -> gelu_and_mul of x[..., a:a+2n] with that form."""
    return _fuse_gated(graph, "gelu_and_mul",
                       lambda node: (lambda s: s and (s[0], (s[1],)))(gelu_source(node)),
                       torch.ops.gemslib.gelu_and_mul.default)


def _fuse_gated(graph: torch.fx.Graph, fusion: str, activation_of, op) -> list[str]:
    """The gated activations' rewrite: ``activation_of(node)`` is (the gate it activates, the
    op's arguments after x) or None."""
    sites = []
    for mul in graph.find_nodes(op="call_function", target=_aten.mul.Tensor):
        for gated, other in (mul.args, mul.args[::-1]):
            if not all(isinstance(a, torch.fx.Node) for a in (gated, other)):
                continue
            found = activation_of(gated)
            source, op_args = found if found else (None, ())
            gate, up = source and _columns_of(source), _columns_of(other)
            if not (gate and up and gate[0] is up[0] and gate[2] == up[1]
                    and gate[2] - gate[1] == up[2] - up[1] > 0 and gate[3] == up[3]):
                continue
            whole, start, end = gate[0], gate[1], up[2]
            if whole.meta["val"].dtype not in runtime.KERNEL_DTYPES or \
                    mul.meta["val"].dtype != whole.meta["val"].dtype or \
                    not verdict_allows(fusion, mul.meta["val"]):
                continue
            with graph.inserting_before(mul):
                if (start, end) != (0, whole.meta["val"].shape[-1]):
                    whole = call_node(graph, _aten.slice.Tensor, whole, -1, start, end)
                fused = call_node(graph, op, whole, *op_args)
                if gate[3] is not None:
                    fused = call_node(graph, _aten.reshape.default, fused, gate[3])
            mul.replace_all_uses_with(fused)
            graph.erase_node(mul)
            sites.append(f"{mul.name} over {whole.name}")
            break
    return sites


GRAPH_REWRITES = (GraphRewrite("silu_and_mul", _fuse_silu_and_mul),
                  GraphRewrite("gelu_and_mul", _fuse_gelu_and_mul))
