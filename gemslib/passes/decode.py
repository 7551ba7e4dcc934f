"""A decode step's projections with the small ops around them folded in -> decode_gemv (a
rewrite, after the patterns and every other rewrite; off by default).

At 1-16 rows a projection is memory-bound (its time is reading W), and the launches between
the projections cost as much as a small model's weight reads (docs/notes/decode.md, issue
56's plan). The rewrite folds them into the projections, as decode_gemv's prologues and
epilogue compute them:

1. gated prologue: ``mm(silu_and_mul(gu), W_down^T)`` (or gelu_and_mul, either form), the
   activation read by nothing else -> ``decode_gemv(gu, W_down, gated=...)``;
2. residual epilogue and norm prologue: ``normed, total = add_rms_norm(y, residual, g, eps
   [, offset])`` with y a projection (mm / addmm of a graph-input weight, or a decode_gemv
   without a residual, from 1. or from this rule) read by nothing else, and every reader of
   ``normed`` a projection of it (mm / addmm, or merged_linear over graph-input weights) ->
   ``total = decode_gemv(<y's input>, W_y, <y's prologue>, residual=residual)`` and each
   reader ``decode_gemv(total, W, norm_weight=g, eps=eps, weight_offset=offset)``
   (decode_gemv_merged for a merged_linear: its readers' slices stay as they were);
3. norm prologue alone: ``rms_norm(x)`` (the first layer's norm, or a final norm with no add
   before it) whose every reader is such a projection -> each reader ``decode_gemv(x, W,
   norm_weight=g, ...)``;
4. (fusion ``decode_gemv_rotary``, a stage after 1.-3.) ``rotary_into_cache`` whose q, k and v
   are the q, k and v heads, end to end, of one decode_gemv without residual or gate (the
   q/k/v projection 2. or 3. made), through views nothing else reads -> one
   ``decode_gemv_rotary`` launch that projects, rotates (with the per-head q/k norm where
   rotary_into_cache had it) and writes k and v into the caches. The views are checked by
   replaying them on the indices of the projection's output.

A site (what ``fusion_report()["decode_gemv"]`` counts) is one small op whose launch is gone:
a gated activation (1.), an add_rms_norm (2.) or an rms_norm (3.) folded into the
projections around it. A llama-like decoder layer has three: its MLP's activation and its two
add_rms_norms (the one after the o projection, and the one after the down projection, which
is the next layer's input norm or the final norm before the lm_head); the graph's first
rms_norm is one more; ``fusion_report()["decode_gemv_rotary"]`` counts the rotaries folded
(one a layer). A layer goes from nine launches to five: q/k/v with the norm, the rotary and
the cache write; decode attention; o with the residual; gate/up with the norm; down with the
gated prologue and the residual.

Conditions: every projection of a site has M <= FOLD_ROWS rows (one: a B1 step; below),
static (the FakeTensor's size; a symbolic size is left alone), a kernel dtype on the kernel
device, every tensor of the site one dtype, weights (and biases) graph inputs; an inference
graph (a training compile's graphs save the intermediates, which the rewrite would drop); the
tune config's ``decode_gemv`` verdict for the width of the site's first projection input.
For 4., a full rotary without the per-head q/k norm. Anything else is left as it is. By
default (option value ``"measured"``) a site is folded only where the GPU's tune config has a
verdict saying so (``python -m gemslib.tune --verdicts`` times a stack of layers at each
model's widths with and without the rewrite): on the H100 the folded projections ran at
0.98-1.16x the unfused path at one row by shape and config, so no one default is right.
``gemslib.decode_gemv=True`` (or ``GEMSLIB_DECODE_GEMV=1``) folds wherever no verdict says
otherwise, ``False`` (``=0``) nowhere. 4. is on wherever 1.-3. are
(``gemslib.decode_gemv_rotary`` or ``GEMSLIB_DECODE_GEMV_ROTARY=0`` turns it off alone).
"""

from __future__ import annotations

import operator

import torch

from gemslib import runtime
from gemslib.fused import decode_gemv as _decode_gemv_ops
from gemslib.fused import merged_linear as _merged_linear_ops  # noqa: F401  (its op)
from gemslib.ops import rms_norm as _rms_norm_ops  # noqa: F401  (the norm ops it reads)
from gemslib.ops import silu as _silu_ops  # noqa: F401  (the gated activations it reads)
from gemslib.passes.base import GraphRewrite, verdict_allows
from gemslib.passes.forms import arguments, call_node, live_users, only_live_user, projection

_aten, _gemslib = torch.ops.aten, torch.ops.gemslib
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)
MAX_ROWS = _decode_gemv_ops.MAX_ROWS
# The rows a site is folded at. Each program of a folded projection reads its rows of x again
# for the norm's rms (M / BLOCK_N of W's bytes once more) or forms act(gate) * up for them
# (2M / BLOCK_N): on the H100 one row ran 0.98-1.05x torch.compile's unfused path, 16 rows
# 0.84-0.91x (norm) and 0.36-0.49x (gate) (docs/notes/decode.md); rows between are unmeasured
FOLD_ROWS = 1
_NO_GATE = _decode_gemv_ops.NO_GATE


def _value(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _static_shape(node) -> tuple[int, ...] | None:
    """The sizes of ``node``'s value when all are plain ints, else None."""
    value = _value(node)
    if not isinstance(value, torch.Tensor) or not all(isinstance(s, int) for s in value.shape):
        return None
    return tuple(value.shape)


def _inference_graph() -> bool:
    """The graph being compiled is an inference graph: AOTAutograd traced no tangents (a
    training compile's forward and backward graphs have some). Unknown (no tracing context):
    not one."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return metadata is not None and not metadata.traced_tangents


def _decode_rows(node) -> int | None:
    """M when ``node``'s value is (M, K) with static sizes, 1 <= M <= FOLD_ROWS; else None."""
    shape = _static_shape(node)
    return shape[0] if shape is not None and len(shape) == 2 and 0 < shape[0] <= FOLD_ROWS \
        else None


def _same_dtype_on_kernel(*nodes) -> bool:
    """Every value of ``nodes`` (None entries skipped) one kernel dtype, on the kernel device."""
    values = [_value(node) for node in nodes if node is not None]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return False
    dtype = values[0].dtype
    return dtype in runtime.KERNEL_DTYPES and all(
        v.dtype == dtype and runtime.on_kernel_device(v) for v in values)


def _reshaped_to(graph: torch.fx.Graph, node: torch.fx.Node, shape) -> torch.fx.Node:
    """``node`` itself where its value has ``shape`` already, else a new reshape of it."""
    if _static_shape(node) == tuple(shape):
        return node
    return call_node(graph, _aten.reshape.default, node, list(shape))


def _gemv(graph: torch.fx.Graph, x, weight, bias=None, residual=None, norm_weight=None,
          eps=0.0, weight_offset=0.0, activation=_NO_GATE) -> torch.fx.Node:
    """A decode_gemv node (decode_gemv_merged where ``weight`` is a list of weights, ``bias``
    then a list too) at the graph's insertion point."""
    if isinstance(weight, (list, tuple)):
        return call_node(graph, _gemslib.decode_gemv_merged.default, x, list(weight),
                         list(bias), residual, norm_weight, float(eps), float(weight_offset),
                         activation)
    return call_node(graph, _gemslib.decode_gemv.default, x, weight, bias, residual, norm_weight,
                     float(eps), float(weight_offset), activation)


# --------------------------------------------------------------------------------------------
# 1. The gated prologue: down(act(gate) * up) -> decode_gemv(gu, W_down, gated=act)
# --------------------------------------------------------------------------------------------

_GATED = {_gemslib.silu_and_mul.default: lambda node: "silu",
          _gemslib.gelu_and_mul.default:
              lambda node: "gelu_tanh" if arguments(node)["tanh"] else "gelu_erf"}


def _chain_to_projection(node: torch.fx.Node):
    """(the linear layer, its (M, K) input) when ``node`` is read, through reshapes each read
    by nothing else, by exactly one linear layer (:func:`projection`) as its input, and by
    nothing else; else None."""
    while True:
        user = only_live_user(node)
        if user is None:
            return None
        if user.target in _RESHAPES and user.args[0] is node:
            node = user
            continue
        found = projection(user)
        if found is None or found[0] is not node:
            return None
        return user, node


def _fold_gated(graph: torch.fx.Graph) -> list[str]:
    sites = []
    for act in list(graph.nodes):
        if act.op != "call_function" or act.target not in _GATED or not live_users(act):
            continue
        gated = _GATED[act.target](act)
        gate_up = arguments(act)["x"]
        chained = _chain_to_projection(act)
        if chained is None:
            continue
        mm, x2d = chained
        _, _, weight, bias = projection(mm)
        rows, gu_shape, w_shape = _decode_rows(x2d), _static_shape(gate_up), \
            _static_shape(weight)
        if rows is None or gu_shape is None or w_shape is None or len(w_shape) != 2:
            continue
        width = _static_shape(x2d)[1]
        if gu_shape[-1] != 2 * width or w_shape[1] != width or \
                rows * 2 * width != _value(gate_up).numel() or \
                not _same_dtype_on_kernel(gate_up, weight, bias) or \
                not verdict_allows("decode_gemv", _value(x2d)):
            continue
        with graph.inserting_before(mm):
            gu = _reshaped_to(graph, gate_up, (rows, 2 * width))
            fused = _gemv(graph, gu, weight, bias,
                          activation=_decode_gemv_ops.ACTIVATIONS[gated])
        mm.replace_all_uses_with(fused)
        graph.erase_node(mm)
        sites.append(f"{act.name} ({gated}) into {mm.name}")
    return sites


# --------------------------------------------------------------------------------------------
# 2., 3. The norm prologue of the projections a norm feeds, and the residual epilogue of the
# projection before an add_rms_norm
# --------------------------------------------------------------------------------------------


def _outputs(norm: torch.fx.Node, index: int) -> list[torch.fx.Node]:
    """The live ``getitem(norm, index)`` nodes."""
    return [user for user in norm.users if user.target is operator.getitem
            and user.args[1] == index and live_users(user)]


def _reader_projection(reader: torch.fx.Node, x: torch.fx.Node):
    """(weight, bias) of ``reader`` when it is a linear layer of input ``x`` (its weight and
    bias graph inputs), or ([weights], [biases]) when it is a merged_linear of ``x`` over
    graph inputs; else None."""
    if reader.target is _gemslib.merged_linear.default:
        x2d, weights, biases = reader.args
        if x2d is not x or reader.kwargs or not weights or any(
                not isinstance(w, torch.fx.Node) or w.op != "placeholder" for w in weights) or \
                any(b is not None and (not isinstance(b, torch.fx.Node) or b.op != "placeholder")
                    for b in biases):
            return None
        return list(weights), list(biases)
    found = projection(reader)
    if found is None or found[0] is not x:
        return None
    return found[2], found[3]


def _norm_readers(normed_nodes: list[torch.fx.Node], rows: int, width: int):
    """[(reader, weight or weights, bias or biases)] when every live reader of the normalised
    rows (``normed_nodes``, of ``rows`` x ``width`` values) is a projection of them, each
    directly or through a reshape to (rows, width) that only projections read; else None
    (also for none)."""
    readers = []
    for normed in normed_nodes:
        for user in live_users(normed):
            if user.target in _RESHAPES and user.args[0] is normed:
                if _static_shape(user) != (rows, width):
                    return None
                pairs = [(reader, user) for reader in live_users(user)]
            elif _static_shape(normed) == (rows, width):
                pairs = [(user, normed)]
            else:
                return None
            for reader, x2d in pairs:
                found = _reader_projection(reader, x2d)
                if found is None:
                    return None
                readers.append((reader, *found))
    return readers or None


def _weights_fit(readers, width: int) -> bool:
    """Every reader's weights (N_i, width)."""
    for _, weight, _ in readers:
        for w in weight if isinstance(weight, list) else [weight]:
            shape = _static_shape(w)
            if shape is None or len(shape) != 2 or shape[1] != width:
                return False
    return True


def _reader_tensors(readers) -> list:
    tensors = []
    for _, weight, bias in readers:
        tensors += weight if isinstance(weight, list) else [weight]
        tensors += [b for b in (bias if isinstance(bias, list) else [bias]) if b is not None]
    return tensors


def _residual_producer(y: torch.fx.Node, norm: torch.fx.Node):
    """(the projection, its arguments as decode_gemv takes them: x, weight, bias, norm_weight,
    eps, weight_offset, activation) when ``y`` is, through reshapes each read by nothing else,
    the output of a linear layer (mm / addmm of a graph-input weight) or of a decode_gemv with
    no residual, read by nothing but ``norm``; else None."""
    if live_users(y) != [norm]:
        return None
    node = y
    while node.target in _RESHAPES:
        node = node.args[0]
        if not isinstance(node, torch.fx.Node) or only_live_user(node) is None:
            return None
    if node.target is _gemslib.decode_gemv.default:
        x, weight, bias, residual, norm_weight, eps, offset, activation = node.args
        if residual is not None or node.kwargs:
            return None
        return node, (x, weight, bias, norm_weight, eps, offset, activation)
    found = projection(node) or _unfused_addmm(node)
    if found is None:
        return None
    x2d, _, weight, bias = found
    return node, (x2d, weight, bias, None, 0.0, 0.0, _NO_GATE)


def _unfused_addmm(node: torch.fx.Node):
    """:func:`projection`'s answer for ``mm(x, W.T) + b`` with b an (N,) graph input and the mm
    read by nothing else: an addmm as inductor leaves it on a GPU where only pointwise ops read
    it (its bias then joins their kernel); else None."""
    if node.target is not _aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    for mm, bias in (node.args, node.args[::-1]):
        if not (isinstance(mm, torch.fx.Node) and isinstance(bias, torch.fx.Node)
                and bias.op == "placeholder") or live_users(mm) != [node]:
            continue
        found = projection(mm)
        bias_shape, weight_shape = _static_shape(bias), _static_shape(found[2]) if found else None
        if found is not None and found[3] is None and weight_shape is not None and \
                bias_shape == weight_shape[:1]:
            return (*found[:3], bias)
    return None


def _fold_norms(graph: torch.fx.Graph) -> list[str]:
    sites = []
    for norm in list(graph.nodes):
        if norm.op != "call_function" or norm.target not in (
                _gemslib.add_rms_norm.default, _gemslib.rms_norm_forward.default):
            continue
        site = _fold_norm(graph, norm)
        if site:
            sites.append(site)
    return sites


def _fold_norm(graph: torch.fx.Graph, norm: torch.fx.Node) -> str | None:
    """One add_rms_norm (2.) or rms_norm (3.) folded into the projections around it; its site,
    or None where it is left alone."""
    args = arguments(norm)
    added = norm.target is _gemslib.add_rms_norm.default
    x, norm_weight, eps, offset = args["x"], args["weight"], args["eps"], args["weight_offset"]
    normed = _outputs(norm, 0)
    if not normed or norm_weight is None or not isinstance(eps, float) or \
            not isinstance(offset, float) or (not added and _outputs(norm, 1)):
        return None  # (rms_norm's second output, the rstd, saved for a backward)
    shape = _static_shape(x)
    if shape is None or not shape:
        return None
    width = shape[-1]
    rows = _value(x).numel() // width if width else 0
    if not 0 < rows <= FOLD_ROWS:
        return None
    readers = _norm_readers(normed, rows, width)
    if readers is None or not _weights_fit(readers, width):
        return None
    producer = None
    if added:  # the projection before the add takes the residual: either operand
        for y, residual in ((x, args["residual"]), (args["residual"], x)):
            found = _residual_producer(y, norm) if isinstance(y, torch.fx.Node) else None
            if found is not None and _decode_rows(found[1][0]) == rows and \
                    _static_shape(found[0]) == (rows, width):
                producer = found
                break
        if producer is None:
            return None
        projected, (p_x, p_weight, p_bias, p_norm_weight, p_eps, p_offset, p_activation) = \
            producer
        site_tensors = (x, residual, norm_weight, p_x, p_weight, p_bias, p_norm_weight)
        main_input = _value(p_x)
    else:
        site_tensors = (x, norm_weight)
        main_input = _value(x).reshape(rows, width)
    if not _same_dtype_on_kernel(*site_tensors, *_reader_tensors(readers)) or \
            not verdict_allows("decode_gemv", main_input):
        return None

    with graph.inserting_before(norm):
        if added:
            total = _gemv(graph, p_x, p_weight, p_bias,
                          _reshaped_to(graph, residual, (rows, width)), p_norm_weight, p_eps,
                          p_offset, p_activation)
            totals = _outputs(norm, 1)
            if totals:
                shaped = _reshaped_to(graph, total, _static_shape(residual))
                for node in totals:
                    node.replace_all_uses_with(shaped)
        else:
            total = _reshaped_to(graph, x, (rows, width))
    for reader, weight, bias in readers:
        with graph.inserting_before(reader):
            fused = _gemv(graph, total, weight, bias, norm_weight=norm_weight, eps=eps,
                          weight_offset=offset)
        reader.replace_all_uses_with(fused)
        graph.erase_node(reader)
    what = f"{norm.name} into {', '.join(reader.name for reader, *_ in readers)}"
    return what + (f" and the residual into {projected.name}" if added else "")


def _fold_into_projections(graph: torch.fx.Graph, real_value) -> list[str]:
    """The gated activations first (a down projection so made is the projection an
    add_rms_norm after it folds its residual into), then the norms in graph order (a norm's
    new total is the next one's residual)."""
    if not _inference_graph():
        return []
    sites = _fold_gated(graph) + _fold_norms(graph)
    if sites:
        graph.eliminate_dead_code()
    return sites


# --------------------------------------------------------------------------------------------
# 4. The rotary and cache write of the q/k/v projection: rotary_into_cache over the q, k and v
# heads of one decode_gemv -> decode_gemv_rotary
# --------------------------------------------------------------------------------------------

# the view ops between a projection's (M, N) output and its (B, S, H, D) heads
_HEAD_VIEWS = (*_RESHAPES, _aten.permute.default, _aten.transpose.int, _aten.slice.Tensor,
               _aten.alias.default)


def _views_down_to(node: torch.fx.Node, views: dict):
    """The projection ``node`` is a view of (through :data:`_HEAD_VIEWS` ops whose other
    arguments are constants), recording each view op in ``views``; else None."""
    while node.target in _HEAD_VIEWS:
        if any(isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        views[node] = None
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return None
    return node if node.target in (_gemslib.decode_gemv.default,
                                   _gemslib.decode_gemv_merged.default) else None


def _view_of_indices(node: torch.fx.Node, indices: torch.Tensor, projection) -> torch.Tensor:
    """``node``'s value computed from ``indices`` in the place of the projection's output:
    where each element of the view lies in it."""
    if node is projection:
        return indices
    source = _view_of_indices(node.args[0], indices, projection)
    return node.target(source, *node.args[1:], **node.kwargs)


def _qkv_heads(write: torch.fx.Node):
    """(the decode_gemv node, Hq) when rotary_into_cache's q, k and v (``write``'s) are the
    q, k and v heads of one decode_gemv's (M, N) output, end to end in that order, (B, S, H, D)
    each with M = B S, through views that nothing else reads, and nothing else reads that
    output; else None."""
    views, projections = {}, set()
    for name in ("q", "k", "v"):
        projections.add(_views_down_to(write.kwargs[name], views))
    if len(projections) != 1 or None in projections:
        return None
    (gemv,) = projections
    if any(set(live_users(node)) - set(views) - {write} for node in (*views, gemv)):
        return None
    shapes = [_static_shape(write.kwargs[name]) for name in ("q", "k", "v")]
    rows_cols = _static_shape(gemv)
    if None in shapes or rows_cols is None or any(len(shape) != 4 for shape in shapes):
        return None
    (batch, seq, n_q_heads, head_dim), (_, _, n_kv_heads, _) = shapes[0], shapes[1]
    n_rows, n_out = rows_cols
    if batch * seq != n_rows or (n_q_heads + 2 * n_kv_heads) * head_dim != n_out:
        return None
    indices = torch.arange(n_rows * n_out).view(n_rows, n_out)
    expected = _decode_gemv_ops._heads(indices, batch, n_q_heads, n_kv_heads, head_dim)
    for name, heads in zip(("q", "k", "v"), expected):
        try:
            placed = _view_of_indices(write.kwargs[name], indices, gemv)
        except (RuntimeError, IndexError, TypeError, ValueError):
            return None
        if placed.shape != heads.shape or not torch.equal(placed, heads):
            return None
    return gemv, n_q_heads


def _fold_rotary(graph: torch.fx.Graph, real_value) -> list[str]:
    """rotary_into_cache (an ``auto_functionalized`` write of the caches) over the heads of a
    decode_gemv(_merged) with no residual and no gated prologue (the q/k/v projection, its
    norm folded in by 2. or 3.) -> ``decode_gemv_rotary``: the projection's launch rotates q
    and k and writes k and v into the caches. A full rotary (the table as wide as a head),
    every tensor one kernel dtype."""
    if not _inference_graph():
        return []
    into_cache, sites = _gemslib.rotary_into_cache.default, []
    for write in graph.find_nodes(op="call_function",
                                  target=torch.ops.higher_order.auto_functionalized):
        if write.args[0] is not into_cache:
            continue
        found = _qkv_heads(write)
        if found is None:
            continue
        gemv, n_q_heads = found
        if gemv.target is _gemslib.decode_gemv.default:
            x, weight, bias, residual, norm_weight, eps, offset, activation = gemv.args
            weights, biases = [weight], [bias]
        else:
            x, weights, biases, residual, norm_weight, eps, offset, activation = gemv.args
        kwargs = write.kwargs
        if kwargs.get("q_weight") is not None:
            # the per-head q/k norm's tiles of whole heads ran 0.41x (one row) and 0.86x (16)
            # the two launches on the H100 with default.yaml's configs grown: left until tuned
            continue
        table, head = _static_shape(kwargs["cos"]), _static_shape(kwargs["q"])
        if residual is not None or activation != _NO_GATE or gemv.kwargs or table is None or \
                len(table) != 3 or table[2] != head[3] or not _same_dtype_on_kernel(
                    x, *weights, *biases, norm_weight, *(kwargs.get(name) for name in (
                        "cos", "sin", "k_cache", "v_cache", "q_weight", "k_weight"))) or \
                not verdict_allows("decode_gemv", _value(x)):
            continue
        with graph.inserting_before(write):
            fused = call_node(
                graph, torch.ops.higher_order.auto_functionalized,
                _gemslib.decode_gemv_rotary.default, x=x, weights=list(weights),
                biases=list(biases), norm_weight=norm_weight, eps=float(eps),
                weight_offset=float(offset), cos=kwargs["cos"], sin=kwargs["sin"],
                interleaved=kwargs["interleaved"], cache_position=kwargs["cache_position"],
                k_cache=kwargs["k_cache"], v_cache=kwargs["v_cache"], n_q_heads=n_q_heads,
                q_weight=kwargs.get("q_weight"), k_weight=kwargs.get("k_weight"),
                qk_eps=float(kwargs.get("eps", 0.0)),
                qk_offset=float(kwargs.get("weight_offset", 0.0)))
            outputs = [call_node(graph, operator.getitem, fused, index) for index in range(3)]
            outputs[0] = _reshaped_to(graph, outputs[0], head)
        for user in list(write.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
        sites.append(f"{write.name} into {gemv.name}")
    if sites:
        graph.eliminate_dead_code()
    return sites


# stage 1: after the other rewrites after the patterns have made all they make
# (rotary_into_cache, rotary_qk_norm and rms_norm_linear_silu read the same norms and
# projections)
GRAPH_REWRITES = (GraphRewrite("decode_gemv", _fold_into_projections, after_patterns=True,
                               stage=1),
                  # stage 2: over the q/k/v projections the norms have been folded into
                  GraphRewrite("decode_gemv_rotary", _fold_rotary, after_patterns=True,
                               stage=2))
