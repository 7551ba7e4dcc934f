"""gemslib: Triton operators for LLM inference, callable directly or as aten overrides.

    import gemslib
    y = gemslib.silu_and_mul(x)           # direct call
    with gemslib.enable():                # F.silu, ... run gemslib kernels inside the block
        y = model(x)

Importing gemslib initialises no CUDA context and compiles nothing: kernels compile on first
use, and launch configs are read from ``tune_configs/`` when the first kernel runs.
"""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path


def _map_source_checkout() -> None:
    """Serve ``gemslib.ops``/``.fused``/``.tune_configs`` from a source checkout.

    Installed (wheel or ``pip install -e .``), these subpackages are found through the install.
    Imported straight from a checkout (its root on ``sys.path``, nothing installed, or a regular
    install shadowed by the working directory), they sit beside ``gemslib/`` as ``ops/``,
    ``fused/`` and ``tune_configs/``; map them the same way the install does.
    """
    root = _Path(__file__).resolve().parent.parent
    for sub, folder in (("ops", "ops"), ("fused", "fused"), ("tune_configs", "tune_configs")):
        name = f"{__name__}.{sub}"
        init = root / folder / "__init__.py"
        if name in _sys.modules or not init.is_file() or _importlib_util.find_spec(name):
            continue
        spec = _importlib_util.spec_from_file_location(
            name, init, submodule_search_locations=[str(init.parent)])
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)


_map_source_checkout()

from gemslib.registry import disable, enable, is_enabled, registered_ops
from gemslib.passes import fusion_report, reset_fusion_report
from gemslib.runtime import TuneConfigError
from gemslib.fused.attention import attention
from gemslib.fused.decode_attention import decode_attention
from gemslib.fused.decode_gemv import decode_gemv
from gemslib.ops.rms_norm import add_rms_norm, rms_norm
from gemslib.ops.rotary import apply_rotary
from gemslib.ops.silu import gelu_and_mul, silu, silu_and_mul
from gemslib.ops.softmax import log_softmax, softmax
from gemslib.fused.rms_norm_linear_silu import rms_norm_linear_silu
from gemslib.fused.rms_norm_swiglu import rms_norm_swiglu

__version__ = "0.1.0"

__all__ = [
    "enable", "disable", "is_enabled", "registered_ops", "TuneConfigError",
    "fusion_report", "reset_fusion_report",
    "rms_norm", "add_rms_norm", "silu", "silu_and_mul", "gelu_and_mul", "softmax", "log_softmax",
    "apply_rotary", "attention", "decode_attention", "rms_norm_linear_silu",
    "rms_norm_swiglu", "decode_gemv",
]
