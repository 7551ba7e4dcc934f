"""gemslib: Triton operators for LLM inference, callable directly or as aten overrides.

    import gemslib
    y = gemslib.silu_and_mul(x)           # direct call
    with gemslib.enable():                # F.silu, ... run gemslib kernels inside the block
        y = model(x)

Importing gemslib initialises no CUDA context and compiles nothing: kernels compile on first
use, and launch configs are read from ``tune_configs/`` when the first kernel runs.
"""

from gemslib.registry import disable, enable, is_enabled, registered_ops
from gemslib.runtime import TuneConfigError
from gemslib.ops.silu import silu, silu_and_mul

__version__ = "0.1.0"

__all__ = [
    "enable", "disable", "is_enabled", "registered_ops", "TuneConfigError",
    "silu", "silu_and_mul",
]
