"""``python -m gemslib demo``: Llama-3-8B-shaped decoder layers, run five ways.

A decoder layer (pre-norm, grouped-query attention with rotary embeddings, SwiGLU MLP):

    h   = x + Wo · attention(rotary(Wq · n1), rotary(Wk · n1), Wv · n1)    n1 = rms_norm(x) * g1
    out = h + Wdown · (silu(Wgate · n2) * (Wup · n2))                     n2 = rms_norm(h) * g2

with random weights (no downloads), run as

- ``eager``: the layer written in torch ops the way Llama's model files write it (separate q, k,
  v, gate and up projections; F.rms_norm, F.scaled_dot_product_attention, F.silu);
- ``eager + enable()``: the same code under ``gemslib.enable()`` (aten overrides);
- ``gemslib``: the layer written with gemslib's operators: add_rms_norm (the residual add
  fused into the next norm, across layers), one QKV matmul, apply_rotary in place on the QKV
  buffer, attention / decode_attention, one gate-up matmul and silu_and_mul;
- ``torch.compile``: the eager layer compiled (inductor);
- ``gemslib, compile(fullgraph)``: the gemslib layer compiled whole (``fullgraph=True``).

``rms_norm_linear_silu`` does not fit this layer: the normed activations feed two matmuls
(gate and up), so fusing the norm into the gate's would leave the up projection to norm again.

Prefill: B sequences of S tokens through the layers. Decode: one new token per sequence
against a KV cache of ``kv_len`` tokens per layer; the gemslib decode step is also captured in
a CUDA graph (positions live in a device tensor, so one graph serves every step). Outputs are
checked against the eager layer in float64 (CPU) or float32 (GPU) on the same weights.

When transformers is installed, a real model follows (``--part``: ``layers``, ``transformers``
or ``all``, the default): transformers' ``LlamaForCausalLM`` at the same sizes (its random
initialisation, seeded; vocabulary 128256, or 512 for the tiny shape), prefill of the same
B x S computing the last position's logits, eager and ``torch.compile(model,
backend="gemslib", fullgraph=True)``, each checked against the same model in float32 (GPU) or
float64 (CPU). It prints the first call's time (the compile), the time per call and
``gemslib.fusion_report()``: which fusions the graph passes made in the model's own code. Without
transformers only the layers run (the part needs nothing beyond torch).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from gemslib.cli import doc_summary, positive_int, size_pair


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama decoder layer. ``head_dim`` = hidden / heads."""
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = LlamaShape(hidden=4096, heads=32, kv_heads=8, intermediate=14336)
TINY = LlamaShape(hidden=128, heads=4, kv_heads=2, intermediate=256)


@dataclasses.dataclass
class LayerWeights:
    """One layer's weights in torch's Linear layout (out_features, in_features)."""
    attn_norm: torch.Tensor   # (hidden,)
    qkv: torch.Tensor         # ((heads + 2 * kv_heads) * head_dim, hidden): Wq, Wk, Wv stacked
    o: torch.Tensor           # (hidden, heads * head_dim)
    mlp_norm: torch.Tensor    # (hidden,)
    gate_up: torch.Tensor     # (2 * intermediate, hidden): Wgate, Wup stacked
    down: torch.Tensor        # (hidden, intermediate)

    def to(self, dtype: torch.dtype) -> "LayerWeights":
        return LayerWeights(*(t.to(dtype) for t in dataclasses.astuple(self)))


def random_layers(shape: LlamaShape, n_layers: int, device, dtype: torch.dtype,
                  seed: int = 0) -> list[LayerWeights]:
    """Weights with the scale of a trained model's (std 1/sqrt(fan_in)), so activations stay
    O(1) through the layers; norm gains near 1."""
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        weight = torch.randn(out_features, in_features, generator=generator)
        return (weight / math.sqrt(in_features)).to(device=device, dtype=dtype)

    def gain() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(shape.hidden, generator=generator)).to(device=device,
                                                                              dtype=dtype)

    qkv_rows = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    return [LayerWeights(gain(), linear(qkv_rows, shape.hidden),
                         linear(shape.hidden, shape.heads * shape.head_dim), gain(),
                         linear(2 * shape.intermediate, shape.hidden),
                         linear(shape.hidden, shape.intermediate))
            for _ in range(n_layers)]


def rotary_tables(shape: LlamaShape, max_position: int, device,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (max_position, head_dim // 2): angle p * theta^(-2i / head_dim)."""
    half = shape.head_dim // 2
    inv_freq = shape.rope_theta ** -(torch.arange(half, dtype=torch.float64) / half)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


# ---- the layer in torch ops (eager, under enable(), and what torch.compile compiles) ----

def _rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / Llama rotary on x (B, S, H, D) with cos, sin (B, S, D/2) gathered by position."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _split_qkv(qkv: torch.Tensor, shape: LlamaShape):
    """(q, k, v) views (B, S, H, D) of a (B, S, (Hq + 2 Hkv) * D) projection."""
    batch, seq = qkv.shape[:2]
    d = shape.head_dim
    q, k, v = qkv.split([shape.heads * d, shape.kv_heads * d, shape.kv_heads * d], dim=-1)
    return (q.view(batch, seq, shape.heads, d), k.view(batch, seq, shape.kv_heads, d),
            v.view(batch, seq, shape.kv_heads, d))


def torch_layer(x: torch.Tensor, w: LayerWeights, shape: LlamaShape, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                position: int = 0) -> torch.Tensor:
    """One layer on x (B, S, hidden), tokens at ``positions`` (B, S). Prefill (cache None):
    causal attention over the S tokens. Decode (S = 1, every sequence's new token at
    ``position``, a Python int as a model file's step counter is): k and v are written into
    ``cache`` (B, Hkv, L, D) there and the token attends to positions 0..position."""
    normed = F.rms_norm(x, (shape.hidden,), w.attn_norm, shape.eps)
    # separate projections, as Llama's model files write them (views of the stacked weights)
    d, heads, kv_heads = shape.head_dim, shape.heads, shape.kv_heads
    q_weight, k_weight, v_weight = w.qkv.split([heads * d, kv_heads * d, kv_heads * d])
    batch, seq = x.shape[:2]
    q = F.linear(normed, q_weight).view(batch, seq, heads, d)
    k = F.linear(normed, k_weight).view(batch, seq, kv_heads, d)
    v = F.linear(normed, v_weight).view(batch, seq, kv_heads, d)
    q = _rotate_half_split(q, cos[positions], sin[positions])
    k = _rotate_half_split(k, cos[positions], sin[positions])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is None:
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        k_cache, v_cache = cache
        k_cache[:, :, position] = k[:, :, 0]
        v_cache[:, :, position] = v[:, :, 0]
        attended = F.scaled_dot_product_attention(q, k_cache[:, :, :position + 1],
                                                  v_cache[:, :, :position + 1], enable_gqa=True)
    h = x + F.linear(attended.transpose(1, 2).reshape(batch, seq, -1), w.o)
    normed = F.rms_norm(h, (shape.hidden,), w.mlp_norm, shape.eps)
    gate_weight, up_weight = w.gate_up.chunk(2)
    return h + F.linear(F.silu(F.linear(normed, gate_weight)) * F.linear(normed, up_weight), w.down)


def torch_stack(x, layers, shape, cos, sin, positions, caches=None, position: int = 0):
    """``torch_layer`` over ``layers``; ``caches`` one (k_cache, v_cache) per layer."""
    for index, w in enumerate(layers):
        x = torch_layer(x, w, shape, cos, sin, positions,
                        None if caches is None else caches[index], position)
    return x


# ---- the layer in gemslib's operators ----

def gemslib_stack(x: torch.Tensor, layers: list[LayerWeights], shape: LlamaShape,
                  cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                  seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """``torch_stack`` with gemslib's operators. Each layer's last residual add is left to the
    next layer's add_rms_norm (one pass: add, then norm). Decode (caches given, S = 1):
    ``positions`` (B, 1) is where each sequence's new token goes, ``seqlens`` (B,) = positions
    + 1, both device tensors, so the step has no host sync and a CUDA graph replays it."""
    import gemslib

    batch, seq = x.shape[:2]
    hidden, residual = x, None
    for index, w in enumerate(layers):
        if residual is None:
            normed, residual = gemslib.rms_norm(hidden, w.attn_norm, shape.eps), hidden
        else:
            normed, residual = gemslib.add_rms_norm(hidden, residual, w.attn_norm, shape.eps)
        qkv = F.linear(normed, w.qkv)
        q, k, v = _split_qkv(qkv, shape)
        q, k = gemslib.apply_rotary(q, k, cos, sin, positions=positions, inplace=True)
        if caches is None:
            attended = gemslib.attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), causal=True).transpose(1, 2)
        else:
            k_cache, v_cache = caches[index]
            rows = torch.arange(batch, device=x.device)
            k_cache[rows, :, positions[:, 0]] = k[:, 0]
            v_cache[rows, :, positions[:, 0]] = v[:, 0]
            attended = gemslib.decode_attention(q[:, 0], k_cache, v_cache, seqlens)
        hidden = F.linear(attended.reshape(batch, seq, -1), w.o)
        normed, residual = gemslib.add_rms_norm(hidden, residual, w.mlp_norm, shape.eps)
        hidden = F.linear(gemslib.silu_and_mul(F.linear(normed, w.gate_up)), w.down)
    return hidden + residual


# ---- running it ----

def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300))


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench on a GPU, wall clock on the CPU)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[1]


def _new_caches(n_layers, batch, shape, length, device, dtype):
    return [tuple(torch.zeros(batch, shape.kv_heads, length, shape.head_dim, device=device,
                              dtype=dtype) for _ in range(2)) for _ in range(n_layers)]


def _fill_caches(caches, generator_seed: int, filled: int):
    """Random K/V in the first ``filled`` positions (the same in every copy made from it)."""
    generator = torch.Generator(device="cpu").manual_seed(generator_seed)
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            values = torch.randn(cache[:, :, :filled].shape, generator=generator)
            cache[:, :, :filled] = values.to(cache.dtype)


def run(shape: LlamaShape, n_layers: int, prefill: tuple[int, int], decode: tuple[int, int],
        device: torch.device, dtype: torch.dtype, time_it: bool, compile_backend: str,
        out=print) -> int:
    """Build the layers, check the five ways agree (and, for decode, the CUDA-graph step),
    time them when ``time_it``. Returns the number of disagreements."""
    import gemslib

    check_dtype = torch.float64 if device.type == "cpu" else torch.float32
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    layers = random_layers(shape, n_layers, device, dtype)
    reference_layers = [w.to(check_dtype) for w in layers]
    max_position = max(prefill[1], decode[1] + 1)
    cos, sin = rotary_tables(shape, max_position, device)
    failures = 0

    def report(kind: str, name: str, result: torch.Tensor, reference: torch.Tensor,
               ms: float | None, base_ms: float | None) -> None:
        nonlocal failures
        error = _relative_error(result, reference)
        ok = bool(torch.isfinite(result).all()) and error <= tolerance
        failures += not ok
        timing = "" if ms is None else f"{ms:>10.3f} ms" + (
            f"  {base_ms / ms:>5.2f}x eager" if base_ms else "")
        out(f"  {kind:<8}{name:<40}{error:>10.1e}  {'ok' if ok else 'MISMATCH':<9}{timing}")

    out(f"{n_layers} layer(s) of hidden {shape.hidden}, heads {shape.heads}/{shape.kv_heads}, "
        f"head dim {shape.head_dim}, intermediate {shape.intermediate}; {dtype} on {device}; "
        f"error: relative to the eager layer in {check_dtype} (tolerance {tolerance:g})")
    out(f"  {'':<8}{'':<40}{'rel error':>10}  {'':<9}" + ("      time" if time_it else ""))

    # prefill
    batch, seq = prefill
    generator = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(batch, seq, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    reference = torch_stack(x.to(check_dtype), reference_layers, shape, cos, sin, positions)
    compiled_torch = torch.compile(torch_stack, backend=compile_backend)
    compiled_gemslib = torch.compile(gemslib_stack, backend=compile_backend, fullgraph=True)
    ways = [("eager", lambda: torch_stack(x, layers, shape, cos, sin, positions), None),
            ("eager + enable()", lambda: torch_stack(x, layers, shape, cos, sin, positions),
             gemslib.enable),
            ("gemslib", lambda: gemslib_stack(x, layers, shape, cos, sin, positions), None),
            ("torch.compile", lambda: compiled_torch(x, layers, shape, cos, sin, positions), None),
            ("gemslib, compile(fullgraph)",
             lambda: compiled_gemslib(x, layers, shape, cos, sin, positions), None)]
    _run_ways("prefill", f"B{batch} S{seq}", ways, reference, report, device, time_it, out)

    # decode: every sequence holds kv_len tokens; the new one goes to position kv_len
    batch, kv_len = decode
    x = torch.randn(batch, 1, shape.hidden, generator=generator).to(device=device, dtype=dtype)
    positions = torch.full((batch, 1), kv_len, device=device, dtype=torch.int64)
    seqlens = positions[:, 0] + 1
    template = _new_caches(n_layers, batch, shape, kv_len + 1, device, dtype)
    _fill_caches(template, 2, kv_len)

    def caches_like(dtype_=dtype):
        return [tuple(c.to(dtype_, copy=True) for c in pair) for pair in template]

    reference = torch_stack(x.to(check_dtype), reference_layers, shape, cos, sin, positions,
                            caches_like(check_dtype), kv_len)
    # every way gets its own caches; a repeated step rewrites the same entries
    eager_caches, gemslib_caches, compiled_caches, fullgraph_caches = (
        caches_like() for _ in range(4))
    ways = [("eager", lambda: torch_stack(x, layers, shape, cos, sin, positions, eager_caches,
                                          kv_len), None),
            ("eager + enable()", lambda: torch_stack(x, layers, shape, cos, sin, positions,
                                                     eager_caches, kv_len), gemslib.enable),
            ("gemslib", lambda: gemslib_stack(x, layers, shape, cos, sin, positions,
                                              gemslib_caches, seqlens), None),
            ("torch.compile", lambda: compiled_torch(x, layers, shape, cos, sin, positions,
                                                     compiled_caches, kv_len), None),
            ("gemslib, compile(fullgraph)", lambda: compiled_gemslib(
                x, layers, shape, cos, sin, positions, fullgraph_caches, seqlens), None)]
    if device.type == "cuda":
        ways.append(("gemslib, CUDA graph", _graphed_decode(
            x, layers, shape, cos, sin, positions, caches_like(), seqlens), None))
    _run_ways("decode", f"B{batch} KV{kv_len}", ways, reference, report, device, time_it, out)
    return failures


def _run_ways(kind, problem, ways, reference, report, device, time_it, out) -> None:
    """Run (and time) each way; ``scope`` (gemslib.enable) wraps a way's calls and the
    overrides that ran and fell back are printed after it."""
    base_ms = None
    for name, fn, scope in ways:
        activation = scope(record=True) if scope else contextlib.nullcontext()
        with activation:
            result = fn()
            ms = _time_ms(fn, device) if time_it else None
        base_ms = base_ms or ms
        report(kind, f"{name} ({problem})", result, reference, ms, base_ms)
        if scope:
            ran = ", ".join(sorted(name.replace("aten::", "") for name in activation.calls))
            fell_back = ", ".join(sorted(activation.fallbacks)) or "none"
            out(f"{'':10}overrides that ran: {ran or 'none'}; fell back: {fell_back}")


def _graphed_decode(x, layers, shape, cos, sin, positions, caches, seqlens) -> Callable:
    """The gemslib decode step captured in a CUDA graph (warmed up first, on a side stream, so
    every kernel is compiled and every decode plan made before capture)."""
    from gemslib import runtime

    graph, out = runtime.captured(
        lambda: gemslib_stack(x, layers, shape, cos, sin, positions, caches, seqlens))

    # the graph reads and writes these tensors' memory: they must outlive it (the caches are
    # this function's own; freed, their memory would go to other tensors while replays write it)
    static = (x, layers, cos, sin, positions, caches, seqlens)

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    replay.static = static
    return replay


# ---- a transformers model (when transformers is installed) ----

def have_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def transformers_llama(shape: LlamaShape, n_layers: int, vocab: int, device: torch.device,
                       seed: int = 0):
    """transformers' LlamaForCausalLM at ``shape``'s sizes, in float32 on ``device``, with
    transformers' random initialisation from ``seed`` (sdpa attention, untied embeddings)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=n_layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.eps,
        rope_theta=shape.rope_theta, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).eval()


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` with its parameters in ``dtype`` and its buffers (the rotary inv_freq) left
    as they are, as ``from_pretrained(dtype=...)`` leaves them."""
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer)
    return model


def run_transformers(shape: LlamaShape, n_layers: int, prefill: tuple[int, int],
                     device: torch.device, dtype: torch.dtype, time_it: bool,
                     out=print) -> int:
    """A transformers Llama, eager and compiled with the gemslib backend, checked against the
    model in float32 (GPU) or float64 (CPU). Returns the number of disagreements."""
    import copy

    import gemslib

    check_dtype = torch.float64 if device.type == "cpu" else torch.float32
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    vocab = 128256 if shape.hidden >= 1024 else 512
    built = transformers_llama(shape, n_layers, vocab, device)
    reference_model = copy.deepcopy(built).to(check_dtype)
    model = cast_parameters(built, dtype)
    batch, seq = prefill
    generator = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    problem = f"B{batch} S{seq}"
    out(f"transformers LlamaForCausalLM, {n_layers} layer(s) of the same sizes, vocabulary "
        f"{vocab}; {dtype} on {device}; error: last-position logits relative to the model in "
        f"{check_dtype} (tolerance {tolerance:g})")
    with torch.no_grad():
        reference = reference_model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
    del reference_model

    torch._dynamo.reset()
    gemslib.reset_fusion_report()
    compiled = torch.compile(model, backend="gemslib", fullgraph=True)
    ways = [("eager", model), ('compile(backend="gemslib", fullgraph)', compiled)]
    failures, base_ms = 0, None
    for name, runner in ways:
        def forward(runner=runner):
            return runner(input_ids=ids, logits_to_keep=1, use_cache=False).logits
        with torch.no_grad():
            started = time.perf_counter()
            logits = forward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            ms = _time_ms(forward, device) if time_it else None
        error = _relative_error(logits, reference)
        ok = bool(torch.isfinite(logits).all()) and error <= tolerance
        failures += not ok
        base_ms = base_ms or ms
        timing = "" if ms is None else f"{ms:>10.3f} ms" + (
            f"  {base_ms / ms:>5.2f}x eager" if base_ms else "")
        out(f"  {'model':<8}{name + f' ({problem})':<48}{error:>10.1e}  "
            f"{'ok' if ok else 'MISMATCH':<9}{timing}")
        if runner is compiled:
            fusions = ", ".join(f"{fusion} {sites}" for fusion, sites
                                in sorted(gemslib.fusion_report().items()))
            out(f"{'':10}first call (compile) {first_s:.1f} s; fusions: {fusions or 'none'}")
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gemslib demo", description=doc_summary(__doc__),
        epilog="exit codes: 0 every way agrees, 1 a mismatch, 2 bad arguments")
    parser.add_argument("--shape", choices=["llama3-8b", "tiny"], default=None,
                        help="layer sizes (default: llama3-8b on a GPU, tiny on the CPU)")
    parser.add_argument("--layers", type=positive_int, default=None, metavar="N",
                        help="decoder layers (default: 4 on a GPU, 2 on the CPU)")
    parser.add_argument("--prefill", type=size_pair("BxS"), default=None, metavar="BxS",
                        help="B sequences of S tokens (default 1x4096 GPU, 1x24 CPU)")
    parser.add_argument("--decode", type=size_pair("BxKV"), default=None, metavar="BxKV",
                        help="B sequences with KV tokens cached (default 16x4096 GPU, 2x20 CPU)")
    parser.add_argument("--no-time", action="store_true", help="check only")
    parser.add_argument("--part", choices=["all", "layers", "transformers"], default="all",
                        help="the hand-written layers, transformers' LlamaForCausalLM compiled "
                             "with the gemslib backend, or both (default: all; the transformers "
                             "part is left out when transformers is not installed)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The demo's arguments; bad ones exit 2 with argparse's message naming the argument
    (``--part transformers`` without transformers installed is one)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.part == "transformers" and not have_transformers():
        parser.error("--part transformers needs transformers (pip install transformers)")
    return args


def main(argv: list[str] | None = None) -> int:
    from gemslib import runtime

    args = parse_args(argv)
    gpu = not runtime.INTERPRETER
    shape = {"llama3-8b": LLAMA3_8B, "tiny": TINY}[args.shape or ("llama3-8b" if gpu else "tiny")]

    started = time.perf_counter()
    n_layers = args.layers or (4 if gpu else 2)
    prefill = args.prefill or ((1, 4096) if gpu else (1, 24))
    device = torch.device(runtime.device_type())
    dtype = torch.bfloat16 if gpu else torch.float32
    failures = 0
    if args.part in ("all", "layers"):
        failures += run(shape, n_layers, prefill, args.decode or ((16, 4096) if gpu else (2, 20)),
                        device, dtype, time_it=gpu and not args.no_time,
                        compile_backend="inductor" if gpu else "aot_eager")
    if args.part in ("all", "transformers"):
        if have_transformers():
            failures += run_transformers(shape, n_layers, prefill, device, dtype,
                                         time_it=gpu and not args.no_time)
        else:
            print("transformers is not installed: the real-model part is left out "
                  "(pip install transformers)")
    elapsed = time.perf_counter() - started
    print(f"{'all ways agree' if not failures else f'{failures} MISMATCH(ES)'} ({elapsed:.1f} s)")
    return 1 if failures else 0
