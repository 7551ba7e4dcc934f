"""Shapes of common LLM families as transformers models, by name: what ``python -m gemslib.tune
--model NAME`` tunes for and what the benchmarks build.

    spec = MODELS["qwen2-7b"]                   # a ModelSpec: sizes, family, default layer count
    model = build_model(spec, "cuda", torch.bfloat16)   # transformers' random init, seeded
    config = hf_config(spec)                    # its transformers config

``layers`` is how many decoder layers are built (fewer than the real model's: the layers
repeat, so the shapes, and the time per layer, are the real model's).
"""

from __future__ import annotations

import dataclasses

SEED = 0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family at one size. ``layers`` is how many decoder layers the benchmark builds
    (fewer than the real model's: the layers repeat, and the time per layer is what compares)."""
    title: str
    family: str           # a key of FAMILIES: the transformers classes
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float
    layers: int
    max_positions: int
    attention: str = "sdpa"  # transformers' attn_implementation

    def tiny(self) -> "ModelSpec":
        """The same family at a size the Triton interpreter runs in seconds."""
        return dataclasses.replace(self, title=self.title + " (tiny)", hidden=64,
                                   intermediate=128, heads=4, kv_heads=2, head_dim=16,
                                   vocab=512, layers=2, max_positions=512)


MODELS = {
    "llama3-8b": ModelSpec("Llama-3-8B", "llama", hidden=4096, intermediate=14336, heads=32,
                           kv_heads=8, head_dim=128, vocab=128256, rope_theta=500000.0,
                           eps=1e-5, layers=8, max_positions=8192),
    # Qwen2's q, k and v projections carry biases (its attention module always has them)
    "qwen2-7b": ModelSpec("Qwen2-7B", "qwen2", hidden=3584, intermediate=18944, heads=28,
                          kv_heads=4, head_dim=128, vocab=152064, rope_theta=1000000.0,
                          eps=1e-6, layers=4, max_positions=32768),
    # Mistral-7B v0.3's form: no sliding window (v0.1's 4096-token window would turn the
    # causal SDPA into an explicit mask at S 4096)
    "mistral-7b": ModelSpec("Mistral-7B", "mistral", hidden=4096, intermediate=14336, heads=32,
                            kv_heads=8, head_dim=128, vocab=32000, rope_theta=1000000.0,
                            eps=1e-5, layers=8, max_positions=32768),
    # families and sizes beyond the three above: a small model (head dim 64, host-bound at
    # short prompts), q/k norms (Qwen3), merged q/k/v and gate/up weights with head dim 96
    # (Phi-3), GELU and (1 + w) norms with head dim 256 (Gemma)
    "llama3.2-1b": ModelSpec("Llama-3.2-1B", "llama", hidden=2048, intermediate=8192,
                             heads=32, kv_heads=8, head_dim=64, vocab=128256,
                             rope_theta=500000.0, eps=1e-5, layers=16, max_positions=8192),
    "qwen3-8b": ModelSpec("Qwen3-8B", "qwen3", hidden=4096, intermediate=12288, heads=32,
                          kv_heads=8, head_dim=128, vocab=151936, rope_theta=1000000.0,
                          eps=1e-6, layers=8, max_positions=40960),
    "phi3-mini": ModelSpec("Phi-3-mini", "phi3", hidden=3072, intermediate=8192, heads=32,
                           kv_heads=32, head_dim=96, vocab=32064, rope_theta=10000.0,
                           eps=1e-5, layers=8, max_positions=4096),
    "gemma-7b": ModelSpec("Gemma-7B", "gemma", hidden=3072, intermediate=24576, heads=16,
                          kv_heads=16, head_dim=256, vocab=256000, rope_theta=10000.0,
                          eps=1e-6, layers=6, max_positions=8192),
    # Gemma-2: four (1 + w) norms a layer (two after their sublayer), GQA at head dim 256, its
    # config's sliding window on every other layer and its logit soft-capping as transformers
    # gives them (SDPA attention)
    "gemma2-9b": ModelSpec("Gemma-2-9B", "gemma2", hidden=3584, intermediate=14336, heads=16,
                           kv_heads=8, head_dim=256, vocab=256000, rope_theta=10000.0,
                           eps=1e-6, layers=6, max_positions=8192),
    # Gemma-2 as it computes with its logit cap: eager attention (transformers' SDPA path drops
    # the cap), which the backend fuses into attention with its softcap
    "gemma2-9b-eager": ModelSpec("Gemma-2-9B (eager, capped)", "gemma2", hidden=3584,
                                 intermediate=14336, heads=16, kv_heads=8, head_dim=256,
                                 vocab=256000, rope_theta=10000.0, eps=1e-6, layers=6,
                                 max_positions=8192, attention="eager"),
}

# family -> (transformers config class, model class, config arguments of the family's own):
# sliding windows off (a window turns the causal SDPA into an explicit mask)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None, "pad_token_id": None,
                                               "eos_token_id": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
}

def hf_config(spec: ModelSpec):
    """The transformers config of ``spec`` (its attention implementation, sdpa unless it says
    otherwise; untied embeddings)."""
    import transformers

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden,
                  intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  head_dim=spec.head_dim, rms_norm_eps=spec.eps, rope_theta=spec.rope_theta,
                  max_position_embeddings=spec.max_positions, tie_word_embeddings=False,
                  attn_implementation=spec.attention)
    if spec.family not in FAMILIES:
        raise ValueError(f"unknown model family {spec.family!r}; known: {', '.join(FAMILIES)}")
    config_class, _, own = FAMILIES[spec.family]
    return getattr(transformers, config_class)(**common, **own)


def build_model(spec: ModelSpec, device, dtype):
    """The model with transformers' random initialisation, seeded and made on ``device`` in
    float32 (the same weights in every process on that device), then cast to ``dtype``."""
    import torch
    import transformers

    config = hf_config(spec)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[spec.family][1])(config)
    # the parameters only: the rotary inv_freq buffers stay float32, as from_pretrained(dtype=)
    # leaves them (model.to(dtype) would round them, and the angles at position 4096 with them)
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer)
    return model.eval()
