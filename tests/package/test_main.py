"""``python -m gemslib``: environment report, operator checks, non-zero exit on a mismatch."""

import os
import subprocess
import sys

import pytest
import torch

from gemslib import __main__ as main_job
from gemslib import registry
from gemslib.registry import Operator, SelfCheck


def test_main_job_checks_every_operator_and_passes(tmp_path):
    env = dict(os.environ)
    result = subprocess.run([sys.executable, "-m", "gemslib", "--rows", "5", "--no-time"],
                            cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "torch " in out and "triton " in out and "tune config:" in out
    assert "native replay of repeated calls: " in out
    assert ("Triton interpreter" in out) == (env.get("TRITON_INTERPRET") == "1")
    for check in ("silu", "silu_backward", "silu_and_mul", "silu_and_mul_backward", "attention",
                  "attention_backward", "decode_attention", "rms_norm_linear_silu"):
        assert f"\n{check} " in out
    assert "all checks passed" in out


def test_main_job_fails_on_a_mismatch(monkeypatch, capsys):
    broken = SelfCheck("broken_negate", lambda device, dtype, rows: (torch.randn(rows, 3, device=device, dtype=dtype),),
                       run=lambda x: x, reference=lambda x: -x, torch_peer=lambda x: -x,
                       dtypes=(torch.float32,))
    operators = dict(registry.operators())
    operators["broken"] = Operator("broken", None, (), (broken,))
    monkeypatch.setattr(registry, "operators", lambda: operators)
    assert main_job.main(["--rows", "4", "--no-time"]) == 1
    out = capsys.readouterr().out
    assert "broken_negate" in out and "FAIL" in out and "1 check(s) FAILED" in out


def test_term_scale_widens_only_the_absolute_tolerance():
    """A check whose outputs combine rounded terms of size T may be off by rtol * T in absolute
    terms (attention: weights rounded to the dtype times values of size T), not relatively."""
    from gemslib import accuracy
    expected = torch.tensor([1e-3, 2.0], dtype=torch.float64)
    off = expected + torch.tensor([4e-4, 4e-4], dtype=torch.float64)
    accuracy.assert_close_to_reference(off, expected, torch.float16, term_scale=1.0)
    with pytest.raises(AssertionError):  # 4e-4 on 1e-3 is not fp16 rounding by itself
        accuracy.assert_close_to_reference(off, expected, torch.float16)
    with pytest.raises(AssertionError):  # relative errors past rtol still fail
        accuracy.assert_close_to_reference(expected * 1.01, expected, torch.float16,
                                           term_scale=1.0)
