"""``python -m gemslib.tune --model``: recording the calls a compiled model makes, tuning each
on the call itself (in the interpreter, with scripted timings: nothing is timed in tests) and
the file that gives each recorded shape its config."""

import json

import pytest
import torch

from helpers import DEVICE
from gemslib import runtime, tune, tune_model, tune_search

transformers = pytest.importorskip("transformers")


def _tiny_config():
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def recorded():
    torch._dynamo.reset()
    calls = tune_model.record_calls(_tiny_config(), [(2, 8), (1, 5)], DEVICE, torch.float32,
                                    progress=lambda line: None)
    yield calls
    torch._dynamo.reset()


def _scripted_ms(fn):
    """A time for the config being forced: a fixed function of it, so the fastest is known."""
    fn()
    forced = [k._forced for k in runtime.KERNELS.values() if k._forced is not None]
    assert len(forced) == 1
    return 1.0 + (sum(map(ord, json.dumps(forced[0].launch_kwargs, sort_keys=True))) % 97) / 100


def test_a_compiled_forward_records_each_kernel_shape_once_with_its_call(recorded):
    """Two forwards (16 and 5 tokens): the norms, the rotary, the SwiGLU and attention of
    each shape, once each, whatever the number of layers; each call runs again alike."""
    kernels = {name for name, _ in recorded}
    assert {"rms_norm.rms_norm_fwd", "rotary.rotary", "silu.silu_and_mul_fwd",
            "attention.attention_fwd"} <= kernels, kernels
    rows = {shape[0] for name, shape in recorded if name == "rms_norm.rms_norm_fwd"}
    assert rows == {16, 5}, rows
    for (name, shape), call in recorded.items():
        assert f"{call.kernel.op}.{call.kernel.name}" == name and call.shape == shape
        first, again = call.run(), call.run()
        for a, b in zip(tune_search.output_tensors(first),
                        tune_search.output_tensors(again)):
            assert torch.equal(a, b), name


def test_each_recorded_shape_gets_its_fastest_config_in_the_file(recorded, tmp_path):
    """The written file loads; at every recorded shape it gives the fastest right config (or
    the file in use's at a tie), and a shape outside those buckets keeps the file in use's."""
    results, skipped = tune_model.tune_calls(recorded, _scripted_ms, quick=True,
                                             progress=lambda line: None)
    assert results and not [why for why in skipped.values() if why != "no tune space"], skipped
    path = tmp_path / "tiny.yaml"
    path.write_text(tune_model.render_yaml(results, "cpu", {"model": "tiny", "gpu": "none"}))
    written = runtime.load_tune_config(path)
    in_use = runtime.active_configs()[0]
    for result in results:
        kernel = runtime.KERNELS[f"{result.op}.{result.kernel}"]
        timed = {t.config: t.ms for t in result.timings if t.ms is not None}
        kept = result.kept or result.reference
        expected = min(timed, key=timed.get)
        if timed[kept] <= timed[expected] * (1 + tune_search.KEEP_MARGIN):
            expected = kept
        assert (tune_search.bucket_config(written, kernel, result.shape) == expected), \
            result.kernel
    norm = runtime.KERNELS["rms_norm.rms_norm_fwd"]
    far = (1 << 20, 1 << 14)  # no recorded shape bounds it
    assert (tune_search.bucket_config(written, norm, far)
            == tune_search.bucket_config(in_use, norm, far))


def test_a_model_is_a_table_name_or_a_config_json(tmp_path):
    title, config = tune_model.model_spec("qwen2-7b", layers=2)
    assert title == "Qwen2-7B" and config.num_hidden_layers == 2 and config.hidden_size == 3584
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_tiny_config().to_dict(), "num_hidden_layers": 12}))
    title, config = tune_model.model_spec(str(tmp_path), layers=3)
    assert config.model_type == "llama" and config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="neither a model of the built-in table"):
        tune_model.model_spec(str(tmp_path / "missing.json"), layers=2)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="no model_type"):
        tune_model.model_spec(str(tmp_path / "other.json"), layers=2)


@pytest.mark.parametrize("args,message", [
    (["--model", "qwen2-7b", "--shapes", "4096"], "expected BxS"),
    (["--model", "qwen2-7b", "--ops", "silu"], "--ops and --model"),
    (["--model", "qwen2-7b", "--layers", "0"], "--layers must be at least 1"),
])
def test_bad_model_arguments_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
