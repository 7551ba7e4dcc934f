"""Experiment: where gemslib's attention backward spends its time, part by part, beside cuDNN's
backward, and whether FlashAttention-3's dQ (fp32 atomics from the dK/dV kernel, no dQ kernel
recomputing s and dp) would be affordable on this GPU.

    python -m benchmark.experiments.attention_backward_parts [--atomics] [--diagnose]

bf16, one process. Per case (B, Hq/Hkv, S, D, causal), each part of
``fused/attention.py::_launch_backward`` timed alone on the inputs it receives (out and lse from
``_launch_forward``): the delta kernel, the dK/dV kernel (Gluon ``backward_dkdv`` where the
launcher takes it, else the Triton one), the Triton dQ kernel; then the whole call with them,
the whole call with dQ from the Gluon dK/dV kernel (``HOPPER_FUSED_DQ``, where it applies) and the
backward of SDPA with cuDNN forced (``torch.autograd.grad`` of a graph built once). Executed
TFLOP/s count 4 matmuls (dK/dV) and 3 (dQ) of 2 * D FLOPs per visible (row, key) pair; the
"useful" rate of a whole backward is 2.5x the forward's FLOPs over its time. Then the atomic
microbenchmark (``_dq_atomic_kernel``): the dQ traffic of a dK/dV grid of 128 keys a program,
one 64 x D fp32 tile added to a (B, Hq, S, D) buffer per (program, query block), as GB/s of
atomic payload and against the dQ kernel's time. Results and the open question:
docs/notes/attention.md.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemslib import layout, runtime
from gemslib.fused import attention as attention_ops
from gemslib.fused._attention_common import default_scale
from gemslib.layout import LOG2E

# (B, Hq, Hkv, S, D, causal)
DIAGNOSE = False  # --diagnose
CASES = ((1, 32, 32, 8192, 128, False), (1, 32, 32, 8192, 128, True),
         (4, 32, 32, 2048, 128, False), (4, 32, 32, 2048, 128, True),
         (2, 16, 16, 4096, 64, False), (2, 16, 16, 4096, 64, True),
         (1, 32, 8, 8192, 128, False))
ATOMIC_ROWS = 64    # query rows per dq tile (one consumer warpgroup's wgmma M)
ATOMIC_KEYS = 128   # keys per program of the dK/dV grid (the Gluon kernel's two warpgroups)
WARMUP_MS, REP_MS = 10, 60


# --------------------------------------------------------------------------------------------
# The atomic dQ traffic, without the math
# --------------------------------------------------------------------------------------------


@triton.jit
def _atomic_body(dq_ptr, seq, group_size, stride_row, CAUSAL: tl.constexpr,
                 HEAD_D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                 TILES: tl.constexpr):
    """The dK/dV grid's walk (layout.head_and_block's order, one flat loop over (group member,
    query block), causal: the query blocks from the program's first key on), adding TILES
    ROWS x HEAD_D fp32 tiles per step to dq (B, Hq, S, HEAD_D) rows of ``stride_row``; S a
    multiple of ROWS (no masks)."""
    i_bhkv, i_n = layout.head_and_block(tl.cdiv(seq, KEYS), CAUSAL)
    first_row = (i_n * KEYS // ROWS) * ROWS if CAUSAL else 0
    row_blocks = tl.cdiv(seq - first_row, ROWS)
    o_m = tl.arange(0, ROWS)
    o_d = tl.arange(0, HEAD_D)
    o_tile = o_m[:, None] * stride_row + o_d[None, :]
    for i_step in range(0, group_size * row_blocks):
        i_bh = i_bhkv * group_size + i_step // row_blocks  # (b * Hkv + hkv) * G + member
        row = first_row + (i_step % row_blocks) * ROWS
        p_dq = dq_ptr + (i_bh.to(tl.int64) * seq + row) * stride_row
        b_tile = tl.zeros([ROWS, HEAD_D], tl.float32) + i_step
        for i_tile in tl.static_range(TILES):
            tl.atomic_add(p_dq + o_tile, b_tile + i_tile, sem="relaxed")


@triton.jit
def _dq_atomic_kernel(dq_ptr, seq, group_size, stride_row, CAUSAL: tl.constexpr,
                      HEAD_D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                      TILES: tl.constexpr):
    """Grid (B * Hkv * cdiv(S, KEYS),); stride_row (= HEAD_D) specialised: the 2-d tile's
    rows are known 16-byte aligned, so the compiler may vectorise the atomics."""
    _atomic_body(dq_ptr, seq, group_size, stride_row, CAUSAL, HEAD_D, ROWS, KEYS, TILES)


@triton.jit(do_not_specialize=["stride_row"])
def _dq_atomic_scalar_kernel(dq_ptr, seq, group_size, stride_row, CAUSAL: tl.constexpr,
                             HEAD_D: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
                             TILES: tl.constexpr):
    """The same with nothing known of stride_row's alignment: one scalar atomic an element."""
    _atomic_body(dq_ptr, seq, group_size, stride_row, CAUSAL, HEAD_D, ROWS, KEYS, TILES)


@triton.jit
def _dq_tma_reduce_kernel(dq_desc, seq, group_size, CAUSAL: tl.constexpr, HEAD_D: tl.constexpr,
                          ROWS: tl.constexpr, KEYS: tl.constexpr):
    """The same walk, each tile added by a TMA reduce (registers -> shared -> bulk add, what
    FA3's dQ accumulation does); dq_desc over (B * Hq * S, HEAD_D) in (ROWS, HEAD_D) blocks."""
    i_bhkv, i_n = layout.head_and_block(tl.cdiv(seq, KEYS), CAUSAL)
    first_row = (i_n * KEYS // ROWS) * ROWS if CAUSAL else 0
    row_blocks = tl.cdiv(seq - first_row, ROWS)
    for i_step in range(0, group_size * row_blocks):
        i_bh = i_bhkv * group_size + i_step // row_blocks
        row = first_row + (i_step % row_blocks) * ROWS
        b_tile = tl.zeros([ROWS, HEAD_D], tl.float32) + i_step
        dq_desc.atomic_add([i_bh * seq + row, 0], b_tile)


ATOMIC_VARIANTS = ("red 2-d", "red 2-d x2", "red scalar", "TMA reduce")


def atomic_tiles(batch: int, n_q_heads: int, seq: int, causal: bool, keys: int = ATOMIC_KEYS,
                 rows: int = ATOMIC_ROWS) -> int:
    """ROWS x D tiles the dK/dV grid adds to dq: one per (program of ``keys`` keys, query block
    it sees) and query head of the group."""
    n_blocks = runtime.cdiv(seq, keys)
    per_head = sum(runtime.cdiv(seq - ((i_n * keys // rows) * rows if causal else 0), rows)
                   for i_n in range(n_blocks))
    return batch * n_q_heads * per_head


def launch_atomics(variant: str, dq: torch.Tensor, n_kv_heads: int, causal: bool) -> None:
    """One pass of ``variant``'s dq traffic into dq (B, Hq, S, D) fp32 contiguous."""
    batch, n_q_heads, seq, head_dim = dq.shape
    grid = (batch * n_kv_heads * runtime.cdiv(seq, ATOMIC_KEYS),)
    group = n_q_heads // n_kv_heads
    if variant == "TMA reduce":
        desc = TensorDescriptor.from_tensor(dq.view(-1, head_dim), [ATOMIC_ROWS, head_dim])
        _dq_tma_reduce_kernel[grid](desc, seq, group, CAUSAL=causal, HEAD_D=head_dim,
                                    ROWS=ATOMIC_ROWS, KEYS=ATOMIC_KEYS, num_warps=8)
        return
    kernel = _dq_atomic_scalar_kernel if variant == "red scalar" else _dq_atomic_kernel
    kernel[grid](dq, seq, group, dq.stride(2), CAUSAL=causal, HEAD_D=head_dim, ROWS=ATOMIC_ROWS,
                 KEYS=ATOMIC_KEYS, TILES=2 if variant == "red 2-d x2" else 1, num_warps=8)


# --------------------------------------------------------------------------------------------
# The backward's parts, launched as _launch_backward launches them
# --------------------------------------------------------------------------------------------


def backward_parts(grad_out, q, k, v, out, lse, causal: bool, scale: float) -> dict:
    """name -> zero-argument launch of one part of ``attention_ops._launch_backward`` (grad_lse
    None), with its buffers made once; "dkdv path" -> "Gluon" or "Triton". Mirrors the
    launcher's code (keep in sync): the delta launch, ``rest``, the Gluon condition."""
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    block_d = max(16, runtime.next_power_of_2(head_dim))
    block_dv = max(16, runtime.next_power_of_2(head_dim_v))
    delta = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)

    def run_delta():
        attention_ops._attention_bwd_delta_kernel[(batch * n_q_heads, runtime.cdiv(seq_q, 64))](
            o_ptr=out, do_ptr=grad_out, grad_lse_ptr=None, delta_ptr=delta, seq_q=seq_q,
            n_q_heads=n_q_heads, head_dim_v=head_dim_v,
            stride_o_b=out.stride(0), stride_o_h=out.stride(1), stride_o_s=out.stride(2),
            stride_do_b=grad_out.stride(0), stride_do_h=grad_out.stride(1),
            stride_do_s=grad_out.stride(2), BLOCK_M=64, BLOCK_DV=block_dv)

    shape = (head_dim, q.element_size())
    rest = (n_q_heads // n_kv_heads, head_dim, head_dim_v, scale, scale * LOG2E.value,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
            causal, q.dtype == torch.float32, block_d, block_dv)
    hopper = attention_ops._attention_hopper
    gluon = (attention_ops.HOPPER_BACKWARD.on and hopper is not None
             and hopper.eligible_backward(q, k, v) and layout.tma_addressable(grad_out))

    def run_dkdv():
        if gluon:
            hopper.backward_dkdv(q, k, v, grad_out, lse, delta, causal, scale)
        else:
            attention_ops.ATTENTION_BWD_DKDV.launch(
                lambda meta: (batch * n_kv_heads * runtime.cdiv(seq_kv, meta["BLOCK_N"]),),
                q, k, v, grad_out, lse, delta, dk, dv, seq_q, seq_kv, n_kv_heads, *rest,
                shape=shape)

    def run_dq():
        attention_ops.ATTENTION_BWD_DQ.launch(
            lambda meta: (batch * n_q_heads * runtime.cdiv(seq_q, meta["BLOCK_M"]),),
            q, k, v, grad_out, lse, delta, dq, seq_q, seq_kv, n_q_heads, *rest, shape=shape)

    run_delta()  # delta first: the other parts read it
    return {"delta": run_delta, "dkdv": run_dkdv, "dq": run_dq,
            "dkdv path": "Gluon" if gluon else "Triton", "delta tensor": delta}


def fused_diagnostics(q, k, v, grad_out, lse, delta, causal: bool, scale: float,
                      errors: list) -> str:
    """The fused-dQ kernel alone (no zeroing or scaling of dq) in its four forms
    (``_attention_hopper._launch_backward``'s dq_diag): 0 as shipped, 1 the writer's atomics as
    plain stores, 2 the writer only meets the consumers, 3 also no dq matmul."""
    hopper = attention_ops._attention_hopper
    dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cells = []
    sums = {}
    for mode in (0, 4):  # the two forms that add dq: the same sums?
        sums[mode] = torch.zeros_like(dq_sum)
        hopper._launch_backward(q, k, v, grad_out, lse, delta, causal, scale, sums[mode], mode)
    differs = ((sums[4] - sums[0]).abs().max() / sums[0].abs().max()).item()
    for mode, warps in ((0, 2), (1, 2), (2, 2), (3, 2), (4, 2)):
        ms = _timed(lambda: hopper._launch_backward(q, k, v, grad_out, lse, delta, causal, scale,
                                                    dq_sum, mode, warps), errors)
        cells.append(f"{mode}/{warps}w:{_us(ms, 5)}")
    return ("    fused kernel alone, us by form/writer warps (0 shipped, 1 stores, 2 no writes, "
            "3 no dq mma, 4 TMA reduce-add): " + " ".join(cells)
            + f"\n    form 4's dq against form 0's: max difference {differs:.1e} of max")


def cudnn_backward(q, k, v, grad_out, causal: bool):
    """torch.autograd.grad of SDPA forced onto cuDNN, the graph built once."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's why-not-cuDNN warnings: the error says enough
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def visible_pairs(batch: int, n_q_heads: int, seq: int, causal: bool) -> int:
    return batch * n_q_heads * (seq * (seq + 1) // 2 if causal else seq * seq)


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:90] if text else ''}"


def _timed(fn, errors: list) -> float | None:
    """median ms of ``fn`` (benchmark.harness.median_ms), None on failure (noted in errors)."""
    from benchmark.harness import median_ms

    try:
        return median_ms(fn, warmup_ms=WARMUP_MS, rep_ms=REP_MS)
    except Exception as error:  # noqa: BLE001 - one failing part must not lose the rest
        errors.append(_first_line(error))
        return None


def _us(ms: float | None, width: int = 8) -> str:
    return f"{ms * 1e3:{width}.0f}" if ms is not None else f"{'-':>{width}}"


def _tf(flops: float, ms: float | None, width: int = 5) -> str:
    return f"{flops / ms / 1e9:{width}.0f}" if ms is not None else f"{'-':>{width}}"


def _case_name(batch, n_q_heads, n_kv_heads, seq, head_dim, causal) -> str:
    return f"B{batch} H{n_q_heads}/{n_kv_heads} S{seq} D{head_dim}{' c' if causal else ''}"


def run_case(batch, n_q_heads, n_kv_heads, seq, head_dim, causal) -> tuple[str, float | None]:
    """The case's table line and the dQ kernel's ms."""
    errors: list = []
    shape_q = (batch, n_q_heads, seq, head_dim)
    shape_kv = (batch, n_kv_heads, seq, head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = default_scale(head_dim)
    out, lse = attention_ops._launch_forward(q, k, v, causal, scale)
    grad_out = torch.randn_like(out)
    parts = backward_parts(grad_out, q, k, v, out, lse, causal, scale)
    ms = {name: _timed(parts[name], errors) for name in ("delta", "dkdv", "dq")}
    with attention_ops.HOPPER_FUSED_DQ.switched_off():
        ms["whole"] = _timed(lambda: attention_ops._launch_backward(
            grad_out, q, k, v, out, lse, None, causal, scale), errors)
    ms["fused"] = _timed(lambda: attention_ops._launch_backward(
        grad_out, q, k, v, out, lse, None, causal, scale), errors)
    try:
        ms["cudnn"] = _timed(cudnn_backward(q, k, v, grad_out, causal), errors)
    except Exception as error:  # noqa: BLE001 - cuDNN unavailable at this shape
        errors.append("cuDNN " + _first_line(error))
        ms["cudnn"] = None
    pairs = visible_pairs(batch, n_q_heads, seq, causal)
    per_matmul = 2 * head_dim * pairs
    useful = 2.5 * 4 * batch * n_q_heads * seq * seq * head_dim / (2 if causal else 1)
    parts_ms = (sum(ms[p] for p in ("delta", "dkdv", "dq"))
                if all(ms[p] is not None for p in ("delta", "dkdv", "dq")) else None)
    ratio = " ".join(f"{ms['cudnn'] / ms[way]:5.2f}" if ms[way] and ms["cudnn"]
                     else f"{'-':>5}" for way in ("whole", "fused"))
    line = (f"{_case_name(batch, n_q_heads, n_kv_heads, seq, head_dim, causal):<22}"
            f"{_us(ms['delta'], 6)} {parts['dkdv path'][0]}{_us(ms['dkdv'], 7)}"
            f"{_tf(4 * per_matmul, ms['dkdv'])}{_us(ms['dq'], 7)}{_tf(3 * per_matmul, ms['dq'])}"
            f"{_us(parts_ms, 7)}{_us(ms['whole'], 7)}{_tf(useful, ms['whole'])}"
            f"{_us(ms['fused'], 7)}{_tf(useful, ms['fused'])}"
            f"{_us(ms['cudnn'], 7)}{_tf(useful, ms['cudnn'])} {ratio}")
    if DIAGNOSE and parts["dkdv path"] == "Gluon" and not causal and \
            head_dim == attention_ops._attention_hopper.HEAD_DIM:  # the forms are D = 128's
        line += "\n" + fused_diagnostics(q, k, v, grad_out, lse, parts["delta tensor"], causal,
                                         scale, errors)
    if errors:
        line += "\n    ! " + "; ".join(errors)[:160]
    del q, k, v, out, lse, grad_out, parts
    return line, ms["dq"]


def run_atomics(batch, n_q_heads, n_kv_heads, seq, head_dim, causal, dq_ms) -> str:
    tiles = atomic_tiles(batch, n_q_heads, seq, causal)
    payload = tiles * ATOMIC_ROWS * head_dim * 4
    dq = torch.zeros((batch, n_q_heads, seq, head_dim), device="cuda", dtype=torch.float32)
    cells, errors = [], []
    for variant in ATOMIC_VARIANTS:
        ms = _timed(lambda: launch_atomics(variant, dq, n_kv_heads, causal), errors)
        moved = payload * (2 if variant == "red 2-d x2" else 1)
        gbps = f"{moved / ms / 1e6:6.0f}" if ms else f"{'-':>6}"
        versus = f"{ms / dq_ms:6.2f}" if ms and dq_ms else f"{'-':>6}"
        cells.append(f"{_us(ms, 7)}{gbps}{versus}")
    line = (f"{_case_name(batch, n_q_heads, n_kv_heads, seq, head_dim, causal):<22}"
            f"{payload / 1e9:5.2f}{_us(dq_ms, 6)} |" + " |".join(cells))
    if errors:
        line += "\n    ! " + "; ".join(errors)[:160]
    return line


def main() -> None:
    import argparse

    from benchmark.harness import measure_ceilings

    parser = argparse.ArgumentParser()
    parser.add_argument("--atomics", action="store_true", help="also the atomic microbenchmark")
    parser.add_argument("--diagnose", action="store_true",
                        help="also the fused-dQ kernel's diagnostic forms (Gluon cases)")
    arguments = parser.parse_args()
    atomics = arguments.atomics
    global DIAGNOSE
    DIAGNOSE = arguments.diagnose

    try:
        ceilings = measure_ceilings(matmul=True, copy_bytes=2**30)
        print(f"copy {ceilings.copy_gbps:.0f} GB/s; cuBLAS bf16 8192^3 "
              f"{ceilings.matmul_tflops:.0f} TFLOP/s", flush=True)
    except Exception as error:  # noqa: BLE001
        print(f"ceilings failed: {_first_line(error)}", flush=True)
    print("us per call; TF = TFLOP/s (dK/dV, dQ: executed, 4 and 3 matmuls a visible pair; "
          "whole, fused, cuDNN: useful, 2.5x fwd);\nG/T = Gluon/Triton dK/dV; parts = sum of "
          "the three; whole: with them; fused: dQ from the Gluon dK/dV kernel;\nx = cuDNN us / "
          "whole us, then / fused us (>1: gemslib faster)")
    print(f"{'case':<22}{'delta':>6} {'dK/dV':>8}{'TF':>5}{'dQ':>7}{'TF':>5}{'parts':>7}"
          f"{'whole':>7}{'TF':>5}{'fused':>7}{'TF':>5}{'cuDNN':>7}{'TF':>5}{'x':>6}{'x':>6}",
          flush=True)
    dq_ms = {}
    for case in CASES:
        try:
            line, dq_ms[case] = run_case(*case)
        except Exception as error:  # noqa: BLE001 - one failing case must not lose the rest
            line = f"{_case_name(*case):<22}failed: {_first_line(error)}"
        print(line, flush=True)
        torch.cuda.empty_cache()
    if not atomics:
        return
    print(f"\ndQ by fp32 atomics from a dK/dV grid of {ATOMIC_KEYS} keys a program, one "
          f"{ATOMIC_ROWS}xD tile per (program, query block); GB = atomic payload;\neach variant: "
          "us, GB/s, us / dQ kernel us. 2-d: aligned rows (v4 atomics); x2: a tile per 64 keys\n"
          "(2x the payload); scalar: alignment hidden (an f32 atomic an element); TMA: bulk "
          "reduce-add")
    print(f"{'case':<22}{'GB':>5}{'dQ us':>6} |" + " |".join(f"{v:>19}" for v in ATOMIC_VARIANTS),
          flush=True)
    for case in CASES if atomics else ():
        if case[4] != 128 or case[3] != 8192:
            continue
        try:
            line = run_atomics(*case, dq_ms.get(case))
        except Exception as error:  # noqa: BLE001
            line = f"{_case_name(*case):<22}failed: {_first_line(error)}"
        print(line, flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
