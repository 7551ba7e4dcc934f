"""Host cost per call at decode sizes: what a call costs the CPU when the GPU work is a few
microseconds, for gemslib's operators and their peers.

    python -m benchmark.host [--calls N] [--out DIR]

Each figure launches ``--calls`` calls back to back without synchronising and divides the
wall time by their number, after a warm-up: with work this small the host is the bottleneck,
so this is the host's time per call (Python, checks, the dispatcher, the kernel launch). The
cases: every operator at a decode size (the fused MLP ops at a width whose weights stream in
a few microseconds), every backward override as autograd calls it, and a prefill-sized
attention call, forward and forward + backward (host-bound too). Ways per case, in one process
and one run: gemslib's direct call (planned calls replayed by the native table of
``gemslib.runtime.native`` where it is on), the same with ``runtime.NATIVE_REPLAY`` switched off
(``gemslib-python``: the plans' generated Python replays), the same with
``runtime.DIRECT_LAUNCH`` switched off (``gemslib-bound``: every launch through Triton's
argument binding), the torch call under ``gemslib.enable()`` (and ``enable-python``, native
replay off), torch eager (for work eager does in two kernels, both: their sum), the torch call
under FlagGems' ``use_gems()``, and Liger-Kernel's functional API, the last two where
importable. The ratios are against torch eager's (the bar: at most 1.5x). Under
the table, a planned silu piece by piece (its allocation, the compiled launcher alone): the
floor of a call made from Python.

A second table measures one launch inside a compiled graph (:func:`run_graphs`): a stack of
layers, each a small projection (cuBLAS for every way) followed by one form that both
backends make one kernel of (an RMSNorm, a residual add and RMSNorm, a SwiGLU activation),
compiled by inductor and by gemslib, beside the same stack without the form. What a layer adds
to the graph's host time over the projections alone is the host time of the form's launch:
inductor's generated Triton launch, or gemslib's operator through its ``graph`` overload
(``gemslib``; ``gemslib-python`` with the native replay off; ``gemslib-default`` with the
default overloads, as graphs called them before the graph overloads existed). The bar: gemslib
at most 1.5x inductor. Writes ``<out>/host.json`` and ``<out>/host.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable

BENCH_DIR = Path(__file__).resolve().parent
HOST_WAYS = ("gemslib", "gemslib-python", "gemslib-bound", "enable", "enable-python", "torch",
             "flaggems", "liger")


def host_us(fn: Callable, calls: int, synchronize: Callable = lambda: None,
            warmup: int = 50) -> float:
    """Microseconds of wall time per call of ``fn`` over ``calls`` calls back to back."""
    for _ in range(warmup):
        fn()
    synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    synchronize()
    return elapsed / calls * 1e6


def cases(device) -> dict[str, dict[str, Callable | None]]:
    """Operator at a decode size -> way -> the call (None: the way has no such call). The
    ``enable`` and ``flaggems`` calls are the torch ones; their scope is entered by :func:`run`."""
    import torch
    import torch.nn.functional as F

    import gemslib
    from gemslib.passes import forms

    aten = torch.ops.aten
    bf16 = dict(device=device, dtype=torch.bfloat16)
    hidden, weight = torch.randn(16, 4096, **bf16), torch.randn(4096, **bf16)
    residual = torch.randn(16, 4096, **bf16)
    gate_up = torch.randn(16, 2 * 28672, **bf16)
    logits = torch.randn(16, 128256, **bf16)
    q, k = torch.randn(16, 1, 32, 128, **bf16), torch.randn(16, 1, 8, 128, **bf16)
    angles = torch.rand(4096, 64, device=device)  # half the head dim: rot_dim = 128
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    q_row = torch.randn(16, 32, 1, 128, **bf16)
    cache = torch.randn(16, 8, 4096, 128, **bf16)
    # a prefill call: Qwen2-7B's attention at B16 S128 (B1 in the CPU's interpreter, whose
    # dot products take seconds)
    prefill_batch = 16 if torch.device(device).type == "cuda" else 1
    q_prompt = torch.randn(prefill_batch, 28, 128, 128, **bf16)
    kv_prompt = torch.randn(prefill_batch, 4, 128, 128, **bf16)
    # the fused MLP ops at a width whose weights stream in a few microseconds (Qwen2-0.5B's
    # hidden 896, intermediate 4864: 17 MB), so that the host's part shows
    small_x, small_norm = torch.randn(16, 896, **bf16), torch.rand(896, **bf16) + 0.5
    gate_up_weight = torch.randn(2 * 4864, 896, **bf16) / 30
    # transformers' per-token table for one token of each sequence: (B, 1, D) halves repeated
    table_angles = torch.cat([angles[:16, None]] * 2, dim=-1)
    cos_table, sin_table = (f(table_angles).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    # backward inputs: an incoming gradient, and what the forward saved
    grad_hidden = torch.randn(16, 4096, **bf16)
    probs, log_probs = torch.softmax(logits, -1), torch.log_softmax(logits, -1)
    grad_logits = torch.randn(16, 128256, **bf16)
    rstd = torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    q_train, kv_train = (t.detach().requires_grad_() for t in (q_prompt, kv_prompt))
    grad_prompt = torch.randn_like(q_prompt)
    liger = _liger()

    def torch_silu_and_mul():
        return F.silu(gate_up[:, :28672]) * gate_up[:, 28672:]

    def torch_add_rms_norm():
        total = hidden + residual
        return F.rms_norm(total, (4096,), weight, 1e-6), total

    def sdpa_row():
        return F.scaled_dot_product_attention(q_row, cache, cache, enable_gqa=True)

    def sdpa_prompt():
        return F.scaled_dot_product_attention(q_prompt, kv_prompt, kv_prompt, is_causal=True,
                                              enable_gqa=True)

    def torch_rotary():  # transformers' apply_rotary_pos_emb on (B, H, 1, D) views
        return forms.transformers_rotary(q.transpose(1, 2), k.transpose(1, 2),
                                         cos_table[:, None], sin_table[:, None])

    def gemslib_rotary_table():
        return gemslib.apply_rotary(q, k, cos_table, sin_table)

    def torch_rms_norm_swiglu():
        gate, up = F.linear(F.rms_norm(small_x, (896,), small_norm, 1e-6),
                            gate_up_weight).chunk(2, -1)
        return F.silu(gate) * up

    def torch_rms_norm_linear_silu():
        return F.silu(F.linear(F.rms_norm(small_x, (896,), small_norm, 1e-6),
                               gate_up_weight[:4864]))

    def sdpa_train():  # forward and backward of the prefill call, as training runs it
        out = F.scaled_dot_product_attention(q_train, kv_train, kv_train, is_causal=True,
                                             enable_gqa=True)
        return torch.autograd.grad(out, (q_train, kv_train), grad_prompt)

    def gemslib_attention_train():
        out = gemslib.attention(q_train, kv_train, kv_train, causal=True)
        return torch.autograd.grad(out, (q_train, kv_train), grad_prompt)

    table = {
        "silu 16x4096": {"gemslib": lambda: gemslib.silu(hidden),
                         "torch": lambda: F.silu(hidden)},
        "silu_and_mul 16x28672": {"gemslib": lambda: gemslib.silu_and_mul(gate_up),
                                  "torch": torch_silu_and_mul,
                                  "liger": liger and (lambda: liger.liger_swiglu(
                                      gate_up[:, :28672], gate_up[:, 28672:]))},
        "rms_norm 16x4096": {"gemslib": lambda: gemslib.rms_norm(hidden, weight),
                             "torch": lambda: F.rms_norm(hidden, (4096,), weight, 1e-6),
                             "liger": liger and (lambda: liger.liger_rms_norm(
                                 hidden, weight, 1e-6, in_place=False))},
        "add_rms_norm 16x4096": {"gemslib": lambda: gemslib.add_rms_norm(hidden, residual, weight),
                                 "torch": torch_add_rms_norm},
        "softmax 16x128256": {"gemslib": lambda: gemslib.softmax(logits),
                              "torch": lambda: torch.softmax(logits, -1),
                              "liger": liger and (lambda: liger.liger_softmax(logits))},
        "log_softmax 16x128256": {"gemslib": lambda: gemslib.log_softmax(logits),
                                  "torch": lambda: torch.log_softmax(logits, -1)},
        "rotary B16 1 token": {"gemslib": lambda: gemslib.apply_rotary(q, k, cos, sin),
                               "torch": torch_rotary},
        "rotary B16 1 token, per-token table": {"gemslib": gemslib_rotary_table,
                                                "torch": torch_rotary},
        "rms_norm_swiglu 16x896 I4864": {
            "gemslib": lambda: gemslib.rms_norm_swiglu(small_x, small_norm, gate_up_weight),
            "torch": torch_rms_norm_swiglu},
        "rms_norm_linear_silu 16x896 N4864": {
            "gemslib": lambda: gemslib.rms_norm_linear_silu(small_x, small_norm,
                                                            gate_up_weight[:4864]),
            "torch": torch_rms_norm_linear_silu},
        # the backward overrides, called as autograd calls them (no direct gemslib call)
        "silu_backward 16x4096": {
            "gemslib": None, "torch": lambda: aten.silu_backward(grad_hidden, hidden)},
        "_fused_rms_norm_backward 16x4096": {
            "gemslib": None, "torch": lambda: aten._fused_rms_norm_backward(
                grad_hidden, hidden, [4096], rstd, weight, [True, True])},
        "_softmax_backward_data 16x128256": {
            "gemslib": None, "torch": lambda: aten._softmax_backward_data(
                grad_logits, probs, -1, torch.bfloat16)},
        "_log_softmax_backward_data 16x128256": {
            "gemslib": None, "torch": lambda: aten._log_softmax_backward_data(
                grad_logits, log_probs, -1, torch.bfloat16)},
        "decode_attention B16 L4096": {
            "gemslib": lambda: gemslib.decode_attention(q_row[:, :, 0], cache, cache),
            "torch": sdpa_row},
        "attention B16 H28/4 S128 causal": {
            "gemslib": lambda: gemslib.attention(q_prompt, kv_prompt, kv_prompt, causal=True),
            "torch": sdpa_prompt},
        "attention forward + backward B16 H28/4 S128 causal": {
            "gemslib": gemslib_attention_train, "torch": sdpa_train},
    }
    for ways in table.values():  # the scoped ways call what gemslib's or torch's does
        ways["gemslib-bound"] = ways["gemslib-python"] = ways["gemslib"]
        ways["enable"] = ways["enable-python"] = ways["flaggems"] = ways["torch"]
        ways.setdefault("liger", None)
    return table


def _liger():
    try:
        from liger_kernel.transformers import functional
    except Exception:  # not installed, or broken against this torch: no column
        return None
    return functional


def _scope(way: str):
    """The context a way's calls run in, or None when the way is not available."""
    if way == "enable":
        import gemslib

        return gemslib.enable
    if way in ("gemslib-bound", "gemslib-python"):
        from gemslib import runtime

        path = runtime.DIRECT_LAUNCH if way == "gemslib-bound" else runtime.NATIVE_REPLAY
        return path.switched_off
    if way == "enable-python":
        import gemslib
        from gemslib import runtime

        @contextlib.contextmanager
        def enabled_in_python():
            with gemslib.enable(), runtime.NATIVE_REPLAY.switched_off():
                yield
        return enabled_in_python
    if way == "flaggems":
        try:
            import flag_gems
        except Exception:
            return None
        return getattr(flag_gems, "use_gems", None)
    return contextlib.nullcontext


def run(calls: int, device, warmup: int = 50) -> dict:
    """Every case's host us per call for every available way, and the ratio to torch's."""
    import torch

    from gemslib import runtime

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = {}
    for name, ways in cases(device).items():
        row = {"plans": {}}
        for way in HOST_WAYS:
            fn, scope = ways.get(way), _scope(way)
            if fn is None or scope is None:
                row[way] = None
                continue
            before = runtime.call_plan_counts()
            try:
                with scope():
                    row[way] = host_us(fn, calls, synchronize, warmup)
            except Exception as err:  # a peer that refuses the case: reported, not fatal
                row[way] = f"{type(err).__name__}: {str(err)[:120]}"
            if way in ("gemslib", "enable"):  # which of gemslib's calls made a plan
                row["plans"][way] = {op: counts for op, counts in
                                     runtime.call_plan_counts().items()
                                     if before.get(op) != counts}
        base = row.get("torch")
        row["ratios"] = {way: value / base for way, value in row.items()
                         if isinstance(value, float) and isinstance(base, float)}
        results[name] = row
        print(f"{name:<28}" + "".join(
            f"{way} {value:6.1f}  " if isinstance(value, float) else f"{way} -  "
            for way, value in row.items() if way in HOST_WAYS), flush=True)
    return results


GRAPH_WAYS = ("inductor", "gemslib", "gemslib-python", "gemslib-default")
GRAPH_FORMS = ("rms_norm", "add_rms_norm", "silu_and_mul")
GRAPH_LAYERS, GRAPH_ROWS, GRAPH_WIDTH = 16, 16, 1024


def _graph_stack(form: str | None, device):
    """``GRAPH_LAYERS`` layers of (projection, ``form``) on (GRAPH_ROWS, GRAPH_WIDTH) bf16
    rows: the projection alone where ``form`` is None. The norms are written as transformers'
    Llama writes them."""
    import torch
    import torch.nn.functional as F

    def rms_norm(x, weight):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * h.to(x.dtype)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            out = 2 * GRAPH_WIDTH if form == "silu_and_mul" else GRAPH_WIDTH
            self.projections = torch.nn.ModuleList(
                torch.nn.Linear(GRAPH_WIDTH, out, bias=False) for _ in range(GRAPH_LAYERS))
            self.norms = torch.nn.ParameterList(
                torch.nn.Parameter(torch.rand(GRAPH_WIDTH) + 0.5) for _ in range(GRAPH_LAYERS))

        def forward(self, h):
            residual = h
            for projection, norm in zip(self.projections, self.norms):
                h = projection(h)
                if form == "rms_norm":
                    h = rms_norm(h, norm)
                elif form == "add_rms_norm":
                    residual = residual + h
                    h = rms_norm(residual, norm)
                elif form == "silu_and_mul":
                    gate, up = h.chunk(2, dim=-1)
                    h = F.silu(gate) * up
            return h

    return Stack().to(device=device, dtype=torch.bfloat16).eval()


def _graph_way(way: str):
    """(the backend, the context the compile and the calls run in) of a compiled-graph way."""
    from gemslib import runtime

    if way == "inductor":
        return "inductor", contextlib.nullcontext
    if way == "gemslib-python":
        return "gemslib", runtime.NATIVE_REPLAY.switched_off
    if way == "gemslib-default":
        return "gemslib", runtime.GRAPH_OVERLOADS.switched_off
    return "gemslib", contextlib.nullcontext


GRAPH_ROUNDS = 5  # each stack timed this many times, alternately; the least kept


def run_graphs(calls: int, device, warmup: int = 50, forms=GRAPH_FORMS,
               ways=GRAPH_WAYS) -> dict:
    """Per form: each way's host us per call of the stack with and without the form, and the
    difference per layer (the form's launch), with the ratio to inductor's.

    The two stacks of a way are compiled first, then timed in ``GRAPH_ROUNDS`` alternating
    rounds of ``calls`` calls, keeping each one's least: the host's speed drifts within a
    run by more than a launch costs (the projections-alone stack of one way read 247-297 us
    in one H100 run), and a difference of two figures taken at different moments carries the
    drift. The gemslib ways compile with the verdicts set aside (the question is what a
    launch costs where the fusion is used, not whether it is); a form the passes still did
    not fuse is reported as such (``fused`` False), its launch figure meaningless."""
    import torch

    import gemslib
    from gemslib import runtime

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(1, GRAPH_ROWS, GRAPH_WIDTH, device=device, dtype=torch.bfloat16)
    results = {}
    for form in forms:
        row = {}
        for way in ways:
            backend, scope = _graph_way(way)
            verdicts = runtime.ignoring_verdicts if backend == "gemslib" else contextlib.nullcontext
            try:
                with scope(), verdicts(), torch.no_grad():
                    torch._dynamo.reset()
                    stacks = {}
                    for with_form in (False, True):
                        gemslib.reset_fusion_report()
                        stacks[with_form] = torch.compile(
                            _graph_stack(form if with_form else None, device), backend=backend)
                        stacks[with_form](x)  # compiled here, not in a timed round
                    fusions = gemslib.fusion_report() if backend == "gemslib" else {}
                    least = {False: float("inf"), True: float("inf")}
                    for _ in range(GRAPH_ROUNDS):
                        for with_form, stack in stacks.items():
                            least[with_form] = min(least[with_form], host_us(
                                lambda stack=stack: stack(x), calls, synchronize, warmup))
                row[way] = {"stack": least[True], "projections": least[False],
                            "per_launch": (least[True] - least[False]) / GRAPH_LAYERS,
                            "fusions": fusions,
                            "fused": backend != "gemslib" or fusions.get(form, 0) > 0}
            except Exception as err:  # reported, not fatal
                row[way] = f"{type(err).__name__}: {str(err)[:120]}"
        base = row.get("inductor")
        for way, value in row.items():
            if isinstance(value, dict) and isinstance(base, dict):
                value["ratio"] = value["per_launch"] / base["per_launch"]
        results[form] = row
        print(f"{form:<16}" + "".join(
            f"{way} {value['per_launch']:6.1f}  " if isinstance(value, dict) else f"{way} -  "
            for way, value in row.items()), flush=True)
    return results


def format_graph_markdown(results: dict) -> str:
    lines = [f"## One launch inside a compiled graph ({GRAPH_LAYERS} layers of a "
             f"{GRAPH_ROWS}x{GRAPH_WIDTH} projection and the form; us of host per launch)", "",
             f"Each stack's least of {GRAPH_ROUNDS} alternating rounds; gemslib's verdicts set "
             "aside.", "",
             "| form | " + " | ".join(GRAPH_WAYS) + " | gemslib / inductor |",
             "| --- |" + " ---: |" * (len(GRAPH_WAYS) + 1)]
    for form, row in results.items():
        cells = [(f"{row[way]['per_launch']:.1f}" if row[way]["fused"] else "not fused")
                 if isinstance(row.get(way), dict) else ("failed" if way in row else "-")
                 for way in GRAPH_WAYS]
        ours = row.get("gemslib")
        ratio = ours.get("ratio") if isinstance(ours, dict) and ours["fused"] else None
        lines.append(f"| {form} | " + " | ".join(cells) + " | " +
                     (f"{ratio:.2f}x" if ratio is not None else "-") + " |")
    lines += ["", "Whole stacks (us per call, projections alone / with the form) and the "
              "fusions gemslib counted:"]
    for form, row in results.items():
        lines.append(f"- {form}: " + "; ".join(
            f"{way} {value['projections']:.1f} / {value['stack']:.1f}"
            + (f" {value['fusions']}" if value["fusions"] else "")
            if isinstance(value, dict) else f"{way} {value}" for way, value in row.items()))
    return "\n".join(lines) + "\n"


def floor_pieces(calls: int, device) -> dict[str, float | str]:
    """What a planned ``gemslib.silu`` of 16x4096 is made of, each piece timed alone beside
    the whole call and torch's: the output's allocation and the compiled launcher's own call
    with fixed arguments (the kernel kept by the calls before). Their sum is what a call made
    from Python cannot go below. And what an override adds to that: a Python kernel that only
    allocates, registered for a throwaway operator and called through the dispatcher as
    ``enable()``'s overrides are."""
    import torch
    import torch.nn.functional as F

    import gemslib
    from gemslib import runtime
    from gemslib.ops import silu as silu_ops

    x = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        gemslib.silu(x)
    plan = silu_ops._SILU_CALLS.get(silu_ops._SILU_CALLS.signature(x))
    if plan is None or len(plan.launches) != 1:
        return {"compiled launcher alone": "silu made no plan of one launch"}
    out = torch.empty_like(x)
    (compiled, template, slots), = plan.launches
    args = list(template)
    for position, slot in slots:  # slot 0: the input, 1: the output
        args[position] = (x, out)[slot].data_ptr()
    stream = runtime.current_stream_handle(x.device.index)

    def bare_launch():
        runtime.launch_compiled(compiled, stream, args)

    synchronize = torch.cuda.synchronize
    library = torch.library.Library("gemslib_host_probe", "FRAGMENT")
    library.define("alloc(Tensor x) -> Tensor")
    library.impl("alloc", lambda t: torch.empty_like(t), "CUDA")
    dispatched_alloc = torch.ops.gemslib_host_probe.alloc
    return {"torch.empty_like": host_us(lambda: torch.empty_like(x), calls, synchronize),
            "compiled launcher alone": host_us(bare_launch, calls, synchronize),
            "gemslib.silu (planned)": host_us(lambda: gemslib.silu(x), calls, synchronize),
            "torch F.silu": host_us(lambda: F.silu(x), calls, synchronize),
            "a Python kernel that allocates, through the dispatcher": host_us(
                lambda: dispatched_alloc(x), calls, synchronize)}


def format_markdown(results: dict, header: str) -> str:
    lines = ["# Host cost per call", "", header, "",
             "| op, shape | " + " | ".join(HOST_WAYS) + " | gemslib / torch | enable / torch |",
             "| --- |" + " ---: |" * (len(HOST_WAYS) + 2)]
    for name, row in results.items():
        cells = [f"{row[way]:.1f}" if isinstance(row[way], float) else
                 ("-" if row[way] is None else "failed") for way in HOST_WAYS]
        ratios = [f"{row['ratios'][way]:.2f}x" if way in row["ratios"] else "-"
                  for way in ("gemslib", "enable")]
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Calls planned per way (operator or aten override: signatures planned / seen "
              "but not planned):"]
    for name, row in results.items():
        plans = row.get("plans", {})
        lines.append(f"- {name}: " + "; ".join(
            f"{way} " + (", ".join(f"{op} {planned}/{unplanned}" for op, (planned, unplanned)
                                   in counts.items()) or "none")
            for way, counts in plans.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from gemslib.cli import positive_int

    parser = argparse.ArgumentParser(prog="python -m benchmark.host",
                                     description="Host microseconds per call at decode sizes.")
    parser.add_argument("--calls", type=positive_int, default=2000, metavar="N",
                        help="calls timed back to back per figure (default: 2000)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results", metavar="DIR",
                        help="where host.json and host.md go (default: benchmark/results)")
    parser.add_argument("--graphs-only", action="store_true",
                        help="only the compiled-graph table (one launch inside a graph)")
    parser.add_argument("--graph-ways", nargs="+", choices=GRAPH_WAYS, default=list(GRAPH_WAYS),
                        metavar="WAY", help=f"the compiled-graph table's ways, of "
                                            f"{', '.join(GRAPH_WAYS)} (default: all)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("python -m benchmark.host: needs a CUDA GPU (host costs of GPU launches); "
              "nothing was run.", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    from gemslib.runtime import native

    header = (f"{torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"{args.calls} calls per figure; microseconds of host time per call; "
              f"native replay {native.status()}.")
    graphs = run_graphs(args.calls, device, ways=args.graph_ways)
    results, floor = {}, {}
    if not args.graphs_only:
        results = run(args.calls, device)
        try:
            floor = floor_pieces(args.calls, device)
        except Exception as err:  # a measurement of internals: reported, never fatal
            floor = {"compiled launcher alone": f"{type(err).__name__}: {str(err)[:120]}"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host.json").write_text(json.dumps({"header": header, "results": results,
                                                    "graphs": graphs, "floor": floor}, indent=1))
    markdown = format_markdown(results, header) + "\nsilu 16x4096, piece by piece (us): " + \
        ", ".join(f"{name} {value:.1f}" if isinstance(value, float) else f"{name}: {value}"
                  for name, value in floor.items()) + "\n\n" if results else \
        f"# Host cost per launch inside compiled graphs\n\n{header}\n\n"
    markdown += format_graph_markdown(graphs)
    (args.out / "host.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
