"""Checks of the arguments of the public functions.

Scalars follow torch's own rules and words: torch's Python argument parser takes, for a
``float`` argument, any real number (bool and int included) or a 0-d tensor; for an ``int``,
an integer that is not a bool, or a 0-d integer tensor; for a ``bool``, only a bool. Anything else is a ``TypeError`` that names the argument:
``gemslib.rms_norm(): argument 'eps' must be float, not str``.

Tensors: a ``TypeError`` for a value that is not a tensor, or not a floating-point one, and a
``ValueError`` for one whose dtype or device differs from the tensor it goes with, each naming
the function and the argument: ``gemslib.silu: x must be a torch.Tensor, got list``.
"""

from __future__ import annotations

import numbers

import torch


def _type_name(value) -> str:
    return "NoneType" if value is None else type(value).__name__


def _fail(function: str, name: str, expected: str, value) -> TypeError:
    return TypeError(f"{function}(): argument '{name}' must be {expected}, not {_type_name(value)}")


def as_float(function: str, name: str, value, optional: bool = False) -> float | None:
    """``value`` as a Python float (None passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        return float(value)
    raise _fail(function, name, "float" if not optional else "float or None", value)


def as_int(function: str, name: str, value) -> int:
    """``value`` as a Python int: an integer that is not a bool, or a 0-d integer tensor."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and \
            type(value).__name__ != "bool_":
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value)
    raise _fail(function, name, "int", value)


def as_bool(function: str, name: str, value) -> bool:
    """``value`` as a Python bool: a bool (or numpy's) only, as torch requires."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise _fail(function, name, "bool", value)


def tensor(function: str, name: str, value, or_none: bool = False) -> None:
    """A ``TypeError`` unless ``value`` is a tensor (or None, when ``or_none``)."""
    if value is None and or_none:
        return
    if not isinstance(value, torch.Tensor):
        expected = "a torch.Tensor or None" if or_none else "a torch.Tensor"
        raise TypeError(f"{function}: {name} must be {expected}, got {type(value).__name__}")


def float_tensor(function: str, name: str, value,
                 expected: str = "a floating-point tensor") -> None:
    """A ``TypeError`` unless ``value`` is a floating-point tensor (``expected`` words it)."""
    tensor(function, name, value)
    if not value.is_floating_point():
        raise TypeError(f"{function}: {name} must be {expected}, got {value.dtype}")


def like(function: str, name: str, value: torch.Tensor, reference: torch.Tensor,
         reference_name: str | None = None) -> None:
    """A ``ValueError`` unless ``value`` has ``reference``'s dtype and device."""
    if value.dtype != reference.dtype or value.device != reference.device:
        like_what = f" like {reference_name}" if reference_name else ""
        raise ValueError(f"{function}: {name} must be {reference.dtype} on {reference.device}"
                         f"{like_what}, got {value.dtype} on {value.device}")
