"""Experiment: every transformers decoder family through ``backend="gemslib"``, tiny configs.

    python -m benchmark.experiments.model_families [--fp16 | --decode | --enable] [family ...]

Builds each family's causal LM from a tiny config (random weights, norms' weights away from 1,
biases away from 0), compiles it with ``backend="gemslib", fullgraph=True`` and prints the
largest logit error against eager relative to the largest logit, whether the eager model still
gives exactly what it gave before the compile (the merged parameters are views), and the
fusion report. With ``--fp16`` the model runs in fp16 and both eager's and the backend's logits
are set against the fp32 model's (relative error of the norms). With ``--decode``, greedy
``generate()`` on a static cache with its decode step compiled by the backend
(``CompileConfig``), a left-padded sequence in the batch, against eager's: whether the tokens
are the same, the largest logit error of any step, and the fusions (decode_gemv's default
applies: ``GEMSLIB_DECODE_GEMV=1`` forces it on). With ``--enable``, eager under
``gemslib.enable()`` (the aten overrides) against eager, a prefill and greedy ``generate()`` on
the dynamic cache: the largest logit error and whether the tokens are the same. On a machine
without a GPU, in the Triton interpreter. Results and the open question: docs/notes/graph-passes.md.
"""

from __future__ import annotations

import os
import sys

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# what a family's config needs besides TINY (experts that fit it, names it uses instead)
FAMILIES = {
    "llama": {}, "qwen2": {}, "mistral": {}, "qwen3": {}, "gemma": {}, "gemma2": {},
    "gemma3_text": {}, "phi3": {}, "phi": {}, "granite": {}, "olmo": {}, "olmo2": {},
    "cohere": {}, "stablelm": {}, "starcoder2": {}, "gpt_neox": {}, "smollm3": {}, "glm": {},
    "glm4": {}, "helium": {}, "exaone4": {}, "ernie4_5": {}, "seed_oss": {}, "arcee": {},
    "apertus": {}, "ministral": {}, "hunyuan_v1_dense": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "falcon": dict(head_dim=None, new_decoder_architecture=True, num_kv_heads=2),
    "olmo3": {}, "cohere2": {}, "nemotron": {}, "persimmon": dict(head_dim=None), "bitnet": {},
    "vaultgemma": {},
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                     moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    # multi-head latent attention: rotary over qk_rope_head_dim (head_dim), one KV head a head
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4),
}


def run_family(family: str, fp16: bool = False) -> str:
    import torch

    import gemslib

    model = build(family)
    ids = torch.randint(3, 96, (2, 11), device=model.device)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    with torch.no_grad():
        reference = model(ids).logits.double()
        if fp16:
            model = model.half()
        expected = model(ids).logits.double()
        logits = torch.compile(model, backend="gemslib", fullgraph=True)(ids).logits.double()
        again = model(ids).logits.double()
    fusions = dict(sorted(gemslib.fusion_report().items()))
    unchanged = torch.equal(again, expected)
    if fp16:
        def error(x):
            return ((x - reference).norm() / reference.norm()).item()
        return (f"vs fp32: eager {error(expected):.2e} gemslib {error(logits):.2e}  "
                f"eager unchanged {unchanged}  {fusions}")
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    return f"error {error:.1e}  eager unchanged {unchanged}  {fusions}"


def build(family: str):
    import torch
    import transformers

    settings = {**TINY, **FAMILIES.get(family, {})}
    settings = {key: value for key, value in settings.items() if value is not None}
    config = transformers.AutoConfig.for_model(family, **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    for name, parameter in model.named_parameters():
        if "norm" in name:
            parameter.data.uniform_(0.5, 1.5)
        elif name.endswith("bias"):
            parameter.data.uniform_(-0.5, 0.5)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def run_decode(family: str) -> str:
    import torch
    import transformers

    import gemslib

    model = build(family)
    ids = torch.randint(3, 96, (2, 7), device=model.device)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # the second sequence padded on the left
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                  cache_implementation="static", pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True)
    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
        config = transformers.CompileConfig(backend="gemslib", fullgraph=True)
        config._compile_all_devices = True  # transformers compiles on GPUs only by default
        model.generation_config.compile_config = config
        got = model.generate(ids, **kwargs)
    error = max(((g - e).abs().max() / e.abs().max()).item()
                for g, e in zip(got.logits, expected.logits))
    same = torch.equal(got.sequences, expected.sequences)
    return (f"decode: tokens eager's {same}  logit error {error:.1e}  "
            f"{dict(sorted(gemslib.fusion_report().items()))}")


def run_enable(family: str) -> str:
    import torch

    import gemslib

    model = build(family)
    ids = torch.randint(3, 96, (2, 11), device=model.device)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        expected = model(ids).logits
        tokens = model.generate(ids, **kwargs)
        with gemslib.enable():
            logits = model(ids).logits
            got = model.generate(ids, **kwargs)
    error = max([((logits - expected).abs().max() / expected.abs().max()).item()] +
                [((g - e).abs().max() / e.abs().max()).item()
                 for g, e in zip(got.logits, tokens.logits)])
    return (f"enable: logit error {error:.1e}  tokens eager's "
            f"{torch.equal(got.sequences, tokens.sequences)}")


def main(families: list[str]) -> None:
    modes = {"--fp16", "--decode", "--enable"}
    fp16, decode, enable = ("--fp16" in families, "--decode" in families,
                            "--enable" in families)
    for family in [f for f in families if f not in modes] or list(FAMILIES):
        try:
            result = (run_decode(family) if decode else run_enable(family) if enable else
                      run_family(family, fp16))
        except Exception as err:  # a family this transformers lacks, or a failure to show
            result = f"FAILED {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        print(f"{family:18s} {result}", flush=True)


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    main(sys.argv[1:])
