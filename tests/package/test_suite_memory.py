"""The suite's own discipline on a shared card: tests that hold GiBs run one at a time, and a
process gives back what a finished test left it holding."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from helpers import BIG_TEST_ELEMENTS, exclusive_lock, is_big, release_gpu_memory


def _item(shape=None, marked=False):
    params = {} if shape is None else {"shape": shape, "dtype": "float32"}
    return SimpleNamespace(callspec=SimpleNamespace(params=params),
                           get_closest_marker=lambda name: object() if marked else None)


@pytest.mark.parametrize("shape,big", [((1024, 131072), True), ((8192, 32000), True),
                                       ((4096, 4096), False), ((BIG_TEST_ELEMENTS,), False),
                                       ((BIG_TEST_ELEMENTS + 1,), True), ((), False),
                                       ("(1024, 131072)", False)])
def test_a_test_is_big_by_its_shape(shape, big):
    assert is_big(_item(shape)) is big


def test_a_test_is_big_by_its_marker_or_not_without_a_shape():
    assert is_big(_item(marked=True)) and not is_big(_item())
    assert not is_big(SimpleNamespace(get_closest_marker=lambda name: None))  # not parametrized


def _try_lock_elsewhere(path) -> str:
    """Whether another process can take the lock now, without waiting."""
    script = textwrap.dedent(f"""
        import fcntl
        with open({str(path)!r}, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print("held")
            else:
                print("free")
        """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_big_memory_lock_excludes_other_processes_until_released(tmp_path):
    path = tmp_path / "big.lock"
    with exclusive_lock(str(path)):
        assert _try_lock_elsewhere(path) == "held"
    assert _try_lock_elsewhere(path) == "free"
    with pytest.raises(RuntimeError):  # a failing test releases it too
        with exclusive_lock(str(path)):
            raise RuntimeError("the test failed")
    assert _try_lock_elsewhere(path) == "free"


@pytest.mark.parametrize("reserved,resets", [(0, 0), (1 << 30, 0), ((1 << 30) + 1, 1)])
def test_a_process_holding_memory_after_a_test_drops_compiled_graphs_and_garbage(
        monkeypatch, reserved, resets):
    """After each test on a GPU the allocator's free blocks go back; where the process still
    holds more than a GiB, dynamo's caches and cyclic garbage are let go too."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: reserved)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    release_gpu_memory()
    assert calls == ["empty_cache"] + ["reset", "empty_cache"] * resets
