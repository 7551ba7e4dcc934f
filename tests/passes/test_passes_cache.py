"""The passes and inductor's caches: a warm compile (a second process) is served from the FX
graph cache and still reports its fusions and merges its projections; options switch fusions
and name the cache entries they make."""

import json
import os
import subprocess
import sys

import pytest
import torch

import gemslib
from helpers import DEVICE
from gemslib.passes.backend import passes_for
from gemslib.passes import manager

_COMPILE_TINY_LLAMA = r"""
import json, sys
import torch, transformers
import gemslib
from torch._dynamo.utils import counters

config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
ids = torch.randint(0, 96, (1, 16))
with torch.no_grad():
    expected = model(ids).logits
    got = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits
attention = model.model.layers[0].self_attn
storages = {p.untyped_storage().data_ptr()
            for p in (attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)}
print(json.dumps({
    "fusions": gemslib.fusion_report(),
    "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
    "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
    "merged": len(storages) == 1,
    "error": ((got - expected).abs().max() / expected.abs().max()).item(),
}))
"""


def _compile_in_a_process(cache_dir) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _COMPILE_TINY_LLAMA], capture_output=True,
                          text=True, env=env, cwd="/", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the processes run in the interpreter")
def test_a_second_process_hits_the_cache_and_still_reports_and_merges(tmp_path):
    pytest.importorskip("transformers")
    cold = _compile_in_a_process(tmp_path)
    warm = _compile_in_a_process(tmp_path)
    assert cold["fx_hits"] == 0 and cold["aot_hits"] == 0, cold
    assert warm["fx_hits"] + warm["aot_hits"] > 0, warm
    assert warm["fusions"] == cold["fusions"] and cold["fusions"]["merged_linear"] == 4, (
        cold, warm)
    assert cold["merged"] and warm["merged"], (cold, warm)
    assert cold["error"] <= 1e-4 and warm["error"] <= 1e-4, (cold, warm)
    assert list((tmp_path / "gemslib").glob("*.json")), "no record beside inductor's cache"


def test_an_option_changes_the_uuid(monkeypatch):
    monkeypatch.delenv("GEMSLIB_DECODE_GEMV", raising=False)
    default = passes_for({})
    assert default.uuid() == passes_for({"gemslib.attention": True}).uuid()
    assert default.uuid() == passes_for({"gemslib.decode_gemv": manager.MEASURED}).uuid()
    for name in manager.fusion_names():
        for other in (True, False, manager.MEASURED):
            if other != manager.fusion_default(name):
                assert passes_for({f"gemslib.{name}": other}).uuid() != default.uuid(), (
                    name, other)


def test_every_fusion_is_on_by_default_but_decode_gemv_which_is_on_where_measured(
        monkeypatch):
    """decode_gemv is used where the tune config's verdicts measured it faster
    (docs/notes/decode.md)."""
    for variable, _ in manager._ENVIRONMENT_DEFAULTS.values():
        monkeypatch.delenv(variable, raising=False)
    defaults = manager.fusion_options()
    assert defaults.pop("decode_gemv") == manager.MEASURED
    assert all(value is True for value in defaults.values()), defaults


@pytest.mark.parametrize("variable, fusion, default", [
    ("GEMSLIB_ROTARY_INTO_CACHE", "rotary_into_cache", True),
    ("GEMSLIB_DECODE_GEMV", "decode_gemv", manager.MEASURED)])
def test_the_environment_is_only_the_default_of_its_option(monkeypatch, variable, fusion,
                                                           default):
    monkeypatch.delenv(variable, raising=False)
    assert manager.fusion_options()[fusion] == default
    for set_to, value in (("1", True), ("0", False)):
        monkeypatch.setenv(variable, set_to)
        assert manager.fusion_options()[fusion] is value
        assert passes_for({}).uuid() == passes_for({f"gemslib.{fusion}": value}).uuid()
        assert manager.fusion_options({f"gemslib.{fusion}": default})[fusion] == default


def test_an_option_is_true_false_or_measured():
    assert manager.fusion_options({"gemslib.rms_norm": "measured"})["rms_norm"] == "measured"
    with pytest.raises(ValueError, match=r"'gemslib\.rms_norm' must be True, False or "
                                         r"'measured', got 'yes'"):
        manager.fusion_options({"gemslib.rms_norm": "yes"})


def test_an_unknown_option_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'gemslib\.nope'.*gemslib\.rotary_into_cache"):
        gemslib.passes.backend(None, [], options={"gemslib.nope": False})
    with pytest.raises(ValueError, match="True, False or .measured."):
        gemslib.passes.GemslibPasses({"gemslib.attention": "no"})


class _TwoProjections(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 24)
        self.to(DEVICE)

    def forward(self, x):
        return self.a(x), self.b(x)


@pytest.mark.parametrize("on", [True, False])
def test_an_option_switches_its_fusion_and_reaches_only_the_passes(on):
    """``gemslib.merged_linear`` (popped before inductor sees the other options) decides
    whether the projections of one input merge; the results are eager's either way."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _TwoProjections().eval()
    x = torch.randn(4, 16, device=DEVICE)
    with torch.no_grad():
        expected = module(x)
        got = torch.compile(module, backend="gemslib", fullgraph=True,
                            options={"gemslib.merged_linear": on, "shape_padding": False})(x)
    assert gemslib.fusion_report() == ({"merged_linear": 1} if on else {}), \
        gemslib.fusion_report()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_record_is_named_by_the_settings_a_compile_changes_not_by_those_it_restates():
    """Inductor's key reads the settings a compile runs with; the record's name must too, or a
    compile that restated a default (the step graph's ``triton.cudagraphs=False``) leaves a
    record that a later compile, served from that entry, cannot find."""
    import torch._inductor.config as inductor_config
    from gemslib.passes.backend import _record_path

    graph = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    inputs = [torch.randn(2, 4)]
    passes = passes_for({})
    in_force = inductor_config.get_config_copy()
    named = _record_path(graph, inputs, passes, {"shape_padding": False})
    assert named == _record_path(graph, inputs, passes, {
        "shape_padding": False, "triton.cudagraphs": in_force["triton.cudagraphs"],
        "post_grad_custom_post_pass": passes})
    assert named != _record_path(graph, inputs, passes, {
        "shape_padding": False, "triton.cudagraphs": not in_force["triton.cudagraphs"]})
    assert named != _record_path(graph, inputs, passes, {})


def test_a_compile_served_from_a_cache_entry_another_compile_restating_a_default_made():
    """The second compile of the same graph (a fresh module: merged parameters would name
    another compile), the first's options restating inductor's defaults, is served by
    inductor's cache and still reports the fusions the passes made."""
    from torch._dynamo.utils import counters

    x = torch.randn(4, 16, device=DEVICE)
    restating = {"triton.cudagraphs": False, "shape_padding": False, "size_asserts": False}
    reports = []
    with torch.no_grad():
        for options in (restating, {"shape_padding": False}):
            module = _TwoProjections().eval()
            torch._dynamo.reset()
            counters.clear()
            gemslib.reset_fusion_report()
            torch.compile(module, backend="gemslib", fullgraph=True, options=options)(x)
            reports.append(gemslib.fusion_report())
    served = counters["inductor"]["fxgraph_cache_hit"] + \
        counters["aot_autograd"]["autograd_cache_hit"]
    assert served > 0, dict(counters)
    assert reports == [{"merged_linear": 1}] * 2, reports
