"""Experiment: the attention forward at one head dim with each of the tuner's 8-warp tiles
forced (and fp32's catch-all tile, what a 16-bit D256 call ran before it had a bucket), beside
SDPA (torch's choice of backend) in the same process: the tile a head dim's bucket should
take before the tuner has run on a card, and how far from SDPA the best one is.

    python -m benchmark.experiments.attention_tiles                      # D256, 16 heads
    python -m benchmark.experiments.attention_tiles --head-dim 96 --heads 32

A head dim between powers of two (96) runs each tile as two column tiles (64 + 32, the opt-in
GEMSLIB_SPLIT_HEAD_DIM=1 path) and as one padded tile (128), ``--split on|off|both`` (both by
default); "shipped" is whichever the environment gives; ``--tiles shipped`` times only the
shipped file's tile. Causal, B1, bf16, at each ``--seqs``; each tile's output checked against
SDPA's in fp32 (max abs error printed), then timed (``triton.testing.do_bench``, median). A
tile that does not compile or fit is printed as failed. Measured: docs/notes/attention.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import gemslib
from gemslib import runtime
from gemslib.fused import attention as attention_ops

CATCH_ALL = {"BLOCK_M": 32, "BLOCK_N": 32, "USE_TMA": 0, "LAZY": 0, "num_warps": 4,
             "num_stages": 1}


def tiles() -> list[dict]:
    """The forward's 8-warp candidates of the tuner, then fp32's catch-all tile."""
    space = next(s for s in attention_ops.TUNING if s.kernel is attention_ops.ATTENTION_FWD)
    return [dict(c) for c in space.candidates if c["num_warps"] == 8] + [CATCH_ALL]


def _shipped_tile(head_dim: int, seq: int) -> dict:
    """The tile the shipped file gives a bf16 causal call of this head dim and length."""
    config = attention_ops.ATTENTION_FWD.planned_config((head_dim, 1, 2, seq, seq))
    return {**config.meta_dict, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _launch_config(tile: dict) -> runtime.LaunchConfig:
    meta = tuple(sorted((k, v) for k, v in tile.items() if k not in ("num_warps", "num_stages")))
    return runtime.LaunchConfig(meta, tile["num_warps"], tile["num_stages"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--split", choices=("on", "off", "both"), default="both",
                        help="the head dim as two column tiles, one padded tile, or each")
    parser.add_argument("--tiles", choices=("all", "shipped"), default="all",
                        help="every 8-warp candidate, or only the shipped file's tile")
    args = parser.parse_args(argv)
    splits = {"on": [True], "off": [False], "both": [True, False]}[args.split]
    with attention_ops.SPLIT_HEAD_DIM.switched_on():
        if not attention_ops.column_tiles(args.head_dim, args.head_dim)[1]:
            splits = [False]  # a power of two (or too wide a tail): one way only
    if not torch.cuda.is_available():
        print("attention_tiles: needs a CUDA GPU")
        return 1
    print(f"{torch.cuda.get_device_name()}, B1 H{args.heads} D{args.head_dim} bf16 causal; "
          f"shipped file {runtime.config_path().name}")
    for seq in args.seqs:
        q, k, v = (torch.randn(1, args.heads, seq, args.head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                   is_causal=True)
        sdpa_ms = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        shipped_ms = triton.testing.do_bench(lambda: gemslib.attention(q, k, v, causal=True))
        print(f"S{seq}: SDPA {sdpa_ms * 1e3:.1f} us; gemslib with the shipped file "
              f"{shipped_ms * 1e3:.1f} us ({sdpa_ms / shipped_ms:.2f}x SDPA)", flush=True)
        candidates = tiles() if args.tiles == "all" else [_shipped_tile(args.head_dim, seq)]
        for tile, split in ((tile, split) for tile in candidates for split in splits):
            name = " ".join(f"{key}={value}" for key, value in tile.items())
            if len(splits) > 1:
                name += " " + ("split" if split else "padded")
            way = attention_ops.SPLIT_HEAD_DIM.switched_on() if split else \
                attention_ops.SPLIT_HEAD_DIM.switched_off()
            try:
                with attention_ops.ATTENTION_FWD.forced(_launch_config(tile)), way:
                    error = (gemslib.attention(q, k, v, causal=True).float()
                             - reference).abs().max().item()
                    ms = triton.testing.do_bench(
                        lambda: gemslib.attention(q, k, v, causal=True))
            except Exception as failure:  # a tile that does not compile or fit: a row
                print(f"  {name}: failed ({type(failure).__name__}: "
                      f"{str(failure).splitlines()[0][:100]})", flush=True)
                continue
            print(f"  {name}: {ms * 1e3:.1f} us ({sdpa_ms / ms:.2f}x SDPA), "
                  f"max error {error:.2e}", flush=True)
        del q, k, v, reference
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
