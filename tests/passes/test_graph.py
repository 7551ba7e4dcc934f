"""Graph passes: torch.compile(backend="gemslib") replaces the forms models write with
gemslib's operators, only where the matched site is that computation."""

import re
import subprocess
import sys

import pytest
import torch

import gemslib
from helpers import DEVICE, caches_written_in_place

transformers = pytest.importorskip("transformers")


_FAMILIES = {  # transformers' config and model classes, by family
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),       # q, k, v with biases
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def _tiny_model(dtype, family="llama", layers=2, eps=1e-5):
    config_name, model_name = _FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=eps)
    torch.manual_seed(0)
    return _away_from_identity(getattr(transformers, model_name)(config).to(DEVICE, dtype).eval())


def _away_from_identity(model):
    """Norm weights away from 1, so a dropped weight would show; biases away from 0."""
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.data.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            parameter.data.uniform_(-0.5, 0.5)
    return model


def _tiny_llama(dtype, layers=2, eps=1e-5):
    return _tiny_model(dtype, "llama", layers, eps)


def _decoder_fusions(layers):
    """What the decoder layers of these families fuse: each layer's q/k/v and gate/up
    projections (two merged_linear), silu_and_mul, the rotary of q and k, and attention (its
    causal mask proven); the attention's residual add with the
    MLP's norm in each layer, and the next layer's input norm (or the final norm) with the
    MLP's residual add; the first layer's input norm, with no add before it, alone."""
    return {"rms_norm": 1, "add_rms_norm": 2 * layers, "merged_linear": 2 * layers,
            "silu_and_mul": layers, "attention": layers, "rotary": layers}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decoder_layers_run_on_gemslib_fusions(family, dtype):
    """Every fusion at every layer of a tiny Llama, Qwen2 and Mistral, and logits that stay
    eager's within the dtype's rounding; the eager model, on its merged parameters after the
    compile, gives exactly what it gave before."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_model(dtype, family)
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        compiled = torch.compile(model, backend="gemslib", fullgraph=True)
        logits = compiled(ids).logits.float()
        again = model(ids).logits.float()
    assert gemslib.fusion_report() == _decoder_fusions(2), gemslib.fusion_report()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest logit"
    assert torch.equal(again, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dynamic_shapes_keep_every_fusion(dtype):
    """With ``dynamic=True`` one graph serves every sequence length (the causal mask is then
    symbolic) and dynamo makes the norms' float epsilon a graph input: every fusion is still
    made, once, and each length's logits are eager's."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_model(dtype, "qwen2")
    compiled = torch.compile(model, backend="gemslib", fullgraph=True, dynamic=True)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for length in (5, 9, 13):
            ids = torch.randint(0, 96, (2, length), device=DEVICE)
            expected = model(ids).logits.float()
            logits = compiled(ids).logits.float()
            error = ((logits - expected).abs().max() / expected.abs().max()).item()
            assert error <= tolerance, f"length {length}: max error {error:.2e}"
    assert gemslib.fusion_report() == _decoder_fusions(2), gemslib.fusion_report()


def test_generate_with_transformers_compile_config():
    """transformers' ``CompileConfig(backend="gemslib")`` compiles generate()'s decode step on a
    static cache (its default mode, reduce-overhead, puts it in CUDA graphs on a GPU): the
    greedy tokens and every step's logits are eager's, with a left-padded sequence in the
    batch, and the layers' fusions are made. The decode step attends over the whole cache
    under a boolean mask of the visible positions (a graph input): decode_attention reads the
    keys it keeps. Each layer's rotary writes the rotated k and the new v into the static
    cache itself (rotary_into_cache), in place: the op runs on the graph's cache inputs and
    inductor left no copy of a cache."""
    from torch._inductor.fx_passes.reinplace import ReinplaceCounters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _tiny_llama(torch.float32)
    ids = torch.randint(1, 96, (2, 7), device=DEVICE)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # the second sequence is 4 tokens, padded on the left
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False,
                  cache_implementation="static", pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        config = transformers.CompileConfig(backend="gemslib", fullgraph=True)
        config._compile_all_devices = True  # transformers compiles on GPUs only by default
        model.generation_config.compile_config = config
        gemslib.reset_fusion_report()
        ReinplaceCounters.clear()
        got, codes = run_and_get_code(model.generate, ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for step, (logits, reference) in enumerate(zip(got.logits, expected.logits)):
        error = ((logits - reference).abs().max() / reference.abs().max()).item()
        assert error <= 1e-4, f"step {step}: max error {error:.2e}"
    fusions = gemslib.fusion_report()
    assert fusions["merged_linear"] == 4 and fusions["rotary"] == 2 and \
        fusions["silu_and_mul"] == 2 and fusions["add_rms_norm"] == 4 and \
        fusions["attention"] == 2 and fusions["rotary_into_cache"] == 2, fusions
    on_inputs = caches_written_in_place("\n".join(codes))
    assert len(on_inputs) == 2 and len({name for pair in on_inputs for name in pair}) == 4
    assert ReinplaceCounters.get_total_missed_bytes() == 0


def test_a_decode_step_whose_attention_splits_a_long_cache_replays_in_cuda_graphs():
    """One Qwen2 sequence (q, k, v with biases) in a 320-long static cache, its decode step
    compiled with reduce-overhead: on a GPU the decode kernel splits the cache over programs
    that merge through kept scratch memory, which must not come from the CUDA graphs' pool
    (torch's graph trees check that it holds only their outputs). The steps' logits are
    eager's."""
    torch._dynamo.reset()
    model = _tiny_model(torch.float32, "qwen2")
    ids = torch.randint(1, 96, (1, 7), device=DEVICE)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        config = transformers.CompileConfig(backend="gemslib", fullgraph=True)
        config._compile_all_devices = True
        model.generation_config.compile_config = config
        gemslib.reset_fusion_report()
        for _ in range(2):  # the second generate replays the recorded graphs
            cache = transformers.StaticCache(config=model.config, max_cache_len=320)
            got = model.generate(ids, past_key_values=cache, **kwargs)
            assert torch.equal(got.sequences, expected.sequences)
            for step, (logits, reference) in enumerate(zip(got.logits, expected.logits)):
                error = ((logits - reference).abs().max() / reference.abs().max()).item()
                assert error <= 1e-4, f"step {step}: max error {error:.2e}"
    assert gemslib.fusion_report()["attention"] == 2, gemslib.fusion_report()


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_inductor_modes_keep_the_fusions(mode):
    """The backend takes inductor's modes (reduce-overhead: CUDA graphs on a GPU)."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend="gemslib", fullgraph=True, mode=mode)
        for _ in range(3):  # CUDA graphs record on a later call and replay after
            logits = compiled(ids).logits.clone()
            assert torch.allclose(logits, expected, atol=1e-4 * expected.abs().max().item())
    assert gemslib.fusion_report() == _decoder_fusions(2), gemslib.fusion_report()


def test_one_sequence_s_packed_sequence_mask_is_proven_causal():
    """For one sequence transformers adds a packed-sequence test of its positions to the
    causal mask (a cumsum over position steps); computed at compile time it is causal."""
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_llama(torch.float32)
    ids = torch.randint(0, 96, (1, 13), device=DEVICE)
    with torch.no_grad():
        expected = model(ids, logits_to_keep=1).logits
        compiled = torch.compile(model, backend="gemslib", fullgraph=True)
        logits = compiled(ids, logits_to_keep=1).logits
    assert gemslib.fusion_report()["attention"] == 2, gemslib.fusion_report()
    assert torch.allclose(logits, expected, atol=1e-4 * expected.abs().max().item())


def test_attention_under_a_sliding_window_is_fused_and_under_padding_left_to_inductor():
    """Mistral's sliding window, shorter than the sequence, is proven from the mask's index
    arithmetic and runs the kernel's window; a padding mask is not the kernel's: its SDPA
    stays inductor's. The logits are eager's both ways."""
    model = _tiny_model(torch.float32, "mistral")
    model.config.sliding_window = 4
    ids = torch.randint(0, 96, (2, 11), device=DEVICE)
    padding = torch.ones_like(ids)
    padding[0, :3] = 0  # the first sequence left-padded
    with torch.no_grad():
        for kwargs, fused in (({}, 2), ({"attention_mask": padding}, 0)):
            torch._dynamo.reset()
            gemslib.reset_fusion_report()
            expected = model(ids, **kwargs).logits
            logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids, **kwargs).logits
            rows = slice(3, None) if kwargs else slice(None)  # padded rows: whatever eager says
            assert torch.allclose(logits[:, rows], expected[:, rows], atol=1e-4), kwargs
            assert gemslib.fusion_report().get("attention", 0) == fused, gemslib.fusion_report()
            assert gemslib.fusion_report()["merged_linear"] == 2 * 2


def test_the_backend_is_found_by_name_without_importing_gemslib():
    script = ("import sys, torch\n"
              "f = torch.compile(lambda x: x * 2, backend='gemslib')\n"
              "assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))\n"
              "print('gemslib' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd="/", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"


def test_mode_and_options_are_inductor_s():
    with pytest.raises(RuntimeError, match="either mode or options"):
        gemslib.passes.backend(None, [], mode="max-autotune", options={"a": 1})
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        gemslib.passes.backend(None, [], options={"post_grad_custom_post_pass": object()})


def test_the_merged_projection_feeds_rotary_and_attention_without_copies():
    """q, k and v reach the rotary and attention ops as views of the merged q | k | v output
    (its rows are q, k and v wide together), not as copies inductor makes for a layout recorded
    before the projections were merged."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _tiny_llama(torch.float32, layers=1)
    ids = torch.randint(0, 96, (1, 16), device=DEVICE)
    with torch.no_grad():
        _, (code, *_) = run_and_get_code(torch.compile(model, backend="gemslib", fullgraph=True),
                                         ids)
    calls = {op: next(line for line in code.splitlines() if f"gemslib.{op}.graph(" in line)
             for op in ("merged_linear", "rotary", "attention")}
    width = 64 + 2 * 32  # q, then k and v of two 16-wide heads
    row_views = re.findall(r"reinterpret_tensor\((buf\d+), \([\d, ]+\), \((\d+), (\d+), (\d+), 1\)",
                           calls["rotary"])
    assert len(row_views) == 2, calls["rotary"]  # q and k: (B, S, H, D) views of token rows
    assert all(int(token) == width for _, _, token, _ in row_views), calls["rotary"]
    assert len({buffer for buffer, *_ in row_views}) == 1, calls["rotary"]
    value = re.findall(r"reinterpret_tensor\((buf\d+), \(1, 2, 16, 16\), \((\d+), 16, (\d+), 1\), 96\)",
                       calls["attention"])
    assert value and int(value[0][2]) == width, calls["attention"]  # v, head-major view


@pytest.mark.parametrize("overloads_on", [True, False])
def test_a_compiled_graph_calls_every_gemslib_op_through_its_graph_overload(overloads_on):
    """Every gemslib op of the compiled model (the passes' and the model's own calls alike) is
    called through its ``graph`` overload (no autograd kernel, planned calls replayed natively);
    with ``runtime.GRAPH_OVERLOADS`` switched off, through its default one. Either way the
    logits are the eager model's."""
    from contextlib import nullcontext

    from torch._inductor.utils import run_and_get_code

    from gemslib import runtime

    torch._dynamo.reset()
    model = _tiny_llama(torch.float32, layers=1)
    ids = torch.randint(0, 96, (1, 16), device=DEVICE)
    scope = nullcontext() if overloads_on else runtime.GRAPH_OVERLOADS.switched_off()
    with torch.no_grad(), scope:
        compiled = torch.compile(model, backend="gemslib", fullgraph=True)
        logits, (code, *_) = run_and_get_code(compiled, ids)
        expected = model(ids).logits
    torch.testing.assert_close(logits.logits, expected, atol=1e-4, rtol=1e-4)
    calls = re.findall(r"torch\.ops\.gemslib\.(\w+)\.(\w+)\(", code)
    assert {op for op, _ in calls} >= {"merged_linear", "rotary", "attention", "rms_norm_forward"}
    assert {overload for _, overload in calls} == {"graph" if overloads_on else "default"}, calls


@pytest.mark.parametrize("options, padding", [(None, False), ({"shape_padding": True}, True)])
def test_matmuls_keep_their_shape_unless_padding_is_asked_for(monkeypatch, options, padding):
    """The backend turns inductor's shape padding off (its GPU timings would decide per run
    whether a projection still reads as one), unless the options ask for it."""
    seen = []
    call = gemslib.passes.GemslibPasses.__call__

    def recording(self, graph):
        seen.append(torch._inductor.config.shape_padding)
        return call(self, graph)

    monkeypatch.setattr(gemslib.passes.GemslibPasses, "__call__", recording)
    torch._dynamo.reset()
    x, w = torch.randn(5, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    f = torch.compile(lambda x, w: x @ w, backend="gemslib", options=options)
    assert torch.allclose(f(x, w), x @ w)
    assert seen == [padding]


@pytest.mark.parametrize("options, asserted", [(None, False), ({"size_asserts": True}, True)])
def test_fallback_outputs_are_not_checked_per_call_unless_asked(options, asserted):
    """Inductor's per-call size/stride checks of fallback outputs (host time on every launch
    of a gemslib op) are off under the backend, on again where its options ask for them."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x = torch.randn(6, 32, device=DEVICE)
    weight = torch.nn.Parameter(torch.randn(32, device=DEVICE))

    def norm(x):
        v = x.float()
        return weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    with torch.no_grad():
        compiled = torch.compile(norm, backend="gemslib", options=options)
        out, (code, *_) = run_and_get_code(compiled, x)
    torch.testing.assert_close(out, norm(x))
    assert "torch.ops.gemslib.rms_norm_forward" in code
    checked = re.findall(r"assert_size_stride\((\w+), .*'torch\.ops\.gemslib", code)
    assert bool(checked) == asserted, code


def test_a_training_graph_keeps_its_gradients():
    """With gradients the forward's intermediates are saved for the backward, so a norm can
    only be replaced where the backward does not read inside it; the gradients stay eager's."""
    _assert_compiled_gradients_are_eager_s(_tiny_llama(torch.float32, layers=1))


def _assert_compiled_gradients_are_eager_s(model):
    torch._dynamo.reset()
    ids = torch.randint(3, 96, (2, 7), device=DEVICE)
    model(ids).logits.square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.compile(model, backend="gemslib")(ids).logits.square().mean().backward()
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item() + 1e-12)


def test_a_training_graph_of_layers_sharing_one_table_compiles():
    """Every layer of a model rotates by one cos/sin table, so the q of one layer and the k of
    an earlier one look like one rotary site; in a training graph's order the matcher offered
    such a pair, and one launch for both would have needed its own output (a cycle: the
    compile failed). Such a pair is refused; the gradients stay eager's."""
    config = transformers.AutoConfig.for_model(
        "phi3", vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.float32)
    _assert_compiled_gradients_are_eager_s(model)


class _NormedAfterRotary(torch.nn.Module):
    """Hunyuan's attention input: the rotary of q and k, then an RMSNorm of each head; the
    rotary's final add must stay the rotary's (not read as a residual add + RMSNorm)."""

    def __init__(self):
        super().__init__()
        self.q_norm = torch.nn.RMSNorm(16, eps=1e-6)
        self.k_norm = torch.nn.RMSNorm(16, eps=1e-6)

    def forward(self, q, k, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.q_norm(q), self.k_norm(k)


def test_the_rotary_is_matched_before_the_norms_after_it():
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    module = _NormedAfterRotary().to(DEVICE)
    q, k = (torch.randn(2, heads, 5, 16, device=DEVICE) for heads in (4, 2))
    cos, sin = (torch.randn(1, 5, 16, device=DEVICE) for _ in range(2))
    with torch.no_grad():
        expected = module(q, k, cos, sin)
        got = torch.compile(module, backend="gemslib", fullgraph=True)(q, k, cos, sin)
    assert gemslib.fusion_report() == {"rotary": 1, "rms_norm": 2}, gemslib.fusion_report()
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5)


# families beyond the three the benchmarks are shaped like, with what each computes in the
# forms the passes know: Phi-3 (q/k/v and gate/up merged in its weights: chunked gate/up),
# Qwen3 (an RMSNorm of q's and k's heads), Hunyuan (the norms after the rotary), GLM (the
# interleaved partial rotary, chunked gate/up), Cohere (LayerNorm, a parallel block: one
# projection for q, k, v, gate and up; the interleaved rotary), Gemma (its (1 + w) norm
# computed in fp32, fused with weight_offset 1, and its GELU MLP), OLMo-2 (norms after each
# sublayer, q and k normed whole), Gemma-3 (Gemma-2's norms and per-head q/k norms),
# StableLM and GPT-NeoX (a quarter of each head rotated, the rest concatenated back)
_OTHER_FAMILIES = {
    "stablelm": {"merged_linear": 4, "rotary": 2, "rotary_partial": 2, "attention": 2,
                 "silu_and_mul": 2},
    "gpt_neox": {"rotary": 2, "rotary_partial": 2, "attention": 2},
    "phi3": {"rms_norm": 1, "add_rms_norm": 4, "rotary": 2, "attention": 2, "silu_and_mul": 2},
    "qwen3": {**_decoder_fusions(2), "rms_norm": 5, "rotary_qk_norm": 2},
    "hunyuan_v1_dense": {**_decoder_fusions(2), "rms_norm": 5},
    "glm": {"rms_norm": 1, "add_rms_norm": 4, "merged_linear": 2, "rotary": 2,
            "rotary_partial": 2, "attention": 2, "silu_and_mul": 2},
    "cohere": {"merged_linear": 2, "rotary": 2, "attention": 2, "silu_and_mul": 2},
    "gemma": {"merged_linear": 4, "rotary": 2, "attention": 2, "add_rms_norm": 4, "rms_norm": 1,
              "gelu_and_mul": 2},
    # Gemma-2: four (1 + w) norms a layer, the two after their sublayer alone (norm, then add)
    "gemma2": {"merged_linear": 4, "rotary": 2, "attention": 2, "add_rms_norm": 4,
               "rms_norm": 5, "gelu_and_mul": 2},
    # Gemma-3: Gemma-2's four (1 + w) norms a layer, and its per-head q/k (1 + w) norms after
    # the heads' transpose, in the rotary's launch (weight_offset 1)
    "gemma3_text": {"merged_linear": 4, "rotary": 2, "attention": 2, "add_rms_norm": 4,
                    "rms_norm": 9, "gelu_and_mul": 2, "rotary_qk_norm": 2},
    # OLMo-2: q and k normed over the whole projection (before the heads' view), each
    # sublayer's output normed before its residual add: four norms a layer, the final one
    # after the last add
    "olmo2": {"merged_linear": 4, "rotary": 2, "attention": 2, "silu_and_mul": 2,
              "rms_norm": 8, "add_rms_norm": 1},
}


@pytest.mark.parametrize("family", sorted(_OTHER_FAMILIES))
def test_other_families_stay_right_and_fuse_what_they_compute(family):
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    config = transformers.AutoConfig.for_model(
        family, vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = _away_from_identity(
        transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.float32).eval())
    ids = torch.randint(3, 96, (2, 11), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits
    assert gemslib.fusion_report() == _OTHER_FAMILIES[family], gemslib.fusion_report()
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-4, f"max error {error:.2e} of the largest logit"


class _Sharded(torch.Tensor):
    """A traceable wrapper subclass of one inner tensor (as a DTensor holds its local shard),
    whose shape is the whole: rows times the shard's."""

    @staticmethod
    def __new__(cls, shard, ranks):
        return torch.Tensor._make_wrapper_subclass(
            cls, (shard.shape[0] * ranks, *shard.shape[1:]), dtype=shard.dtype,
            device=shard.device)

    def __init__(self, shard, ranks):
        self.shard = shard

    def __tensor_flatten__(self):
        return ["shard"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"_Sharded holds inputs only, not {func}")

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _Sharded(inner["shard"], outer_size[0] // inner["shard"].shape[0])


def test_subclass_inputs_map_to_their_leaves_even_one_leaf_each():
    """The backend's inputs are subclasses with one leaf each (DTensor parameters), so the
    graph has as many placeholders as inputs: each placeholder is still the leaf's, the
    shard, not the whole."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gemslib.passes import manager
    from gemslib.passes.base import compiling

    shards = [torch.randn(4, 8), torch.randn(2, 8)]
    inputs = [_Sharded(shard, ranks=2) for shard in shards]
    traced = torch.fx.Graph()
    with FakeTensorMode() as fake_mode:
        for i, shard in enumerate(shards):
            traced.placeholder(f"arg{i}").meta["val"] = fake_mode.from_tensor(shard)
    with compiling(manager.compile_record(inputs)):
        real_value = manager._real_values(traced)
    placeholders = traced.find_nodes(op="placeholder")
    assert [real_value(node) is shard for node, shard in zip(placeholders, shards)] == [True, True]


def test_gemslib_ops_reach_inductor_with_their_fallbacks_registered(monkeypatch):
    """Inductor meets no gemslib operator without a lowering: its implicit path formats the
    call's IR arguments (eagerly before torch 2.12), a string that grows with the graph above
    the call (megabytes in a decode step)."""
    from torch._inductor import graph as inductor_graph
    from torch._inductor import lowering

    for op in [op for op in lowering.lowerings if "gemslib::" in str(op)]:
        monkeypatch.delitem(lowering.lowerings, op)  # as in a fresh process
    implicit = []
    real_make_fallback = inductor_graph.make_fallback

    def recording_make_fallback(op, *args, **kwargs):
        implicit.append(str(op))
        return real_make_fallback(op, *args, **kwargs)

    monkeypatch.setattr(inductor_graph, "make_fallback", recording_make_fallback)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    model = _tiny_llama(torch.float32, layers=2)
    ids = torch.randint(0, 96, (1, 8), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        got = torch.compile(model, backend="gemslib")(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert gemslib.fusion_report()["add_rms_norm"] == 4  # gemslib ops were lowered
    assert [op for op in implicit if op.startswith("gemslib")] == []
