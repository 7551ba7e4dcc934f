"""RMSNorm the way models write it -> gemslib's rms_norm and add_rms_norm (patterns).

transformers' RMSNorm (with its epsilon a number, or a graph input under ``dynamic=True``),
Gemma's ``(1 + weight)`` RMSNorm (the kernel's ``weight_offset`` 1) and ``F.rms_norm`` as
torch decomposes it, each alone or after a decoder layer's residual add.
"""

from __future__ import annotations

import functools

import torch

from gemslib import runtime
from gemslib.ops import rms_norm as _rms_norm_ops  # noqa: F401  (defines torch.ops.gemslib's norms)
from gemslib.passes.base import GraphPattern
from gemslib.passes.forms import gemma_rms_norm, same_size, transformers_rms_norm


def _transformers_rms_norm_eps_input(x, weight, eps):
    """transformers' RMSNorm with its epsilon a graph input (a 0-d float64 tensor), as dynamo
    traces it under ``dynamic=True``."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps.to(torch.float32))
    return weight * h.to(dtype)


def _gemma_rms_norm_eps_input(x, weight, eps):
    """Gemma's RMSNorm with its epsilon a graph input (see the transformers one above)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps.to(torch.float32))
    return (h * (1.0 + weight.float())).type_as(x)


def _functional_rms_norm(x, weight, eps):
    """``F.rms_norm`` over the last dim, in the form torch decomposes it to (written out: the
    pattern tracer does not functionalise the decomposition's in-place add, and the
    decomposition names the dim from the front): the weight is applied in fp32, before the one
    rounding to x's dtype, as the kernel does."""
    h = x.to(torch.float32)
    h = h * torch.ops.aten.add.Scalar(h.pow(2).mean(x.dim() - 1, keepdim=True), eps).rsqrt()
    return (h * weight).to(x.dtype)


def _functional_rms_norm_unweighted(x, eps):
    h = x.to(torch.float32)
    h = h * torch.ops.aten.add.Scalar(h.pow(2).mean(x.dim() - 1, keepdim=True), eps).rsqrt()
    return h.to(x.dtype)


def _after_residual_add(norm):
    """A decoder layer's ``hidden = residual + x`` followed by ``norm``; both are used."""
    def add_norm(x, residual, weight, eps):
        total = residual + x
        return norm(total, weight, eps), total
    add_norm.__name__ = f"add_then_{norm.__name__}"
    return add_norm


def _replacements(weight_offset: float):
    """gemslib's four norm ops for one ``weight_offset`` (0: none, as most models; 1: Gemma's
    ``1 + w``): (rms_norm, add_rms_norm, with eps a number or a graph input). Offset 0 is not
    passed: a norm node of three arguments is one the fused MLP rewrite can read."""
    offset = () if weight_offset == 0.0 else (weight_offset,)

    def norm(x, weight, eps):
        return torch.ops.gemslib.rms_norm_forward(x, weight, eps, *offset)[0]

    def add_norm(x, residual, weight, eps):
        normed, total = torch.ops.gemslib.add_rms_norm(x, residual, weight, eps, *offset)
        return normed, total

    def norm_eps_input(x, weight, eps):
        return torch.ops.gemslib.rms_norm_eps_input(x, weight, eps, *offset)

    def add_norm_eps_input(x, residual, weight, eps):
        normed, total = torch.ops.gemslib.add_rms_norm_eps_input(x, residual, weight, eps,
                                                                 *offset)
        return normed, total
    return norm, add_norm, norm_eps_input, add_norm_eps_input


def _unweighted_rms_norm_replacement(x, eps):
    return torch.ops.gemslib.rms_norm_forward(x, None, eps)[0]


def _is_rms_norm_of(match, x, eps_is_input: bool = False) -> bool:
    """The matched nodes compute an RMSNorm of ``x`` (a FakeTensor) over its last dim exactly:
    the exponent, the reduced dim and both casts (the matcher compares them too), statistics
    in fp32, and a weight of one row of x's width and dtype (the result's dtype and shape are
    then x's, as the kernel gives them). eps is a number, or with ``eps_is_input`` a 0-d CPU
    tensor."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if x.dtype not in runtime.KERNEL_DTYPES or x.dim() < 1:
        return False
    aten, prims = torch.ops.aten, torch.ops.prims
    eps_input = match.kwargs.get("eps")
    if isinstance(eps_input, torch.fx.Node) != eps_is_input:
        return False  # a number pattern's eps matched to a tensor, or the other way round
    if eps_is_input:  # a 0-d float tensor on the CPU, read without a device sync
        eps = eps_input.meta["val"]
        if eps.dim() != 0 or not eps.dtype.is_floating_point or eps.device.type != "cpu":
            return False
    else:
        # eps is read from the graph: torch 2.11 hands the check the re-traced match, in which
        # eps is a constant, not a keyword
        eps = [node.args[1] for node in match.nodes
               if node.target in (aten.add.Scalar, aten.add.Tensor)
               and any(user.target is aten.rsqrt.default for user in node.users)]
        if len(eps) != 1 or not isinstance(eps[0], (int, float)):
            return False
    if "weight" in match.kwargs:
        weight = match.kwargs["weight"].meta["val"]
        if weight.dtype != x.dtype or weight.dim() != 1 or not statically_known_true(
                weight.shape[0] == x.shape[-1]):
            return False
    casts = [node for node in match.nodes if node.target is prims.convert_element_type.default
             and node.args[0] is not eps_input]
    if not casts and x.dtype != torch.float32:  # 16-bit statistics: not what the kernel computes
        return False
    for node in match.nodes:
        if node.target is aten.pow.Tensor_Scalar and node.args[1] != 2:
            return False
        if node.target is aten.mean.dim and (
                [d % x.dim() for d in node.args[1]] != [x.dim() - 1] or node.args[2] is not True):
            return False
        if node in casts:
            # up to fp32 for the statistics, back to x's dtype before the weight
            source = node.args[0].meta["val"].dtype
            if node.args[1] != (torch.float32 if source == x.dtype else x.dtype):
                return False
    return True


def _is_rms_norm(match, eps_is_input: bool = False) -> bool:
    return _is_rms_norm_of(match, match.kwargs["x"].meta["val"], eps_is_input)


def _is_transformers_add_rms_norm(match, eps_is_input: bool = False) -> bool:
    """The norm of x + residual, with x and residual of one shape and dtype (no broadcast)."""
    x, residual = match.kwargs["x"].meta["val"], match.kwargs["residual"].meta["val"]
    if x.dtype != residual.dtype or x.dim() != residual.dim() or not all(
            same_size(a, b) for a, b in zip(x.shape, residual.shape)):
        return False
    return _is_rms_norm_of(match, x, eps_is_input)


def _pattern_inputs(dtype, n_rows_tensors, weighted=True, eps_input=False):
    """Example inputs for tracing a pattern: (2, 8) tensors, then an (8,) weight, then a 0-d
    float64 eps when it is an input."""
    return lambda: (*(torch.empty(2, 8, dtype=dtype) for _ in range(n_rows_tensors)),
                    *((torch.empty(8, dtype=dtype),) if weighted else ()),
                    *((torch.empty((), dtype=torch.float64),) if eps_input else ()))


def _family(dtype, norm, norm_eps_input, weight_offset: float):
    """A norm form's four patterns for ``dtype``: after a residual add first (its norm is an
    rms_norm site too, and the larger match must win), eps a number or a graph input."""
    norm_op, add_op, norm_eps_op, add_eps_op = _replacements(weight_offset)
    eps_is_input = functools.partial(_is_transformers_add_rms_norm, eps_is_input=True)
    return (
        GraphPattern("add_rms_norm", _after_residual_add(norm), add_op, _pattern_inputs(dtype, 2),
                     check=_is_transformers_add_rms_norm, scalars={"eps": 1e-6}),
        GraphPattern("add_rms_norm", _after_residual_add(norm_eps_input), add_eps_op,
                     _pattern_inputs(dtype, 2, eps_input=True), check=eps_is_input),
        GraphPattern("rms_norm", norm, norm_op, _pattern_inputs(dtype, 1), check=_is_rms_norm,
                     scalars={"eps": 1e-6}),
        GraphPattern("rms_norm", norm_eps_input, norm_eps_op,
                     _pattern_inputs(dtype, 1, eps_input=True),
                     check=functools.partial(_is_rms_norm, eps_is_input=True)))


# Each for 16-bit x (the casts are in the graph) and fp32 x (they trace away: another pattern).
_NO_OFFSET = _replacements(0.0)
GRAPH_PATTERNS = tuple(
    pattern for dtype in (torch.float16, torch.float32) for pattern in (
        *_family(dtype, transformers_rms_norm, _transformers_rms_norm_eps_input, 0.0),
        *_family(dtype, gemma_rms_norm, _gemma_rms_norm_eps_input, 1.0),
        GraphPattern("add_rms_norm", _after_residual_add(_functional_rms_norm), _NO_OFFSET[1],
                     _pattern_inputs(dtype, 2), check=_is_transformers_add_rms_norm,
                     scalars={"eps": 1e-6}),
        GraphPattern("rms_norm", _functional_rms_norm, _NO_OFFSET[0],
                     _pattern_inputs(dtype, 1), check=_is_rms_norm,
                     scalars={"eps": 1e-6}),
        GraphPattern("rms_norm", _functional_rms_norm_unweighted, _unweighted_rms_norm_replacement,
                     _pattern_inputs(dtype, 1, weighted=False), check=_is_rms_norm,
                     scalars={"eps": 1e-6})))
