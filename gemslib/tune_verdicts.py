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


def widths(kind: str) -> list[int]:
    """The distinct ``hidden`` or ``intermediate`` sizes of the models of gemslib.models."""
    from gemslib.models import MODELS

    return sorted({getattr(spec, kind) for spec in MODELS.values()})


def measure(fusion: str, rows: int, cols: int, timer: Callable[[Callable], float],
            device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(gemslib's ms, inductor's ms) for ``fusion``'s form at ``rows`` x ``cols``; the gemslib
    compile must have made the fusion (else a RuntimeError)."""
    import gemslib

    form, make_inputs, _ = FORMS[fusion]
    inputs = make_inputs(rows, cols, device=device, dtype=dtype)
    times = {}
    with torch.no_grad(), runtime.ignoring_verdicts():
        for backend in ("gemslib", "inductor"):
            torch._dynamo.reset()
            gemslib.reset_fusion_report()
            compiled = torch.compile(form, backend=backend, dynamic=False)
            times[backend] = timer(lambda: compiled(*inputs))
            if backend == "gemslib" and gemslib.fusion_report().get(fusion) != 1:
                raise RuntimeError(f"{fusion} at {rows}x{cols}: the gemslib compile made "
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


def main(out: Path, quick: bool, progress=print) -> int:
    """Measure every fusion of :data:`FORMS`, and write the file in use with these verdicts
    to ``out``. Returns 0, or 1 where a fusion could not be measured (left out)."""
    started = time.perf_counter()
    timer = tune_search.do_bench_ms(quick, calls=CALLS_PER_REPLAY)
    device = torch.device(runtime.device_type())
    rows_list = ROWS[::2] if quick else ROWS
    verdicts, notes, failed = {}, {}, 0
    in_use = runtime.active_configs()[0]
    in_use_text, kept = in_use.path.read_text(), dict(in_use.verdicts)
    for fusion, (_, _, kind) in FORMS.items():
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
            verdicts[fusion], notes[fusion] = verdict_buckets(timings), timings
            # written after each fusion, so a run cut short keeps what it finished
            out.write_text(with_verdicts(in_use_text,
                                         tune_search.render_verdicts({**kept, **verdicts}, notes)))
            runtime.load_tune_config(out)  # what was written must load
    progress(f"wrote {out} (verdicts of {', '.join(verdicts)})" if verdicts else
             f"nothing measured: {out} not written")
    progress(f"in {time.perf_counter() - started:.0f} s")
    return 1 if failed else 0
