"""Tolerances and comparisons against float64 references, shared by tests and ``python -m gemslib``.

Relative tolerances are ``torch.testing.assert_close``'s defaults for each dtype; the absolute
tolerance grows with the square root of the reduction length, since rounding errors of a sum of
``n`` terms grow like ``sqrt(n)``.
"""

from __future__ import annotations

import math

import torch

_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float32: 1.3e-6, torch.float64: 1e-7}
_ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-5, torch.float32: 1e-5, torch.float64: 1e-7}


def tolerance(dtype: torch.dtype, reduction_len: int = 1) -> dict[str, float]:
    """``dict(rtol=..., atol=...)`` for outputs of ``dtype`` from sums of ``reduction_len`` terms."""
    return {"rtol": _RTOL[dtype], "atol": _ATOL[dtype] * math.sqrt(max(reduction_len, 1))}


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                              reduction_len: int = 1, msg: str = "",
                              term_scale: float = 0.0) -> None:
    """Compare ``actual`` (in ``dtype``) with a float64 ``expected``; NaN must match NaN.
    ``term_scale``: the size of the terms an output combines (e.g. attention's values, whose
    weights are rounded to ``dtype``): absolute errors up to rtol * term_scale are rounding."""
    bounds = tolerance(dtype, reduction_len)
    bounds["atol"] = max(bounds["atol"], bounds["rtol"] * term_scale)
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), equal_nan=True,
                               check_dtype=False, msg=(lambda m: f"{msg}\n{m}") if msg else None,
                               **bounds)


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` over finite entries (0 for empty tensors)."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    finite = torch.isfinite(expected)
    if not finite.any():
        return 0.0
    diff = (actual[finite] - expected[finite]).norm()
    return float(diff / expected[finite].norm().clamp_min(1e-300))
