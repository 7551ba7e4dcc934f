"""Graph passes: ``torch.compile(model, backend="gemslib")`` is inductor with gemslib's
pattern passes installed after its own post-grad passes.

    model = torch.compile(model, backend="gemslib")                          # passes + inductor
    model = torch.compile(model, backend="gemslib", mode="reduce-overhead")  # ... in CUDA graphs
    gemslib.fusion_report()        # {fusion: sites replaced} over the graphs compiled so far

Each operator file declares the patterns its op replaces as ``GRAPH_PATTERNS`` (a tuple of
``registry.GraphPattern``); this module only collects them (through the registry), registers them
with inductor's pattern matcher and counts what they replace. ``PASSES`` is the pass object
itself, for an inductor config of one's own:

    torch._inductor.config.post_grad_custom_post_pass = gemslib.graph.PASSES
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import torch

log = logging.getLogger("gemslib.graph")


_report: dict[str, int] = {}
# the real tensors the backend's graph is being compiled for (its parameters among them)
_compiling_inputs: contextvars.ContextVar[Sequence[Any] | None] = contextvars.ContextVar(
    "gemslib_compiling_inputs", default=None)


def fusion_report() -> dict[str, int]:
    """{fusion name: sites replaced} for every graph compiled with the passes since the last
    :func:`reset_fusion_report` (a recompilation counts its sites again)."""
    return dict(_report)


def reset_fusion_report() -> None:
    _report.clear()


def _counted(pattern: GraphPattern) -> Callable[[Any], bool]:
    def check(match) -> bool:
        try:
            accepted = bool(pattern.check(match))
        except Exception as err:  # a site the check cannot read is not proven equal
            log.debug("gemslib %s: check failed on %s: %s", pattern.fusion, match.nodes[-1], err)
            accepted = False
        if accepted:
            _report[pattern.fusion] = _report.get(pattern.fusion, 0) + 1
            log.debug("gemslib %s: replacing %s", pattern.fusion,
                      ", ".join(node.name for node in match.nodes))
        return accepted
    return check


@functools.cache
def _pattern_passes():
    """One inductor pattern pass per stage of the operators' patterns, lowest stage first."""
    from torch._inductor import pattern_matcher

    from gemslib import registry

    matchers: dict[int, Any] = {}
    for operator in registry.operators().values():
        for pattern in operator.graph_patterns:
            matcher = matchers.get(pattern.stage)
            if matcher is None:
                matcher = matchers[pattern.stage] = pattern_matcher.PatternMatcherPass(
                    pass_name=f"gemslib_stage_{pattern.stage}")
            for trace in _traces(pattern):
                pattern_matcher.register_replacement(
                    pattern.search, pattern.replace, list(pattern.example_inputs()),
                    trace, matcher, extra_check=_counted(pattern),
                    scalar_workaround=dict(pattern.scalars) or None)
    return tuple(matchers[stage] for stage in sorted(matchers))


def _traces(pattern) -> tuple[Callable, ...]:
    """How to trace a pattern: as written, and, when that trace holds views, with its views
    as reshapes too (inductor turns a graph's views into reshapes before the post-grad passes
    run: a flatten in a model's code reaches the passes as a reshape)."""
    from torch._inductor import pattern_matcher

    traced = pattern_matcher.fwd_only(
        lambda *tensors: pattern.search(*tensors, **pattern.scalars),
        list(pattern.example_inputs()))
    if not traced.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        return (pattern_matcher.fwd_only,)

    def with_reshapes(fn, args, *rest, **kwargs):
        module = pattern_matcher.fwd_only(fn, args, *rest, **kwargs)
        for node in module.graph.find_nodes(op="call_function",
                                            target=torch.ops.aten.view.default):
            node.target = torch.ops.aten.reshape.default
        module.recompile()
        return module
    return pattern_matcher.fwd_only, with_reshapes


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


def _rewrites(after_patterns: bool):
    from gemslib import registry
    return [rewrite for operator in registry.operators().values()
            for rewrite in operator.graph_rewrites if rewrite.after_patterns == after_patterns]


def _real_values(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], Any]:
    """placeholder -> the real tensor the backend compiles ``graph`` for, or None: known only
    for the graph whose inputs are the backend's own (an inference graph, or a training
    graph's forward), one to one, or, where inputs are tensor subclasses that AOTAutograd
    flattens (DTensor: its local shard), tensor leaf to tensor placeholder; checked input by
    input against the traced metadata."""
    inputs = _compiling_inputs.get()
    placeholders = graph.find_nodes(op="placeholder")
    if inputs is None:
        return {}.get
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if any(is_traceable_wrapper_subclass(value) for value in inputs):
        # the graph's inputs are the leaves, even where there are as many as the subclasses
        # (a DTensor has one: its local shard)
        tensor_placeholders = [node for node in placeholders
                               if isinstance(node.meta.get("val"), torch.Tensor)]
        leaves = list(_tensor_leaves(inputs))
        if len(leaves) != len(tensor_placeholders):
            return {}.get
        pairs = list(zip(tensor_placeholders, leaves))
    elif len(inputs) == len(placeholders):
        pairs = list(zip(placeholders, inputs))
    else:  # another graph of the compile (a training graph's backward)
        return {}.get

    known: dict[torch.fx.Node, torch.Tensor] = {}
    for node, value in pairs:
        traced = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            continue
        if not isinstance(traced, torch.Tensor) or traced.dtype != value.dtype or \
                traced.dim() != value.dim() or any(
                    isinstance(a, int) and a != b for a, b in zip(traced.shape, value.shape)):
            return {}.get  # the inputs are not the graph's
        known[node] = value
    return known.get


def _tensor_leaves(values):
    """The plain tensors of ``values`` in AOTAutograd's flattening order: a traceable tensor
    subclass (DTensor) as its inner tensors, anything that is not a tensor left out."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(value):
            attrs, _ = value.__tensor_flatten__()
            yield from _tensor_leaves([getattr(value, attr) for attr in attrs])
        else:
            yield value


def _apply_rewrites(graph: torch.fx.Graph, after_patterns: bool = False) -> int:
    real_value, fused = _real_values(graph), 0
    for _ in range(8):  # each round may enable another rewrite's site; a few suffice
        round_fused = 0
        for rewrite in _rewrites(after_patterns):
            for site in rewrite.rewrite(graph, real_value):
                _report[rewrite.fusion] = _report.get(rewrite.fusion, 0) + 1
                log.debug("gemslib %s: %s", rewrite.fusion, site)
                round_fused += 1
        if not round_fused:
            break
        fused += round_fused
    return fused


def _passes_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass
    return CustomGraphPass


class GemslibPasses(_passes_base()):
    """The inductor post-grad pass: every operator's ``GRAPH_REWRITES``, then its
    ``GRAPH_PATTERNS``, then the rewrites marked ``after_patterns``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        replaced = _apply_rewrites(graph)
        if replaced:
            graph.eliminate_dead_code()
        for matcher in _pattern_passes():
            matched = matcher.apply(graph)
            if matched:
                # a replacement of several outputs goes before the first of them, which may
                # come before the producers of the other outputs' inputs (rotary: k's
                # projection follows q's rotary); sort before the next stage matches and
                # before eliminate_dead_code lints the graph
                stable_topological_sort(graph)
                graph.eliminate_dead_code()
                replaced += matched
        late = _apply_rewrites(graph, after_patterns=True)
        if late:
            graph.eliminate_dead_code()
            replaced += late
        if replaced:
            _free_layouts(graph)
            log.debug("gemslib: %d sites replaced in one graph", replaced)

    def uuid(self) -> Any:
        # None keeps inductor's FX graph cache out of graphs these passes see: a cached graph
        # would skip the passes, and fusion_report() could not count what it holds
        return None


def _free_layouts(graph: torch.fx.Graph) -> None:
    """Drop the input layouts recorded when a replacement was traced from gemslib's nodes.

    A pattern's replacement is traced on the matched values as they were before the rewrites
    changed their producers (a projection's output became a slice of the merged one), and
    inductor would copy each input into that stale layout. gemslib's operators take any
    strides, and without the record inductor passes the inputs as they are, as it does for
    the nodes the rewrites insert."""
    for node in graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "gemslib":
            node.meta.pop("eager_input_vals", None)


PASSES = GemslibPasses()


def backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
            options: Mapping[str, Any] | None = None):
    """The ``"gemslib"`` torch.compile backend: inductor (with ``mode``'s or ``options``'
    settings, as ``backend="inductor"`` takes them) plus gemslib's passes."""
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    if mode is not None and options:
        raise RuntimeError("gemslib backend: either mode or options can be given, not both "
                           "(as with inductor)")
    patches = dict(torch._inductor.list_mode_options(mode)) if mode is not None else {}
    patches.update(options or {})
    if patches.get("post_grad_custom_post_pass") not in (None, PASSES):
        raise ValueError("gemslib backend: options sets post_grad_custom_post_pass, which is "
                         "where gemslib's passes go; install gemslib.graph.PASSES in your own "
                         "pass instead")
    patches["post_grad_custom_post_pass"] = PASSES
    # inductor's shape padding rewrites a matmul whose rows are not aligned into a padded one
    # when a timing on the GPU favours it, and that decides per run whether the projections
    # still read as linear layers; merged_linear's GEMM over aligned weights needs no padding
    patches.setdefault("shape_padding", False)
    token = _compiling_inputs.set(list(example_inputs))
    try:
        return compile_fx(gm, example_inputs, config_patches=patches)
    finally:
        _compiling_inputs.reset(token)
