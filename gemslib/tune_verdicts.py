"""Verdicts: where a fusion of the graph passes beats the path inductor takes without it.

    python -m gemslib.tune --verdicts [--quick] [--out PATH | --user]

A fusion replaces a form a model writes (an RMSNorm, a residual add and RMSNorm, a SwiGLU or
GeGLU activation) by one gemslib kernel; inductor, without it, generates its own kernel for the
same form. Which is faster depends on the GPU and the shape, so for each such fusion this times both
on the GPU (each a compiled function of the form alone, ``backend="gemslib"`` and
``backend="inductor"``, CALLS_PER_REPLAY calls replayed from one CUDA graph: GPU time a
call, no host) at every
width of the models of ``gemslib.models`` and at row counts from one token to a long prompt,
and writes the outcome as the file's ``verdicts``: per fusion, buckets of ``rows`` and
``cols`` (the form's last dim: the hidden size for the norms, the intermediate size for the
gated activations) saying ``use: gemslib`` where gemslib's time was at most inductor's plus 1% (the
tuner's margin for noise), else ``use: inductor``. The passes read them (``verdict_allows``)
and leave a site whose bucket says inductor to inductor. The rest of the file is the file in
use's, so a run adds verdicts to the configs already tuned.

attention (SDPA -> gemslib's kernel) is timed against SDPA as inductor runs it, a causal
prompt of one sequence at each model's heads and several lengths; its verdicts are keyed on
the head dim (``cols``) and the prompt length (``rows``), the least favourable where models
share a head dim. transformers' eager attention that inductor's own patterns leave as it is
(a logit cap) is not under them: inductor's path there computes the scores whole.

decode_gemv (a decode step's projections taking the norms, the gated activation and the
residual adds around them; on by default only where measured) is weighed on a whole layer
instead: a stack of decoder layers of each model's widths at one token (attention left out),
compiled by gemslib with the fusion and without it, its weights several times the L2 so that
each replay reads them from memory as a step does; its verdict goes to each width a folded
site is keyed on (the hidden, the attention output's and the intermediate width).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from gemslib import runtime, tune_search

ROWS = (1, 16, 64, 256, 1024, 4096, 16384)
MARGIN = 1.01  # gemslib's time may be this much of inductor's and still be used
# calls timed in one CUDA-graph replay: with one, a 1-row form's 5.5-6.2 us on either side
# was the replay's start, and noise decided its verdict (docs/notes/tuning.md)
CALLS_PER_REPLAY = 16


def _norm(x, weight):
    from gemslib.passes.forms import transformers_rms_norm

    return transformers_rms_norm(x, weight, 1e-6)


def _add_norm(x, residual, weight):
    total = residual + x
    return _norm(total, weight), total


def _swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _geglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


# fusion -> (the form, its inputs for (rows, cols), which size of a model its cols are)
FORMS: dict[str, tuple[Callable, Callable, str]] = {
    "rms_norm": (_norm, lambda rows, cols, **kw: (torch.randn(1, rows, cols, **kw),
                                                  torch.rand(cols, **kw) + 0.5), "hidden"),
    "add_rms_norm": (_add_norm, lambda rows, cols, **kw: (
        torch.randn(1, rows, cols, **kw), torch.randn(1, rows, cols, **kw),
        torch.rand(cols, **kw) + 0.5), "hidden"),
    "silu_and_mul": (_swiglu, lambda rows, cols, **kw: (torch.randn(1, rows, 2 * cols, **kw),),
                     "intermediate"),
    "gelu_and_mul": (_geglu, lambda rows, cols, **kw: (torch.randn(1, rows, 2 * cols, **kw),),
                     "intermediate"),
}


DECODE_FUSION = "decode_gemv"  # weighed on whole layers (below), not a form alone
ATTENTION_FUSION = "attention"  # weighed against SDPA at each model's heads (below)
FUSIONS = (*FORMS, ATTENTION_FUSION, DECODE_FUSION)  # what --verdicts times, in its order


def widths(kind: str) -> list[int]:
    """The distinct ``hidden`` or ``intermediate`` sizes of the models of gemslib.models."""
    from gemslib.models import MODELS

    return sorted({getattr(spec, kind) for spec in MODELS.values()})


# --------------------------------------------------------------------------------------------
# attention, against SDPA at each model's heads
# --------------------------------------------------------------------------------------------

ATTENTION_ROWS = (512, 2048, 8192)  # prompt lengths, one sequence, causal


def _causal_attention(q, k, v):
    """transformers' SDPA attention of a causal prefill: K and V (B, Hkv, S, D) repeated to
    q's heads (its ``repeat_kv``), then SDPA."""
    batch, kv_heads, seq, head_dim = k.shape
    groups = q.shape[1] // kv_heads
    if groups > 1:
        k, v = (t[:, :, None].expand(batch, kv_heads, groups, seq, head_dim)
                .reshape(batch, kv_heads * groups, seq, head_dim) for t in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_heads() -> list[tuple[int, int, int]]:
    """The distinct (heads, kv_heads, head_dim) of the models of gemslib.models."""
    from gemslib.models import MODELS

    return sorted({(spec.heads, spec.kv_heads, spec.head_dim) for spec in MODELS.values()})


def measure_attention(heads: int, kv_heads: int, head_dim: int, seq: int,
                      timer: Callable[[Callable], float], device,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(gemslib's ms, inductor's ms) for a causal prefill's attention of one ``seq``-long
    sequence at these heads, each compiled by its backend (inductor's: SDPA, the vendor
    kernel torch picks); the gemslib compile must have fused it (else a RuntimeError)."""
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype)
            for _ in range(2))
    return _timed_by_both(_causal_attention, (q, k, v), ATTENTION_FUSION, timer,
                          f"attention at {heads}/{kv_heads} heads of {head_dim}, {seq} rows")


def attention_verdict_buckets(timings: Mapping[tuple[int, int, int, int], tuple[float, float]]
                              ) -> tuple[list, dict[tuple[int, int], tuple[float, float]]]:
    """(buckets, the timings they were made from) from ``{(heads, kv_heads, head_dim, rows):
    (gemslib ms, inductor ms)}``: keyed on the head dim (``cols``) and the prompt length
    (``rows``), the least favourable of the models sharing a head dim."""
    by_dim: dict[tuple[int, int], tuple[float, float]] = {}
    for (_, _, head_dim, rows), (ours, theirs) in timings.items():
        kept = by_dim.get((head_dim, rows))
        if kept is None or ours / theirs > kept[0] / kept[1]:
            by_dim[head_dim, rows] = (ours, theirs)
    return verdict_buckets(by_dim), by_dim


# --------------------------------------------------------------------------------------------
# decode_gemv, weighed on whole layers
# --------------------------------------------------------------------------------------------

# a stack's weights at least this much, several times an H100's or H200's 50 MB of L2
DECODE_STACK_BYTES = 256 << 20


class DecodeLayers(torch.nn.Module):
    """``layers`` decoder layers of ``spec``'s widths at a decode step's one token, attention
    left out: per layer the input norm (the residual add after the previous layer's down
    projection before it), the q, k and v projections (q, ``heads * head_dim`` wide, standing
    for the attention's output; k and v returned so that they are computed), the o projection,
    the residual add and norm, gate and up, ``act(gate) * up`` (SiLU, GELU-tanh for Gemma),
    the down projection, whose residual add ends the stack. Every form decode_gemv folds, as
    the models write them: ``3 * layers`` sites (the first norm, and per layer the norm after
    o and the gated down projection, and the residual add and norm between two layers)."""

    def __init__(self, spec, layers: int):
        super().__init__()
        attention_width = spec.heads * spec.head_dim
        kv_width = spec.kv_heads * spec.head_dim
        self.eps = spec.eps
        self.gelu = spec.family.startswith("gemma")

        def linear(inputs, outputs):
            return torch.nn.Linear(inputs, outputs, bias=False)

        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.q, layer.k, layer.v = (linear(spec.hidden, width) for width in
                                         (attention_width, kv_width, kv_width))
            layer.o = linear(attention_width, spec.hidden)
            layer.gate, layer.up = (linear(spec.hidden, spec.intermediate) for _ in range(2))
            layer.down = linear(spec.intermediate, spec.hidden)
            layer.input_norm, layer.post_norm = (torch.nn.Parameter(torch.rand(spec.hidden) + 0.5)
                                                 for _ in range(2))
            self.layers.append(layer)

    def _norm(self, x, weight):
        from gemslib.passes.forms import transformers_rms_norm

        return transformers_rms_norm(x, weight, self.eps)

    def forward(self, x):
        residual, h, keys_values = x, None, []
        for layer in self.layers:
            if h is not None:
                residual = residual + h
            normed = self._norm(residual, layer.input_norm)
            q = layer.q(normed)
            keys_values += [layer.k(normed), layer.v(normed)]
            residual = residual + layer.o(q)
            normed = self._norm(residual, layer.post_norm)
            gate, up = layer.gate(normed), layer.up(normed)
            act = (torch.nn.functional.gelu(gate, approximate="tanh") if self.gelu else
                   torch.nn.functional.silu(gate))
            h = layer.down(act * up)
        return residual + h, keys_values


def decode_stack_layers(spec, elem_bytes: int = 2) -> int:
    """Layers in the stack timed for ``spec``: enough for :data:`DECODE_STACK_BYTES` of
    weights, at least 2."""
    attention_width = spec.heads * spec.head_dim
    per_layer = spec.hidden * (2 * attention_width + 2 * spec.kv_heads * spec.head_dim
                               + 3 * spec.intermediate) * elem_bytes
    return max(2, -(-DECODE_STACK_BYTES // per_layer))


def decode_widths(spec) -> tuple[int, ...]:
    """The widths decode_gemv's sites in ``spec``'s layers are keyed on (their first
    projection's input): the hidden, the attention output's and the intermediate."""
    return tuple(sorted({spec.hidden, spec.heads * spec.head_dim, spec.intermediate}))


def measure_decode(spec, timer: Callable[[Callable], float], device,
                   dtype: torch.dtype = torch.bfloat16, layers: int | None = None
                   ) -> tuple[float, float]:
    """(ms a layer with decode_gemv, ms a layer without) for a :class:`DecodeLayers` stack of
    ``spec``'s widths at one token (``layers`` deep, else :func:`decode_stack_layers`), each
    compiled by gemslib; the compile with the fusion must have folded every site (else a
    RuntimeError)."""
    import gemslib

    layers = layers or decode_stack_layers(spec, torch.empty((), dtype=dtype).element_size())
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a GB of weights at 8B's widths
        model = DecodeLayers(spec, layers).to(dtype)
    x = torch.randn(1, 1, spec.hidden, device=device, dtype=dtype)
    times = {}
    with torch.no_grad(), runtime.ignoring_verdicts():
        for on in (True, False):
            torch._dynamo.reset()
            gemslib.reset_fusion_report()
            compiled = torch.compile(model, backend="gemslib", dynamic=False,
                                     options={f"gemslib.{DECODE_FUSION}": on})
            times[on] = timer(lambda: compiled(x)) / layers
            folded = gemslib.fusion_report().get(DECODE_FUSION, 0)
            if folded != (3 * layers if on else 0):
                raise RuntimeError(f"{DECODE_FUSION} at {spec.title}'s widths: the compile "
                                   f"{'with' if on else 'without'} it folded {folded} sites "
                                   f"of {3 * layers}")
    return times[True], times[False]


def decode_verdict_buckets(timings: Mapping[tuple[int, ...], tuple[float, float]]
                           ) -> tuple[list, dict[tuple[int, int], tuple[float, float]]]:
    """(buckets, the timings they were made from by width) from ``{widths: (ms with, ms
    without)}``, one entry a model (its :func:`decode_widths`): every width of a model takes
    its verdict; a width several models share takes the least favourable of theirs."""
    by_width: dict[tuple[int, int], tuple[float, float]] = {}
    for widths_of_model, (ours, theirs) in timings.items():
        for cols in widths_of_model:
            kept = by_width.get((cols, 1))
            if kept is None or ours / theirs > kept[0] / kept[1]:
                by_width[cols, 1] = (ours, theirs)
    return verdict_buckets(by_width), by_width


def measure(fusion: str, rows: int, cols: int, timer: Callable[[Callable], float],
            device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(gemslib's ms, inductor's ms) for ``fusion``'s form at ``rows`` x ``cols``; the gemslib
    compile must have made the fusion (else a RuntimeError)."""
    form, make_inputs, _ = FORMS[fusion]
    inputs = make_inputs(rows, cols, device=device, dtype=dtype)
    return _timed_by_both(form, inputs, fusion, timer, f"{fusion} at {rows}x{cols}")


def _timed_by_both(form: Callable, inputs, fusion: str, timer: Callable[[Callable], float],
                   what: str) -> tuple[float, float]:
    """(gemslib's ms, inductor's ms) for ``form(*inputs)`` compiled by each backend, the
    file's verdicts set aside; the gemslib compile must have made one ``fusion`` (else a
    RuntimeError naming ``what``)."""
    import gemslib

    times = {}
    with torch.no_grad(), runtime.ignoring_verdicts():
        for backend in ("gemslib", "inductor"):
            torch._dynamo.reset()
            gemslib.reset_fusion_report()
            compiled = torch.compile(form, backend=backend, dynamic=False)
            times[backend] = timer(lambda: compiled(*inputs))
            if backend == "gemslib" and gemslib.fusion_report().get(fusion) != 1:
                raise RuntimeError(f"{what}: the gemslib compile made "
                                   f"{gemslib.fusion_report()}, not one {fusion}")
    return times["gemslib"], times["inductor"]


def verdict_buckets(timings: Mapping[tuple[int, int], tuple[float, float]]
                    ) -> list[tuple[dict[str, int] | None, str]]:
    """Buckets from ``{(cols, rows): (gemslib ms, inductor ms)}``: per width, ascending, one
    bucket per run of row counts with one verdict (bounded by the run's last row count; the
    last run of a width covers every row count above it too), then a last bucket without
    bounds for widths above the widest measured, with the widest's verdict at most rows."""
    buckets: list[tuple[dict[str, int] | None, str]] = []
    by_width: dict[int, list[tuple[int, str]]] = {}
    for (cols, rows), (ours, theirs) in sorted(timings.items()):
        by_width.setdefault(cols, []).append(
            (rows, "gemslib" if ours <= theirs * MARGIN else "inductor"))
    last = "gemslib"
    for cols, verdicts in by_width.items():
        runs: list[tuple[int, str]] = []
        for rows, use in verdicts:
            if runs and runs[-1][1] == use:
                runs[-1] = (rows, use)
            else:
                runs.append((rows, use))
        for i, (rows, use) in enumerate(runs):
            if i == len(runs) - 1:
                buckets.append(({"cols": cols}, use))
            else:
                buckets.append(({"rows": rows, "cols": cols}, use))
        last = runs[-1][1]
    buckets.append((None, last))
    return _merged(buckets)


def _merged(buckets):
    """Neighbouring buckets of one verdict where the first's bound only narrows the second's
    (the second would take the first's shapes anyway)."""
    out = []
    for bound, use in buckets:
        if out and out[-1][1] == use and (bound is None or (
                set(out[-1][0] or {}) >= set(bound)
                and all(out[-1][0][k] <= v for k, v in bound.items()))):
            out[-1] = (bound, use)
        else:
            out.append((bound, use))
    return out


def with_verdicts(text: str, lines: list[str]) -> str:
    """A tune-config file's text with its ``verdicts:`` section (the last, as gemslib writes
    them) replaced by ``lines``."""
    kept = text.split("\nverdicts:", 1)[0].rstrip("\n")
    return kept + "\n" + ("\n".join(lines) + "\n" if lines else "")


def main(out: Path, quick: bool, progress=print, fusions=None) -> int:
    """Measure every fusion of :data:`FORMS`, attention at each model's heads, then
    decode_gemv at each model's widths (or
    only those of ``fusions``), and write the file in use with these verdicts to ``out`` (its
    verdicts of the fusions not measured kept). Returns 0, or 1 where a fusion could not be
    measured (left out)."""
    started = time.perf_counter()
    timer = tune_search.do_bench_ms(quick, calls=CALLS_PER_REPLAY)
    device = torch.device(runtime.device_type())
    rows_list = ROWS[::2] if quick else ROWS
    verdicts, notes, failed = {}, {}, 0
    in_use = runtime.active_configs()[0]
    in_use_text, kept = in_use.path.read_text(), dict(in_use.verdicts)
    kept_lines = tune_search.verdict_blocks(tune_search.kept_text(in_use)[1])
    chosen = set(fusions or FUSIONS)

    def write(fusion, buckets, timings):
        # after each fusion, so a run cut short keeps what it finished; the verdicts kept
        # keep their lines (their timings' comments)
        verdicts[fusion], notes[fusion] = buckets, timings
        lines = ["verdicts:"]
        for name in {**kept, **verdicts}:
            lines += (tune_search.render_verdicts({name: verdicts[name]}, notes)[1:]
                      if name in verdicts else kept_lines[name])
        out.write_text(with_verdicts(in_use_text, lines))
        runtime.load_tune_config(out)  # what was written must load

    for fusion, (_, _, kind) in FORMS.items():
        if fusion not in chosen:
            continue
        timings = {}
        for cols in widths(kind):
            for rows in rows_list:
                try:
                    timings[cols, rows] = measure(fusion, rows, cols, timer, device)
                except Exception as err:  # reported; the fusion keeps what it had
                    progress(f"  {fusion} {rows}x{cols}: not measured: {err}")
                    failed += 1
                    continue
                ours, theirs = timings[cols, rows]
                progress(f"  {fusion} {rows}x{cols}: gemslib {ours * 1e3:.1f} us, inductor "
                         f"{theirs * 1e3:.1f} us")
        if timings:
            write(fusion, verdict_buckets(timings), timings)
    attention_timer = tune_search.do_bench_ms(quick)
    attention_timings = {}
    for heads, kv_heads, head_dim in attention_heads() if ATTENTION_FUSION in chosen else ():
        for seq in ATTENTION_ROWS[::2] if quick else ATTENTION_ROWS:
            key = (heads, kv_heads, head_dim, seq)
            try:
                attention_timings[key] = measure_attention(*key, attention_timer, device)
            except Exception as err:  # reported; the fusion keeps what it had
                progress(f"  {ATTENTION_FUSION} {heads}/{kv_heads}x{head_dim} S{seq}: not "
                         f"measured: {err}")
                failed += 1
                continue
            ours, theirs = attention_timings[key]
            progress(f"  {ATTENTION_FUSION} {heads}/{kv_heads}x{head_dim} S{seq}: gemslib "
                     f"{ours * 1e3:.1f} us, SDPA under inductor {theirs * 1e3:.1f} us")
    if attention_timings:
        write(ATTENTION_FUSION, *attention_verdict_buckets(attention_timings))
    from gemslib.models import MODELS

    decode_timer = tune_search.do_bench_ms(quick)
    decode_timings = {}
    for spec in MODELS.values() if DECODE_FUSION in chosen else ():
        if decode_widths(spec) in decode_timings:
            continue
        try:
            decode_timings[decode_widths(spec)] = measure_decode(spec, decode_timer, device)
        except Exception as err:  # reported; the fusion keeps what it had
            progress(f"  {DECODE_FUSION} at {spec.title}'s widths: not measured: {err}")
            failed += 1
            continue
        ours, theirs = decode_timings[decode_widths(spec)]
        progress(f"  {DECODE_FUSION} a layer of {spec.title} at one token: with it "
                 f"{ours * 1e3:.1f} us, without {theirs * 1e3:.1f} us")
    if decode_timings:
        write(DECODE_FUSION, *decode_verdict_buckets(decode_timings))
    progress(f"wrote {out} (verdicts of {', '.join(verdicts)})" if verdicts else
             f"nothing measured: {out} not written")
    progress(f"in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0
