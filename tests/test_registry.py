"""The aten override registry: what enable() registers, that it ran, and that it is undone."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import gemslib
from conftest import DEVICE, DTYPES, random_tensor
from gemslib import registry, runtime
from gemslib.accuracy import assert_close_to_reference
from gemslib.ops import silu as silu_ops

SILU_ATEN = ("aten::silu", "aten::silu_", "aten::silu.out", "aten::silu_backward")
KEY = runtime.dispatch_key()


def dispatch_tables(ops=SILU_ATEN):
    return {op: torch._C._dispatch_dump_table(op) for op in ops}


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
        assert dispatch_tables(others) == others_before
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
