"""SDPA, and transformers' eager attention, -> gemslib's attention, or decode_attention for
one query row (a rewrite).

A site fuses where its mask is none, causal (``is_causal``, or transformers' causal mask
proven causal from its index arithmetic), a causal sliding window so proven (the kernel's
``window``), or lets every query see every key; one query row under a mask of visible cache
positions (a static cache's decode step) runs decode_attention over the keys the mask keeps.
The eager form (``attn_implementation="eager"``: matmul, scale, Gemma-2's ``tanh`` logit cap,
the additive mask, an fp32 softmax, matmul) fuses under the same masks, its cap as the
kernel's ``softcap``. K and V are read before transformers' ``repeat_kv``: gemslib's kernels
take grouped heads.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gemslib import runtime
from gemslib.fused import attention as _attention_ops  # noqa: F401  (torch.ops.gemslib.attention)
from gemslib.fused import decode_attention as _decode_ops  # noqa: F401  (... .decode_attention)
from gemslib.fused._attention_common import MAX_HEAD_DIM, default_scale
from gemslib.passes.base import GraphRewrite, verdict_allows_at
from gemslib.passes.forms import arguments, call_node, live_users, same_size

_aten, _prims = torch.ops.aten, torch.ops.prims
# the SDPA backend operators a post-grad graph holds, and where their mask argument is
_SDPA_MASK_ARG = {
    _aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    _aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    _aten._scaled_dot_product_flash_attention.default: None,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}
_VIEWS = (_aten.unsqueeze.default, _aten.expand.default)


def _index(node):
    """(axis, offset) when ``node`` is ``iota(n)`` plus or minus integers, only unsqueezed and
    expanded, so that its value at position p of ``axis`` (counted from the end) is
    ``p + offset`` and it has size 1 on every other axis (axis None: n is 1); else None."""
    shape, offset = node.meta["val"].shape, 0
    while True:
        if node.target in _VIEWS:
            node = node.args[0]
        elif node.target in _SHIFTS and isinstance(node.args[1], int):
            offset += node.args[1] * _SHIFTS[node.target]
            node = node.args[0]
        else:
            break
    if node.target is not _prims.iota.default or node.kwargs.get("step") != 1 or \
            not isinstance(node.kwargs.get("start"), int):
        return None
    length = node.args[0]
    if isinstance(length, torch.fx.Node):  # a symbolic size, a graph input
        length = length.meta["val"]
    sized = [axis for axis in range(-len(shape), 0) if not same_size(shape[axis], 1)]
    if not sized and same_size(length, 1):  # one index (one query row): any axis
        return None, node.kwargs["start"] + offset
    if len(sized) != 1 or not same_size(shape[sized[0]], length):
        return None
    return sized[0], node.kwargs["start"] + offset


_SHIFTS = {_aten.add.Tensor: 1, _aten.add.Scalar: 1, _aten.sub.Tensor: -1, _aten.sub.Scalar: -1}
# a comparison of key index j + a against query index i + b bounds d = j - i by b - a plus
# these (lower, upper) shifts: j + a <= i + b  <=>  d <= b - a
_COMPARISONS = {_aten.le.Tensor: (None, 0), _aten.lt.Tensor: (None, -1),
                _aten.ge.Tensor: (0, None), _aten.gt.Tensor: (1, None)}
_FLIPPED = {_aten.le.Tensor: _aten.ge.Tensor, _aten.lt.Tensor: _aten.gt.Tensor,
            _aten.ge.Tensor: _aten.le.Tensor, _aten.gt.Tensor: _aten.lt.Tensor}


def _visible_band(mask):
    """(lo, hi) when ``mask`` lets query i see exactly the keys j with lo <= j - i <= hi (None:
    unbounded), as transformers' causal and sliding-window masks trace under torch.compile:
    ``where(condition, 0, -inf or the dtype's lowest)`` or the boolean condition itself, a conjunction of
    comparisons of key and query indices (``iota`` plus constants) broadcast over batch and
    heads. None for any other mask."""
    mask = _kept_keys(mask)
    if mask is None:
        return None
    if _is_full(mask, True):
        return None, None
    if mask.target is _aten.bitwise_and.Tensor:
        bands = [_visible_band(term) if isinstance(term, torch.fx.Node) else None
                 for term in mask.args]
        if None in bands:
            return None
        (lo_a, hi_a), (lo_b, hi_b) = bands
        return (max((b for b in (lo_a, lo_b) if b is not None), default=None),
                min((b for b in (hi_a, hi_b) if b is not None), default=None))
    comparison = mask.target
    if comparison not in _COMPARISONS:
        return None
    left, right = (_index(a) if isinstance(a, torch.fx.Node) else None for a in mask.args)
    if left is None or right is None:
        return None
    if left[0] is None and right[0] is not None:  # one index: the other operand's partner
        left = (-1 if right[0] == -2 else -2), left[1]
    if right[0] is None and left[0] is not None:
        right = (-1 if left[0] == -2 else -2), right[1]
    if (left[0], right[0]) == (-2, -1):  # query ? key: the flipped comparison of key ? query
        left, right, comparison = right, left, _FLIPPED[comparison]
    if (left[0], right[0]) != (-1, -2):
        return None
    shift = right[1] - left[1]
    lo, hi = _COMPARISONS[comparison]
    return (None if lo is None else shift + lo), (None if hi is None else shift + hi)


def _kept_keys(mask):
    """The boolean condition ``mask`` keeps keys by (True: visible), read through what SDPA
    wraps around it (:func:`_unwrapped`): the mask itself when it is boolean, or the condition
    of ``where(condition, 0, hidden)`` with a value that hides (:func:`_hides`); else None."""
    mask = _unwrapped(mask)
    if isinstance(mask, torch.fx.Node) and mask.target is _aten.where.self:
        condition, visible, hidden = mask.args
        if not (_is_full(visible, 0.0) and _hides(hidden)):
            return None
        mask = _unwrapped(condition)
    if not isinstance(mask, torch.fx.Node) or mask.meta["val"].dtype != torch.bool:
        return None
    return mask


def _unwrapped(mask):
    """``mask`` without what SDPA's efficient backend wraps around it, which changes no value
    at any (query, key): a broadcast, and the padding of the key axis to an aligned width
    sliced back off (``constant_pad_nd(m, [0, p])[..., 0:n]`` with n m's key length)."""
    while isinstance(mask, torch.fx.Node):
        if mask.target is _aten.expand.default:
            mask = mask.args[0]
        elif mask.target is _aten.slice.Tensor and _is_unpadding(mask):
            mask = mask.args[0].args[0]
        else:
            break
    return mask


def _is_unpadding(node) -> bool:
    """``node`` is ``slice(constant_pad_nd(m, [0, p], value), -1, 0, n)`` with n m's last size:
    m again, the padding cut off."""
    args = arguments(node)
    padded, dim, start, end, step = (args[name] for name in ("self", "dim", "start", "end",
                                                             "step"))
    if not (isinstance(padded, torch.fx.Node) and padded.target is _aten.constant_pad_nd.default):
        return False
    source, pad = padded.args[0], list(padded.args[1])
    rank = source.meta["val"].dim()
    if isinstance(end, torch.fx.Node):  # a symbolic length
        end = end.meta["val"]
    return len(pad) == 2 and same_size(pad[0], 0) and dim in (-1, rank - 1) and start == 0 \
        and step == 1 and end is not None and same_size(end, source.meta["val"].shape[-1])


class _NotConstant(Exception):
    pass


def _evaluated(node, values: dict):
    """The value of ``node`` when it depends on no graph input (the mask transformers builds
    from positions it computes itself, under static shapes), computed now; else raises."""
    if node in values:
        return values[node]
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded in node.target.tags:
        raise _NotConstant(node)
    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda a: _evaluated(a, values))
    if any(isinstance(a, torch.SymInt) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
        raise _NotConstant(node)
    values[node] = node.target(*args, **kwargs)
    return values[node]


def _evaluated_band(mask, seq_q, seq_kv):
    """(lo, hi) as :func:`_visible_band` gives them, for a mask computed from no graph input
    that is exactly causal (0, None) or full (None, None) for every batch and head; else
    None. Decides masks whose arithmetic the band does not read (transformers' packed-sequence
    test of a single sequence's positions)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if not (isinstance(seq_q, int) and isinstance(seq_kv, int)) or seq_q * seq_kv > 1 << 26:
        return None
    try:
        with unset_fake_temporarily(), torch.no_grad():
            value = _evaluated(mask, {})
            if value.dtype != torch.bool:
                hidden = value <= _HIDDEN
                if not bool(((value == 0) | hidden).all()):
                    return None
                value = value == 0
            value = value.expand(*value.shape[:-2], seq_q, seq_kv).reshape(-1, seq_q, seq_kv)
            causal = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=value.device).tril()
            if bool((value == causal).all()):
                return None, 0
            if bool(value.all()):
                return None, None
    except (_NotConstant, RuntimeError):
        return None
    return None


_HIDDEN = -65504.0  # torch's value for hidden keys in 16-bit cuDNN masks (bf16: -65536)


def _hides(node) -> bool:
    """``node`` is the value a mask adds to hidden scores: -inf, or a number at most -65504
    (torch turns boolean masks into -65504 for 16-bit cuDNN attention, -65536 in bf16).
    Causal and full masks leave every row a visible key, so such a number gives hidden keys
    zero weight too, unless a hidden score exceeds the row's visible maximum by about 65400
    (not a score a model reaches)."""
    if not (isinstance(node, torch.fx.Node) and node.target is _aten.full.default):
        return False
    dtype = node.kwargs.get("dtype") or torch.float32
    return list(node.args[0]) == [] and dtype.is_floating_point and \
        isinstance(node.args[1], float) and node.args[1] <= _HIDDEN


def _is_full(node, value) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is _aten.full.default and \
        list(node.args[0]) == [] and node.args[1] == value


def _unrepeated(kv: torch.fx.Node, n_q_heads):
    """K or V before transformers' repeat_kv (``expand`` of a new dim 2, ``clone``,
    ``reshape`` to (B, Hq, S, D)), which gemslib's attention does not need; else ``kv``."""
    node = kv
    if node.target in _RESHAPES:
        node = node.args[0]
        if node.target is _aten.clone.default:
            node = node.args[0]
    if node.target is _aten.expand.default and node.args[0].target is _aten.unsqueeze.default \
            and node.args[0].args[1] == 2:
        source = node.args[0].args[0]
        source_shape, repeated = source.meta["val"].shape, node.meta["val"].shape
        if len(source_shape) == 4 and len(repeated) == 5 and all(
                same_size(a, b) for a, b in zip(source_shape[:2], repeated[:2])) and all(
                same_size(a, b) for a, b in zip(source_shape[2:], repeated[3:])) and same_size(
                repeated[1] * repeated[2], n_q_heads):
            return source
    return kv


def _decode_key_mask(mask, q_val, seq_kv):
    """For one query row (a decode step) under a mask the band does not decide (transformers'
    static cache: a boolean graph input of the visible cache positions), the boolean
    condition of shape (B or 1, 1, 1, Skv) the mask keeps keys by: the mask itself, or
    ``where(condition, 0, hidden)``; else None. decode_attention then reads only the blocks of
    keys it keeps. A row the mask hides entirely gives 0 there, as SDPA's math backend gives
    for a boolean mask (torch's 16-bit cuDNN path, which hides with a finite -65504 instead,
    would average such a row's values)."""
    mask = _kept_keys(mask) if same_size(q_val.shape[2], 1) else None
    if mask is None or mask.meta["val"].dim() != 4:
        return None
    value = mask.meta["val"]
    batch = value.shape[0]
    if not ((same_size(batch, 1) or same_size(batch, q_val.shape[0]))
            and same_size(value.shape[1], 1) and same_size(value.shape[2], 1)
            and same_size(value.shape[3], seq_kv)):
        return None
    return mask


def _sdpa_scale(args, q_val) -> float | None:
    """The SDPA site's softmax scale as a number (its default for None), or None when it is
    not one (a symbolic value)."""
    scale = args.get("scale")
    scale = default_scale(q_val.shape[-1]) if scale is None else scale
    return scale if isinstance(scale, float) else None


def _replace_sdpa(graph: torch.fx.Graph, node, out) -> None:
    """Point the uses of the SDPA ``node``'s output (its getitem 0) at ``out``; drop both."""
    for user in list(node.users):
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)


def _fuse_decode(graph: torch.fx.Graph, node, args, q, k, v, key_mask,
                 extents: dict) -> str | None:
    """Replace the one-row SDPA ``node`` by decode_attention under ``key_mask``; its site, or
    None where the scale is not a number."""
    scale = _sdpa_scale(args, q.meta["val"])
    if scale is None:
        return None
    out = _decode_call(graph, node, q, k, v, scale, key_mask, extents)
    _replace_sdpa(graph, node, out)
    return f"{node.name} (decode under a key mask, 1 x {k.meta['val'].shape[2]})"


def _decode_call(graph: torch.fx.Graph, before, q, k, v, scale: float, key_mask, extents: dict,
                 softcap: float = 0.0) -> torch.fx.Node:
    """decode_attention of q's one row (q (B, H, 1, D), k and v as repeat_kv gave them) under
    ``key_mask``, inserted before ``before``: its output (B, H, 1, Dv). ``extents``: (mask,
    batch, length) -> the node of each sequence's extent, one past its last visible position,
    made once for all the layers that read the mask: decode_attention takes it as the lengths
    its splits divide (a static cache's mask keeps a prefix of a longer cache)."""
    q_val = q.meta["val"]
    batch, seq_kv = q_val.shape[0], k.meta["val"].shape[2]
    k, v = _unrepeated(k, q_val.shape[1]), _unrepeated(v, q_val.shape[1])
    with graph.inserting_before(before):
        keys = call_node(graph, _aten.reshape.default, key_mask,
                         [key_mask.meta["val"].shape[0], seq_kv])
        keys = call_node(graph, _aten.expand.default, keys, [batch, seq_kv])
        seqlens = extents.get((key_mask, str(batch), str(seq_kv)))
        if seqlens is None and isinstance(seq_kv, int):
            positions = call_node(graph, torch.ops.prims.iota.default, seq_kv, start=1, step=1,
                                  dtype=torch.int32, device=q_val.device, requires_grad=False)
            seqlens = call_node(graph, _aten.amax.default,
                                call_node(graph, _aten.where.ScalarOther, keys, positions, 0),
                                [-1])
            extents[key_mask, str(batch), str(seq_kv)] = seqlens
        rows = call_node(graph, _aten.select.int, q, 2, 0)
        fused = call_node(graph, torch.ops.gemslib.decode_attention.default, rows, k, v, seqlens,
                          scale, keys, *((0, softcap) if softcap else ()))
        return call_node(graph, _aten.unsqueeze.default, fused, 2)


def _mask_form(mask, seq_q, seq_kv, bands: dict):
    """(causal, window) of the kernel call that computes attention under ``mask`` (window 0:
    none), when its band is proven (:func:`_visible_band`, :func:`_evaluated_band`) and one
    the kernel computes: every key, causal, or a causal sliding window; else None. ``bands``
    caches each mask's band (every layer reads the one mask)."""
    key = mask, str(seq_q), str(seq_kv)  # symbolic sizes do not hash
    if key not in bands:
        bands[key] = _visible_band(mask) or _evaluated_band(mask, seq_q, seq_kv)
    if bands[key] is None:
        return None
    lo, hi = bands[key]
    window = 0
    if lo is not None and not statically_known_true(lo <= 1 - seq_q):
        if hi != 0 or not isinstance(lo, int) or lo > 0:
            return None  # a band the kernel does not compute
        window = 1 - lo  # j - i >= lo: i - window < j <= i, a sliding window
    if hi == 0:
        return True, window
    if hi is None or statically_known_true(hi >= seq_kv - 1):
        return False, window  # every key visible
    return None


def _heads_taken(q_val, v_val) -> bool:
    """Whether the kernels' tiles hold these heads (at most MAX_HEAD_DIM features, or a size
    not known until run time): a wider head would run torch's math inside the op, slower
    than SDPA."""
    return not any(statically_known_true(t.shape[-1] > MAX_HEAD_DIM) for t in (q_val, v_val))


def _attention_shape(q_val) -> dict[str, int] | None:
    """What the attention verdicts are keyed on: ``cols`` the head dim, ``rows`` the query
    rows of a sequence (left out where symbolic: a dynamic prompt length takes the verdict
    measured at the longest prompts)."""
    head_dim, seq_q = q_val.shape[-1], q_val.shape[2]
    if not isinstance(head_dim, int):
        return None
    return {"cols": head_dim, **({"rows": seq_q} if isinstance(seq_q, int) else {})}


def _fuse_sdpa(graph: torch.fx.Graph, real_value) -> list[str]:
    """SDPA whose mask is none, causal (``is_causal``, or transformers' causal mask proven from
    its index arithmetic), a causal sliding window so proven, or lets every query see every
    key -> gemslib's attention (its ``window`` for the sliding one) (which runs
    the decode kernel for one query row); the grouped K/V before repeat_kv. Dropout, any other
    mask, a use of the log-sum-exp, or a tune-config verdict that measured SDPA faster at the
    site's head dim and prompt length (``python -m gemslib.tune --verdicts``) leaves the site
    to inductor. One query row (the decode kernel's, timed apart) and a static cache's decode
    step are not under those verdicts."""
    sites, bands, extents = [], {}, {}  # every layer's SDPA reads the one mask: read it once
    for target, mask_arg in _SDPA_MASK_ARG.items():
        for node in graph.find_nodes(op="call_function", target=target):
            args = arguments(node)
            q, k, v = args["query"], args["key"], args["value"]
            mask = args.get(mask_arg) if mask_arg else None
            if args.get("dropout_p", 0.0) != 0.0 or any(
                    user.target is not operator.getitem or user.args[1] != 0
                    for user in node.users):
                continue
            q_val, k_val = q.meta["val"], k.meta["val"]
            if q_val.dim() != 4 or q_val.dtype not in runtime.KERNEL_DTYPES or \
                    not _heads_taken(q_val, v.meta["val"]):
                continue
            seq_q, seq_kv = q_val.shape[2], k_val.shape[2]
            window = 0
            if mask is None:
                causal = bool(args.get("is_causal"))
            else:
                if args.get("is_causal"):
                    continue
                form = _mask_form(mask, seq_q, seq_kv, bands)
                if form is None:
                    key_mask = _decode_key_mask(mask, q_val, seq_kv)
                    site = key_mask is not None and _fuse_decode(graph, node, args, q, k, v,
                                                                 key_mask, extents)
                    if site:
                        sites.append(site)
                    continue
                causal, window = form
            scale = _sdpa_scale(args, q_val)
            if scale is None or (not same_size(seq_q, 1) and not verdict_allows_at(
                    "attention", _attention_shape(q_val))):
                continue
            k, v = _unrepeated(k, q_val.shape[1]), _unrepeated(v, q_val.shape[1])
            with graph.inserting_before(node):
                fused = call_node(graph, torch.ops.gemslib.attention.default, q, k, v, causal,
                                  scale, *((window,) if window else ()))
                out = call_node(graph, operator.getitem, fused, 0)
            _replace_sdpa(graph, node, out)
            form = f"window {window}" if window else "causal" if causal else "full"
            sites.append(f"{node.name} ({form}, {seq_q} x {seq_kv})")
    return sites


# --------------------------------------------------------------------------------------------
# transformers' eager attention (``attn_implementation="eager"``)
# --------------------------------------------------------------------------------------------
#
# As a post-grad graph holds it (torch.matmul of 4-d tensors is a bmm between reshapes of
# expands; softmax(dim=-1, dtype=float32) is its decomposition):
#   S = reshape(bmm(Q3, K3T), (B, H, Sq, Skv)) * scale
#   S = tanh(S / cap) * cap                                  (Gemma-2's logit soft-capping)
#   Z = S + mask                                             (where(visible, 0, hidden))
#   P = exp(Z32 - amax(Z32)) / sum(exp(...)),  Z32 = Z in fp32, P cast back to q's dtype
#       (on CUDA inductor has already put amax and sum into one prepare_softmax_online)
#   O = reshape(bmm(P3, V3), (B, H, Sq, Dv))


_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def _batched(node):
    """x (4-d) when ``node`` is the 3-d operand torch.matmul makes of it: ``reshape`` of an
    ``expand`` to x's own shape (no broadcast), possibly through a ``clone``; else None."""
    if not isinstance(node, torch.fx.Node) or node.target not in _RESHAPES:
        return None
    node = node.args[0]
    if node.target is _aten.clone.default:
        node = node.args[0]
    if node.target is not _aten.expand.default:
        return None
    source = node.args[0]
    shape, expanded = source.meta["val"].shape, node.meta["val"].shape
    if len(shape) != 4 or len(expanded) != 4 or not all(
            same_size(a, b) for a, b in zip(shape, expanded)):
        return None
    return source


def _is_last_dim_reduction(node, target, source) -> bool:
    """``node`` is ``target(source, [-1], keepdim=True)`` (amax or sum over the last dim)."""
    if not (isinstance(node, torch.fx.Node) and node.target is target and
            node.args[0] is source):
        return False
    dims = list(node.args[1]) if len(node.args) > 1 else None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = source.meta["val"].dim()
    return dims is not None and len(dims) == 1 and dims[0] % rank == rank - 1 and keepdim


def _softmax_input(probs):
    """(Z, c) when ``probs`` is softmax(Z c, dim=-1) as decomposed (in fp32 from a 16-bit Z,
    and cast back to Z's dtype), its max and sum as amax and sum or, as inductor's CUDA graphs
    hold them, the two outputs of one prepare_softmax_online (c 1.0); or with the scaling
    moved after the max's subtraction by inductor's scaled-softmax rewrite
    (:func:`_scaled_softmax_logits`); else None."""
    if probs.target is _prims.convert_element_type.default:
        probs = probs.args[0]
    if probs.target is not _aten.div.Tensor:
        return None
    exp, total = probs.args
    if not (isinstance(exp, torch.fx.Node) and exp.target is _aten.exp.default and
            isinstance(total, torch.fx.Node) and isinstance(exp.args[0], torch.fx.Node)):
        return None
    scaled = _scaled_softmax_logits(exp.args[0])
    if scaled is not None:
        return scaled if _is_last_dim_reduction(total, _aten.sum.dim_IntList, exp) else None
    if exp.args[0].target is not _aten.sub.Tensor:
        return None
    scores, row_max = exp.args[0].args
    online = _online_statistics(total)
    if online is not None:
        if online != (scores, row_max):
            return None
    elif not (_is_last_dim_reduction(total, _aten.sum.dim_IntList, exp) and
              _is_last_dim_reduction(row_max, _aten.amax.default, scores)):
        return None
    if scores.target is _prims.convert_element_type.default:
        scores = scores.args[0]
    return scores, 1.0


def _scaled_softmax_logits(node):
    """(x, c) when ``node`` is what inductor makes of softmax(x c)'s ``x c - amax(x c)`` (its
    joint-graph rewrite of a scaled softmax, taken where no attention pattern of its own took
    the graph, e.g. fp32 on a GPU without TF32): ``(xs - amax(xs)) * c'`` with xs = x (as fp32)
    times its sign (1 or -1, c = sign c'), alone or as the finite branch of ``where(all
    finite, it, x c - amax(x c))``; else None."""
    if node.target is _aten.where.self:
        node = node.args[1]
    if not (isinstance(node, torch.fx.Node) and node.target is _aten.mul.Tensor
            and isinstance(node.args[1], (int, float)) and isinstance(node.args[0], torch.fx.Node)
            and node.args[0].target is _aten.sub.Tensor):
        return None
    signed, row_max = node.args[0].args
    if not _is_last_dim_reduction(row_max, _aten.amax.default, signed):
        return None
    x, sign = signed, 1.0
    if signed.target is _aten.mul.Tensor and signed.args[1] in (1, -1):
        x, sign = signed.args[0], float(signed.args[1])
    if x.target is _prims.convert_element_type.default:
        x = x.args[0]
    return x, sign * float(node.args[1])


def _online_statistics(total):
    """(Z, its row max node) when ``total`` is the sum output of ``prepare_softmax_online(Z,
    -1)`` (inductor's pass on CUDA), the max being the same call's other output; else None."""
    from torch._inductor import inductor_prims

    if total.target is not operator.getitem or total.args[1] != 1:
        return None
    online = total.args[0]
    if not (isinstance(online, torch.fx.Node)
            and online.target is inductor_prims.prepare_softmax_online):
        return None
    scores, dim = online.args[:2]
    rank = scores.meta["val"].dim()
    maxes = [user for user in online.users
             if user.target is operator.getitem and user.args[1] == 0]
    if not isinstance(dim, int) or dim % rank != rank - 1 or len(maxes) != 1:
        return None
    return scores, maxes[0]


def _scores(node):
    """(q, k, scale, softcap) when ``node`` is the scaled, possibly capped, q @ k.T of 4-d q
    and k (k as repeat_kv gave it; softcap 0.0: none); else None."""
    softcap = 0.0
    if node.target is _aten.mul.Tensor and isinstance(node.args[1], float) and \
            node.args[0].target is _aten.tanh.default:
        inner = node.args[0].args[0]
        if not (inner.target is _aten.div.Tensor and inner.args[1] == node.args[1] > 0):
            return None
        softcap, node = node.args[1], inner.args[0]
    scale = 1.0
    if node.target is _aten.mul.Tensor and isinstance(node.args[1], float):
        scale, node = node.args[1], node.args[0]
    if node.target not in _RESHAPES or node.args[0].target is not _aten.bmm.default:
        return None
    q, k_t = (_batched(a) for a in node.args[0].args)
    if q is None or k_t is None or not _swaps_last_two(k_t):
        return None
    return q, k_t.args[0], scale, softcap


def _swaps_last_two(node) -> bool:
    """``node`` is a 4-d tensor's transpose of its last two dims (``permute(x, [0, 1, 3, 2])``
    as post-grad graphs hold it, or ``transpose(x, 2, 3)``)."""
    if node.target is _aten.permute.default:
        return list(node.args[1]) == [0, 1, 3, 2]
    return node.target is _aten.transpose.int and \
        sorted(d % 4 for d in node.args[1:3]) == [2, 3]


def _eager_attention(bmm: torch.fx.Node):
    """(q, k, v, mask or None, scale, softcap, out) when ``bmm`` is eager attention's P @ V
    (out its reshape to (B, H, Sq, Dv)) with softmax weights read by nothing else; else
    None."""
    probs3, v3 = bmm.args
    probs, v = _batched(probs3), _batched(v3)
    users = live_users(bmm)
    # the weights feed this product alone (not returned, as output_attentions would)
    if probs is None or v is None or len(users) != 1 or users[0].target not in _RESHAPES or \
            users[0].meta["val"].dim() != 4 or len(live_users(probs)) != 1:
        return None
    found = _softmax_input(probs)
    if found is None:
        return None
    logits, factor = found
    for scores, mask in ((logits, None),) if logits.target is not _aten.add.Tensor else \
            (logits.args, logits.args[::-1]):
        found = isinstance(scores, torch.fx.Node) and (
            mask is None or isinstance(mask, torch.fx.Node)) and _scores(scores)
        if found:
            q, k, scale, softcap = found
            if factor != 1.0 and (softcap or mask is not None):
                return None  # the factor scales the capped or masked logits: not a scale
            return q, k, v, mask, scale * factor, softcap, users[0]
    return None


def _fuse_eager(graph: torch.fx.Graph, real_value) -> list[str]:
    """transformers' eager attention -> gemslib's attention (its ``softcap`` for a ``tanh``
    cap) under the masks :func:`_fuse_sdpa` takes, or decode_attention for one query row
    under a key mask (a static cache's step); the grouped K/V before repeat_kv."""
    sites, bands, extents = [], {}, {}
    for bmm in graph.find_nodes(op="call_function", target=_aten.bmm.default):
        found = _eager_attention(bmm)
        if found is None:
            continue
        q, k, v, mask, scale, softcap, out = found
        q_val, k_val, v_val = q.meta["val"], k.meta["val"], v.meta["val"]
        if q_val.dtype not in runtime.KERNEL_DTYPES or not (
                q_val.dtype == k_val.dtype == v_val.dtype) or not all(
                same_size(a, b) for a, b in zip(q_val.shape[:2], k_val.shape[:2])) or \
                not same_size(k_val.shape[2], v_val.shape[2]) or not _heads_taken(q_val, v_val):
            continue
        seq_q, seq_kv = q_val.shape[2], k_val.shape[2]
        form = (False, 0) if mask is None else _mask_form(mask, seq_q, seq_kv, bands)
        if form is None:
            key_mask = _decode_key_mask(mask, q_val, seq_kv)
            if key_mask is not None:
                result = _decode_call(graph, out, q, k, v, scale, key_mask, extents, softcap)
                out.replace_all_uses_with(result)
                graph.erase_node(out)
                sites.append(f"{bmm.name} (eager, decode under a key mask"
                             f"{f', cap {softcap}' if softcap else ''}, 1 x {seq_kv})")
            continue
        causal, window = form
        k, v = _unrepeated(k, q_val.shape[1]), _unrepeated(v, q_val.shape[1])
        with graph.inserting_before(out):
            fused = call_node(graph, torch.ops.gemslib.attention.default, q, k, v, causal,
                              scale, window, softcap)
            result = call_node(graph, operator.getitem, fused, 0)
        out.replace_all_uses_with(result)
        graph.erase_node(out)
        form = f"window {window}" if window else "causal" if causal else "full"
        sites.append(f"{bmm.name} (eager, {form}{f', cap {softcap}' if softcap else ''}, "
                     f"{seq_q} x {seq_kv})")
    return sites


def _fuse_attention(graph: torch.fx.Graph, real_value) -> list[str]:
    return _fuse_sdpa(graph, real_value) + _fuse_eager(graph, real_value)


GRAPH_REWRITES = (GraphRewrite("attention", _fuse_attention),)
