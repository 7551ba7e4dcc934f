"""The pass manager: the inductor post-grad pass that runs gemslib's fusions, and the report.

The fusion families are the modules of ``gemslib.passes`` that declare ``GRAPH_PATTERNS``
and ``GRAPH_REWRITES`` (see ``base``); this module finds them by walking the package, registers
the patterns with inductor's pattern matcher (one pattern pass per stage and set of fusions
switched on), runs the rewrites and counts what they replace. A :class:`GemslibPasses` object
is the pass for one set of options; ``PASSES`` is the one with the defaults, for an inductor
config of one's own:

    torch._inductor.config.post_grad_custom_post_pass = gemslib.passes.PASSES

Its ``uuid()`` names what decides the graph it makes (the passes' and the operators' source,
the options, the tune config, the device), so inductor's caches serve a compile they have seen.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pkgutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from gemslib.passes.base import (CompileRecord, GraphPattern, GraphRewrite, in_flight,
                                 measured_only, verdict_allows)

log = logging.getLogger("gemslib.passes")


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------

_report: dict[str, int] = {}


def fusion_report() -> dict[str, int]:
    """{fusion name: sites replaced} for every graph compiled with the passes since the last
    :func:`reset_fusion_report` (a recompilation counts its sites again, and so does a compile
    that inductor's caches serve)."""
    return dict(_report)


def reset_fusion_report() -> None:
    _report.clear()


def count(fusion: str, sites: int = 1) -> None:
    """Add ``sites`` replacements of ``fusion`` to the report and to the compile in flight."""
    _report[fusion] = _report.get(fusion, 0) + sites
    record = in_flight()
    if record is not None:
        record.fusions[fusion] += sites


# --------------------------------------------------------------------------------------------
# The fusion families and their options
# --------------------------------------------------------------------------------------------


@functools.cache
def _families() -> tuple[Any, ...]:
    """The modules of ``gemslib.passes`` that declare fusions, by name."""
    found = []
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "GRAPH_PATTERNS") or hasattr(module, "GRAPH_REWRITES"):
            found.append(module)
    return tuple(found)


def _patterns() -> list[GraphPattern]:
    return [p for family in _families() for p in getattr(family, "GRAPH_PATTERNS", ())]


def _rewrites() -> list[GraphRewrite]:
    return [r for family in _families() for r in getattr(family, "GRAPH_REWRITES", ())]


OPTION_PREFIX = "gemslib."
# an option's third value: the fusion is on only at the shapes where the tune config in use has
# a verdict measuring it faster than the path without it (``python -m gemslib.tune --verdicts``)
MEASURED = "measured"
# a fusion whose default the environment gives: (the variable, the default where it is not
# set): a way in or out without code. Every other fusion is on.
_ENVIRONMENT_DEFAULTS = {
    "rotary_into_cache": ("GEMSLIB_ROTARY_INTO_CACHE", True),
    # measured on the H100 at one row between 0.98x and 1.16x the unfused path, by shape
    # and config (docs/notes/decode.md, issue 56): used where the GPU's file says it wins
    "decode_gemv": ("GEMSLIB_DECODE_GEMV", MEASURED),
    # (it takes decode_gemv's q/k/v projections: with decode_gemv off it finds none)
    "decode_gemv_rotary": ("GEMSLIB_DECODE_GEMV_ROTARY", True),
}


def fusion_names() -> tuple[str, ...]:
    """Every fusion the passes know, each switched by the backend option ``gemslib.<name>``."""
    return tuple(dict.fromkeys([p.fusion for p in _patterns()] + [r.fusion for r in _rewrites()]))


def fusion_default(name: str) -> bool | str:
    """Fusion ``name``'s value where no option names it: its environment variable's (read
    now; "1" on, "0" off) where it has one and it is set, else its default (on, but for the
    fusions :data:`_ENVIRONMENT_DEFAULTS` gives another: off, or :data:`MEASURED`)."""
    from gemslib import runtime

    variable, default = _ENVIRONMENT_DEFAULTS.get(name, (None, True))
    if variable is None or not os.environ.get(variable, "").strip():
        return default
    return runtime.env_flag(variable)


def fusion_options(options: Mapping[str, Any] | None = None) -> dict[str, bool | str]:
    """{fusion: True, False or :data:`MEASURED`} from ``options``
    (``{"gemslib.<fusion>": value}``), every fusion not named taking its default
    (:func:`fusion_default`). An unknown ``gemslib.*`` key, or another value, is a
    ValueError."""
    known = fusion_names()
    chosen = {name: fusion_default(name) for name in known}
    for key, value in (options or {}).items():
        name = key[len(OPTION_PREFIX):] if key.startswith(OPTION_PREFIX) else None
        if name not in chosen:
            raise ValueError(f"gemslib backend: unknown option {key!r}; the gemslib options are "
                             f"{', '.join(OPTION_PREFIX + n for n in known)}")
        if not isinstance(value, bool) and value != MEASURED:
            raise ValueError(f"gemslib backend: option {key!r} must be True, False or "
                             f"{MEASURED!r}, got {value!r}")
        chosen[name] = value
    return chosen


# --------------------------------------------------------------------------------------------
# Patterns
# --------------------------------------------------------------------------------------------


def _counted(pattern: GraphPattern) -> Callable[[Any], bool]:
    def check(match) -> bool:
        try:
            accepted = bool(pattern.check(match))
        except Exception as err:  # a site the check cannot read is not proven equal
            log.debug("gemslib %s: check failed on %s: %s", pattern.fusion, match.nodes[-1], err)
            accepted = False
        if accepted and not verdict_allows(pattern.fusion, _main_input(match)):
            log.debug("gemslib %s: left to inductor, faster there at %s (the tune config's "
                      "verdict)", pattern.fusion, match.nodes[-1])
            accepted = False
        if accepted:
            count(pattern.fusion)
            log.debug("gemslib %s: replacing %s", pattern.fusion,
                      ", ".join(node.name for node in match.nodes))
        return accepted
    return check


def _main_input(match) -> Any:
    """The value a matched site's shape is read from: its ``x`` (the norms), else its first
    tensor input (rotary's q)."""
    nodes = [match.kwargs["x"]] if "x" in match.kwargs else list(match.kwargs.values())
    for node in nodes:
        if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor):
            return node.meta["val"]
    return None


@functools.cache
def _pattern_passes(fusions: frozenset[str]):
    """One inductor pattern pass per stage of the patterns of ``fusions``, lowest stage first."""
    from torch._inductor import pattern_matcher

    matchers: dict[int, Any] = {}
    for pattern in _patterns():
        if pattern.fusion not in fusions:
            continue
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


# --------------------------------------------------------------------------------------------
# Rewrites and the real values they read
# --------------------------------------------------------------------------------------------


def compile_record(example_inputs) -> CompileRecord:
    """A record for a compile of a graph of ``example_inputs``; its inputs are the values the
    graph's placeholders stand for: the example inputs themselves, or where some are tensor
    subclasses that AOTAutograd flattens (DTensor), the plain tensors they hold, in
    AOTAutograd's order."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    inputs = list(example_inputs)
    if any(is_traceable_wrapper_subclass(value) for value in inputs):
        return CompileRecord(list(_tensor_leaves(inputs)), leaves=True)
    return CompileRecord(inputs)


def _real_values(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], Any]:
    """placeholder -> the real tensor the backend compiles ``graph`` for, or None: known only
    for the graph whose inputs are the backend's own (an inference graph, or a training
    graph's forward), one to one, or, where inputs are tensor subclasses that AOTAutograd
    flattens (DTensor: its local shard), tensor leaf to tensor placeholder; checked input by
    input against the traced metadata."""
    record = in_flight()
    placeholders = graph.find_nodes(op="placeholder")
    if record is None:
        return {}.get
    from torch._subclasses.fake_tensor import FakeTensor

    inputs = record.inputs
    if record.leaves:
        # the graph's inputs are the leaves, even where there are as many as the subclasses
        # (a DTensor has one: its local shard)
        tensor_placeholders = [node for node in placeholders
                               if isinstance(node.meta.get("val"), torch.Tensor)]
        if len(inputs) != len(tensor_placeholders):
            return {}.get
        pairs = list(zip(tensor_placeholders, inputs))
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


def _apply_rewrites(graph: torch.fx.Graph, fusions: frozenset[str],
                    after_patterns: bool = False) -> int:
    """The rewrites of one phase (before or after the patterns) whose fusions are on, stage by
    stage: each stage's in rounds until none of them fuses anything more."""
    rewrites = [r for r in _rewrites()
                if r.after_patterns == after_patterns and r.fusion in fusions]
    real_value, fused = _real_values(graph), 0
    for stage in sorted({r.stage for r in rewrites}):
        staged = [r for r in rewrites if r.stage == stage]
        for _ in range(8):  # each round may enable another rewrite's site; a few suffice
            round_fused = 0
            for rewrite in staged:
                for site in rewrite.rewrite(graph, real_value):
                    count(rewrite.fusion)
                    log.debug("gemslib %s: %s", rewrite.fusion, site)
                    round_fused += 1
            if not round_fused:
                break
            fused += round_fused
    return fused


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


class GemslibPasses(CustomGraphPass):
    """The inductor post-grad pass for one set of options (``{"gemslib.<fusion>": value}``;
    see :func:`fusion_options`): the families' ``GRAPH_REWRITES``, then their
    ``GRAPH_PATTERNS``, then the rewrites marked ``after_patterns`` (each phase of rewrites
    stage by stage), each only where its fusion is on. Options not given take their defaults
    when the pass runs."""

    def __init__(self, options: Mapping[str, bool | str] | None = None):
        self.options = dict(options or {})
        if self.options:
            fusion_options(self.options)  # an unknown key fails here, not at the compile

    def fusions(self) -> frozenset[str]:
        """The fusions switched on (those on only where measured included)."""
        return frozenset(name for name, on in fusion_options(self.options).items() if on)

    def measured_only(self) -> frozenset[str]:
        """The fusions on only where the tune config's verdicts measured them faster."""
        return frozenset(name for name, on in fusion_options(self.options).items()
                         if on == MEASURED)

    def __call__(self, graph: torch.fx.Graph) -> None:
        record = in_flight()
        if record is not None:
            record.ran = True
        with measured_only(self.measured_only()):
            self._fuse(graph)

    def _fuse(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        from gemslib import runtime

        fusions = self.fusions()
        replaced = _apply_rewrites(graph, fusions)
        if replaced:
            graph.eliminate_dead_code()
        for matcher in _pattern_passes(fusions):
            matched = matcher.apply(graph)
            if matched:
                # a replacement of several outputs goes before the first of them, which may
                # come before the producers of the other outputs' inputs (rotary: k's
                # projection follows q's rotary); sort before the next stage matches and
                # before eliminate_dead_code lints the graph
                stable_topological_sort(graph)
                graph.eliminate_dead_code()
                replaced += matched
        late = _apply_rewrites(graph, fusions, after_patterns=True)
        if late:
            graph.eliminate_dead_code()
            replaced += late
        if replaced:
            _free_layouts(graph)
            log.debug("gemslib: %d sites replaced in one graph", replaced)
        if runtime.GRAPH_OVERLOADS.on:
            _call_graph_overloads(graph)

    def uuid(self) -> str:
        """A hash of what decides the graph the passes make: their source and the operators'
        (a fusion's verdict may be an operator's), the fusions switched on, the tune config
        (a verdict may read it) and whether its verdicts are set aside, the device, and for
        the compile in flight the state of its inputs that decides a fusion
        (``CompileRecord.state``)."""
        from gemslib import runtime

        digest = hashlib.sha256(_source_hash().encode())
        record = in_flight()
        if record is not None:
            digest.update(record.state.encode())
        digest.update(repr(sorted(fusion_options(self.options).items())).encode())
        digest.update(repr(runtime.GRAPH_OVERLOADS.on).encode())
        digest.update(repr(runtime.verdicts_ignored()).encode())
        try:
            digest.update(runtime.config_path().read_bytes())
        except OSError:
            digest.update(b"no tune config")
        digest.update(_device_identity().encode())
        return digest.hexdigest()


@functools.cache
def _source_hash() -> str:
    """A hash of gemslib's Python source: the passes, the operators (``gemslib.ops``,
    ``gemslib.fused``) and the modules they share."""
    folders = [Path(__file__).parent.parent] + [
        Path(folder) for name in ("gemslib.ops", "gemslib.fused")
        for folder in importlib.import_module(name).__path__]
    paths = {path.resolve() for folder in folders for path in folder.rglob("*.py")}
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _device_identity() -> str:
    """The Triton interpreter, or the CUDA device's name and capability (a verdict may read
    them), or none."""
    from gemslib import runtime

    if runtime.INTERPRETER:
        return "interpreter"
    if not torch.cuda.is_available():
        return "no gpu"
    return f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}"


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


def _call_graph_overloads(graph: torch.fx.Graph) -> None:
    """Every gemslib operator of the graph (put there by the passes, or by the model's own
    calls) called through its ``graph`` overload: no autograd, planned calls replayed in C++
    (see ``gemslib.runtime.custom_op.define_graph_overload``). Last, since the patterns and
    rewrites match the default overloads."""
    from gemslib.runtime.custom_op import GRAPH_OVERLOAD

    def graph_overload(target):
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "gemslib" and \
                target._overloadname == "default":
            return getattr(target.overloadpacket, GRAPH_OVERLOAD, None)
        return None

    functionalized = (torch.ops.higher_order.auto_functionalized,
                      getattr(torch.ops.higher_order, "auto_functionalized_v2", None))
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in functionalized and node.args:  # a mutating op, not yet reinplaced
            overload = graph_overload(node.args[0])
            if overload is not None:
                node.args = (overload, *node.args[1:])
            continue
        overload = graph_overload(node.target)
        if overload is not None:
            node.target = overload


PASSES = GemslibPasses()
