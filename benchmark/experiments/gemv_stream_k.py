"""Experiment: a decode GEMV (1 to 16 rows) whose programs share the weight's bytes equally
(stream-K), against cuBLAS and decode_gemv's tile grid.

    python -m benchmark.experiments.gemv_stream_k [--quick] [--rows 1 16] [--grid-configs]

The question it answers (docs/notes/decode.md, the fused GEMVs): decode_gemv and cuBLAS read a
decode step's large projections at 78-80% of copy bandwidth, and the estimate says a tile
grid's last partial wave costs most of the gap (Llama-3-8B's gate/up: 896 tiles for ~528
resident programs, 1.7 waves). Here a fixed number of programs (``programs``, a multiple of
the SMs) each stream an equal share of the (tile, K step) iterations: a share may start or
end inside a tile; such a tile's partial sums go to a scratch row per contributing program,
and the last contributor to arrive adds them in program order (deterministic) and stores
the tile. Nothing is zeroed per call (the last arrival puts the tile's counter back to 0).

Timed: each way over R copies of the weight in turn (R x its bytes >= 4x L2), captured in one
CUDA graph, so that every call streams its weight from DRAM and no flush's write-back is in
the figure; GB/s of the weight's bytes and their share of the run's copy bandwidth. Shapes:
the projections of Llama-3.2-1B and Llama-3-8B and Llama-3-8B's lm_head, at one row (and 16
with ``--rows``: the tl.dot tile).
Needs a CUDA GPU; the kernel's correctness is tested in the interpreter
(tests/benchmark/test_gemv_stream_k.py).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_k_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, arrivals_ptr,
                          n_rows, n_out, n_in, k_steps, total_iters, n_programs, max_contrib,
                          stride_x_row, stride_w_row, stride_y_row,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] W[n, k], fp32 sums: x (n_rows <= BLOCK_M, n_in), W (n_out, n_in),
    y (n_rows, n_out), unit last strides. BLOCK_M 1: products by multiply and tl.sum; else
    tl.dot on a BLOCK_M-row tile.

    Iteration i is K step i % k_steps of column tile i // k_steps (BLOCK_N rows of W, BLOCK_K
    columns); program p takes iterations [p T / P, (p + 1) T / P) (T = total_iters, P =
    n_programs <= T, so each takes at least one). A tile whose iterations one program takes
    whole is stored by it; otherwise each contributor stores its partial tile in part[tile,
    p - first] (first: the tile's first contributor) and counts itself in arrivals[tile]; the
    last to arrive adds the partials in order, stores the tile and puts the counter back to
    0."""
    BLOCK_TILE: tl.constexpr = BLOCK_M * BLOCK_N
    i_p = tl.program_id(0)
    it = (i_p * total_iters) // n_programs
    it_end = ((i_p + 1) * total_iters) // n_programs
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_row = tl.arange(0, BLOCK_N)
    o_col = tl.arange(0, BLOCK_K)
    o_tile = o_m[:, None] * BLOCK_N + o_row[None, :]  # a partial tile's elements, row-major
    p_x = x_ptr + o_m.to(tl.int64)[:, None] * stride_x_row
    while it < it_end:
        i_tile = it // k_steps
        tile_begin = i_tile * k_steps
        seg_end = tl.minimum(it_end, tile_begin + k_steps)
        o_n = i_tile * BLOCK_N + o_row
        m_n = o_n < n_out
        m_y = m_m[:, None] & m_n[None, :]
        p_w = w_ptr + o_n.to(tl.int64)[:, None] * stride_w_row
        b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(it, seg_end):
            o_k = (i - tile_begin) * BLOCK_K + o_col
            m_k = o_k < n_in
            b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            if BLOCK_M == 1:
                b_acc += tl.sum(b_w.to(tl.float32) * b_x.to(tl.float32), axis=1)[None, :]
            else:
                b_acc = tl.dot(b_x, tl.trans(b_w), b_acc)
        p_y = y_ptr + o_m.to(tl.int64)[:, None] * stride_y_row + o_n[None, :]
        if (it == tile_begin) & (seg_end == tile_begin + k_steps):
            tl.store(p_y, b_acc.to(y_ptr.dtype.element_ty), mask=m_y)
        else:
            # the program holding iteration j is ((j + 1) P - 1) // T
            first = ((tile_begin + 1) * n_programs - 1) // total_iters
            last = ((tile_begin + k_steps) * n_programs - 1) // total_iters
            p_part = part_ptr + (i_tile * max_contrib).to(tl.int64) * BLOCK_TILE + o_tile
            tl.store(p_part + (i_p - first) * BLOCK_TILE, b_acc)
            tl.debug_barrier()  # every thread's store issued before the program counts itself
            arrived = tl.atomic_add(arrivals_ptr + i_tile, 1, sem="acq_rel")
            if arrived == last - first:
                b_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for j in range(0, last - first + 1):  # in program order: deterministic
                    b_sum += tl.load(p_part + j * BLOCK_TILE, cache_modifier=".cg")
                tl.store(p_y, b_sum.to(y_ptr.dtype.element_ty), mask=m_y)
                tl.atomic_xchg(arrivals_ptr + i_tile, 0)
        it = seg_end


class StreamKGemv:
    """y = x @ W.T by :func:`_stream_k_gemv_kernel` for one weight shape and up to ``rows``
    rows of x (1: the one-row path; 2..16: a 16-row tl.dot tile), its scratch kept (the
    counters come back to 0 after every call, so a CUDA graph replays the launch alone)."""

    def __init__(self, n_out: int, n_in: int, device, programs: int, block_n: int = 32,
                 block_k: int = 256, num_warps: int = 4, num_stages: int = 3, rows: int = 1):
        if not 1 <= rows <= 16:
            raise ValueError(f"rows: expected 1 to 16, got {rows}")
        self.n_out, self.n_in, self.rows = n_out, n_in, rows
        self.block_m = 1 if rows == 1 else 16
        self.block_n, self.block_k = block_n, block_k
        self.k_steps = triton.cdiv(n_in, block_k)
        tiles = triton.cdiv(n_out, block_n)
        self.total_iters = tiles * self.k_steps
        self.programs = max(1, min(programs, self.total_iters))
        # a tile's k_steps iterations meet at most this many shares of >= T // P iterations
        self.max_contrib = triton.cdiv(self.k_steps, self.total_iters // self.programs) + 1
        self.part = torch.empty(tiles * self.max_contrib * self.block_m * block_n,
                                dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(tiles, dtype=torch.int32, device=device)
        self.launch_options = {"num_warps": num_warps, "num_stages": num_stages}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x (n_in,) or (M, n_in) with M <= rows; returns y of x's leading shape + (n_out,)."""
        if weight.shape != (self.n_out, self.n_in) or weight.stride(1) != 1:
            raise ValueError(f"weight: expected ({self.n_out}, {self.n_in}) with unit last "
                             f"stride, got {tuple(weight.shape)} strides {weight.stride()}")
        x2d = x if x.dim() == 2 else x[None]
        if x2d.dim() != 2 or x2d.shape[1] != self.n_in or not 1 <= x2d.shape[0] <= self.rows \
                or x2d.stride(1) != 1:
            raise ValueError(f"x: expected (n_in,) or (M, n_in) with n_in {self.n_in}, M <= "
                             f"{self.rows} and unit last stride, got {tuple(x.shape)} strides "
                             f"{x.stride()}")
        shape = (*x.shape[:-1], self.n_out)
        y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
        if tuple(y.shape) != shape or y.stride(-1) != 1:
            raise ValueError(f"out: expected {shape} with unit last stride, got "
                             f"{tuple(y.shape)} strides {y.stride()}")
        y2d = y if y.dim() == 2 else y[None]
        _stream_k_gemv_kernel[(self.programs,)](
            x2d, weight, y2d, self.part, self.arrivals, x2d.shape[0], self.n_out, self.n_in,
            self.k_steps, self.total_iters, self.programs, self.max_contrib, x2d.stride(0),
            weight.stride(0), y2d.stride(0), BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            BLOCK_K=self.block_k, **self.launch_options)
        return y


# (name, n_out, n_in)
SHAPES = (("1B q/k/v", 3072, 2048), ("1B o", 2048, 2048), ("1B gate/up", 16384, 2048),
          ("1B down", 2048, 8192), ("8B q/k/v", 6144, 4096), ("8B o", 4096, 4096),
          ("8B gate/up", 28672, 4096), ("8B down", 4096, 14336), ("8B lm_head", 128256, 4096))
QUICK = ("1B o", "8B gate/up", "8B down")
L2_MULTIPLE = 4  # the copies of a weight read in turn hold at least this many L2s
# (programs per SM, BLOCK_N, BLOCK_K) of the stream-K kernel
VARIANTS = tuple((per_sm, block_n, block_k) for per_sm in (2, 4, 8) for block_n in (16, 32)
                 for block_k in (128, 256))


def _rotated_us(fn, weights, x) -> float:
    """us a call of ``fn(x, w)``, the calls over ``weights`` in turn captured in one graph."""
    from benchmark.harness import graphed, median_ms

    replay = graphed(lambda: [fn(x, w) for w in weights])
    return median_ms(replay) * 1e3 / len(weights)


def _grid_configs(rows: int):
    """decode_gemv's candidates of its tune space for ``rows`` (GEMV 1 at one row, the 16-row
    tile above; its own stream-K configs among them), as launch configs."""
    from gemslib import runtime
    from gemslib.fused.decode_gemv import _GEMV_CANDIDATES

    for candidate in _GEMV_CANDIDATES:
        if candidate["GEMV"] == (1 if rows == 1 else 0):
            meta = tuple((k, v) for k, v in candidate.items()
                         if k not in ("num_warps", "num_stages"))
            yield runtime.LaunchConfig(meta, candidate["num_warps"], candidate["num_stages"])


def _rotated_us_forced(config, weights, x) -> float:
    from gemslib.fused.decode_gemv import DECODE_GEMV, decode_gemv

    with DECODE_GEMV.forced(config):
        return _rotated_us(decode_gemv, weights, x)


def _short(config) -> str:
    meta = config.meta_dict
    return (f"N{meta['BLOCK_N']} K{meta['BLOCK_K']} split {meta['SPLIT_K']} "
            f"stream-K {meta['STREAM_K']} w{config.num_warps}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.gemv_stream_k")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], metavar="M",
                        help="rows of x, 1 to 16 (default: 1)")
    parser.add_argument("--grid-configs", action="store_true",
                        help="also decode_gemv at each config of its tune space for the rows, "
                             "the best kept (the tile grid tuned for the shape)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_stream_k: needs a CUDA GPU (the kernel's tests run in the interpreter)")
        return 1
    from benchmark.harness import measure_ceilings
    from gemslib.fused.decode_gemv import decode_gemv

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    sms, l2_bytes = props.multi_processor_count, props.L2_cache_size
    copy_gbps = measure_ceilings().copy_gbps
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, L2 {l2_bytes / 2**20:.0f} MiB, copy "
          f"{copy_gbps:.0f} GB/s; us a call, (% of copy bandwidth for the weight's bytes)")
    for rows in args.rows:
        for name, n_out, n_in in SHAPES:
            if not args.quick or name in QUICK:
                _compare(name, n_out, n_in, rows, device, sms, l2_bytes, copy_gbps,
                         args.grid_configs, decode_gemv)
    return 0


def _compare(name, n_out, n_in, rows, device, sms, l2_bytes, copy_gbps, grid_configs,
             decode_gemv) -> None:
    weight_bytes = n_out * n_in * 2
    copies = max(2, triton.cdiv(L2_MULTIPLE * l2_bytes, weight_bytes))
    weights = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) / n_in**0.5
               for _ in range(copies)]
    x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
    reference = x.double() @ weights[0].double().t()

    def share(us: float) -> str:
        return f"{us:7.1f} ({weight_bytes / us / 1e3 / copy_gbps:5.1%})"

    figures = {"cuBLAS": _rotated_us(lambda x, w: x @ w.t(), weights, x),
               "decode_gemv": _rotated_us(decode_gemv, weights, x)}
    if grid_configs:  # the tile grid at its best for this shape
        us, config = min(((_rotated_us_forced(config, weights, x), config)
                          for config in _grid_configs(rows)), key=lambda timed: timed[0])
        figures[f"decode_gemv best {_short(config)}"] = us
    for per_sm, block_n, block_k in VARIANTS:
        way = f"stream-K {per_sm}/SM N{block_n} K{block_k}"
        gemv = StreamKGemv(n_out, n_in, device, sms * per_sm, block_n, block_k, rows=rows)
        error = ((gemv(x, weights[0]).double() - reference).norm() / reference.norm()).item()
        figures[way] = f"wrong ({error:.1e})" if error > 1e-2 else _rotated_us(gemv, weights, x)
    best = min(((value, way) for way, value in figures.items() if isinstance(value, float)),
               key=lambda timed: timed[0])
    print(f"\n{name}, M{rows} ({n_out}x{n_in}, {weight_bytes / 2**20:.0f} MiB, {copies} "
          f"copies): best {best[1]}")
    for way, value in figures.items():
        print(f"  {way:<38} {share(value) if isinstance(value, float) else value}")


if __name__ == "__main__":
    raise SystemExit(main())
