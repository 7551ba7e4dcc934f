"""The forms several fusions match, and the graph helpers every family uses.

The forms are written the way models write them (transformers' RMSNorm and ``rotate_half``)
or read the way inductor's post-grad graph holds them (silu's decomposition); the helpers
make nodes and read sizes and slices of a post-grad ``torch.fx.Graph``.
"""

from __future__ import annotations

import math

import torch

_aten, _prims = torch.ops.aten, torch.ops.prims


# --------------------------------------------------------------------------------------------
# Forms models write
# --------------------------------------------------------------------------------------------


def transformers_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm (Qwen2, Mistral and most others copy it): statistics in fp32,
    the normalised rows rounded back to x's dtype, then scaled by the weight."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def gemma_rms_norm(x, weight, eps):
    """transformers' GemmaRMSNorm (Gemma 1-3, Qwen3-Next and others copy it): statistics and
    the ``(1 + weight)`` scale in fp32, one rounding to x's dtype at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def rotate_half(x):
    """transformers' rotate_half: (-x2, x1) for the halves (x1, x2) of the last dim."""
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def transformers_rotary(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (Llama, Qwen2, Mistral and most others copy it) after
    its ``cos.unsqueeze(1)``: q (B, Hq, S, D), k (B, Hk, S, D), cos and sin (B or 1, 1, S, D)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_pairs(x):
    """The interleaved rotate_half (GLM, Helium, Ernie, Cohere): (-x[2i+1], x[2i]) per pair."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------
# Forms the post-grad graph holds
# --------------------------------------------------------------------------------------------


def cast_source(node, dtype):
    """The node that ``node`` converts to ``dtype``, or None."""
    if isinstance(node, torch.fx.Node) and node.target is _prims.convert_element_type.default \
            and node.args[1] == dtype:
        return node.args[0]
    return None


def silu_source(node):
    """s when ``node`` computes silu(s) rounded once to s's dtype, as inductor decomposes
    F.silu: ``s / (1 + exp(-s))``, for 16-bit s upcast to fp32 and the result cast back."""
    dtype, inner = _fp32_body(node)
    if not (isinstance(inner, torch.fx.Node) and inner.target is _aten.div.Tensor):
        return None
    numerator, denominator = inner.args
    if not (isinstance(denominator, torch.fx.Node) and denominator.target is _aten.add.Tensor
            and denominator.args[1] == 1 and isinstance(denominator.args[0], torch.fx.Node)
            and denominator.args[0].target is _aten.exp.default):
        return None
    negated = denominator.args[0].args[0]
    if not (isinstance(negated, torch.fx.Node) and negated.target is _aten.neg.default
            and negated.args[0] is numerator):
        return None
    return _upcast_of(numerator, dtype)


def gelu_source(node):
    """(s, tanh) when ``node`` computes F.gelu(s) rounded once to s's dtype, as inductor
    decomposes it: ``s/2 * (1 + erf(s / sqrt(2)))`` (tanh False) or ``s/2 * (1 + tanh(
    sqrt(2/pi) * (s + 0.044715 s^3)))`` (tanh True), for 16-bit s upcast to fp32 and the result
    cast back; else None. Any other constant (another GELU) is no match."""
    dtype, inner = _fp32_body(node)
    if not (isinstance(inner, torch.fx.Node) and inner.target is _aten.mul.Tensor):
        return None
    for half, bracket in (inner.args, inner.args[::-1]):
        upcast = _times(half, 0.5)
        curve = _plus_one(bracket)
        if upcast is None or curve is None or curve.target not in (_aten.tanh.default,
                                                                   _aten.erf.default):
            continue
        tanh = curve.target is _aten.tanh.default
        argument = curve.args[0]
        if tanh:
            cubic_sum = _times(argument, 0.7978845608028654)
            if not (isinstance(cubic_sum, torch.fx.Node) and cubic_sum.target is _aten.add.Tensor
                    and cubic_sum.args[0] is upcast
                    and _is_cube_of(_times(cubic_sum.args[1], 0.044715), upcast)):
                continue
        elif _times(argument, 0.7071067811865476) is not upcast:
            continue
        source = _upcast_of(upcast, dtype)
        if source is not None:
            return source, tanh
    return None


def _fp32_body(node):
    """(the dtype of ``node``'s value, the fp32 node it rounds: itself for fp32, the source of
    its cast for 16 bits); (None, None) for a node without a value."""
    if not isinstance(node, torch.fx.Node) or "val" not in node.meta:
        return None, None
    dtype = node.meta["val"].dtype
    return dtype, node if dtype == torch.float32 else cast_source(node, dtype)


def _upcast_of(node, dtype):
    """The ``dtype`` value that ``node`` is in fp32 (itself for fp32, its cast's source for 16
    bits), or None."""
    source = node if dtype == torch.float32 else cast_source(node, torch.float32)
    if isinstance(source, torch.fx.Node) and source.meta["val"].dtype == dtype:
        return source
    return None


def _times(node, constant):
    """x when ``node`` is ``x * constant`` (either order), else None."""
    if not (isinstance(node, torch.fx.Node) and node.target is _aten.mul.Tensor):
        return None
    for x, c in (node.args, node.args[::-1]):
        if isinstance(c, float) and math.isclose(c, constant, rel_tol=1e-12) and \
                isinstance(x, torch.fx.Node):
            return x
    return None


def _plus_one(node):
    """x when ``node`` is ``x + 1``, else None."""
    if isinstance(node, torch.fx.Node) and node.target is _aten.add.Tensor and \
            node.args[1] == 1 and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return None


def _is_cube_of(node, x) -> bool:
    """``node`` is ``x * x * x`` as the decomposition writes it."""
    return isinstance(node, torch.fx.Node) and node.target is _aten.mul.Tensor and \
        node.args[1] is x and isinstance(node.args[0], torch.fx.Node) and \
        node.args[0].target is _aten.mul.Tensor and node.args[0].args == (x, x)


# --------------------------------------------------------------------------------------------
# Graph helpers
# --------------------------------------------------------------------------------------------
def arguments(node: torch.fx.Node) -> dict:
    """``node``'s arguments by schema name, defaults included."""
    schema = node.target._schema
    bound = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    bound.update(zip((arg.name for arg in schema.arguments), node.args))
    bound.update(node.kwargs)
    return bound


def call_node(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new ``target(*args, **kwargs)`` node at the graph's insertion point, with the
    ``meta["val"]`` (a fake tensor) that later passes and inductor read, computed from its
    inputs' values (with none, as the compilation's fake mode makes it)."""
    node = graph.call_function(target, args, kwargs)
    values, kwarg_values = torch.fx.map_arg((args, kwargs), lambda a: a.meta["val"])
    fake_mode = next((v.fake_mode for v in torch.utils._pytree.tree_leaves(values)
                      if hasattr(v, "fake_mode")), None) or torch._guards.detect_fake_mode()
    with fake_mode:
        node.meta["val"] = target(*values, **kwarg_values)
    return node


def live_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of ``node`` that the graph's result depends on (a rewrite leaves the nodes it
    replaced for one dead-code pass at the end, so ``node.users`` still lists them)."""
    def live(user):
        return user.op == "output" or any(live(u) for u in user.users)
    return [user for user in node.users if live(user)]


def replace_if(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node, fits: bool,
               made: tuple = ()) -> bool:
    """A rewrite's last step: ``old``'s uses handed to ``new`` and ``old`` erased when
    ``fits``, else ``new`` and the nodes ``made`` for it erased. Whether it replaced."""
    if not fits:
        for node in (new, *made):
            graph.erase_node(node)
        return False
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return True


def same_size(a, b) -> bool:
    """Whether sizes ``a`` and ``b`` (ints or symbolic) are equal for every value the graph can
    take (a symbolic pair that may differ is not)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return statically_known_true(a == b)


def slice_bounds(node: torch.fx.Node) -> tuple[int, int, int, int] | None:
    """(dim, start, end, step) of an ``aten.slice.Tensor`` node, normalised as torch does
    (dim non-negative, None and negative bounds resolved, bounds clamped to the sliced dim's
    size), or None where the sliced dim's size or a bound is not a plain int."""
    value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if value is None or value.dim() == 0:
        return None
    args = list(node.args[1:]) + [None] * (4 - len(node.args[1:]))
    dim, start, end, step = (node.kwargs.get(name, default) for name, default in
                             zip(("dim", "start", "end", "step"), args))
    dim, step = (0 if dim is None else dim), (1 if step is None else step)
    if not isinstance(dim, int):
        return None
    dim %= value.dim()
    size = value.shape[dim]
    start, end = (0 if start is None else start), (size if end is None else end)
    if not all(isinstance(v, int) for v in (size, start, end, step)):
        return None
    start, end = (v + size if v < 0 else v for v in (start, end))
    return dim, min(max(start, 0), size), min(max(end, 0), size), step


def only_live_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The one live user of ``node`` (see :func:`live_users`), or None."""
    users = live_users(node)
    return users[0] if len(users) == 1 else None


def projection(mm: torch.fx.Node):
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
