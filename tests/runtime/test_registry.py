"""The aten override registry: what enable() registers, that it ran, and that it is undone."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gemslib
from helpers import DEVICE, DTYPES, random_tensor
from gemslib import registry, runtime
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import silu as silu_ops

SILU_ATEN = ("aten::silu", "aten::silu_", "aten::silu.out", "aten::silu_backward")
KEY = runtime.dispatch_key()


def dispatch_tables(ops=SILU_ATEN):
    return {op: torch._C._dispatch_dump_table(op) for op in ops}


def assert_restored(before, after):
    """``after`` is the dispatcher ``before`` but for the one documented exception to exact
    restore (gemslib.registry's docstring): a backend kernel that torch lacked, installed for
    good by the first enable() that needed it. Nothing else may differ."""
    permanent = registry.permanent_fallbacks()
    assert set(after) == set(before)
    for op, table in before.items():
        then, now = table.splitlines(), after[op].splitlines()
        if op in permanent:
            assert permanent[op] in now, op
            then, now = ([line for line in lines if line != permanent[op]] for lines in (then, now))
        assert now == then, op


def backend_entry(op):
    """The line of the dispatcher's table for gemslib's dispatch key."""
    return next(line for line in torch._C._dispatch_dump_table(op).splitlines()
                if line.startswith(f"{KEY}:"))


def test_registered_ops_are_collected_from_operator_files():
    ops = gemslib.registered_ops()
    assert ops["silu"] == SILU_ATEN
    assert all(registry.operators()[name].module.__name__.startswith("gemslib.") for name in ops)


def test_enable_registers_under_the_backend_key_and_restores_exactly():
    before = dispatch_tables()
    with gemslib.enable() as activation:
        for op in SILU_ATEN:
            assert "gemslib" in backend_entry(op), op
        assert set(SILU_ATEN) <= set(activation.aten_overloads)
        assert gemslib.is_enabled()
    assert dispatch_tables() == before
    assert not gemslib.is_enabled()


def test_global_enable_until_disable():
    before = dispatch_tables()
    gemslib.enable()
    assert "gemslib" in backend_entry("aten::silu")
    gemslib.disable()
    assert dispatch_tables() == before
    gemslib.disable()  # idempotent
    assert dispatch_tables() == before


def test_exception_inside_the_block_restores_the_dispatcher():
    before = dispatch_tables()
    with pytest.raises(ZeroDivisionError):
        with gemslib.enable():
            1 / 0
    assert dispatch_tables() == before
    assert not gemslib.is_enabled()


def test_nested_enable_restores_each_level():
    before = dispatch_tables()
    others = tuple(a for name, atens in gemslib.registered_ops().items() if name != "silu"
                   for a in atens)
    others_before = dispatch_tables(others)
    with gemslib.enable(ops=["silu"]) as outer:
        inside_outer = dispatch_tables()
        with gemslib.enable(ops=["silu"]) as inner:
            assert inner.aten_overloads == ()  # the outer block already serves silu
            assert dispatch_tables() == inside_outer
        with gemslib.enable() as inner:
            assert set(inner.aten_overloads) == set(others)  # only what was not on yet
            assert dispatch_tables() == inside_outer
        assert dispatch_tables() == inside_outer and outer.active
        assert_restored(others_before, dispatch_tables(others))
    assert dispatch_tables() == before


def test_disable_inside_a_block_then_leaving_it():
    before = dispatch_tables()
    with gemslib.enable():
        gemslib.disable()
        assert dispatch_tables() == before
    assert dispatch_tables() == before


def test_allow_list_and_exclude():
    before = dispatch_tables()
    with gemslib.enable(exclude=["silu"]) as activation:
        assert "silu" not in activation.ops and dispatch_tables() == before
        assert set(activation.ops) == set(gemslib.registered_ops()) - {"silu"}
    with gemslib.enable(ops=["silu"]) as activation:
        assert activation.ops == ("silu",)
        assert "gemslib" in backend_entry("aten::silu")
    with gemslib.enable(ops=[]) as activation:
        assert dispatch_tables() == before


def test_unknown_operator_names_are_errors():
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['gelu'\] in ops.*registered"):
        gemslib.enable(ops=["gelu"])
    with pytest.raises(ValueError, match="in exclude"):
        gemslib.enable(exclude=["nope"])
    with pytest.raises(TypeError, match="list of operator names"):
        gemslib.enable(ops="silu")
    assert not gemslib.is_enabled()


@pytest.mark.parametrize("dtype", DTYPES)
def test_overrides_run_gemslib_kernels(dtype):
    x = random_tensor((17, 33), dtype)
    expected = silu_ops.silu_reference(x.double())
    with gemslib.enable(record=True) as activation:
        functional = F.silu(x)
        out = torch.empty_like(x)
        torch.ops.aten.silu.out(x, out=out)
        in_place = x.clone()
        F.silu(in_place, inplace=True)
    assert activation.calls == {"aten::silu": 1, "aten::silu.out": 1, "aten::silu_": 1}
    assert not activation.fallbacks
    for result in (functional, out, in_place):
        assert_close_to_reference(result, expected, dtype)


def test_the_kernel_itself_ran(monkeypatch):
    """Not only the record: the Triton launcher is what produced the numbers."""
    runtime.clear_call_plans()  # an earlier test's calls of this signature would replay a plan
    launched = []
    original = silu_ops.SILU_FWD.launch
    monkeypatch.setattr(silu_ops.SILU_FWD, "launch",
                        lambda *a, **k: (launched.append(k["shape"]), original(*a, **k))[1])
    x = random_tensor((4, 5), torch.float32)
    with gemslib.enable():
        F.silu(x)
    assert launched == [(20,)]
    F.silu(x)
    assert launched == [(20,)]  # outside the block torch's kernel runs


@pytest.mark.parametrize("dtype", DTYPES)
def test_training_through_f_silu_uses_both_kernels(dtype):
    x = random_tensor((23, 41), dtype).requires_grad_()
    grad = random_tensor((23, 41), dtype)
    with gemslib.enable(record=True) as activation:
        F.silu(x).backward(grad)
    assert activation.calls["aten::silu"] == 1 and activation.calls["aten::silu_backward"] == 1
    x64 = x.detach().double().requires_grad_()
    silu_ops.silu_reference(x64).backward(grad.double())
    assert_close_to_reference(x.grad, x64.grad, dtype)


def test_unsupported_calls_fall_back_to_torch_exactly():
    x64 = torch.randn(9, 10, dtype=torch.float64, device=DEVICE)
    expected = F.silu(x64)
    grad = torch.randn_like(x64)
    expected_grad = torch.ops.aten.silu_backward(grad, x64)
    with gemslib.enable(record=True) as activation:
        result = F.silu(x64)
        result_grad = torch.ops.aten.silu_backward(grad, x64)
        mixed_out = torch.empty(9, 10, dtype=torch.float32, device=DEVICE)
        with pytest.raises(RuntimeError, match="Found dtype Float but expected Half"):
            torch.ops.aten.silu.out(random_tensor((9, 10), torch.float16), out=mixed_out)
    assert torch.equal(result, expected) and torch.equal(result_grad, expected_grad)
    assert activation.fallbacks == {"aten::silu": 1, "aten::silu_backward": 1, "aten::silu.out": 1}
    assert not activation.calls


def test_fallback_resizes_out_like_torch():
    x = random_tensor((3, 4), torch.float32)
    out = torch.empty(0, device=DEVICE)
    with gemslib.enable(record=True) as activation:
        torch.ops.aten.silu.out(x, out=out)
    assert out.shape == (3, 4) and activation.fallbacks["aten::silu.out"] == 1
    assert_close_to_reference(out, silu_ops.silu_reference(x.double()), torch.float32)


def test_in_place_on_a_broadcast_view_keeps_torchs_error():
    x = random_tensor((1, 4), torch.float32).expand(3, 4)
    with gemslib.enable(record=True) as activation:
        with pytest.raises(RuntimeError, match="more than one element"):
            F.silu(x, inplace=True)
    assert activation.fallbacks["aten::silu_"] == 1


def test_debug_log_names_each_dispatch(caplog):
    x = random_tensor((2, 3), torch.float32)
    with caplog.at_level("DEBUG", logger="gemslib"), gemslib.enable():
        F.silu(x)
        F.silu(x.double())
    assert "aten::silu -> gemslib" in caplog.text
    assert "aten::silu -> torch (dtypes ['torch.float64'])" in caplog.text


def test_import_initialises_no_cuda_and_compiles_nothing(tmp_path):
    code = ("import torch, gemslib; gemslib.registered_ops(); "
            "print(torch.cuda.is_initialized())")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True, cwd=tmp_path)
    assert result.stdout.strip() == "False"
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir())


def _all_overridden():
    return tuple(a for atens in gemslib.registered_ops().values() for a in atens)


def test_enable_checks_every_kernel_before_registering_anything(monkeypatch):
    """An op without a fallback and without a backend kernel (get_kernel would fail): a clear
    error, and nothing registered, not even the overloads before it in the list."""
    before = dispatch_tables(_all_overridden())
    has_kernel = registry._has_kernel
    monkeypatch.setattr(registry, "_has_kernel",
                        lambda aten, key: aten != "aten::silu.out" and has_kernel(aten, key))
    with pytest.raises(RuntimeError, match=rf"torch has no {KEY} kernel for aten::silu.out.*"
                                           r"set TRITON_INTERPRET=1 before importing gemslib"):
        gemslib.enable()
    assert not gemslib.is_enabled() and not registry._served_by
    assert dispatch_tables(_all_overridden()) == before


_WITHOUT_INTERPRETER = """
import torch, torch.nn.functional as F, gemslib
from gemslib import registry
ops = [a for atens in gemslib.registered_ops().values() for a in atens]
tables = lambda: {op: torch._C._dispatch_dump_table(op) for op in ops}
before = tables()
try:
    with gemslib.enable():
        print("ENABLED", "gemslib" in torch._C._dispatch_dump_table("aten::silu"))
except RuntimeError as error:
    print("ERROR", error)
print("STATE", gemslib.is_enabled(), tuple(sorted(registry._served_by)), registry.permanent_fallbacks(),
      tables() == before)
x = torch.randn(3)
print("SILU", torch.equal(gemslib.silu(x), F.silu(x)), gemslib.silu(x).shape)
"""


def test_enable_without_the_interpreter_on_a_cpu_build_says_what_to_do(tmp_path):
    """Without TRITON_INTERPRET gemslib's backend is CUDA; torch's CPU build has no CUDA kernels
    to override or hand calls to. enable() then says what to do, and registers nothing; the
    direct functions still compute CPU tensors (with torch: no kernel runs on them)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_INTERPRETER], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    if torch.backends.cuda.is_built():  # a CUDA build: there are CUDA kernels to override
        assert lines["ENABLED"] == "True"
    else:
        assert "ENABLED" not in lines
        assert lines["ERROR"].startswith(
            f"gemslib.enable: this torch build ({torch.__version__}) has no CUDA kernels, so "
            "there is nothing on CUDA to override")
        assert ("gemslib's kernels run on CUDA GPUs, or on CPU tensors in the Triton "
                "interpreter: set TRITON_INTERPRET=1 before importing gemslib") in lines["ERROR"]
    assert lines["STATE"] == "False () {} True"  # nothing registered, nothing left behind
    assert lines["SILU"] == "True torch.Size([3])"


_FIRST_ENABLE = """
import torch, torch.nn.functional as F, gemslib
from gemslib import registry
op = "aten::_fused_rms_norm_backward"
torch_has_one = torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
ops = [a for atens in gemslib.registered_ops().values() for a in atens]
tables = lambda: {name: torch._C._dispatch_dump_table(name).splitlines() for name in ops}
before = tables()
with gemslib.enable(ops=["silu"]):
    pass
print("AFTER_SILU", registry.permanent_fallbacks() == {}, tables() == before)
x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
w = torch.randn(8, dtype=torch.float64, requires_grad=True)
expected = torch.autograd.grad(F.rms_norm(x, (8,), w).sum(), (x, w))
with gemslib.enable():
    loss = F.rms_norm(x, (8,), w).sum()
grads = torch.autograd.grad(loss, (x, w))  # after the block
# inside a block the installed kernel runs gemslib's wrapper, which records the call (float64:
# handed to the fallback, so no interpreted kernel runs, whatever numpy this machine has)
with gemslib.enable(record=True) as served:
    torch.autograd.grad(F.rms_norm(x, (8,), w).sum(), (x, w))
permanent = registry.permanent_fallbacks()
print("TORCH_HAS_ONE", torch_has_one)
print("PERMANENT", sorted(permanent))
print("SERVED_INSIDE", served.fallbacks[op] == 1 and not served.calls[op])
after = tables()
added = {name: [l for l in after[name] if l not in before[name]] for name in ops}
removed = {name: [l for l in before[name] if l not in after[name]] for name in ops}
print("ADDED", {k: v for k, v in added.items() if v} == {k: [v] for k, v in permanent.items()})
print("REMOVED", not any(removed.values()))
print("GRADS", all(torch.allclose(a, b) for a, b in zip(grads, expected)))
with gemslib.enable(ops=["rms_norm"]) as second:
    print("SECOND_OVERRIDES", op in second.aten_overloads)
print("SECOND_RESTORES", tables() == after)
"""


def test_first_enable_installs_the_missing_backward_kernel_for_good(tmp_path):
    """In a fresh process: where torch has no CPU kernel for _fused_rms_norm_backward, the first
    enable() that overrides it installs gemslib's fallback (and only then: enable(ops=["silu"])
    does not); that kernel serves gemslib's implementation while a block claims it (torch 2.11
    allows one Python kernel per operator and key); after the block the one
    added line is the only difference, and the graph recorded inside differentiates."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _FIRST_ENABLE], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["AFTER_SILU"] == "True True"
    installed = "[]" if lines["TORCH_HAS_ONE"] == "True" else "['aten::_fused_rms_norm_backward']"
    assert lines["PERMANENT"] == installed
    for key in ("SERVED_INSIDE", "ADDED", "REMOVED", "GRADS", "SECOND_OVERRIDES",
                "SECOND_RESTORES"):
        assert lines[key] == "True", key


@pytest.mark.parametrize("record", ["yes", 1, None])
def test_record_must_be_a_bool(record):
    with pytest.raises(TypeError, match="gemslib.enable\\(\\): argument 'record' must be bool"):
        gemslib.enable(record=record)
    assert not gemslib.is_enabled()
