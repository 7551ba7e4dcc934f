"""The ``"gemslib"`` torch.compile backend: inductor with gemslib's passes after its own
post-grad passes.

    model = torch.compile(model, backend="gemslib")                          # passes + inductor
    model = torch.compile(model, backend="gemslib", mode="reduce-overhead")  # ... in CUDA graphs
    model = torch.compile(model, backend="gemslib",
                          options={"gemslib.rotary_into_cache": False})     # a fusion off

Options named ``gemslib.<fusion>`` switch a fusion (see ``fusion_options``); the rest
go to inductor as its config patches, as ``backend="inductor"`` takes them. With CUDA graphs
on (``mode="reduce-overhead"`` or ``triton.cudagraphs``), ``gemslib.step_graphs`` replays an
inference graph on the GPU from a CUDA graph of gemslib's own instead of inductor's trees
(``gemslib.passes.step_graph``: less host time a call, a copy of each output): True always,
False never, ``"auto"`` (the default; ``GEMSLIB_STEP_GRAPHS=1`` / ``0`` gives True / False)
only where the graph's outputs have static sizes totalling at most ``AUTO_OUTPUT_BYTES`` and
none of them is a view of an input.

A warm compile (one inductor's FX graph cache or AOTAutograd's cache serves) skips the
passes. What the passes did besides editing the graph is therefore written beside inductor's
cache for each compile, and redone when the passes did not run: the fusions are counted in the
report, and the parameters merged_linear's rewrite merged are merged again (see
docs/notes/compile-cache.md).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from gemslib.passes.base import CompileRecord, compiling
from gemslib.passes.manager import (OPTION_PREFIX, GemslibPasses, compile_record, count,
                                    fusion_options)

log = logging.getLogger("gemslib.passes")

_passes: dict[tuple, GemslibPasses] = {}  # one pass object per set of options


def passes_for(options: Mapping[str, bool | str]) -> GemslibPasses:
    """The pass for ``options`` (``{"gemslib.<fusion>": value}``), every fusion's default
    read now (an environment variable may give one)."""
    resolved = fusion_options(options)
    key = tuple(sorted(resolved.items()))
    if key not in _passes:
        _passes[key] = GemslibPasses(
            {OPTION_PREFIX + name: on for name, on in resolved.items()})
    return _passes[key]


def backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
            options: Mapping[str, Any] | None = None):
    """The ``"gemslib"`` torch.compile backend: inductor (with ``mode``'s or ``options``'
    settings, as ``backend="inductor"`` takes them) plus gemslib's passes, the fusions
    switched by the options ``gemslib.<fusion>``."""
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    options = dict(options or {})
    step_graphs = options.pop(STEP_GRAPHS_OPTION) if STEP_GRAPHS_OPTION in options else \
        step_graphs_default()
    if not (isinstance(step_graphs, bool) or step_graphs == "auto"):
        raise ValueError(f"gemslib backend: option {STEP_GRAPHS_OPTION!r} must be True, False "
                         f"or 'auto', got {step_graphs!r}")
    ours = {key: options.pop(key) for key in list(options)
            if key.startswith(OPTION_PREFIX)}
    if mode is not None and options:
        raise RuntimeError("gemslib backend: either mode or options can be given, not both "
                           "(as with inductor)")
    patches = dict(torch._inductor.list_mode_options(mode)) if mode is not None else {}
    patches.update(options)
    if patches.get("post_grad_custom_post_pass") is not None and not isinstance(
            patches["post_grad_custom_post_pass"], GemslibPasses):
        raise ValueError("gemslib backend: options sets post_grad_custom_post_pass, which is "
                         "where gemslib's passes go; install gemslib.passes.PASSES in your own "
                         "pass instead")
    passes = passes_for(ours)
    patches["post_grad_custom_post_pass"] = passes
    # inductor's shape padding rewrites a matmul whose rows are not aligned into a padded one
    # when a timing on the GPU favours it, and that decides per run whether the projections
    # still read as linear layers; merged_linear's GEMM over aligned weights needs no padding
    patches.setdefault("shape_padding", False)
    # inductor checks every fallback's outputs against their fake tensors' sizes and strides
    # on each call (~0.4 us an output, host time its own kernels never pay); gemslib's ops
    # allocate their outputs as their fake kernels do (opcheck'd), so the graph skips them
    patches.setdefault("size_asserts", False)

    # gemslib's own CUDA graph for an inference graph on the GPU; training and CPU graphs
    # keep inductor's path, and under "auto" so does a graph whose outputs are large or of
    # sizes unknown here (a step graph copies every output on every replay)
    own_graph = step_graphs is not False and bool(patches.get("triton.cudagraphs")) and \
        not _trains(example_inputs) and _on_cuda(example_inputs)
    if own_graph and step_graphs == "auto":
        size = _outputs_bytes(gm)
        own_graph = size is not None and size <= AUTO_OUTPUT_BYTES and \
            not _outputs_alias_inputs(gm)
    if own_graph:
        patches["triton.cudagraphs"] = False

    from gemslib.passes.linear import merge_once, merge_state

    lower_gemslib_ops_as_fallbacks()
    record = compile_record(example_inputs)
    # the merges a compile can make depend on the merges made before it (a parameter merged
    # in one group is not merged into another): part of what names the compile
    record.state = merge_state(record.inputs)
    with compiling(record):
        path = _record_path(gm, example_inputs, passes, patches)
        compiled = compile_fx(gm, example_inputs, config_patches=patches)
    if record.ran:
        _write(path, record)
    else:
        _replay(path, record, merge_once)
    if own_graph:
        from gemslib.passes.step_graph import StepGraphs

        return StepGraphs(compiled)
    return compiled


STEP_GRAPHS_OPTION = "gemslib.step_graphs"
STEP_GRAPHS_ENV = "GEMSLIB_STEP_GRAPHS"
# "auto"'s bound: output copies cost ~2 x bytes / copy bandwidth (~11 us) vs ~0.1 ms host saved
AUTO_OUTPUT_BYTES = 16 << 20


def step_graphs_default() -> bool | str:
    """The default of ``gemslib.step_graphs``, from ``GEMSLIB_STEP_GRAPHS``: "1" -> True,
    "0" -> False, unset or empty -> "auto"."""
    value = os.environ.get(STEP_GRAPHS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"gemslib: {STEP_GRAPHS_ENV} must be 1, 0 or unset, got {value!r}")
    return {"": "auto", "0": False, "1": True}[value]


def _output_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    nodes: list[torch.fx.Node] = []
    for output in gm.graph.find_nodes(op="output"):
        torch.fx.node.map_arg(output.args, nodes.append)
    return nodes


_UNKNOWN = object()


def _tensor_values(node: torch.fx.Node):
    """The fake tensors dynamo keeps in ``node``'s meta (its value's tensor leaves), or
    ``[_UNKNOWN]`` where the node has no value."""
    value = node.meta.get("example_value", node.meta.get("val", _UNKNOWN))
    if value is _UNKNOWN:
        return [_UNKNOWN]
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value)
            if isinstance(leaf, torch.Tensor)]


def _outputs_bytes(gm: torch.fx.GraphModule) -> int | None:
    """The bytes of ``gm``'s outputs, sum of numel x element size over its tensor outputs
    (other outputs 0), read from the fake values dynamo keeps in each output node's meta;
    None where that is not known at compile time (a symbolic size, a node without a value)."""
    total = 0
    for node in _output_nodes(gm):
        for value in _tensor_values(node):
            if value is _UNKNOWN or not all(isinstance(size, int) for size in value.shape):
                return None
            total += value.numel() * value.element_size()
    return total


def _outputs_alias_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether an output of ``gm`` shares its storage with an input (a view of a parameter,
    a buffer or an argument), read from dynamo's fake values: a step graph refuses such an
    output at its capture and then runs without a CUDA graph, where the trees handle it."""
    def storages(nodes):
        return {value.untyped_storage()._cdata for node in nodes
                for value in _tensor_values(node) if value is not _UNKNOWN}

    return bool(storages(_output_nodes(gm)) & storages(gm.graph.find_nodes(op="placeholder")))


def _trains(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _on_cuda(example_inputs) -> bool:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.is_cuda for t in tensors)


def lower_gemslib_ops_as_fallbacks() -> None:
    """Give every gemslib operator inductor's fallback lowering before a compile, as inductor
    gives one to an operator it meets without a lowering (the same layout constraint, from
    the operator's tags), but without the step before it: inductor first logs the call's
    arguments, and torch before 2.12 formats that message whether or not it is shown. An IR
    node's string holds its inputs' strings, so it grows with the graph above the call (a
    decode step's first q/k/v GEMV: 1.1 MB of text). Operators defined later (a plugin's)
    still take inductor's own path."""
    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:  # another torch: inductor's own path, message included
        return
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, qualified = name.partition("::")
        if namespace != "gemslib":
            continue
        packet_name, _, overload_name = qualified.partition(".")
        op = getattr(getattr(torch.ops.gemslib, packet_name), overload_name or "default")
        if op in lowerings:
            continue
        try:
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False)
        except Exception as err:  # another torch's signatures: inductor's own path for it
            log.debug("gemslib: no fallback registered ahead for %s: %s", op, err)


def _record_path(gm, example_inputs, passes: GemslibPasses, patches) -> Path:
    """Where the record of a compile of ``gm`` for ``example_inputs`` goes: under inductor's
    cache dir, named by a hash of what inductor's own key reads that decides the passes' work
    (the graph, its inputs' metadata, the config patches, the passes' uuid)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    digest = hashlib.sha256()
    for part in (gm.code, _inputs_metadata(example_inputs), passes.uuid(), torch.__version__,
                 repr(torch.is_grad_enabled()), repr(_settings_changed(patches))):
        digest.update(str(part).encode())
        digest.update(b"\0")
    return Path(cache_dir()) / "gemslib" / f"{digest.hexdigest()}.json"


def _settings_changed(patches) -> list[tuple[str, str]]:
    """The inductor settings ``patches`` change from those in force, sorted: inductor's own key
    reads the settings a compile runs with, so a patch that restates one (the step graph's
    ``triton.cudagraphs=False`` in a process whose default is False) must name the same
    compile, or a compile inductor's cache serves finds no record to replay."""
    import torch._inductor.config as inductor_config

    in_force = inductor_config.get_config_copy()
    missing = object()
    return sorted((key, repr(value)) for key, value in patches.items()
                  if key != "post_grad_custom_post_pass" and in_force.get(key, missing) != value)


def _inputs_metadata(example_inputs) -> list[str]:
    described = []
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            described.append(f"{type(value).__name__} {value.dtype} {tuple(value.shape)} "
                             f"{value.stride()} {value.device.type} {value.requires_grad}")
        else:
            described.append(type(value).__name__)
    return described


def _write(path: Path, record: CompileRecord) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"fusions": dict(record.fusions),
                                       "merged": record.merged}))
        os.replace(partial, path)  # whole or not at all, for a process reading it meanwhile
    except OSError as err:  # a read-only cache: the next process compiles cold, no harm
        log.debug("gemslib: could not write %s: %s", path, err)


def _replay(path: Path, record: CompileRecord, merge_once) -> None:
    """Redo what the passes did for a compile that inductor's caches served."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        log.debug("gemslib: no record at %s of a compile the caches served", path)
        return
    for fusion, sites in saved.get("fusions", {}).items():
        count(fusion, sites)
    for group in saved.get("merged", []):
        if all(0 <= i < len(record.inputs) for i in group):
            merge_once([record.inputs[i] for i in group])
