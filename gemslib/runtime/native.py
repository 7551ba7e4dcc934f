"""gemslib's native replay of planned calls: a small C++ module, built on first use.

A planned call (:class:`~gemslib.runtime.plans.CallPlans`) spends its host time in Python: the
signature from every argument, the lookup, the allocations and the compiled launcher's
argument parsing. ``_launch.cpp`` (with the ``_launch_*.h`` headers beside it) does the same
work in C++ (a table per operator, from the call's signature to its plan: outputs to allocate
and kernels to launch with ``cuLaunchKernel``), so that a repeated call costs about what
torch's own call costs. For the aten overrides of ``enable()`` it also registers a kernel
after autograd (``register_replay``: ADInplaceOrView, functional operators only) that
replays a planned call from the dispatcher's stack without entering Python at all, and
passes any other call on to the override's Python kernel.

The module is compiled against the installed torch with the system's C++ compiler (Triton
needs a C compiler on the machine anyway), once per source, torch and Python version, into
``$GEMSLIB_CACHE_DIR`` (default ``~/.cache/gemslib``). It is used only on CUDA (not under the
interpreter) and only where it builds and the driver loads; anything else leaves the Python
replay in charge, which computes the same thing. ``GEMSLIB_NATIVE=0`` switches it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from gemslib.runtime import env
from gemslib.runtime.cuda import split_scratch

log = logging.getLogger("gemslib.runtime.native")

SOURCE = Path(__file__).with_name("_launch.cpp")
HEADERS = tuple(sorted(SOURCE.parent.glob("_launch_*.h")))  # included by SOURCE
_MODULE_NAME = "gemslib_launch"
_lock = threading.Lock()
_state: dict = {}  # "module": the loaded module or None, "error": why it is not there


cache_dir = env.cache_dir  # where built modules are kept


def _cuda_header_dir() -> Path | None:
    """Triton's copy of ``cuda.h`` (its launcher is built with it; the module needs only the
    driver API's types, and finds the functions in libcuda at run time)."""
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return None
    include = Path(nvidia.__file__).parent / "include"
    return include if (include / "cuda.h").exists() else None


def _build_command(output: Path) -> list[str] | None:
    from torch.utils import cpp_extension

    cuda_include = _cuda_header_dir()
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cuda_include is None or compiler is None:
        return None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                str(cuda_include)]
    libraries = cpp_extension.library_paths()
    return [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in includes),
            str(SOURCE), "-o", str(output), *(f"-L{path}" for path in libraries),
            *(f"-Wl,-rpath,{path}" for path in libraries),
            "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def _tag() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        digest.update(header.read_bytes())
    digest.update(f"{torch.__version__}|{sys.version}|{sys.platform}".encode())
    return digest.hexdigest()[:16]


def build(directory: Path | None = None) -> Path:
    """The built module's path (building it first where it is not in ``directory``, default
    :func:`cache_dir`); raises ``RuntimeError`` with the compiler's output where it fails.
    Processes building at once wait for each other on a lock file."""
    directory = cache_dir() if directory is None else directory
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    target = directory / f"{_MODULE_NAME}_{_tag()}{suffix}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{target.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if target.exists():  # another process built it while this one waited
                return target
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                built = Path(scratch) / target.name
                command = _build_command(built)
                if command is None:
                    raise RuntimeError("gemslib.runtime.native: no C++ compiler or no cuda.h "
                                       "(Triton's) to build the native launch path with")
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"gemslib.runtime.native: building {SOURCE.name} failed "
                                       f"({' '.join(command[:2])} ...):\n{done.stderr[-4000:]}")
                os.replace(built, target)  # whole or not at all, for the other processes
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return target


def load(path: Path):
    """Import a built module from ``path`` and hand it the Python objects it keys on."""
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.setup(torch.Tensor, torch.nn.Parameter, split_scratch)
    return module


def _wanted() -> str | None:
    """Why the native path is not used here, or None where it should be."""
    if os.environ.get("GEMSLIB_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "switched off (GEMSLIB_NATIVE=0)"
    if env.INTERPRETER:
        return "the Triton interpreter runs the kernels (TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def module():
    """The native module, or None where it is not used (:func:`status` says why). Built and
    loaded on the first call; a failure is logged once and leaves the Python replay."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        reason = _wanted()
        loaded = None
        if reason is None:
            try:
                loaded = load(build())
                if not loaded.load_driver():
                    loaded, reason = None, "libcuda.so.1 has no launch functions"
            except Exception as err:  # no compiler, headers or driver: the Python path serves
                reason = str(err)
                log.warning("gemslib: the native launch path is off, the Python replay serves: "
                            "%s", reason)
        _state["error"] = reason
        _state["module"] = loaded
        return loaded


def status() -> str:
    """'on', or why the native launch path is off (for reports)."""
    module()
    return "on" if _state["module"] is not None else f"off: {_state['error']}"
