"""Where kernels run and which paths they take: environment flags, the Triton interpreter,
the dispatch key, and the kernel paths an operator can switch off (:class:`KernelPath`)."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import torch


def env_flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "").strip().lower() in ("1", "true", "yes",
                                                                             "on")


# Triton decides at decoration time whether @triton.jit builds interpreted functions, so the
# mode is frozen when gemslib is imported, exactly like the kernels themselves.
INTERPRETER: bool = env_flag("TRITON_INTERPRET")


def cache_dir() -> Path:
    """gemslib's own cache on this machine (the built native module, GPU files tuned here):
    ``$GEMSLIB_CACHE_DIR``, or ``$XDG_CACHE_HOME/gemslib`` (default ``~/.cache/gemslib``)."""
    explicit = os.environ.get("GEMSLIB_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gemslib"


def device_type() -> str:
    """``"cpu"`` under the Triton interpreter, else ``"cuda"``."""
    return "cpu" if INTERPRETER else "cuda"


def dispatch_key() -> str:
    """The dispatch key gemslib overrides aten operators under: ``CPU`` or ``CUDA``."""
    return "CPU" if INTERPRETER else "CUDA"


@contextlib.contextmanager
def _quietly():
    import warnings

    import numpy

    with numpy.errstate(all="ignore"), warnings.catch_warnings():
        # Triton 3.6's interpreter indexes loops with one-element numpy arrays
        warnings.filterwarnings("ignore", "Conversion of an array with ndim > 0 to a scalar",
                                DeprecationWarning)
        yield


def quiet_interpreter():
    """Around interpreted launches: the interpreter computes in numpy, which warns where the
    kernels meet -inf, NaN or overflow on purpose (exp of a large shift, log2 of a zero sum,
    inf inputs), and Triton 3.6's interpreter trips a numpy DeprecationWarning itself; the
    results are the intended ones, as on a GPU, so those warnings would only reach user
    scripts as noise (or, under ``-W error``, fail the launch). A no-op on a GPU."""
    return _quietly() if INTERPRETER else contextlib.nullcontext()


class KernelPath:
    """An alternative kernel an operator takes where it applies (a Gluon kernel on sm_90, say),
    on by default. ``with path.switched_off():`` keeps the calls inside the block, whichever
    thread runs them (autograd's backward runs in its own), on the operator's Triton kernel: how
    tuning problems and benchmarks pick a path, instead of flipping a module flag."""

    def __init__(self, op: str, description: str, environment: str | None = None,
                 default: bool = True):
        self.op, self.description = op, description
        # nesting depth of switched_off() blocks; 1 outside any for a path the environment
        # variable ``environment`` (else ``default``) leaves off
        self._switched_off = int(not (env_flag(environment, default) if environment
                                      else default))

    @property
    def on(self) -> bool:
        return not self._switched_off

    @contextlib.contextmanager
    def switched_off(self):
        self._switched_off += 1
        try:
            yield
        finally:
            self._switched_off -= 1

    @contextlib.contextmanager
    def switched_on(self):
        """The path on inside the block, whatever its default: how tests and benchmarks reach
        an opt-in path."""
        saved, self._switched_off = self._switched_off, 0
        try:
            yield
        finally:
            self._switched_off = saved

    def __repr__(self) -> str:
        return f"<gemslib kernel path {self.op}: {self.description}, {'on' if self.on else 'off'}>"


DIRECT_LAUNCH = KernelPath("every operator", "launches of a repeated call straight to the "
                           "compiled kernel, past Triton's argument binding")
NATIVE_REPLAY = KernelPath("every operator", "planned calls replayed in C++ "
                           "(gemslib.runtime.native), not by their generated Python")
GRAPH_OVERLOADS = KernelPath("every operator", "compiled graphs call the operators' graph "
                             "overloads (no autograd, planned), not their default ones",
                             environment="GEMSLIB_GRAPH_OVERLOADS")
# Programmatic dependent launch (sm_90 and later): a kernel built for it (TunedKernel's
# ``dependent_launch``) starts its blocks while the kernel before it on the stream finishes,
# and waits in griddepcontrol.wait before touching memory, which hides the gap between small
# kernels (see docs/notes/decode.md). GEMSLIB_PDL=0 launches them plain
DEPENDENT_LAUNCH: bool = env_flag("GEMSLIB_PDL", default=True)


@functools.cache
def dependent_launch_here() -> bool:
    """Whether kernels built for it are launched dependent in this process: GEMSLIB_PDL not
    0, a real GPU, the current one of compute capability 9.0 or later."""
    return DEPENDENT_LAUNCH and not INTERPRETER and torch.cuda.is_available() and \
        torch.cuda.get_device_capability() >= (9, 0)


# GEMSLIB_PDL_EARLY=1: each such kernel also lets the next one launch as soon as its own wait
# is over (griddepcontrol.launch_dependents), and the GEMVs prefetch their first K step of W
# into L2 before they wait, so a kernel's ramp runs under the previous one's work. Off: an
# H100's 1B decode step ran 4% slower with it (docs/notes/decode.md, the GEMVs' boundaries).
EARLY_DEPENDENTS: bool = env_flag("GEMSLIB_PDL_EARLY")


def early_dependents_here() -> bool:
    """Whether kernels launched dependent here also trigger their dependents early and
    prefetch their weights: :func:`dependent_launch_here` and GEMSLIB_PDL_EARLY."""
    return EARLY_DEPENDENTS and dependent_launch_here()
