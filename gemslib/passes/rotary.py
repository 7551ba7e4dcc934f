"""Rotary the way models write it -> gemslib's rotary (patterns), and a decode step's rotary
with its static cache's update -> rotary_into_cache (a rewrite).

The patterns match transformers' ``apply_rotary_pos_emb`` with ``rotate_half`` or its
interleaved form. The rewrite runs after the patterns: it reads their rotary nodes, finds the
rotated k written into a static cache (``index_put`` copied back into a graph input) beside
v's write at the same positions, and has the rotary's launch write both caches in place.
"""

from __future__ import annotations

import functools
import operator

import torch

from gemslib import runtime
from gemslib.ops import rotary as _rotary_ops  # noqa: F401  (defines torch.ops.gemslib.rotary*)
from gemslib.passes.base import GraphPattern, GraphRewrite
from gemslib.passes.forms import (call_node, live_users, only_live_user, replace_if,
                                  rotate_pairs, same_size, slice_bounds, transformers_rotary)


def _interleaved_rotary(q, k, cos, sin):
    """apply_rotary_pos_emb of the models with the interleaved rotate_half, after their
    ``cos.unsqueeze(1)`` (and the repeat_interleave of the table's first half, which is the
    table here: any table is rotated by)."""
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def _replacement(interleaved: bool):
    def replacement(q, k, cos, sin):
        # the op takes (B, S, H, D): the head-major tensors as transposed views (no copy),
        # the per-token tables without their head dim
        q_rot, k_rot = torch.ops.gemslib.rotary(q.transpose(1, 2), k.transpose(1, 2),
                                                cos.select(1, 0), sin.select(1, 0), None,
                                                interleaved, False)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    return replacement


def _is_rotate_half_of(cat, x_node, head_dim: int) -> bool:
    """``cat`` is ``cat((-x[..., D/2:], x[..., :D/2]), -1)`` of ``x_node`` (D = head_dim)."""
    aten = torch.ops.aten
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % 4 != 3 or len(parts) != 2:
        return False
    negated, first_half = parts
    if negated.target is not aten.neg.default or first_half.target is not aten.slice.Tensor:
        return False
    second_half = negated.args[0]
    if second_half.target is not aten.slice.Tensor:
        return False
    if second_half.args[0] is not x_node or first_half.args[0] is not x_node:
        return False
    half = head_dim // 2
    return (slice_bounds(second_half) == (3, half, head_dim, 1)
            and slice_bounds(first_half) == (3, 0, half, 1))


def _is_rotate_pairs_of(flat, x_node, head_dim: int) -> bool:
    """``flat`` is ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)`` of ``x_node`` as
    the post-grad graph holds it: the two slices unsqueezed at the end, a cat over that new
    dim, and a reshape back to x's shape (D = head_dim)."""
    aten = torch.ops.aten
    if flat.target not in (aten.reshape.default, aten.view.default):
        return False
    cat = flat.args[0]
    if cat.target is not aten.cat.default or len(cat.args[0]) != 2:
        return False
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % 5 != 4:
        return False
    odd, even = cat.args[0]
    for part in (odd, even):
        if part.target is not aten.unsqueeze.default or not isinstance(part.args[1], int) or \
                part.args[1] % 5 != 4:
            return False
    negated, even = odd.args[0], even.args[0]
    if negated.target is not aten.neg.default:
        return False
    odd = negated.args[0]
    if odd.target is not aten.slice.Tensor or even.target is not aten.slice.Tensor or \
            odd.args[0] is not x_node or even.args[0] is not x_node:
        return False
    flat_shape, x_shape = flat.meta["val"].shape, x_node.meta["val"].shape
    return (len(flat_shape) == 4
            and all(same_size(a, b) for a, b in zip(flat_shape, x_shape))
            and slice_bounds(odd) == (3, 1, head_dim, 2)
            and slice_bounds(even) == (3, 0, head_dim, 2))


def _half_rotations(match, head_dim: int):
    """The tensors rotate_half is applied to in the match (each cat proven to be it), or None."""
    cats = [node for node in match.nodes if node.target is torch.ops.aten.cat.default]
    sources = []
    for cat in cats:
        source = cat.args[0][1].args[0] if len(cat.args[0]) == 2 else None
        if source is None or not _is_rotate_half_of(cat, source, head_dim):
            return None
        sources.append(source)
    return sources


def _pair_rotations(match, head_dim: int):
    """The tensors the interleaved rotate_half is applied to (each proven), or None."""
    aten = torch.ops.aten
    flats = [node for node in match.nodes
             if node.target in (aten.reshape.default, aten.view.default)
             and getattr(node.args[0], "target", None) is aten.cat.default]
    sources = []
    for flat in flats:
        try:
            source = flat.args[0].args[0][1].args[0].args[0]  # cat -> unsqueeze -> slice -> x
        except (AttributeError, IndexError):
            return None
        if not _is_rotate_pairs_of(flat, source, head_dim):
            return None
        sources.append(source)
    return sources


def _is_rotary(match, rotations) -> bool:
    """The matched site is the rotary of q and k by one full table, as the op computes it:
    q (B, Hq, S, D) and k (B, Hk, S, D) of one kernel dtype, D even; cos and sin of that dtype
    and shape (B or 1, 1, S, D) (broadcasting over heads only: the results have q's and k's
    shapes and dtype); ``rotations(match, D)`` proves each branch's rotation (rotate_half, or
    its interleaved form) and names the tensor it rotates, which must be q in one branch and
    k in the other (the matcher can map both outputs onto one branch). The matcher compares
    node targets and structure, not the dims and bounds (its re-trace compares them, but this
    check does not rely on it): they are read from the graph here (torch 2.11 hands the check
    the re-traced match, whose kwargs are the tensor inputs only)."""
    nodes = {name: match.kwargs[name] for name in ("q", "k", "cos", "sin")}
    q, k, cos, sin = (nodes[name].meta["val"] for name in ("q", "k", "cos", "sin"))
    if q.dtype not in runtime.KERNEL_DTYPES or any(t.dtype != q.dtype for t in (k, cos, sin)):
        return False
    if any(t.dim() != 4 for t in (q, k, cos, sin)) or not runtime.on_kernel_device(q):
        return False
    batch, _, seq_len, head_dim = q.shape
    if not isinstance(head_dim, int) or head_dim % 2 or head_dim == 0:
        return False
    if not (same_size(k.shape[0], batch) and same_size(k.shape[2], seq_len)
            and same_size(k.shape[3], head_dim)):
        return False
    for table in (cos, sin):
        if not ((same_size(table.shape[0], 1) or same_size(table.shape[0], batch))
                and same_size(table.shape[1], 1) and same_size(table.shape[2], seq_len)
                and same_size(table.shape[3], head_dim)):
            return False
    sources = rotations(match, head_dim)
    # q and k two tensors: the matcher can also map both branches onto one rotary (q's)
    if nodes["q"] is nodes["k"] or sources is None or len(sources) != 2 or \
            set(sources) != {nodes["q"], nodes["k"]}:
        return False
    return not _reads_the_match(match, (nodes["q"], nodes["k"]))


def _reads_the_match(match, inputs) -> bool:
    """Whether one of ``inputs`` is computed from a node of the match: the q of one layer and
    the k of an earlier one (one cos/sin table serves every layer) look like one site, and
    one launch for both would need its own output first."""
    matched = set(match.nodes)
    seen, stack = set(), list(inputs)
    while stack:
        node = stack.pop()
        if node in matched:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


def _pattern_inputs():
    """q (2, 4, 3, 8), k (2, 2, 3, 8), cos and sin (2, 1, 3, 8) for tracing the pattern."""
    return (torch.empty(2, 4, 3, 8), torch.empty(2, 2, 3, 8), torch.empty(2, 1, 3, 8),
            torch.empty(2, 1, 3, 8))


# one pattern per form for every dtype (the casts of cos and sin to q's dtype come before
# it), matched before the norms: a model that normalises q and k after the rotary (Hunyuan)
# would have its final add read as a residual add + RMSNorm
GRAPH_PATTERNS = (
    GraphPattern("rotary", transformers_rotary, _replacement(False), _pattern_inputs,
                 check=functools.partial(_is_rotary, rotations=_half_rotations), stage=-1),
    GraphPattern("rotary", _interleaved_rotary, _replacement(True), _pattern_inputs,
                 check=functools.partial(_is_rotary, rotations=_pair_rotations), stage=-1),
)


def _cache_write(node):
    """(cache, positions, values) when ``node`` is ``index_put(cache, [None, None, positions],
    values)`` into a graph input that the graph copies the result back into (a static cache's
    update: it then happens in place), ``values`` (B, H, S, D) of the cache's (B, H, L, D)
    shape but S = len(positions) rows and of its dtype, positions (S,) integers; else None."""
    aten = torch.ops.aten
    if node.target is not aten.index_put.default or len(node.args) < 3:
        return None
    cache, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate is not False or not isinstance(cache, torch.fx.Node) or \
            cache.op != "placeholder" or len(indices) != 3 or indices[0] is not None or \
            indices[1] is not None or not isinstance(indices[2], torch.fx.Node):
        return None
    if not any(user.target is aten.copy_.default and user.args[0] is cache
               and user.args[1] is node for user in node.users):
        return None
    positions = indices[2]
    cache_val, values_val, positions_val = (n.meta["val"] for n in (cache, values, positions))
    if positions_val.dim() != 1 or positions_val.is_floating_point() or \
            positions_val.dtype == torch.bool or cache_val.dim() != 4 or \
            values_val.dtype != cache_val.dtype:
        return None
    expected = (*cache_val.shape[:2], positions_val.shape[0], cache_val.shape[3])
    if values_val.dim() != 4 or any(not same_size(a, b)
                                    for a, b in zip(values_val.shape, expected)):
        return None
    return cache, positions, values


def _fuse_cache_writes(graph: torch.fx.Graph, real_value) -> list[str]:
    """A rotary (gemslib's, by a per-token table) one of whose outputs goes, transposed back to
    (B, Hk, S, D), only into a static cache's k update, paired with the v update of the same
    positions that the same attention reads -> ``rotary_into_cache``: the rotated k and v are
    written into the caches by the rotary's launch, in place (``auto_functionalized``, which
    inductor reinplaces since the graph copies the update back into the cache), and the two
    index_put kernels and the rotated k's own tensor are gone."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    aten, sites = torch.ops.aten, []
    for rotary in graph.find_nodes(op="call_function", target=torch.ops.gemslib.rotary.default):
        first, second, cos, sin, positions, interleaved, inverse = rotary.args
        if positions is not None or inverse or cos.meta["val"].dim() != 3:
            continue
        outputs = {user.args[1]: user for user in rotary.users
                   if user.target is operator.getitem and live_users(user)}
        for which in (0, 1):
            site = _cache_write_site(outputs.get(which))
            if site is None or outputs.get(1 - which) is None:
                continue
            (k_write, (k_cache, cache_position, _)), (v_write, (v_cache, _, v_values)) = site
            inputs = (first, second)
            dtype = inputs[which].meta["val"].dtype
            if any(node.meta["val"].dtype != dtype
                   for node in (inputs[1 - which], cos, sin, k_cache, v_cache)):
                continue
            with graph.inserting_before(k_write):
                v_tokens = call_node(graph, aten.permute.default, v_values, [0, 2, 1, 3])
                fused = call_node(graph, torch.ops.higher_order.auto_functionalized,
                                  torch.ops.gemslib.rotary_into_cache.default,
                                  q=inputs[1 - which], k=inputs[which], v=v_tokens, cos=cos,
                                  sin=sin, interleaved=interleaved,
                                  cache_position=cache_position, k_cache=k_cache,
                                  v_cache=v_cache)
                rotated = call_node(graph, operator.getitem, fused, 0)
                new_k_cache = call_node(graph, operator.getitem, fused, 1)
                new_v_cache = call_node(graph, operator.getitem, fused, 2)
            outputs[1 - which].replace_all_uses_with(rotated)
            k_write.replace_all_uses_with(new_k_cache)
            v_write.replace_all_uses_with(new_v_cache)
            sites.append(f"{rotary.name} -> {k_cache.name}, {v_cache.name}")
            break
    if sites:
        stable_topological_sort(graph)  # the rotated q's users may come before the writes
    return sites


def _cache_write_site(rotated):
    """((k's cache write, its :func:`_cache_write`), (v's, its)) when ``rotated`` (one output
    of a rotary, (B, S, Hk, D)) is read only by its transpose back to (B, Hk, S, D), read only
    by a static cache's update, whose reader (the attention) also reads the update of another
    cache at the same positions."""
    aten = torch.ops.aten
    if rotated is None:
        return None
    transposed = only_live_user(rotated)
    if transposed is None or transposed.target is not aten.permute.default or \
            list(transposed.args[1]) != [0, 2, 1, 3]:
        return None
    k_write = only_live_user(transposed)
    written = _cache_write(k_write) if k_write is not None else None
    if written is None or written[2] is not transposed:
        return None
    k_cache, cache_position, _ = written
    partners = {}
    for reader in live_users(k_write):
        if reader.target is aten.copy_.default:
            continue
        for node in reader.all_input_nodes:
            other = _cache_write(node) if node is not k_write else None
            if other is not None and other[1] is cache_position and other[0] is not k_cache \
                    and other[0].meta["val"].shape == k_cache.meta["val"].shape:
                partners[node] = other
    return ((k_write, written), *partners.items()) if len(partners) == 1 else None


def _fuse_qk_norms(graph: torch.fx.Graph, real_value) -> list[str]:
    """``rotary(rms_norm(q_heads), rms_norm(k_heads))`` (after the patterns: gemslib's rotary
    node over its two norms' outputs, each through the transposes that cancel, each norm over
    head_dim with a (D,) weight and the same eps, read by nothing else; a full rotary) ->
    ``rotary_qk_norm``: the per-head q/k RMSNorm of Qwen3 and OLMo-2 in the rotary's launch.
    A rotary whose k goes into a cache has become ``rotary_into_cache`` before: its norms go
    into that launch, as its q_weight and k_weight."""
    sites = []
    for rotary in graph.find_nodes(op="call_function", target=torch.ops.gemslib.rotary.default):
        first, second, cos, sin, positions, interleaved, inverse = rotary.args
        if inverse or not live_users(rotary):  # dead: a cache write took its place
            continue
        norms = _fusible_norms(first, second, cos, rotary)
        if norms is None:
            continue
        q, k, q_weight, k_weight, eps, offset = norms
        with graph.inserting_before(rotary):
            fused = call_node(graph, torch.ops.gemslib.rotary_qk_norm.default, q, k, cos, sin,
                              positions, interleaved, q_weight, k_weight, eps,
                              *((offset,) if offset else ()))
        if replace_if(graph, rotary, fused, [t.stride() for t in fused.meta["val"]]
                      == [t.stride() for t in rotary.meta["val"]]):
            sites.append(f"{rotary.name} over {first.name}, {second.name}")
    into_cache = torch.ops.gemslib.rotary_into_cache.default
    for write in graph.find_nodes(op="call_function",
                                  target=torch.ops.higher_order.auto_functionalized):
        if write.args[0] is not into_cache or write.kwargs.get("q_weight") is not None:
            continue
        first, second = write.kwargs["q"], write.kwargs["k"]
        norms = _fusible_norms(first, second, write.kwargs["cos"], write)
        if norms is None:
            continue
        q, k, q_weight, k_weight, eps, offset = norms
        for name, value in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight),
                            ("eps", eps), ("weight_offset", offset)):
            write.update_kwarg(name, value)
        sites.append(f"{write.name} over {first.name}, {second.name}")
    return sites


def _fusible_norms(first, second, cos, reader):
    """(q, k, q_weight, k_weight, eps, weight_offset) when ``first`` and ``second`` (a rotary's
    inputs, read by ``reader``) are per-head RMSNorms of q and k with one eps and one weight
    offset (Gemma-3's 1), weights of q's dtype, read by nothing else, and the table ``cos``
    rotates whole heads; else None."""
    normed = [_normed_heads(node) for node in (first, second)]
    if None in normed or normed[0][2:4] != normed[1][2:4]:
        return None
    (q, q_weight, eps, offset, q_chain), (k, k_weight, _, _, k_chain) = normed
    head_dim = first.meta["val"].shape[-1]
    table = cos.meta["val"]
    rot_dim = table.shape[-1] if table.dim() == 3 else 2 * table.shape[-1]
    if rot_dim != head_dim or any(
            w.meta["val"].dtype != q.meta["val"].dtype for w in (q_weight, k_weight)) or \
            any(set(live_users(node)) - set(chain) - {reader}
                for chain in (q_chain, k_chain) for node in chain):
        return None
    return q, k, q_weight, k_weight, eps, offset


def _normed_heads(node):
    """(x, weight, eps, weight offset, the nodes from ``node`` down to the norm) when ``node``
    is gemslib's rms_norm of x with a weight (and a float offset, or none) read through
    permutes that compose to none, or that undo a permute of the norm's input that keeps the
    last dim (Gemma-3 norms the heads after their transpose: the norm, over the last dim,
    commutes with it; x is then that permute's input); else None."""
    chain, order = [], None
    while isinstance(node, torch.fx.Node) and node.target is torch.ops.aten.permute.default:
        dims = list(node.args[1])
        order = dims if order is None else [dims[i] for i in order]
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is operator.getitem
            and node.args[1] == 0):
        return None
    norm = node.args[0]
    if not (isinstance(norm, torch.fx.Node)
            and norm.target is torch.ops.gemslib.rms_norm_forward.default
            and len(norm.args) in (3, 4) and not norm.kwargs):
        return None
    x, weight, eps, offset = (*norm.args, 0.0)[:4]
    if weight is None or not isinstance(eps, float) or not isinstance(offset, float):
        return None
    if order is not None and order != sorted(order):
        inner = list(x.args[1]) if x.target is torch.ops.aten.permute.default else None
        if inner is None or inner[-1] != len(inner) - 1 or \
                [inner[i] for i in order] != sorted(order):
            return None
        x = x.args[0]
    return x, weight, eps, offset, [*chain, node, norm]


def _partial_heads(node, rot_dim: int):
    """X when ``node`` is ``permute(X[..., :rot_dim], [0, 2, 1, 3])`` of a 4-d X (B, H, S, D)
    with D > rot_dim, that permute read by nothing else; else None."""
    aten = torch.ops.aten
    if node is None or node.target is not aten.permute.default or \
            list(node.args[1]) != [0, 2, 1, 3] or len(live_users(node)) != 1:
        return None
    rotated = node.args[0]
    if not isinstance(rotated, torch.fx.Node) or rotated.target is not aten.slice.Tensor:
        return None
    heads = rotated.args[0]
    value = heads.meta.get("val") if isinstance(heads, torch.fx.Node) else None
    if value is None or value.dim() != 4 or not isinstance(value.shape[3], int) or \
            value.shape[3] <= rot_dim or slice_bounds(rotated) != (3, 0, rot_dim, 1):
        return None
    return heads


def _rejoined(rotated, heads, rot_dim: int):
    """The ``cat`` when ``rotated`` (one output of a rotary, (B, S, H, rot_dim)) is read only
    by its transpose back, read only by ``cat([that, heads[..., rot_dim:]], -1)``; else None."""
    aten = torch.ops.aten
    back = only_live_user(rotated) if rotated is not None else None
    if back is None or back.target is not aten.permute.default or \
            list(back.args[1]) != [0, 2, 1, 3]:
        return None
    cat = only_live_user(back)
    if cat is None or cat.target is not aten.cat.default or len(cat.args[0]) != 2 or \
            cat.args[0][0] is not back:
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    rest = cat.args[0][1]
    if dim not in (-1, 3) or not isinstance(rest, torch.fx.Node) or \
            rest.target is not aten.slice.Tensor or rest.args[0] is not heads:
        return None
    size = heads.meta["val"].shape[3]
    return cat if slice_bounds(rest) == (3, rot_dim, size, 1) else None


def _fuse_partial_rotary(graph: torch.fx.Graph, real_value) -> list[str]:
    """A partial rotary as transformers writes it (StableLM, GPT-NeoX, Phi, Persimmon,
    Nemotron): ``q_rot, k_rot = rotary(q[..., :R], k[..., :R])`` then
    ``cat((q_rot, q[..., R:]), -1)`` and k's alike, R the table's rot_dim < D -> gemslib's
    rotary over the whole heads, which rotates the first R features and passes the rest
    through: the two concatenations (a copy of q and of k) are gone, and a decode step's
    rotated k is then the cache's update as it is for a full rotary (``rotary_into_cache``)."""
    aten, sites = torch.ops.aten, []
    for rotary in graph.find_nodes(op="call_function", target=torch.ops.gemslib.rotary.default):
        first, second, cos, sin, positions, interleaved, inverse = rotary.args
        table = cos.meta["val"]
        rot_dim = table.shape[-1] if table.dim() == 3 else 2 * table.shape[-1]
        if not isinstance(rot_dim, int):
            continue
        heads = [_partial_heads(node, rot_dim) for node in (first, second)]
        if None in heads:
            continue
        outputs = {user.args[1]: user for user in rotary.users
                   if user.target is operator.getitem and live_users(user)}
        cats = [_rejoined(outputs.get(which), heads[which], rot_dim) for which in (0, 1)]
        if None in cats:
            continue
        with graph.inserting_before(rotary):
            whole = [call_node(graph, aten.permute.default, x, [0, 2, 1, 3]) for x in heads]
            fused = call_node(graph, torch.ops.gemslib.rotary.default, *whole, cos, sin,
                              positions, interleaved, inverse)
            for which, cat in enumerate(cats):
                rotated = call_node(graph, operator.getitem, fused, which)
                cat.replace_all_uses_with(
                    call_node(graph, aten.permute.default, rotated, [0, 2, 1, 3]))
        sites.append(f"{rotary.name}: rot_dim {rot_dim} of {heads[0].meta['val'].shape[3]}")
    return sites


# a partial rotary over whole heads first (its rotated k then goes into the cache like a full
# one's); the cache write next: a decode step's rotary keeps its write, its norms then join it
GRAPH_REWRITES = (GraphRewrite("rotary_partial", _fuse_partial_rotary, after_patterns=True,
                               stage=-1),
                  GraphRewrite("rotary_into_cache", _fuse_cache_writes, after_patterns=True),
                  GraphRewrite("rotary_qk_norm", _fuse_qk_norms, after_patterns=True))
