"""Experiment: the decode kernel's three ways through its keys, compiled for sm_90 on any
machine (no GPU needed), and what each costs in shared memory and instructions.

    python -m benchmark.experiments.decode_mask_sm90 [--block-n 128] [--stages 3] [--warps 4]
                                                   [--head-dim 128]

A static cache's decode step calls decode_attention with lengths and a key mask. How the
kernel's key loop treats the mask decides whether its K/V loads stay pipelined, and the H200
refuses a launch over 232448 B of shared memory. Here the three ways (lengths alone, lengths
and a mask, a mask alone; B16, Hq32, Hkv8, a 4096 cache) are planned as decode_attention
plans them, under the given config (default: the H200 file's 16-bit bucket). They are
specialised as a GPU launch specialises them: 16-byte aligned pointers and multiples of 16
are divisible by 16, an int 1 is a constant. Each is compiled with Triton's real compiler for
sm_90. Per way it prints the shared memory and counts in the PTX: cp.async (loads the
pipeliner staged), ld/st.shared and bar.sync (layout conversions through shared memory), mma,
ld.global. Results: benchmark/NOTES.md.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

from gemslib import runtime
from gemslib.fused import decode_attention as decode_ops

_COUNTS = {"cp.async": r"cp\.async\.ca|cp\.async\.cg", "ld.shared": r"ld\.shared",
           "st.shared": r"st\.shared", "bar.sync": r"bar\.sync", "mma": r"mma\.sync|wgmma",
           "ld.global": r"ld\.global"}


def _source(kernel, values: list, meta: dict) -> ASTSource:
    """The kernel's source for these positional argument values and the config's ``meta``
    (the tunables, by name), specialised as a launch would be."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, value) in enumerate(zip(kernel.params, values)):
        if param.is_constexpr or value is None:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False,
                                            not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[param.name], constexprs[param.name] = "constexpr", spec
            continue
        signature[param.name] = kind
        if spec == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    for param in kernel.params[len(values):]:  # the tunables, then the defaults (PDL)
        signature[param.name] = "constexpr"
        constexprs[param.name] = meta.get(param.name, param.default)
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmark.experiments.decode_mask_sm90")
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    runtime.multiprocessor_count = lambda device_index: 132  # the splits of the H200's SMs
    config = runtime.LaunchConfig((("BLOCK_N", args.block_n), ("PROGRAMS_PER_SM", 1)),
                                  args.warps, args.stages)
    batch, cache_len, dim = 16, 4096, args.head_dim
    q = torch.empty(batch, 32, dim, dtype=torch.bfloat16)
    k_cache = torch.empty(batch, 8, cache_len, dim, dtype=torch.bfloat16)
    seqlens = torch.full((batch,), 2048, dtype=torch.int32)
    key_mask = (torch.arange(cache_len) < 2048).expand(batch, cache_len)
    print(f"decode_attention B{batch} Hq32 Hkv8 L{cache_len} D{dim}, BLOCK_N {args.block_n}, "
          f"{args.warps} warps, {args.stages} stages; sm_90's limit 232448 B")
    for name, lengths, mask in (("lengths", seqlens, None), ("lengths + mask", seqlens, key_mask),
                                ("mask", None, key_mask)):
        plan = decode_ops._plan_decode(q, k_cache, k_cache, lengths is not None, 0.088, config,
                                       key_mask_strides=None if mask is None else mask.stride())
        out = torch.empty(plan.out_shape, dtype=q.dtype)
        scratch = (decode_ops._decode_scratch(q.device, *plan.scratch) if plan.scratch
                   else (None, None, None))
        arrivals, lse_part, o_part = scratch
        values = [q, k_cache, k_cache, lengths, mask, out, None, o_part, lse_part, arrivals,
                  *plan.arguments]
        compiled = triton.compile(_source(decode_ops._decode_kernel, values, config.meta_dict),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": args.warps, "num_stages": args.stages})
        ptx = compiled.asm["ptx"]
        counts = ", ".join(f"{key} {len(re.findall(pattern, ptx))}"
                           for key, pattern in _COUNTS.items())
        print(f"  {name:15s} grid {plan.grid}: shared {compiled.metadata.shared} B; {counts}")


if __name__ == "__main__":
    main()
