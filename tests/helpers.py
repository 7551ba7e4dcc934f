"""What the tests share: the device they run on, the dtypes, fresh random inputs, poisoned
outputs, the repository's root, the check that a module compiled with the backend is eager's,
opcheck of both overloads of an operator. Imported as ``helpers`` (pytest puts ``tests/`` on
the path);
the conftest has already chosen the interpreter or the GPU by the time a test imports it."""

import contextlib
import fcntl
import math
import os
import tempfile
from pathlib import Path

import torch

import gemslib
from gemslib import runtime

REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICE = torch.device(runtime.device_type())
ON_GPU = not runtime.INTERPRETER
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# A test whose inputs hold more elements than this (its float64 reference and temporaries
# take several times their bytes) runs alone among such tests on the card: the suite runs a
# process per core, and a few of them at once overflow an 80 GB card.
BIG_TEST_ELEMENTS = 1 << 25
BIG_TEST_LOCK = os.path.join(tempfile.gettempdir(), f"gemslib-tests-big-memory-{os.getuid()}.lock")


def is_big(item) -> bool:
    """Marked ``big_memory``, or parametrized by a ``shape`` of over BIG_TEST_ELEMENTS."""
    if item.get_closest_marker("big_memory") is not None:
        return True
    shape = getattr(getattr(item, "callspec", None), "params", {}).get("shape")
    return (isinstance(shape, tuple) and all(isinstance(size, int) for size in shape)
            and math.prod(shape) > BIG_TEST_ELEMENTS)


@contextlib.contextmanager
def exclusive_lock(path: str):
    """Held by one process at a time (an flock: released if the holder dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# What a test's process may keep reserved on the card after it (its CUDA context aside): more
# is held by references the test left (a compiled model in dynamo's caches, a CUDA graph pool,
# a cycle), which the next tests on that card cannot have.
KEPT_GPU_BYTES = 1 << 30


def release_gpu_memory(kept_bytes: int = KEPT_GPU_BYTES) -> None:
    """Give the card back the memory a finished test's process holds: the allocator's free
    blocks, and, where more than ``kept_bytes`` stays reserved, dynamo's compiled graphs and
    cyclic garbage too."""
    import gc

    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() > kept_bytes:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def random_tensor(shape, dtype, device=DEVICE, scale=3.0):
    """Fresh normal samples times ``scale`` (covers silu's saturated tails)."""
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype)


def poisoned(shape, dtype, device=DEVICE):
    """An output buffer full of NaN, so an element the kernel does not write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def opcheck_overloads(op: torch._ops.OpOverloadPacket, args, **kwargs) -> None:
    """``torch.library.opcheck`` of the operator's default overload (autograd included) and
    of its ``graph`` overload, which has no autograd: schema, fake tensors and AOT dispatch on
    the arguments detached."""
    torch.library.opcheck(op.default, args, **kwargs)
    detached = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, args)
    wanted = kwargs.pop("test_utils", ("test_schema", "test_faketensor",
                                       "test_aot_dispatch_dynamic"))
    torch.library.opcheck(op.graph, detached, test_utils=tuple(
        test for test in wanted if test != "test_autograd_registration"), **kwargs)


def assert_device_side_assert(script: str, message: str) -> None:
    """Run ``script`` (which makes a kernel meet a bad value on the GPU) in a fresh process,
    since a device-side assert leaves the CUDA context unusable, and check that it failed with
    one, printing ``message``."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "device-side assert" in done.stderr, done.stderr[-2000:]
    assert message in done.stdout + done.stderr, done.stderr[-2000:]


def assert_compiled_is_eager_s(module, x, fusions):
    """The module compiled with the backend reports ``fusions`` and returns eager's results:
    same dtypes and shapes, values within 16-bit rounding of the largest."""
    with torch.no_grad():
        expected = module(x)
        results = torch.compile(module, backend="gemslib", fullgraph=True)(x)
    assert gemslib.fusion_report() == fusions, gemslib.fusion_report()
    for got, want in zip(results, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.allclose(got.float(), want.float(), atol=2e-3 * want.abs().max().item())


def caches_written_in_place(code: str) -> list[tuple[str, str]]:
    """The (k_cache, v_cache) graph inputs each ``rotary_into_cache`` call in inductor's
    generated ``code`` writes: the op runs on the graph's cache inputs themselves."""
    import re

    return re.findall(r"rotary_into_cache\.graph\([^\n]*, (arg\d+_1), (arg\d+_1)"
                      r"(?:, q_weight=[^\n]*)?\)", code)

