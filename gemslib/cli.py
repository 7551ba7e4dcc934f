"""Argument helpers shared by the package's command lines (``python -m gemslib``, its demo,
``python -m gemslib.tune``, ``python -m benchmark``).

Standard library only, so that any command line can take them without a cycle or a heavy
import.
"""

from __future__ import annotations

import argparse
import re


def plain_help(text: str) -> str:
    """A docstring's text as --help prints it: reST literals (``x``, `x`) as plain x."""
    return re.sub(r"`{1,2}([^`]+)`{1,2}", r"\1", text)


def doc_summary(doc: str) -> str:
    """The first line of a module docstring, for an ArgumentParser's description."""
    return plain_help(doc.strip().splitlines()[0])


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def size_pair(form: str):
    """argparse ``type=`` for ``form`` (e.g. "BxS"): two positive integers joined by x."""
    def parse(text: str) -> tuple[int, int]:
        parts = text.lower().split("x")
        try:
            values = tuple(int(part) for part in parts)
        except ValueError:
            values = ()
        if len(values) != 2 or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"expected {form} with positive integers (e.g. 1x4096), got {text!r}")
        return values
    parse.__name__ = form
    return parse
