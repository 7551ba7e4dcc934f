"""Experiment: the Hopper softmax path (ops/_softmax_hopper.py, a row held in shared memory
across a cluster of 1-8 CTAs and read from HBM once) at every (CLUSTER, num_warps) whose slice
fits, beside the shipped configs, torch and quack (where it imports), at the wide-row shapes
of docs/notes/softmax.md.

    python -m benchmark.experiments.softmax_cluster             # GPU: check and time
    python -m benchmark.experiments.softmax_cluster --compile   # CPU: compile for sm_90 only
    python -m benchmark.experiments.softmax_cluster --yaml h200.yaml  # and write the choice

Each variant is checked against float64 (softmax and log_softmax) before it is timed; the
backward (ops/_softmax_hopper.py's, dy and y held across the cluster) at the forward's fastest
configs that hold two slices. Expected and measured, and the open question: docs/notes/softmax.md.
"""

from __future__ import annotations

import argparse

import torch
import triton

from gemslib import runtime
from gemslib.ops import _softmax_hopper as hopper
from gemslib.ops import softmax as softmax_ops

VEC = 8  # 16-bit elements per 16-byte copy


def softmax_cluster(x: torch.Tensor, log: bool = False, cluster: int = 2,
                    num_warps: int = 8) -> torch.Tensor:
    """The Hopper path on a 2-d tensor, whatever the configs say."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    if not hopper.eligible(x, out) or not hopper.fits(x.shape[1], 2, cluster, num_warps):
        raise ValueError(f"softmax_cluster: {tuple(x.shape)} {x.dtype} does not take the path")
    with softmax_ops.SOFTMAX_CLUSTER_FWD.forced(_config(cluster, num_warps)):
        hopper.forward(softmax_ops.SOFTMAX_CLUSTER_FWD, x, out, log, cluster, num_warps)
    return out


def _config(cluster: int, num_warps: int) -> runtime.LaunchConfig:
    return runtime.LaunchConfig((("CLUSTER", cluster),), num_warps, 1)


def softmax_cluster_backward(grad: torch.Tensor, y: torch.Tensor, log: bool = False,
                             cluster: int = 2, num_warps: int = 8) -> torch.Tensor:
    """The backward's Hopper path on 2-d tensors, whatever the configs say."""
    dx = torch.empty_like(y)
    if not hopper.eligible(grad, y, dx) or not hopper.fits(y.shape[1], y.element_size(), cluster,
                                                          num_warps, slices=2):
        raise ValueError(f"softmax_cluster_backward: {tuple(y.shape)} does not take the path")
    with softmax_ops.SOFTMAX_CLUSTER_BWD.forced(_config(cluster, num_warps)):
        hopper.backward(softmax_ops.SOFTMAX_CLUSTER_BWD, grad, y, dx, log, cluster, num_warps)
    return dx


def compile_for_sm90(n_cols: int, cluster: int, num_warps: int, log: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {"x_ptr": "*bf16", "y_ptr": "*bf16", "partial_ptr": "*fp32", "n_cols": "i32",
                 "stride_x_row": "i32", "stride_y_row": "i32", "LOG": "constexpr",
                 "VEC": "constexpr", "N_CHUNKS": "constexpr"}
    constants = {"LOG": log, "VEC": VEC,
                 "N_CHUNKS": hopper.n_chunks(n_cols, 2, cluster, num_warps)}
    aligned = [["tt.divisibility", 16]]
    source = GluonASTSource(hopper._softmax_cluster_fwd_kernel, signature, constants,
                            attrs={(0,): aligned, (1,): aligned, (2,): aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_ctas": cluster})


SHAPES = ((1024, 131072), (512, 262144), (8192, 32000), (256, 152064), (2048, 50257),
          (4096, 128256), (64, 151936), (16384, 4096))
CLUSTERS = (1, 2, 4, 8)
WARPS = (4, 8, 16)
MIN_SLICE = 8 * 1024


def variants(n_cols: int):
    for cluster in CLUSTERS:
        for warps in WARPS:
            if hopper.fits(n_cols, 2, cluster, warps) and (
                    MIN_SLICE <= hopper.slice_bytes(n_cols, 2, cluster, warps) or cluster == 1):
                yield cluster, warps


def _quack():
    try:
        from quack.softmax import softmax_fwd
    except Exception as error:  # noqa: BLE001 - any failure means no peer
        print(f"quack: not importable ({type(error).__name__}: {str(error)[:120]})", flush=True)
        return None
    return softmax_fwd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="compile for sm_90 only (CPU)")
    parser.add_argument("--shapes", nargs="*", default=None, help="ROWSxCOLS ...")
    parser.add_argument("--yaml", default=None,
                        help="write nvidia_h200.yaml with the softmax_cluster_fwd buckets the "
                             "run chose (CLUSTER 0 where gemslib's Triton kernels were faster)")
    args = parser.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(map(int, s.split("x"))) for s in args.shapes]
    if args.compile:
        for _, n_cols in shapes:
            for cluster, warps in variants(n_cols):
                ptx = compile_for_sm90(n_cols, cluster, warps).asm["ptx"]
                print(f"{n_cols} cluster {cluster} x {warps} warps: slice "
                      f"{hopper.slice_bytes(n_cols, 2, cluster, warps) // 1024} KB, 16-byte cp.async "
                      f"{ptx.count('cp.async.cg.shared.global [')}, st.global.v4 "
                      f"{ptx.count('st.global.v4')}, barrier.cluster "
                      f"{ptx.count('barrier.cluster')}", flush=True)
        return
    import gemslib
    from benchmark.harness import measure_ceilings, median_ms

    copy = measure_ceilings().copy_gbps
    print(f"copy {copy:.0f} GB/s", flush=True)
    quack = _quack()
    timings = {}  # (rows, cols) -> {(CLUSTER, num_warps): ms}, (0, 8) the shipped kernels
    backward_timings = {}  # the same for the backward
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 4
        x64 = x.double()
        reference, log_reference = torch.softmax(x64, -1), torch.log_softmax(x64, -1)
        moved = 2 * x.numel() * x.element_size()

        def rate(ms):
            return f"{ms * 1e3:.1f} us ({moved / ms / 1e6 / copy:.0%})"

        shipped = median_ms(lambda: gemslib.softmax(x))
        timings[rows, cols] = {(0, 8): shipped}
        line = [f"{rows}x{cols}: gemslib {rate(shipped)}",
                f"torch {rate(median_ms(lambda: torch.softmax(x, -1)))}"]
        if quack is not None and cols % 8 == 0:
            try:
                line.append(f"quack {rate(median_ms(lambda: quack(x)))}")
            except Exception as error:  # noqa: BLE001
                line.append(f"quack failed ({type(error).__name__})")
        best = None
        for cluster, warps in variants(cols):
            try:
                out = softmax_cluster(x, cluster=cluster, num_warps=warps)
                error = ((out.double() - reference).norm() / reference.norm()).item()
                log_out = softmax_cluster(x, log=True, cluster=cluster, num_warps=warps)
                # relative to |log y| + 1: bf16 rounds log-probabilities near -40 by 0.125
                log_error = ((log_out.double() - log_reference).abs()
                             / (log_reference.abs() + 1)).max().item()
                ms = median_ms(lambda: softmax_cluster(x, cluster=cluster, num_warps=warps))
            except Exception as failure:  # noqa: BLE001 - a variant that does not launch
                line.append(f"c{cluster}x{warps}w failed ({type(failure).__name__}: "
                            f"{str(failure)[:80]})")
                continue
            ok = error < 1e-2 and log_error < 1e-2
            line.append(f"c{cluster}x{warps}w {rate(ms)} err {error:.1e}/{log_error:.1e}"
                        + ("" if ok else " WRONG"))
            if ok:
                timings[rows, cols][cluster, warps] = ms
            if ok and (best is None or ms < best[0]):
                best = (ms, cluster, warps)
        if best:
            ms, cluster, warps = best
            log_ms = median_ms(lambda: softmax_cluster(x, log=True, cluster=cluster,
                                                       num_warps=warps))
            line.append(f"BEST c{cluster}x{warps}w {rate(ms)}; log_softmax {rate(log_ms)} "
                        f"(gemslib log {rate(median_ms(lambda: gemslib.log_softmax(x)))})")
        # the backward holds two slices a CTA: the forward's fastest configs that still fit
        fastest = [c for _, c in sorted((ms, c) for c, ms in timings[rows, cols].items() if c[0])
                   if hopper.fits(cols, 2, *c, slices=2)][:4]
        backward_line, backward_timings[rows, cols] = _backward_line(x, fastest, copy)
        line.append(backward_line)
        print("\n    ".join(line), flush=True)
        del x, x64, reference, log_reference
    if args.yaml:
        write_configs({"softmax_cluster_fwd": timings, "softmax_cluster_bwd": backward_timings},
                      args.yaml)


def _backward_line(x: torch.Tensor, configs, copy: float) -> tuple[str, dict]:
    """The backward (softmax) at ``configs`` beside gemslib's Triton kernel and torch's,
    checked first; rates over the 3 passes of bytes it needs (dy and y read, dx written).
    Returns the line and {(CLUSTER, num_warps): ms}, (0, 8) the Triton kernel."""
    from benchmark.harness import median_ms

    def rate(ms):
        return f"{ms * 1e3:.1f} us ({3 * x.numel() * x.element_size() / ms / 1e6 / copy:.0%})"

    y = torch.softmax(x.float(), -1).to(x.dtype)
    grad = torch.randn_like(x)
    y64, grad64 = y.double(), grad.double()
    reference = y64 * (grad64 - (grad64 * y64).sum(-1, keepdim=True))
    triton_ms = median_ms(lambda: softmax_ops._backward_on_triton(grad, y))
    timings = {(0, 8): triton_ms}
    parts = [f"backward: gemslib Triton {rate(triton_ms)}",
             f"torch {rate(median_ms(lambda: torch.ops.aten._softmax_backward_data(grad, y, -1, x.dtype)))}"]
    for cluster, warps in configs:
        try:
            dx = softmax_cluster_backward(grad, y, cluster=cluster, num_warps=warps)
            error = ((dx.double() - reference).norm() / reference.norm()).item()
            ms = median_ms(lambda: softmax_cluster_backward(grad, y, cluster=cluster,
                                                            num_warps=warps))
        except Exception as failure:  # noqa: BLE001
            parts.append(f"c{cluster}x{warps}w: {str(failure)[:60]}")
            continue
        ok = error < 2e-2
        parts.append(f"c{cluster}x{warps}w {rate(ms)} err {error:.1e}" + ("" if ok else " WRONG"))
        if ok:
            timings[cluster, warps] = ms
    return "; ".join(parts), timings


BUCKETS = (4096, 32768, 65536, 131072, 160000, None)  # cols bounds of the shipped buckets


def write_configs(timings: dict, path: str) -> None:
    """nvidia_h200.yaml with each of ``timings``' kernels (name -> its timings) given buckets
    from them: per bucket, the config with the least mean of (its time / the best time) over
    the bucket's shapes timed with every config; CLUSTER 0 if the Triton kernels win. The
    shipped file's first bucket stays where it bounds the rows (few rows keep the Triton
    kernels: their calls are planned, and host time decides there; GPU time is what the
    experiment measures)."""
    import re
    from pathlib import Path

    shipped = (runtime.shipped_configs_dir() / "nvidia_h200.yaml").read_text().splitlines()
    for kernel, kernel_timings in timings.items():
        start = next(i for i, line in enumerate(shipped) if line.startswith(f"    {kernel}:"))
        end = next(i for i in range(start + 1, len(shipped)) if not shipped[i].startswith("      "))
        rows_bound = re.fullmatch(r"      - max: \{rows: (\d+)\}.*", shipped[start + 1])
        lines = [f"    {kernel}:  # chosen by benchmark/experiments/softmax_cluster.py"]
        if rows_bound:
            lines += shipped[start + 1:start + 3]
        few_rows = int(rows_bound.group(1)) if rows_bound else 0
        lower = 0
        for bound in BUCKETS:
            inside = [shape for shape in kernel_timings if shape[0] > few_rows
                      and lower < shape[1] and (bound is None or shape[1] <= bound)]
            lower = bound or lower
            common = (set.intersection(*(set(kernel_timings[s]) for s in inside)) if inside
                      else {(0, 8)})
            choice = min(common, key=lambda c: sum(kernel_timings[s][c]
                                                  / min(kernel_timings[s].values())
                                                  for s in inside))
            where = "" if bound is None else f"max: {{cols: {bound}}}\n        "
            lines.append(f"      - {where}config: {{CLUSTER: {choice[0]}, num_warps: {choice[1]}, "
                         f"num_stages: 1}}" + (f"  # {', '.join(f'{r}x{c}' for r, c in inside)}"
                                               if inside else "  # nothing timed here"))
            print(f"{kernel} cols <= {bound}: CLUSTER {choice[0]} x {choice[1]} warps", flush=True)
        shipped = shipped[:start] + lines + shipped[end:]
    Path(path).write_text("\n".join(shipped) + "\n")


if __name__ == "__main__":
    main()
