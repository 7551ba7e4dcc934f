"""``python -m gemslib.tune --verdicts``: the timings' verdicts as buckets, the section written
into the file in use's text and read back, the forms measured through both backends (with a
made-up timer on the CPU)."""

import pytest
import torch

from gemslib import runtime, tune_search, tune_verdicts


def test_runs_of_one_verdict_make_one_bucket_per_width():
    ms = {(2048, 1): (1.0, 2.0), (2048, 16): (1.0, 2.0), (2048, 256): (3.0, 2.0),
          (2048, 4096): (1.0, 2.0), (4096, 1): (1.0, 1.0), (4096, 4096): (2.05, 2.0)}
    assert tune_verdicts.verdict_buckets(ms) == [
        ({"rows": 16, "cols": 2048}, "gemslib"), ({"rows": 256, "cols": 2048}, "inductor"),
        ({"cols": 2048}, "gemslib"), ({"rows": 1, "cols": 4096}, "gemslib"),
        (None, "inductor")]


def test_a_fusion_faster_everywhere_is_one_bucket():
    ms = {(cols, rows): (1.0, 1.005) for cols in (896, 4096) for rows in (1, 64)}
    assert tune_verdicts.verdict_buckets(ms) == [(None, "gemslib")]


def test_written_verdicts_read_back_and_replace_the_old_ones(tmp_path):
    default = (runtime.shipped_configs_dir() / "default.yaml").read_text()
    first = {"rms_norm": [({"rows": 16, "cols": 2048}, "inductor"), (None, "gemslib")]}
    path = tmp_path / "gpu.yaml"
    path.write_text(tune_verdicts.with_verdicts(
        default, tune_search.render_verdicts(first, {"rms_norm": {(2048, 16): (1e-3, 2e-3)}})))
    loaded = runtime.load_tune_config(path)
    assert loaded.verdicts == {"rms_norm": (({"rows": 16, "cols": 2048}, "inductor"),
                                            (None, "gemslib"))}
    def configs(file):
        return {(op, kernel): [(b.max, b.configs) for b in buckets]
                for op, kernels in file.ops.items() for kernel, buckets in kernels.items()}

    assert configs(loaded) == configs(runtime.load_tune_config(
        runtime.shipped_configs_dir() / "default.yaml"))
    second = {"silu_and_mul": [(None, "inductor")]}
    path.write_text(tune_verdicts.with_verdicts(path.read_text(),
                                                tune_search.render_verdicts(second)))
    assert runtime.load_tune_config(path).verdicts == {"silu_and_mul": ((None, "inductor"),)}


def test_the_tuner_s_file_keeps_the_verdicts_of_the_file_in_use(config_file):
    from gemslib import tune

    path = config_file("""
        schema: 1
        device: test
        ops:
          silu:
            silu_fwd:
              - config: {BLOCK: 128, num_warps: 4}
        verdicts:
          rms_norm:
            - max: {rows: 4}
              use: inductor
            - use: gemslib
    """)
    kept = runtime.load_tune_config(path)
    text = tune.render_yaml([], kept, "test", {"gpu": "none"}, set())
    assert "silu_fwd" in text
    written = path.parent / "written.yaml"
    written.write_text(text)
    assert runtime.load_tune_config(written).verdicts == kept.verdicts


@pytest.mark.parametrize("fusion", sorted(tune_verdicts.FORMS))
def test_each_form_is_measured_through_both_backends_with_the_fusion_made(fusion, config_file):
    """Every form compiles to its one fusion under gemslib, even where the file in use's
    verdict leaves it to inductor, and each backend's compiled call is what gets timed."""
    from helpers import DEVICE

    config_file(f"""
        schema: 1
        device: test
        ops: {{}}
        verdicts:
          {fusion}:
            - use: inductor
    """)
    timed = []

    def timer(call):
        timed.append(call())
        return float(len(timed))

    # fp32: the interpreter's casts to bf16 truncate
    ours, theirs = tune_verdicts.measure(fusion, 4, 32, timer, DEVICE, torch.float32)
    assert (ours, theirs) == (1.0, 2.0)
    first, second = (t if isinstance(t, torch.Tensor) else t[0] for t in timed)
    torch.testing.assert_close(first, second, atol=1e-5, rtol=1e-5)


def test_widths_are_the_models_sizes():
    from gemslib.models import MODELS

    assert tune_verdicts.widths("hidden") == sorted({s.hidden for s in MODELS.values()})
    assert 8192 in tune_verdicts.widths("intermediate")


@pytest.mark.parametrize("extra, said", [(["--ops", "silu"], "unknown ['silu']"),
                                         (["--model", "llama3-8b"], "without --model")])
def test_verdicts_take_fusions_not_operators_nor_a_model(capsys, extra, said):
    from gemslib import tune

    with pytest.raises(SystemExit) as stop:
        tune.main(["--verdicts", *extra])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and "--verdicts" in error and said in error, error


def test_verdicts_of_named_fusions_are_checked_before_the_gpu(capsys, monkeypatch):
    from gemslib import tune

    monkeypatch.setattr(tune, "gpu_available", lambda: False)  # a GPU machine too
    assert tune.main(["--verdicts", "--ops", "decode_gemv", "rms_norm"]) == tune.NO_GPU_EXIT
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_run_of_some_fusions_keeps_the_others_verdicts(config_file, tmp_path, monkeypatch):
    """Only the fusions named are measured; the file written keeps the verdicts of the
    others as the file in use had them, and adds the new ones."""
    config_file("""
        schema: 1
        device: test
        ops: {}
        verdicts:
          rms_norm:
            # gemslib / inductor us at cols x rows: 64x4 2.0/1.0
            - max: {rows: 4}
              use: inductor
            - use: gemslib
    """)
    measured = []
    monkeypatch.setattr(tune_verdicts, "measure",
                        lambda fusion, *args, **kw: measured.append(fusion) or (1.0, 2.0))
    monkeypatch.setattr(tune_verdicts, "measure_decode",
                        lambda spec, *args, **kw: measured.append(spec.title) or (2.0, 1.0))
    monkeypatch.setattr(tune_verdicts, "measure_attention",
                        lambda *args, **kw: measured.append(args[:4]) or (1.0, 2.0))
    out = tmp_path / "gpu.yaml"
    assert tune_verdicts.main(out, True, progress=lambda line: None,
                              fusions=["decode_gemv", "attention"]) == 0
    assert "rms_norm" not in measured and "silu_and_mul" not in measured and measured
    assert {args[:3] for args in measured if isinstance(args, tuple)} == \
        set(tune_verdicts.attention_heads())
    verdicts = runtime.load_tune_config(out).verdicts
    assert verdicts["rms_norm"] == (({"rows": 4}, "inductor"), (None, "gemslib"))
    assert set(verdicts) == {"rms_norm", "decode_gemv", "attention"}
    assert all(use == "inductor" for _, use in verdicts["decode_gemv"])
    assert verdicts["attention"] == ((None, "gemslib"),)
    assert "# gemslib / inductor us at cols x rows: 64x4 2.0/1.0" in out.read_text()


def test_decode_gemv_is_measured_on_a_stack_of_layers_with_every_site_folded(config_file):
    """The stack compiled with decode_gemv folds all its 3 sites a layer, even where the file
    in use's verdict leaves it out; without, none; both compute the stack's eager output and
    the time returned is a layer's."""
    from gemslib.models import MODELS
    from helpers import DEVICE

    spec = MODELS["llama3.2-1b"].tiny()
    config_file("""
        schema: 1
        device: test
        ops: {}
        verdicts:
          decode_gemv:
            - use: inductor
    """)
    layers, outputs = 3, []

    def timer(call):
        outputs.append(call())
        return 6.0 * len(outputs)

    # fp32: the interpreter's casts to bf16 truncate
    ours, theirs = tune_verdicts.measure_decode(spec, timer, DEVICE, torch.float32, layers)
    assert (ours, theirs) == (2.0, 4.0)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = tune_verdicts.DecodeLayers(spec, layers)
    x = torch.randn(1, 1, spec.hidden, device=DEVICE)  # what measure_decode drew, reseeded
    with torch.no_grad():
        expected, keys_values = model(x)
    assert len(keys_values) == 2 * layers
    for got, _ in outputs:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_gelu_family_s_stack_folds_its_gated_activation_too():
    from gemslib.models import MODELS
    from helpers import DEVICE

    def timer(call):
        call()
        return 1.0

    ours, theirs = tune_verdicts.measure_decode(MODELS["gemma-7b"].tiny(), timer, DEVICE,
                                                torch.float32, 2)
    assert (ours, theirs) == (0.5, 0.5)


def test_decode_verdicts_go_to_each_width_of_a_model_the_least_favourable_where_shared():
    timings = {(2048, 8192): (1.0, 1.1), (3072, 8192): (1.2, 1.0), (4096, 14336): (1.0, 1.0)}
    buckets, by_width = tune_verdicts.decode_verdict_buckets(timings)
    assert by_width[8192, 1] == (1.2, 1.0) and by_width[2048, 1] == (1.0, 1.1)
    assert buckets == [({"cols": 2048}, "gemslib"), ({"cols": 3072}, "inductor"),
                       ({"cols": 4096}, "gemslib"), ({"cols": 8192}, "inductor"),
                       (None, "gemslib")]


def test_a_stack_holds_several_times_an_l2_of_weights():
    from gemslib.models import MODELS

    for spec in MODELS.values():
        layers = tune_verdicts.decode_stack_layers(spec)
        attention, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        per_layer = 2 * spec.hidden * (2 * attention + 2 * kv + 3 * spec.intermediate)
        assert layers >= 2 and layers * per_layer >= tune_verdicts.DECODE_STACK_BYTES
        assert (layers - 1) * per_layer < tune_verdicts.DECODE_STACK_BYTES or layers == 2
    assert tune_verdicts.decode_widths(MODELS["gemma-7b"]) == (3072, 4096, 24576)


def test_attention_is_measured_against_sdpa_with_the_fusion_made(config_file):
    """The gemslib compile fuses the causal SDPA (even where the file in use's verdict leaves
    it to inductor) and each backend's compiled call is what gets timed; both give SDPA's
    output."""
    from helpers import DEVICE

    config_file("""
        schema: 1
        device: test
        ops: {}
        verdicts:
          attention:
            - use: inductor
    """)
    timed = []

    def timer(call):
        timed.append(call())
        return float(len(timed))

    torch.manual_seed(0)
    ours, theirs = tune_verdicts.measure_attention(4, 2, 16, 32, timer, DEVICE, torch.float32)
    assert (ours, theirs) == (1.0, 2.0)
    torch.manual_seed(0)  # what measure_attention drew, redrawn
    q = torch.randn(1, 4, 32, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 32, 16, device=DEVICE) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    for got in timed:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_attention_verdicts_are_keyed_on_head_dim_and_length_the_least_favourable_shared():
    timings = {(32, 8, 128, 512): (1.0, 1.1), (28, 4, 128, 512): (1.2, 1.0),
               (32, 8, 128, 8192): (1.0, 1.1), (28, 4, 128, 8192): (1.0, 1.05),
               (32, 8, 64, 512): (1.0, 1.0), (32, 8, 64, 8192): (1.5, 1.0)}
    buckets, by_dim = tune_verdicts.attention_verdict_buckets(timings)
    assert by_dim == {(128, 512): (1.2, 1.0), (128, 8192): (1.0, 1.05),
                      (64, 512): (1.0, 1.0), (64, 8192): (1.5, 1.0)}
    assert buckets == [({"rows": 512, "cols": 64}, "gemslib"), ({"cols": 64}, "inductor"),
                       ({"rows": 512, "cols": 128}, "inductor"), (None, "gemslib")]


def test_attention_heads_are_the_models():
    from gemslib.models import MODELS

    heads = tune_verdicts.attention_heads()
    assert set(heads) == {(s.heads, s.kv_heads, s.head_dim) for s in MODELS.values()}
    assert len(heads) == len(set(heads))
