"""The tune config's verdicts: a fusion the tuner measured slower than inductor's path at a
shape is left to inductor there, and used elsewhere; a malformed verdict is an error naming
its key."""

import pytest
import torch

import gemslib
from gemslib import runtime
from helpers import DEVICE

_VERDICTS = """
schema: 1
device: test
ops: {{}}
verdicts:
  rms_norm:
    - max: {{rows: 8, cols: 64}}
      use: {small}
    - use: gemslib
  silu_and_mul:
    - max: {{cols: 32}}
      use: inductor
    - use: gemslib
"""


def _norm(x, weight):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def _fusions(fn, *args):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    with torch.no_grad():
        expected = fn(*args)
        got = torch.compile(fn, backend="gemslib")(*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    return gemslib.fusion_report()


@pytest.mark.parametrize("small", ["inductor", "gemslib"])
def test_a_fusion_is_left_to_inductor_where_its_verdict_says(config_file, small):
    config_file(_VERDICTS.format(small=small))
    weight = torch.rand(64, device=DEVICE) + 0.5
    assert runtime.fusion_verdict("rms_norm", {"rows": 8, "cols": 64}) == small
    at_small = _fusions(_norm, torch.randn(2, 4, 64, device=DEVICE), weight)
    assert at_small == ({} if small == "inductor" else {"rms_norm": 1})
    assert _fusions(_norm, torch.randn(3, 4, 64, device=DEVICE), weight) == {"rms_norm": 1}


def test_the_environment_sets_the_verdicts_aside_and_the_compile_is_named_by_it(
        config_file, monkeypatch):
    """GEMSLIB_VERDICTS=0 uses every fusion switched on wherever it applies; the passes' uuid (part of
    inductor's cache key) tells the two apart, so a cached graph of one never serves the
    other."""
    from gemslib.passes import PASSES

    config_file(_VERDICTS.format(small="inductor"))
    weight, x = torch.rand(64, device=DEVICE) + 0.5, torch.randn(2, 4, 64, device=DEVICE)
    honoured = PASSES.uuid()
    assert _fusions(_norm, x, weight) == {}
    monkeypatch.setenv(runtime.configs.VERDICTS_ENV, "0")
    assert runtime.fusion_verdict("rms_norm", {"rows": 8, "cols": 64}) is None
    assert PASSES.uuid() != honoured
    assert _fusions(_norm, x, weight) == {"rms_norm": 1}


def test_a_rewrite_reads_its_verdict_too(config_file):
    config_file(_VERDICTS.format(small="gemslib"))

    def gated(x):
        gate, up = x.chunk(2, -1)
        return torch.nn.functional.silu(gate) * up

    assert _fusions(gated, torch.randn(4, 64, device=DEVICE)) == {}  # 32 columns out
    assert _fusions(gated, torch.randn(4, 96, device=DEVICE)) == {"silu_and_mul": 1}


@pytest.mark.parametrize("verdicts, message", [
    ("rms_norm: [{use: cuda}]", "verdicts.rms_norm[0].use: expected one of gemslib, inductor"),
    ("rms_norm: [{max: {rows: 4}, use: gemslib}]", "the last bucket must have no 'max'"),
    ("rms_norm: [{max: {rows: -1}, use: gemslib}, {use: gemslib}]", "verdicts.rms_norm[0].max.rows"),
    ("rms_norm: [{use: gemslib, when: 3}]", "verdicts.rms_norm[0]: expected"),
    ("rms_norm: []", "verdicts.rms_norm: expected a non-empty list"),
])
def test_a_malformed_verdict_names_its_key(tmp_path, verdicts, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"schema: 1\ndevice: test\nops: {{}}\nverdicts:\n  {verdicts}\n")
    with pytest.raises(runtime.TuneConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        runtime.load_tune_config(path)


_ATTENTION_VERDICTS = """
schema: 1
device: test
ops: {}
verdicts:
  attention:
    - max: {rows: 32, cols: 16}
      use: inductor
    - max: {cols: 16}
      use: gemslib
    - max: {cols: 32}
      use: inductor
    - use: gemslib
"""


def test_sdpa_is_left_to_inductor_at_the_head_dims_and_lengths_its_verdict_says(config_file):
    """Keyed on the head dim and the prompt length; a dynamic prompt length skips the buckets
    bounding the length (the one measured at the longest prompts decides); one query row is
    not under them."""
    from gemslib import tune_verdicts

    config_file(_ATTENTION_VERDICTS)

    def attention(head_dim, seq, dynamic=False):
        q = torch.randn(1, 4, seq, head_dim, device=DEVICE)
        k, v = (torch.randn(1, 2, seq, head_dim, device=DEVICE) for _ in range(2))
        torch._dynamo.reset()
        gemslib.reset_fusion_report()
        with torch.no_grad():
            expected = tune_verdicts._causal_attention(q, k, v)
            got = torch.compile(tune_verdicts._causal_attention, backend="gemslib",
                                dynamic=dynamic)(q, k, v)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return gemslib.fusion_report().get("attention", 0)

    assert attention(16, 32) == 0
    assert attention(16, 48) == 1
    assert attention(16, 32, dynamic=True) == 1  # rows unknown: the {cols: 16} bucket
    assert attention(32, 48) == 0 and attention(64, 16) == 1
    assert attention(32, 1) == 1  # one row runs the decode kernel: not what was timed
