"""Test setup: pick the device, and run the kernels in the Triton interpreter without a GPU.

What tests share (the device, random inputs, ...) is in ``helpers.py``; this file holds the
setup and the fixtures.

TRITON_INTERPRET must be set before Triton decorates gemslib's kernels, i.e. before gemslib is
imported, so this happens at the top of the conftest, ahead of every test module.
"""

import atexit
import contextlib
import os
import shutil
import tempfile
import textwrap

# inductor's caches in a folder of this session's own: a graph cached by older code (the
# passes' uuid is a hash of the source, but not of everything a test may patch) never serves
# a test, and the suite leaves nothing behind
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gemslib-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# the fusions wherever they apply, whichever GPU's file is in use: what the tests check is
# the passes and the kernels, not where a GPU's verdicts send a shape (tests of verdicts write
# their own file through ``config_file``, which honours them); processes tests start inherit it
os.environ["GEMSLIB_VERDICTS"] = "0"

import pytest  # noqa: E402  (after the cache decision: inductor reads it once)
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread a process: the suite runs one pytest-xdist worker per core, and the
    # processes some tests start share those cores with the workers. torch's default, a thread
    # per core in every process, oversubscribes them, and on a busy core each small CPU op
    # waits for its OpenMP threads (10x slower in a float64 gradcheck). The processes tests
    # start inherit the setting through the environment (they pass os.environ on).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import gemslib  # noqa: E402  (after the interpreter decision)
from gemslib import runtime  # noqa: E402
from helpers import (BIG_TEST_LOCK, DEVICE, ON_GPU, exclusive_lock, is_big,  # noqa: E402
                     release_gpu_memory)


def pytest_report_header(config):
    where = "CUDA GPU" if ON_GPU else "Triton interpreter on the CPU"
    return f"gemslib tests on {where}; tune config {runtime.config_path()}"


def pytest_configure(config):
    config.addinivalue_line("markers", "big_memory: holds GiBs of GPU memory; runs alone among "
                                       "such tests (tests parametrized by a large `shape` too)")


@pytest.fixture(autouse=True)
def _fresh_state(request):
    """Every test starts and ends with nothing overridden, whatever it did; a big test on the
    GPU holds the suite's big-memory lock throughout."""
    with exclusive_lock(BIG_TEST_LOCK) if ON_GPU and is_big(request.node) \
            else contextlib.nullcontext():
        gemslib.disable()
        yield
        gemslib.disable()
        if ON_GPU:
            # the suite runs a process per core on one card: memory a finished test's process
            # keeps reserved is memory the other processes' tests cannot have
            release_gpu_memory()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    """Write a YAML document, point GEMSLIB_TUNE_CONFIG at it (its verdicts honoured), and
    reload; undone afterwards."""

    def write(text: str):
        path = tmp_path / "custom.yaml"
        path.write_text(textwrap.dedent(text))
        monkeypatch.setenv(runtime.CONFIG_ENV, str(path))
        monkeypatch.delenv(runtime.configs.VERDICTS_ENV, raising=False)  # its verdicts count
        runtime.reload_configs()
        return path

    yield write
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)
    runtime.reload_configs()
