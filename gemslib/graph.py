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

import functools
import logging
from typing import Any, Callable, Mapping

import torch

log = logging.getLogger("gemslib.graph")


_report: dict[str, int] = {}


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
def _pattern_pass():
    from torch._inductor import pattern_matcher

    from gemslib import registry

    matcher = pattern_matcher.PatternMatcherPass(pass_name="gemslib")
    for operator in registry.operators().values():
        for pattern in operator.graph_patterns:
            pattern_matcher.register_replacement(
                pattern.search, pattern.replace, list(pattern.example_inputs()),
                pattern_matcher.fwd_only, matcher, extra_check=_counted(pattern),
                scalar_workaround=dict(pattern.scalars) or None)
    return matcher


def _passes_base():
    from torch._inductor.custom_graph_pass import CustomGraphPass
    return CustomGraphPass


class GemslibPasses(_passes_base()):
    """The inductor post-grad pass that applies every operator's ``GRAPH_PATTERNS``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        replaced = _pattern_pass().apply(graph)
        if replaced:
            # a replacement of several outputs goes before the first of them, which may come
            # before the producers of the other outputs' inputs (rotary: k's projection follows
            # q's rotary); sort before eliminate_dead_code lints the graph
            from torch._inductor.pattern_matcher import stable_topological_sort
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
            log.debug("gemslib: %d sites replaced in one graph", replaced)

    def uuid(self) -> Any:
        # None keeps inductor's FX graph cache out of graphs these passes see: a cached graph
        # would skip the passes, and fusion_report() could not count what it holds
        return None


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
    return compile_fx(gm, example_inputs, config_patches=patches)
