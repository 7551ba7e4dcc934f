"""Experiment: decode_gemv's stream-K configs (programs sharing the weight's bytes equally)
against its tile grid and cuBLAS, at decode's 1 and 16 rows.

    python -m benchmark.experiments.gemv_stream_k [--quick] [--rows 1 16] [--grid-configs]

The question it answers (docs/notes/decode.md, the fused GEMVs): decode_gemv and cuBLAS read a
decode step's large projections at 78-80% of copy bandwidth, and the estimate says a tile
grid's last partial wave costs most of the gap (Llama-3-8B's gate/up: 896 tiles for ~528
resident programs, 1.7 waves). With ``STREAM_K`` (``fused/decode_gemv.py``) a fixed grid of
programs, STREAM_K an SM, each streams an equal share of the (tile, K step) iterations; a tile
cut between programs is summed by the last contributor to arrive.

Timed, per shape and rows: cuBLAS (``x @ W.T``), decode_gemv with the file's config, with each
stream-K config of its tune space, and (``--grid-configs``) at its best tile-grid config;
each way over R copies of the weight in turn (R x its bytes >= 4x L2), captured in one CUDA
graph, so that every call streams its weight from DRAM and no flush's write-back is in the
figure; us a call and the weight's bytes as a share of the run's copy bandwidth. Shapes: the
projections of Llama-3.2-1B and Llama-3-8B and Llama-3-8B's lm_head. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
import triton

# (name, n_out, n_in)
SHAPES = (("1B q/k/v", 3072, 2048), ("1B o", 2048, 2048), ("1B gate/up", 16384, 2048),
          ("1B down", 2048, 8192), ("8B q/k/v", 6144, 4096), ("8B o", 4096, 4096),
          ("8B gate/up", 28672, 4096), ("8B down", 4096, 14336), ("8B lm_head", 128256, 4096))
QUICK = ("1B o", "8B gate/up", "8B down")
L2_MULTIPLE = 4  # the copies of a weight read in turn hold at least this many L2s


def _rotated_us(fn, weights, x) -> float:
    """us a call of ``fn(x, w)``, the calls over ``weights`` in turn captured in one graph."""
    from benchmark.harness import graphed, median_ms

    replay = graphed(lambda: [fn(x, w) for w in weights])
    return median_ms(replay) * 1e3 / len(weights)


def _configs(rows: int, stream_k: bool):
    """decode_gemv's tune-space candidates for ``rows`` (GEMV 1 at one row, the 16-row tile
    above), the stream-K ones or the tile grid's, as launch configs."""
    from gemslib import runtime
    from gemslib.fused.decode_gemv import _GEMV_CANDIDATES

    for candidate in _GEMV_CANDIDATES:
        if candidate["GEMV"] == (1 if rows == 1 else 0) and \
                (candidate["STREAM_K"] > 0) == stream_k:
            meta = tuple((k, v) for k, v in candidate.items()
                         if k not in ("num_warps", "num_stages"))
            yield runtime.LaunchConfig(meta, candidate["num_warps"], candidate["num_stages"])


def _forced_us(config, weights, x) -> float:
    from gemslib.fused.decode_gemv import DECODE_GEMV, decode_gemv

    with DECODE_GEMV.forced(config):
        return _rotated_us(decode_gemv, weights, x)


def _label(config) -> str:
    meta = config.meta_dict
    sharing = f"stream-K {meta['STREAM_K']}/SM" if meta["STREAM_K"] else \
        f"split {meta['SPLIT_K']}"
    return f"N{meta['BLOCK_N']} K{meta['BLOCK_K']} {sharing} w{config.num_warps}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.gemv_stream_k")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], metavar="M",
                        help="rows of x, 1 to 16 (default: 1)")
    parser.add_argument("--grid-configs", action="store_true",
                        help="also decode_gemv's tile grid at each of its candidates, the best "
                             "kept (the grid tuned for the shape)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_stream_k: needs a CUDA GPU (decode_gemv's stream-K configs are tested in "
              "the interpreter: tests/ops/test_decode_gemv.py)")
        return 1
    from benchmark.harness import measure_ceilings

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_gbps = measure_ceilings().copy_gbps
    print(f"{torch.cuda.get_device_name()}: {props.multi_processor_count} SMs, L2 "
          f"{props.L2_cache_size / 2**20:.0f} MiB, copy {copy_gbps:.0f} GB/s; us a call (% of "
          f"copy bandwidth for the weight's bytes)")
    for rows in args.rows:
        for name, n_out, n_in in SHAPES:
            if not args.quick or name in QUICK:
                _compare(name, n_out, n_in, rows, device, props.L2_cache_size, copy_gbps,
                         args.grid_configs)
    return 0


def _compare(name, n_out, n_in, rows, device, l2_bytes, copy_gbps, grid_configs) -> None:
    from gemslib.fused.decode_gemv import DECODE_GEMV, decode_gemv

    weight_bytes = n_out * n_in * 2
    copies = max(2, triton.cdiv(L2_MULTIPLE * l2_bytes, weight_bytes))
    weights = [torch.randn(n_out, n_in, device=device, dtype=torch.bfloat16) / n_in**0.5
               for _ in range(copies)]
    x = torch.randn(rows, n_in, device=device, dtype=torch.bfloat16)
    reference = x.double() @ weights[0].double().t()
    figures = {"cuBLAS": _rotated_us(lambda x, w: x @ w.t(), weights, x),
               "decode_gemv (file's config)": _rotated_us(decode_gemv, weights, x)}
    if grid_configs:
        us, config = min(((_forced_us(config, weights, x), config)
                          for config in _configs(rows, stream_k=False)),
                         key=lambda timed: timed[0])
        figures[f"grid best: {_label(config)}"] = us
    for config in _configs(rows, stream_k=True):
        with DECODE_GEMV.forced(config):
            out = decode_gemv(x, weights[0])
        error = ((out.double() - reference).norm() / reference.norm()).item()
        figures[_label(config)] = f"wrong ({error:.1e})" if error > 1e-2 else \
            _forced_us(config, weights, x)
    timed = [(value, way) for way, value in figures.items() if isinstance(value, float)]
    best = min(timed, key=lambda item: item[0])
    print(f"\n{name}, M{rows} ({n_out}x{n_in}, {weight_bytes / 2**20:.0f} MiB, {copies} "
          f"copies): best {best[1]}")
    for way, value in figures.items():
        shown = f"{value:7.1f} ({weight_bytes / value / 1e3 / copy_gbps:5.1%})" \
            if isinstance(value, float) else value
        print(f"  {way:<36} {shown}")


if __name__ == "__main__":
    raise SystemExit(main())
