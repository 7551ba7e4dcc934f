"""Experiment: a decode layer's four projections in one persistent launch, phases separated by
device-wide arrival counters, against the same tiles as four launches, cuBLAS and decode_gemv.

    python -m benchmark.experiments.persistent_layer [--model 1b|8b] [--layers L] [--quick]

The question it answers (docs/notes/decode.md, "Plan: one persistent kernel a layer"): a narrow
GEMV is a wave or less, and each kernel boundary costs its ramp and drain (~4-8 us measured at
Llama-3.2-1B's projections), so a 1B layer of five launches takes ~79 us for ~41 us of weight
bytes. Does one launch a layer, whose programs issue the next phase's first weight loads before
they wait on an arrival counter, replace that boundary with the counter's round trip (~1-2 us)?

The layer here is its four projections at one row, chained as the step chains them (their
norms, rotary, attention and activations left out: they move kilobytes):

    h0 = W_qkv x        h1 = W_o h0[:hidden]        h2 = W_gate_up h1        x' = W_down h2[:inter]

bf16 weights and activations, fp32 sums, each output rounded once. Every way runs ``--layers``
such layers, each with its own weights (L x the layer's bytes > L2), the chain captured in one
CUDA graph and timed per layer; the floor is the weights' bytes at the run's copy bandwidth.

Ways: ``phases`` (this file's kernel, one launch a projection, a tile grid), ``persistent``
(the same tiles, one launch a layer, grid = programs resident at once), cuBLAS (``F.linear``),
``decode_gemv`` (gemslib's, the file's configs). Each kernel way is swept over a few launch
configs and its best kept; ``persistent`` and ``phases`` give bitwise equal outputs at one
config (same tiles, same order), and every way is checked against a float64 chain.

The persistent way needs every program resident at once, or a waiting program starves the one
it waits for: its grid is the compiled kernel's occupancy (warps, registers, shared memory)
times the SMs, never more, and a wait that polls past ``SPIN_LIMIT`` sets an error flag and
gives up, so a wrong grid is a reported failure, not a hang. Needs a CUDA GPU (the Triton
interpreter runs programs one after another, so no wait could ever pass there).
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import triton
import triton.language as tl

from gemslib import pdl

# (hidden, q/k/v rows, intermediate): Llama-3.2-1B and Llama-3-8B
MODELS = {"1b": (2048, 3072, 8192), "8b": (4096, 6144, 14336)}
SPIN_LIMIT = 1 << 20  # polls of a counter before a wait gives up (~1 s, not a hang)
ALL_PHASES = -1  # the kernel's PHASE for the persistent launch
PREFETCH_COLS = tl.constexpr(2048)  # columns of a first tile asked of L2 with PREFETCH 2
PREFETCHES = {0: "nothing", 1: "registers", 2: "L2"}


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _first_block(p_w, i_tile, n_out, n_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) first K block of tile i_tile's rows of W (zeros past the rows):
    loaded before a wait, so its DRAM latency runs under the previous phase's tail."""
    o_n = i_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    return tl.load(p_w + o_n[:, None].to(tl.int64) * n_in + o_k[None, :],
                   mask=(o_n[:, None] < n_out) & (o_k[None, :] < n_in), other=0.0)


@triton.jit
def _tiles(p_w, p_x, p_out, b_w_first, i_program, n_programs, n_out, n_in,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM_EACH_STEP: tl.constexpr):
    """out[n] = sum_k W[n, k] x[k] for the tiles i_program, i_program + n_programs, ... of
    BLOCK_N rows; b_w_first: the first tile's first K block, already loaded. The products
    add up in a (BLOCK_N, BLOCK_K) fp32 tile summed over K once at the end, or (SUM_EACH_STEP,
    as decode_gemv's one-row path does) each K step is summed into a (BLOCK_N,) row. x is read
    past L1 (``.cg``): another SM wrote it in this launch."""
    b_w_block = b_w_first
    for i_tile in range(i_program, tl.cdiv(n_out, BLOCK_N), n_programs):
        o_n = i_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        o_k = tl.arange(0, BLOCK_K)
        b_x = tl.load(p_x + o_k, mask=o_k < n_in, other=0.0, cache_modifier=".cg")
        b_acc = b_w_block.to(tl.float32) * b_x.to(tl.float32)[None, :]
        if SUM_EACH_STEP:
            b_acc = tl.sum(b_acc, axis=1)
        for i_k in range(BLOCK_K, n_in, BLOCK_K):
            o_k = i_k + tl.arange(0, BLOCK_K)
            b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * n_in + o_k[None, :],
                          mask=(o_n[:, None] < n_out) & (o_k[None, :] < n_in), other=0.0)
            b_x = tl.load(p_x + o_k, mask=o_k < n_in, other=0.0, cache_modifier=".cg")
            if SUM_EACH_STEP:
                b_acc += tl.sum(b_w.to(tl.float32) * b_x.to(tl.float32)[None, :], axis=1)
            else:
                b_acc += b_w.to(tl.float32) * b_x.to(tl.float32)[None, :]
        if not SUM_EACH_STEP:
            b_acc = tl.sum(b_acc, axis=1)
        tl.store(p_out + o_n, b_acc.to(p_out.dtype.element_ty), mask=o_n < n_out)
        b_w_block = _first_block(p_w, i_tile + n_programs, n_out, n_in, BLOCK_N, BLOCK_K)


@triton.jit
def _arrive_and_wait(p_count, n_programs, p_error, spin_limit):
    """Count this program in the phase's counter, then wait until every program has: the
    barrier orders all threads' stores before the release; the acquire orders the next
    phase's loads after it."""
    tl.debug_barrier()
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")
    n_arrived = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
    n_polls = 0
    while (n_arrived < n_programs) & (n_polls < spin_limit):
        n_arrived = tl.atomic_add(p_count, 0, sem="acquire", scope="gpu")
        n_polls += 1
    if n_arrived < n_programs:
        tl.atomic_xchg(p_error, 1)


@triton.jit
def _phase(p_w, p_x, p_out, n_out, n_in, p_count, p_error, i_program, n_programs, spin_limit,
           WAIT: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, SUM_EACH_STEP: tl.constexpr):
    """One projection's tiles, after (WAIT) every program has counted itself in p_count. What
    of this program's first tile of W is asked for before the wait: PREFETCH 0 nothing, 1 its
    first K block into registers, 2 its first PREFETCH_COLS columns into L2."""
    if WAIT and PREFETCH == 2:
        o_n = i_program * BLOCK_N + tl.arange(0, BLOCK_N)
        pdl.prefetch_rows_to_l2(p_w, o_n, o_n < n_out, 0, n_in, n_in, PREFETCH_COLS)
    if PREFETCH == 1:
        b_w = _first_block(p_w, i_program, n_out, n_in, BLOCK_N, BLOCK_K)
    if WAIT:
        _arrive_and_wait(p_count, n_programs, p_error, spin_limit)
    if PREFETCH != 1:
        b_w = _first_block(p_w, i_program, n_out, n_in, BLOCK_N, BLOCK_K)
    _tiles(p_w, p_x, p_out, b_w, i_program, n_programs, n_out, n_in, BLOCK_N, BLOCK_K,
           SUM_EACH_STEP)


@triton.jit
def _layer_kernel(p_x, p_w_qkv, p_h0, p_w_o, p_h1, p_w_gate_up, p_h2, p_w_down, p_out,
                  p_counts, p_error, hidden, qkv_rows, inter, spin_limit,
                  PHASE: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N_WIDE: tl.constexpr,
                  BLOCK_N_NARROW: tl.constexpr, BLOCK_K: tl.constexpr,
                  SUM_EACH_STEP: tl.constexpr = False):
    """One layer's projections. PHASE 0..3: that projection alone (a tile grid, a program a
    tile); ALL_PHASES: all four in turn, the grid's programs resident at once, each phase
    after counter p_counts[phase - 1] says every program finished the one before (PREFETCH:
    :func:`_phase`). The last program to finish puts the counters back to 0 for the next
    launch."""
    i_program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    PERSISTENT: tl.constexpr = PHASE < 0  # ALL_PHASES
    if PERSISTENT or PHASE == 0:
        _phase(p_w_qkv, p_x, p_h0, qkv_rows, hidden, p_counts, p_error, i_program, n_programs,
               spin_limit, False, PREFETCH, BLOCK_N_WIDE, BLOCK_K, SUM_EACH_STEP)
    if PERSISTENT or PHASE == 1:
        _phase(p_w_o, p_h0, p_h1, hidden, hidden, p_counts + 0, p_error, i_program,
               n_programs, spin_limit, PERSISTENT, PREFETCH, BLOCK_N_NARROW, BLOCK_K,
               SUM_EACH_STEP)
    if PERSISTENT or PHASE == 2:
        _phase(p_w_gate_up, p_h1, p_h2, 2 * inter, hidden, p_counts + 1, p_error, i_program,
               n_programs, spin_limit, PERSISTENT, PREFETCH, BLOCK_N_WIDE, BLOCK_K,
               SUM_EACH_STEP)
    if PERSISTENT or PHASE == 3:
        _phase(p_w_down, p_h2, p_out, hidden, inter, p_counts + 2, p_error, i_program,
               n_programs, spin_limit, PERSISTENT, PREFETCH, BLOCK_N_NARROW, BLOCK_K,
               SUM_EACH_STEP)
    if PERSISTENT:
        tl.debug_barrier()
        if tl.atomic_add(p_counts + 3, 1, sem="acq_rel", scope="gpu") == n_programs - 1:
            # every program has passed its last wait: the counters can go back to 0
            for i_count in tl.static_range(4):
                tl.atomic_xchg(p_counts + i_count, 0)


# --------------------------------------------------------------------------------------------
# Layers, launches and references
# --------------------------------------------------------------------------------------------


class Layer:
    """One layer's weights (bf16, scaled so each output's variance stays ~1) and activations;
    ``x`` is the layer's input, ``out`` its output (the next layer's ``x``)."""

    def __init__(self, hidden: int, qkv_rows: int, inter: int, x: torch.Tensor):
        device, dtype = x.device, torch.bfloat16

        def weight(n_out, n_in):
            return torch.randn(n_out, n_in, device=device, dtype=dtype) / n_in**0.5

        self.hidden, self.qkv_rows, self.inter = hidden, qkv_rows, inter
        self.w_qkv, self.w_o = weight(qkv_rows, hidden), weight(hidden, hidden)
        self.w_gate_up, self.w_down = weight(2 * inter, hidden), weight(hidden, inter)
        self.x = x
        self.h0 = torch.empty(qkv_rows, device=device, dtype=dtype)
        self.h1 = torch.empty(hidden, device=device, dtype=dtype)
        self.h2 = torch.empty(2 * inter, device=device, dtype=dtype)
        self.out = torch.empty(hidden, device=device, dtype=dtype)

    @property
    def weight_bytes(self) -> int:
        return 2 * sum(w.numel() for w in (self.w_qkv, self.w_o, self.w_gate_up, self.w_down))

    def launch_args(self):
        return (self.x, self.w_qkv, self.h0, self.w_o, self.h1, self.w_gate_up, self.h2,
                self.w_down, self.out)


def chain(hidden: int, qkv_rows: int, inter: int, n_layers: int, device) -> list[Layer]:
    x = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    layers = []
    for _ in range(n_layers):
        layers.append(Layer(hidden, qkv_rows, inter, x))
        x = layers[-1].out
    return layers


def reference(layers: list[Layer]) -> torch.Tensor:
    """The chain in float64, no rounding between projections."""
    x = layers[0].x.double()
    for layer in layers:
        h0 = layer.w_qkv.double() @ x
        h1 = layer.w_o.double() @ h0[:layer.hidden]
        h2 = layer.w_gate_up.double() @ h1
        x = layer.w_down.double() @ h2[:layer.inter]
    return x


# each projection: (name, its input's field and width, its output's field, its weight's field)
PROJECTIONS = (("q/k/v", "x", "h0", "w_qkv"), ("o", "h0", "h1", "w_o"),
               ("gate/up", "h1", "h2", "w_gate_up"), ("down", "h2", "out", "w_down"))


def projection_input(layer: Layer, index: int) -> torch.Tensor:
    """Projection ``index``'s (1, K) input in ``layer``, as the chain reads it."""
    width = layer.w_qkv.shape[1], layer.w_o.shape[1], layer.w_gate_up.shape[1], \
        layer.w_down.shape[1]
    return getattr(layer, PROJECTIONS[index][1])[None, :width[index]]


def linear_layers(layers: list[Layer], linear) -> torch.Tensor:
    """The chain's output through ``linear(x (1, K), w) -> (1, N)`` (cuBLAS or decode_gemv),
    one call a projection, its own activations."""
    x = layers[0].x[None]
    for layer in layers:
        h0 = linear(x, layer.w_qkv)
        h1 = linear(h0[:, :layer.hidden], layer.w_o)
        h2 = linear(h1, layer.w_gate_up)
        x = linear(h2[:, :layer.inter], layer.w_down)
    return x[0]


class Launches:
    """The kernel's launches of the chain at one config: ``persistent`` one a layer (grid:
    ``programs_per_sm`` x SMs, at most the occupancy), else four a layer (tile grids)."""

    def __init__(self, layers: list[Layer], block_n_wide: int, block_n_narrow: int,
                 block_k: int, num_warps: int, persistent: bool, programs_per_sm: int = 0,
                 prefetch: int = 1, sum_each_step: bool = False, only: int | None = None):
        self.layers, self.persistent, self.only = layers, persistent, only
        self.meta = dict(BLOCK_N_WIDE=block_n_wide, BLOCK_N_NARROW=block_n_narrow,
                         BLOCK_K=block_k, num_warps=num_warps, PREFETCH=prefetch,
                         SUM_EACH_STEP=sum_each_step)
        device = layers[0].x.device
        self.counts = torch.zeros(4, device=device, dtype=torch.int32)
        self.error = torch.zeros(1, device=device, dtype=torch.int32)
        self.programs = 0
        if persistent:
            resident = resident_programs_per_sm(self._compiled(), device)
            per_sm = min(programs_per_sm or resident, resident)
            self.programs = per_sm * torch.cuda.get_device_properties(device).multi_processor_count

    def _args(self, layer: Layer):
        return (*layer.launch_args(), self.counts, self.error, layer.hidden, layer.qkv_rows,
                layer.inter, SPIN_LIMIT)

    def _compiled(self):
        compiled = _layer_kernel.warmup(*self._args(self.layers[0]), PHASE=ALL_PHASES,
                                        grid=(1,), **self.meta)
        compiled._init_handles()  # loads it: its register count is known from then on
        return compiled

    def __call__(self) -> torch.Tensor:
        for layer in self.layers:
            if self.persistent:
                _layer_kernel[(self.programs,)](*self._args(layer), PHASE=ALL_PHASES,
                                                **self.meta)
                continue
            rows = (layer.qkv_rows, layer.hidden, 2 * layer.inter, layer.hidden)
            blocks = (self.meta["BLOCK_N_WIDE"], self.meta["BLOCK_N_NARROW"]) * 2
            for phase, (n_out, block_n) in enumerate(zip(rows, blocks)):
                if self.only is not None and phase != self.only:
                    continue
                _layer_kernel[(triton.cdiv(n_out, block_n),)](*self._args(layer), PHASE=phase,
                                                              **self.meta)
        return self.layers[-1].out if self.only is None else \
            getattr(self.layers[-1], PROJECTIONS[self.only][2])

    def label(self) -> str:
        meta = self.meta
        grid = f", {self.programs} programs, first W: {PREFETCHES[meta['PREFETCH']]}" \
            if self.persistent else ""
        summed = ", K summed each step" if meta["SUM_EACH_STEP"] else ""
        return (f"N{meta['BLOCK_N_WIDE']}/{meta['BLOCK_N_NARROW']} K{meta['BLOCK_K']} "
                f"w{meta['num_warps']}{grid}{summed}")


def resident_programs_per_sm(compiled, device) -> int:
    """Programs of ``compiled`` one SM holds at once: the least of what its warps, registers
    (allocated per warp in units of 256) and shared memory allow, and 32."""
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    registers_per_warp = math.ceil(max(compiled.n_regs, 1) * 32 / 256) * 256
    by_registers = props.regs_per_multiprocessor // (registers_per_warp * warps)
    shared = compiled.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // (shared + 1024) if shared else 32
    return max(1, min(by_warps, by_registers, by_shared, 32))


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

CONFIGS = [dict(block_n_wide=wide, block_n_narrow=narrow, block_k=block_k, num_warps=warps)
           for wide, narrow, block_k, warps in itertools.product((8, 16), (2, 4), (512, 1024),
                                                                  (4, 8))]
QUICK_CONFIGS = [dict(block_n_wide=8, block_n_narrow=4, block_k=512, num_warps=4),
                 dict(block_n_wide=16, block_n_narrow=4, block_k=1024, num_warps=8)]


def _timed_us(fn, layers: list[Layer]) -> tuple[float, float, torch.Tensor]:
    """(us a layer of ``fn``'s chain in one CUDA graph, its output's relative error to the
    float64 chain, that output)."""
    from benchmark.harness import graphed, median_ms

    replay = graphed(fn)
    us = median_ms(replay) * 1e3 / len(layers)
    out = replay().clone()
    expected = reference(layers)
    return us, ((out.double() - expected).norm() / expected.norm()).item(), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.persistent_layer")
    parser.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["1b"])
    parser.add_argument("--layers", type=int, default=4, help="layers chained (default 4)")
    parser.add_argument("--quick", action="store_true", help="two configs a way, not sixteen")
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[0],
                        help="persistent grids to try, programs an SM (0: the occupancy)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2],
                        choices=sorted(PREFETCHES), help="what of a phase's first W tile a "
                        "persistent program asks for before it waits: 0 nothing, 1 a K block "
                        "into registers, 2 its first columns into L2 (default: each)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("persistent_layer: needs a CUDA GPU (a wait on another program cannot pass in "
              "the interpreter, which runs programs one after another)")
        return 1
    from benchmark.harness import measure_ceilings
    from gemslib.fused.decode_gemv import decode_gemv

    device = torch.device("cuda")
    copy_gbps = measure_ceilings().copy_gbps
    n_sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {n_sms} SMs, copy {copy_gbps:.0f} GB/s; us a layer "
          f"(% of copy bandwidth for its weights), relative error to float64")
    for model in args.model:
        layers = chain(*MODELS[model], args.layers, device)
        floor_us = layers[0].weight_bytes / copy_gbps / 1e3
        print(f"\n{model}: {args.layers} layers of {layers[0].weight_bytes / 2**20:.0f} MiB, "
              f"floor {floor_us:.1f} us a layer")

        def show(way, us, error, _output=None):  # _timed_us's output, not shown
            print(f"  {way:<48} {us:7.1f} ({floor_us / us:5.1%})  err {error:.1e}", flush=True)

        show("cuBLAS (F.linear, four launches)",
             *_timed_us(lambda: linear_layers(layers, torch.nn.functional.linear), layers))
        show("decode_gemv (file's configs, four launches)",
             *_timed_us(lambda: linear_layers(layers, decode_gemv), layers))
        best_phases = None
        for config in QUICK_CONFIGS if args.quick else CONFIGS:
            phases = Launches(layers, **config, persistent=False)
            phases_us, phases_error, phases_out = _timed_us(phases, layers)
            show(f"phases {phases.label()}", phases_us, phases_error)
            best_phases = min(best_phases or (phases_us, config), (phases_us, config),
                              key=lambda timed: timed[0])
            for per_sm, prefetch in itertools.product(args.programs_per_sm, args.prefetch):
                persistent = Launches(layers, **config, persistent=True, programs_per_sm=per_sm,
                                      prefetch=prefetch)
                persistent()
                if persistent.error.item():  # a wait gave up: the grid was not all resident
                    print(f"  persistent {persistent.label()}: a wait gave up; not timed")
                    continue
                us, error, out = _timed_us(persistent, layers)
                same = torch.equal(out, phases_out) and not persistent.error.item()
                show(f"persistent {persistent.label()}" + ("" if same else " DIFFERS"), us,
                     error)
        _per_projection(layers, best_phases[1], copy_gbps)
    return 0


def _per_projection(layers: list[Layer], config: dict, copy_gbps: float) -> None:
    """Each projection alone over the layers (one CUDA graph a way), us a call and % of copy:
    cuBLAS, decode_gemv (the file's configs, and forced to the tiles' shape with GEMV 2), and
    the chain's best tile config summing over K at the end and at each step, so the
    projection that holds a way back, and what the sums cost, show."""
    from benchmark.harness import graphed, median_ms
    from gemslib import runtime
    from gemslib.fused.decode_gemv import DECODE_GEMV, SUM_AT_END_GEMV, decode_gemv

    def decode_gemv_as_tiles(index):
        """decode_gemv forced to the tiles' shape, its products summed after the loop."""
        block_n = config["block_n_wide"] if index in (0, 2) else config["block_n_narrow"]
        forced = runtime.LaunchConfig((("BLOCK_N", block_n), ("BLOCK_K", config["block_k"]),
                                       ("SPLIT_K", 1), ("STREAM_K", 0),
                                       ("GEMV", SUM_AT_END_GEMV)), config["num_warps"], 3)

        def call():
            with DECODE_GEMV.forced(forced):
                return [decode_gemv(projection_input(layer, index),
                                    getattr(layer, PROJECTIONS[index][3])) for layer in layers]
        return call

    print(f"  each projection alone (tiles {Launches(layers, **config, persistent=False).label()}"
          f"): us a call (% of copy)")
    for index, (name, _, _, weight_name) in enumerate(PROJECTIONS):
        weight_bytes = 2 * getattr(layers[0], weight_name).numel()
        ways = {"cuBLAS": lambda: [torch.nn.functional.linear(projection_input(layer, index),
                                                              getattr(layer, weight_name))
                                   for layer in layers],
                "decode_gemv": lambda: [decode_gemv(projection_input(layer, index),
                                                    getattr(layer, weight_name))
                                        for layer in layers],
                "decode_gemv GEMV 2 as the tiles": decode_gemv_as_tiles(index),
                "tiles, K summed at the end": Launches(layers, **config, persistent=False,
                                                       only=index),
                "tiles, K summed each step": Launches(layers, **config, persistent=False,
                                                      only=index, sum_each_step=True)}
        figures = []
        for way, fn in ways.items():
            us = median_ms(graphed(fn)) * 1e3 / len(layers)
            figures.append(f"{way} {us:.1f} ({weight_bytes / us / 1e3 / copy_gbps:.0%})")
        print(f"    {name:<8} " + ", ".join(figures), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
