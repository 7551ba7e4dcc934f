"""Decode attention: one new query per sequence against the first ``seqlens[b]`` positions of a
KV cache, the KV length split over programs (flash-decoding), all in one launch.

    decode_attention(q, k_cache, v_cache, seqlens)[b, h] = sum_j p_j v_cache[b, g(h), j],
    p_j = softmax_j(scale * q[b, h] . k_cache[b, g(h), j])  over j < seqlens[b]

with g(h) = h // (Hq / Hkv). q is (B, Hq, D), k_cache (B, Hkv, L, D), v_cache (B, Hkv, L, Dv),
any strides with a unit last stride. The query heads of one KV head share a program, so K/V
are read once for the group; each program folds one split of the keys with an online softmax,
and the last split of a KV head to finish merges the splits by log-sum-exp. The plan of a
launch (config, grid, arguments) is kept per argument layout: decode calls the same layout
every step. ``attention`` runs this kernel for one query row (a decode step through SDPA).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gemslib import checks, pdl, runtime
from gemslib.fused._attention_common import (_CHECK_DTYPES, _check, _kernels_take,
                                              attention_reference, band_arguments,
                                              default_scale, soft_tanh)
from gemslib.layout import LN2, LOG2E, unit_last
from gemslib.registry import SelfCheck, TuneBucket, TuneSpace


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _fold_keys(b_q, p_k, p_v, o_n, m_n, o_d, o_dv, head_dim, head_dim_v, stride_k_s, stride_v_s,
               scale_log2, cap_log2, b_acc, b_row_max, b_row_sum, IEEE: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """One block of keys (positions o_n, those of m_n visible, at least one) folded into the
    online softmax of the query rows b_q: (accumulator, row max, row sum), base-2 scores,
    capped at cap_log2 * tanh(s / cap_log2) with SOFTCAP. A hidden key is not read."""
    b_k = tl.load(p_k + o_n[None, :] * stride_k_s + o_d[:, None],
                  mask=m_n[None, :] & (o_d[:, None] < head_dim), other=0.0)
    if IEEE:
        b_s = tl.dot(b_q, b_k, input_precision="ieee") * scale_log2
    else:
        b_s = tl.dot(b_q, b_k) * scale_log2
    if SOFTCAP:
        b_s = cap_log2 * soft_tanh(b_s, cap_log2)
    b_s = tl.where(m_n[None, :], b_s, -float("inf"))
    b_new_max = tl.maximum(b_row_max, tl.max(b_s, axis=1))
    b_rescale = tl.exp2(b_row_max - b_new_max)
    b_p = tl.exp2(b_s - b_new_max[:, None])
    b_row_sum = b_row_sum * b_rescale + tl.sum(b_p, axis=1)
    b_v = tl.load(p_v + o_n[:, None] * stride_v_s + o_dv[None, :],
                  mask=m_n[:, None] & (o_dv[None, :] < head_dim_v), other=0.0)
    if IEEE:
        b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
    else:
        b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
    return b_acc, b_new_max, b_row_sum


# positions of a key mask one step of the scan for kept keys reads (16 bytes a thread of 4
# warps): a split of up to this many keys is scanned in one load
_SCAN_BLOCK = tl.constexpr(2048)


@triton.jit
def _kept_span(p_m, key_start, key_end, stride_m_s):
    """(first, end, contiguous) of the positions in [key_start, key_end) the key mask (row
    pointer p_m) keeps: the first kept one, one past the last, and whether it keeps every
    position between (or none: then first >= end)."""
    n_kept = 0
    first = key_end
    last = -1
    for i_n in range(key_start, key_end, _SCAN_BLOCK):
        o_n = i_n + tl.arange(0, _SCAN_BLOCK)
        m_n = o_n < key_end
        m_kept = m_n & (tl.load(p_m + o_n * stride_m_s, mask=m_n, other=0) != 0)
        n_kept += tl.sum(m_kept.to(tl.int32), axis=0)
        first = tl.minimum(first, tl.min(tl.where(m_kept, o_n, key_end), axis=0))
        last = tl.maximum(last, tl.max(tl.where(m_kept, o_n, -1), axis=0))
    # none kept (an empty split's key_end may be below its key_start): the empty run there
    end = tl.where(n_kept == 0, first, last + 1)
    return first, end, (n_kept == 0) | (n_kept == end - first)


@triton.jit
def _fold_split(b_q, p_k, p_v, p_m, key_start, key_end, o_d, o_dv, head_dim, head_dim_v,
                stride_k_s, stride_v_s, stride_m_s, scale_log2, cap_log2, b_acc, b_row_max,
                b_row_sum, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr):
    """The keys [key_start, key_end) folded in, BLOCK_N at a time: all of them, or with
    MASKED those the key mask (row pointer p_m) keeps, a block it hides entirely not read.
    The masked loop's K/V loads wait for the mask and a branch, which costs it its
    pipelining (and the shared memory of one)."""
    for i_n in range(key_start, key_end, BLOCK_N):
        o_n = i_n + tl.arange(0, BLOCK_N)
        m_n = o_n < key_end
        if MASKED:
            m_n = m_n & (tl.load(p_m + o_n * stride_m_s, mask=m_n, other=0) != 0)
            if tl.max(m_n.to(tl.int32), axis=0) > 0:
                b_acc, b_row_max, b_row_sum = _fold_keys(
                    b_q, p_k, p_v, o_n, m_n, o_d, o_dv, head_dim, head_dim_v, stride_k_s,
                    stride_v_s, scale_log2, cap_log2, b_acc, b_row_max, b_row_sum, IEEE,
                    SOFTCAP)
        else:
            b_acc, b_row_max, b_row_sum = _fold_keys(
                b_q, p_k, p_v, o_n, m_n, o_d, o_dv, head_dim, head_dim_v, stride_k_s,
                stride_v_s, scale_log2, cap_log2, b_acc, b_row_max, b_row_sum, IEEE, SOFTCAP)
    return b_acc, b_row_max, b_row_sum


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, key_mask_ptr, o_ptr, lse_ptr, o_part_ptr, lse_part_ptr,
    arrivals_ptr, cache_len, n_q_heads, n_kv_heads, group_size, head_dim, head_dim_v, split_len,
    n_splits, scale_log2, window, cap_log2, stride_q_b, stride_q_h, stride_k_b, stride_k_h,
    stride_k_s, stride_v_b, stride_v_h, stride_v_s, stride_m_b, stride_m_s, stride_o_b,
    stride_o_h, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False, PDL_EARLY: tl.constexpr = False,
):
    """Grid (splits, B * Hkv): the query heads sharing one KV head attend to one split of the
    first ``seqlens[b]`` (in [0, L], asserted; all L where seqlens is None) cache positions,
    whose K/V are read once for all of them. Unless key_mask is None, only the keys j with
    ``key_mask[b, j]`` count: each split first finds the positions the mask keeps among its
    own; a run of them (a static cache's prefix, left padding before it) streams as without
    a mask, any other pattern is read with the mask, a block it hides entirely skipped. With
    lengths the splits divide each sequence's own positions evenly (``split_len`` is then
    worked out here); without them, the cache's, ``split_len`` apart. With WINDOW only the
    last ``window`` positions of each sequence count (a sliding window: the query is the
    sequence's last position), and the splits divide those; SOFTCAP caps the scores
    (``cap_log2`` = cap * log2(e)).

    With one split the split scratch (o_part, lse_part, arrivals) is None and the program
    writes the output. With several it writes each head's normalised partial output and
    log-sum-exp (an empty split: lse -inf, output 0), counts itself in ``arrivals[b * Hkv + h]``,
    and the last of the splits to arrive merges them by log-sum-exp (no keys at all gives 0)
    and puts the counter back to 0 for the next call: one launch per decode step instead of a
    partial and a merge launch. Unless lse is None, the program that writes a head's output
    also writes its log-sum-exp (natural log; -inf without keys) to ``lse[b * Hq + head]``.
    PDL: launched dependent (runtime.dependent_launch_here), it first waits for the kernel
    before it on the stream; PDL_EARLY: then lets the next one launch (gemslib.pdl).
    """
    pdl.wait_for_previous_kernel(PDL, PDL_EARLY)
    i_split = tl.program_id(0)
    i_bhkv = tl.program_id(1)
    i_b = (i_bhkv // n_kv_heads).to(tl.int64)
    i_hkv = (i_bhkv % n_kv_heads).to(tl.int64)
    if seqlens_ptr is not None:
        # a length outside [0, L]: a device-side assert (compiled in, see DECODE); clamped so
        # that no input reads outside the cache where asserts are off
        seq_len = tl.load(seqlens_ptr + i_b).to(tl.int64)
        tl.device_assert((seq_len >= 0) & (seq_len <= cache_len),
                         "gemslib.decode_attention: seqlens must be in [0, L] (the cache length)")
        seq_len = tl.minimum(tl.maximum(seq_len, 0), cache_len).to(tl.int32)
        # the splits share the keys this sequence has (whole blocks each), not the cache's
        # length: with a short sequence in a long cache every program still streams keys
        split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    else:
        seq_len = cache_len
    key_lo = 0
    if WINDOW:  # the splits share the window's keys
        key_lo = tl.maximum(seq_len - window, 0)
        split_len = tl.cdiv(tl.cdiv(seq_len - key_lo, n_splits), BLOCK_N) * BLOCK_N
    key_start = key_lo + i_split * split_len
    key_end = tl.minimum(key_start + split_len, seq_len)
    o_g = tl.arange(0, BLOCK_G)
    o_h = i_hkv * group_size + o_g  # the query heads of this KV head
    m_h = o_g < group_size
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_q = tl.load(q_ptr + i_b * stride_q_b + o_h[:, None] * stride_q_h + o_d[None, :],
                  mask=m_h[:, None] & (o_d[None, :] < head_dim), other=0.0)
    p_k = k_ptr + i_b * stride_k_b + i_hkv * stride_k_h
    p_v = v_ptr + i_b * stride_v_b + i_hkv * stride_v_h
    b_acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    b_row_max = tl.full([BLOCK_G], -float("inf"), dtype=tl.float32)
    b_row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    p_m = key_mask_ptr + i_b * stride_m_b if key_mask_ptr is not None else None
    if key_mask_ptr is not None:
        # the keys the mask keeps, mostly one run (a static cache's prefix, left padding before
        # it): the run streams as without a mask, only a scattered pattern reads the mask
        kept_start, kept_end, contiguous = _kept_span(p_m, key_start, key_end, stride_m_s)
        if contiguous:
            b_acc, b_row_max, b_row_sum = _fold_split(
                b_q, p_k, p_v, p_m, kept_start, kept_end, o_d, o_dv, head_dim, head_dim_v,
                stride_k_s, stride_v_s, stride_m_s, scale_log2, cap_log2, b_acc, b_row_max,
                b_row_sum, IEEE, SOFTCAP, BLOCK_N, False)
        else:
            b_acc, b_row_max, b_row_sum = _fold_split(
                b_q, p_k, p_v, p_m, key_start, key_end, o_d, o_dv, head_dim, head_dim_v,
                stride_k_s, stride_v_s, stride_m_s, scale_log2, cap_log2, b_acc, b_row_max,
                b_row_sum, IEEE, SOFTCAP, BLOCK_N, True)
    else:
        b_acc, b_row_max, b_row_sum = _fold_split(
            b_q, p_k, p_v, p_m, key_start, key_end, o_d, o_dv, head_dim, head_dim_v,
            stride_k_s, stride_v_s, stride_m_s, scale_log2, cap_log2, b_acc, b_row_max,
            b_row_sum, IEEE, SOFTCAP, BLOCK_N, False)
    m_empty = b_row_sum == 0.0
    b_o = tl.where(m_empty[:, None], 0.0, b_acc / tl.where(m_empty, 1.0, b_row_sum)[:, None])
    m_o = m_h[:, None] & (o_dv[None, :] < head_dim_v)
    p_o = o_ptr + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_dv[None, :]
    if o_part_ptr is None:  # one split: no scratch, no merge
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_o)
        if lse_ptr is not None:
            tl.store(lse_ptr + i_b * n_q_heads + o_h,
                     tl.where(m_empty, -float("inf"), (b_row_max + tl.log2(b_row_sum)) * LN2),
                     mask=m_h)
    else:
        b_lse = tl.where(m_empty, -float("inf"), (b_row_max + tl.log2(b_row_sum)) * LN2)
        o_slot = (i_b * n_q_heads + o_h) * n_splits  # (B, Hq, splits) buffers
        tl.store(o_part_ptr + (o_slot + i_split)[:, None] * head_dim_v + o_dv[None, :], b_o,
                 mask=m_o)
        tl.store(lse_part_ptr + o_slot + i_split, b_lse, mask=m_h)
        tl.debug_barrier()  # every thread's stores issued before this program counts itself
        arrived = tl.atomic_add(arrivals_ptr + i_bhkv, 1, sem="acq_rel")
        if arrived == n_splits - 1:  # the last split of this KV head: merge
            # the whole group at once, [members, splits(, features)] tiles in chunks of splits
            # with masks instead of branches, so every load can be in flight together (a loop
            # over splits would wait one L2 round trip each; one over members, a store between)
            o_member = tl.arange(0, GROUP)
            m_member = o_member < group_size
            o_member_slot = (i_b * n_q_heads + i_hkv * group_size + o_member) * n_splits
            o_s = tl.arange(0, BLOCK_S)
            # .cg: the other programs' results from L2, never from a stale L1 line
            b_lses = tl.load(lse_part_ptr + o_member_slot[:, None] + o_s[None, :],
                             mask=m_member[:, None] & (o_s[None, :] < n_splits),
                             other=-float("inf"), cache_modifier=".cg")
            b_top = tl.max(b_lses, axis=1)
            b_total = tl.sum(tl.where(b_lses == -float("inf"), 0.0,
                                      tl.exp(b_lses - b_top[:, None])), axis=1)
            b_merged = tl.zeros([GROUP, BLOCK_DV], dtype=tl.float32)
            for i_chunk in tl.static_range(0, BLOCK_S, MERGE_S):
                o_chunk = i_chunk + tl.arange(0, MERGE_S)
                m_chunk = m_member[:, None] & (o_chunk[None, :] < n_splits)
                b_chunk_lses = tl.load(lse_part_ptr + o_member_slot[:, None] + o_chunk[None, :],
                                       mask=m_chunk, other=-float("inf"), cache_modifier=".cg")
                b_weights = tl.where(b_chunk_lses == -float("inf"), 0.0,
                                     tl.exp(b_chunk_lses - b_top[:, None]))
                o_part_row = (o_member_slot[:, None] + o_chunk[None, :]) * head_dim_v
                b_pieces = tl.load(o_part_ptr + o_part_row[:, :, None] + o_dv[None, None, :],
                                   mask=m_chunk[:, :, None] & (o_dv[None, None, :] < head_dim_v),
                                   other=0.0, cache_modifier=".cg")
                b_merged += tl.sum(b_pieces * b_weights[:, :, None], axis=1)
            # no keys at all: 0
            b_merged = b_merged / tl.where(b_total == 0.0, 1.0, b_total)[:, None]
            tl.store(o_ptr + i_b * stride_o_b
                     + (i_hkv * group_size + o_member)[:, None] * stride_o_h + o_dv[None, :],
                     b_merged.to(o_ptr.dtype.element_ty),
                     mask=m_member[:, None] & (o_dv[None, :] < head_dim_v))
            if lse_ptr is not None:
                tl.store(lse_ptr + i_b * n_q_heads + i_hkv * group_size + o_member,
                         tl.where(b_total == 0.0, -float("inf"), b_top + tl.log(b_total)),
                         mask=m_member)
            tl.atomic_xchg(arrivals_ptr + i_bhkv, 0)


DECODE = runtime.TunedKernel("decode_attention", "decode_attention", _decode_kernel,
                             tunables=("BLOCK_N",), launcher_knobs=("PROGRAMS_PER_SM",),
                             # kv_heads: B x Hkv, the programs before the keys are split (few
                             # of them: the splits carry the parallelism and their fixed costs)
                             shape_keys=("head_dim", "elem_bytes", "seq_kv", "kv_heads"),
                             device_asserts=True,
                             dependent_launch=True)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _decode_splits(batch_kv: int, cache_len: int, block_n: int, device_index: int,
                   programs_per_sm: int) -> int:
    """Splits of the KV length: as many programs as fit ``programs_per_sm`` per SM (a config
    choice: streaming the cache wants several resident per SM to keep loads in flight), rounded
    down (a last wave that is partly full takes as long as a full one), but no split shorter
    than one block of keys and at most 256."""
    wanted = programs_per_sm * runtime.multiprocessor_count(device_index) // max(batch_kv, 1)
    return max(1, min(wanted, runtime.cdiv(cache_len, block_n), 256))


def _decode_scratch(device: torch.device, n_counters: int, n_lse: int,
                    head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arrivals, lse_part, o_part) of a decode launch with splits (runtime.split_scratch):
    counters for the last-arrival merge, and fp32 room for the splits' log-sum-exps (n_lse)
    and partial outputs (n_lse x head_dim_v)."""
    arrivals, parts = runtime.split_scratch(device, n_counters, n_lse * (head_dim_v + 1))
    return arrivals, parts[:n_lse], parts[n_lse:]


class _DecodePlan(NamedTuple):
    """Everything about a decode launch that follows from the layout (shapes, strides, dtypes,
    scale, config), worked out once: decode calls the same layout every step, and at small
    batches the host's time is most of a step (see docs/notes/host-path.md)."""
    config: runtime.LaunchConfig
    grid: tuple[int, int]
    out_shape: tuple[int, int, int]
    scratch: tuple[int, int, int] | None  # _decode_scratch's sizes; None: one split
    arguments: tuple  # the scalars and constexprs after the tensors
    replay_key: tuple  # determines config, grid, arguments and the None tensors (replay)


def _plan_decode(q, k_cache, v_cache, has_seqlens: bool, scale: float, config,
                 with_lse: bool = False, key_mask_strides: tuple[int, int] | None = None,
                 out_strides: tuple[int, int] | None = None, window: int = 0,
                 softcap: float = 0.0) -> _DecodePlan:
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads, cache_len, head_dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    meta = config.meta_dict
    block_n = meta["BLOCK_N"]
    n_keys = min(cache_len, window or cache_len)  # a query's keys at most
    n_splits = _decode_splits(batch * n_kv_heads, n_keys, block_n, q.device.index or 0,
                              meta["PROGRAMS_PER_SM"])
    split_len = runtime.cdiv(runtime.cdiv(n_keys, n_splits), block_n) * block_n
    n_splits = runtime.cdiv(n_keys, split_len)
    group_size = n_q_heads // n_kv_heads
    block_dv = max(16, runtime.next_power_of_2(head_dim_v))
    block_s = max(2, runtime.next_power_of_2(n_splits))
    group_pow2 = runtime.next_power_of_2(group_size)  # merged in chunks of <= 8192 values
    if out_strides is None:  # the output's (batch, head) strides: contiguous by default
        out_strides = (n_q_heads * head_dim_v, head_dim_v)
    # the kernel's parameters after the tensors, positional (TunedKernel.replay launches the
    # compiled kernel with them so): sizes and scale; strides; flag and blocks
    values = (
        cache_len, n_q_heads, n_kv_heads, group_size, head_dim, head_dim_v, split_len, n_splits,
        scale * LOG2E.value, int(window), float(softcap) * LOG2E.value,
        *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        *(key_mask_strides or (0, 0)), *out_strides)
    constexprs = (q.dtype == torch.float32, bool(window), bool(softcap), max(16, group_pow2),
                  group_pow2,
                  max(16, runtime.next_power_of_2(head_dim)), block_dv, block_s,
                  min(block_s, max(2, 8192 // (block_dv * group_pow2))))
    arguments = values + constexprs
    grid = (n_splits, batch * n_kv_heads)
    scratch = ((batch * n_kv_heads, batch * n_q_heads * n_splits, head_dim_v)
               if n_splits > 1 else None)
    # the kernel is compiled for which tensors are None (seqlens, key_mask, lse, the split
    # scratch), so the key holds them: the scratch with the grid's split count, the others as
    # flags. The sizes and strides only as Triton specialises them (no heuristic reads them):
    # a decode loop's growing cache keeps one compiled launch while its splits stay
    return _DecodePlan(config, grid, (batch, n_q_heads, head_dim_v), scratch, arguments,
                       (config, grid, runtime.specialization_key(values), constexprs,
                        has_seqlens, key_mask_strides is not None, with_lse))


def _check_seqlens_in_cache(seqlens: torch.Tensor | None, cache_len: int,
                            on_device_too: bool = False) -> None:
    """Lengths on the CPU (or anywhere, with ``on_device_too``: the caller reads them on the
    host anyway) are checked here; on a GPU the kernel asserts them itself, since reading them
    here would wait for the device."""
    if seqlens is None or seqlens.numel() == 0 or (seqlens.device.type != "cpu"
                                                   and not on_device_too):
        return
    low, high = int(seqlens.min()), int(seqlens.max())
    if low < 0 or high > cache_len:
        raise ValueError(f"gemslib.decode_attention: seqlens must be in [0, {cache_len}] (the "
                         f"caches' length), got {low if low < 0 else high}")


def _run_decode(plan: _DecodePlan, q, k_cache, v_cache, seqlens,
                lse: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The output (B, Hq, Dv), written into ``out`` when given (with the strides the plan was
    made for); ``lse`` (B * Hq fp32, contiguous) gets the log-sum-exps. seqlens, key_mask and
    lse are None exactly where the plan was made without them."""
    _check_seqlens_in_cache(seqlens, k_cache.shape[2])
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    if plan.scratch is not None:
        arrivals, lse_part, o_part = _decode_scratch(q.device, *plan.scratch)
    else:
        arrivals = lse_part = o_part = None  # one split: no merge
    tensors = (q, k_cache, v_cache, seqlens, key_mask, out, lse, o_part, lse_part, arrivals)
    # positional: TunedKernel.replay launches the compiled kernel with them so
    tensors_key, pointers = runtime.tensor_key(tensors)
    DECODE.replay((plan.replay_key, tensors_key), plan.config, plan.grid,
                  (*tensors, *plan.arguments), (*pointers, *plan.arguments))
    return out


# layout key (``_decode_layout``) of arguments that passed the checks -> the plan of their
# kernel launch, or None where the call copies, falls back to torch or has nothing to compute
# (the checks and the plan arithmetic are a large share of a small batch's host time: see
# docs/notes/host-path.md); kept by ``_checked_plan``
_decode_layouts: dict[tuple, _DecodePlan | None] = {}
_UNCHECKED = object()


def _planned_config(q, k_cache) -> runtime.LaunchConfig:
    """DECODE's config for q (B, Hq, D) against k_cache (B, Hkv, L, D): by head dim, element
    bytes (fp32 caches need smaller K/V stages: shared memory), cache length and B x Hkv."""
    return DECODE.planned_config((q.shape[-1], q.element_size(), k_cache.shape[-2],
                                  q.shape[0] * k_cache.shape[1]))


def _decode_layout(q, k_cache, v_cache, seqlens, scale, key_mask=None, window: int = 0,
                   softcap: float = 0.0) -> tuple | None:
    """What a decode plan depends on, from decode_attention's raw arguments (None for
    arguments that are not tensors)."""
    try:
        return (q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape,
                v_cache.stride(), q.dtype, k_cache.dtype, v_cache.dtype, q.device,
                k_cache.device, v_cache.device,
                None if seqlens is None else (seqlens.shape, seqlens.dtype, seqlens.device),
                None if key_mask is None else (key_mask.shape, key_mask.stride(),
                                               key_mask.dtype, key_mask.device),
                scale, window, softcap,
                _planned_config(q, k_cache))
    except (AttributeError, IndexError, TypeError):
        return None


def _launch_plan(q, k_cache, v_cache, has_seqlens: bool, scale: float,
                 with_lse: bool = False, key_mask: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, window: int = 0,
                 softcap: float = 0.0) -> _DecodePlan | None:
    """The plan of the launch for arguments with a unit last stride; None when there is
    nothing to compute (no rows, no features or no keys)."""
    batch, n_q_heads, head_dim = q.shape
    cache_len, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if batch * n_q_heads * head_dim_v == 0 or cache_len == 0:
        return None
    return _plan_decode(q, k_cache, v_cache, has_seqlens, scale,
                        _planned_config(q, k_cache),
                        with_lse=with_lse,
                        key_mask_strides=None if key_mask is None else key_mask.stride(),
                        out_strides=None if out is None else out.stride()[:2], window=window,
                        softcap=softcap)


def _launch_decode(q, k_cache, v_cache, seqlens, scale: float,
                   lse: torch.Tensor | None = None,
                   key_mask: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, window: int = 0,
                   softcap: float = 0.0) -> torch.Tensor:
    """(B, Hq, Dv) for q (B, Hq, D) against the first seqlens[b] positions of the caches (all
    of them when seqlens is None), of those the ones key_mask (B, L) bool keeps, if given. One
    launch; see ``_decode_kernel``. ``lse`` (B, Hq) fp32 contiguous, if given, gets each
    head's log-sum-exp. ``out`` (B, Hq, Dv), any batch and head strides with a unit last
    stride, sharing no memory with the inputs, if given, is written and returned (an SDPA
    override's output in torch's layout, without a copy). ``window`` and ``softcap`` (0:
    none) as :func:`decode_attention_reference` takes them."""
    q, k_cache, v_cache = unit_last(q), unit_last(k_cache), unit_last(v_cache)
    plan = _launch_plan(q, k_cache, v_cache, seqlens is not None, scale, with_lse=lse is not None,
                        key_mask=key_mask, out=out, window=window, softcap=softcap)
    if plan is None:
        if lse is not None:
            lse.fill_(-float("inf"))
        if out is not None:
            return out.zero_()
        return q.new_zeros((q.shape[0], q.shape[1], v_cache.shape[3]))
    return _run_decode(plan, q, k_cache, v_cache, seqlens, lse, key_mask, out)


# --------------------------------------------------------------------------------------------
# Plain PyTorch reference (tests run it in float64)
# --------------------------------------------------------------------------------------------


def decode_attention_reference(q, k_cache, v_cache, seqlens=None, scale=None, key_mask=None,
                               window=0, softcap=0.0):
    """One query per sequence against the first seqlens[b] cache positions (clamped to
    [0, L]; decode_attention rejects lengths outside), with ``window`` > 0 the last window of
    them, of those the ones key_mask[b] keeps, by definition, the scores capped at softcap *
    tanh(s / softcap) with ``softcap`` > 0; no key at all gives 0."""
    outs = []
    for b in range(q.shape[0]):
        length = k_cache.shape[2] if seqlens is None else min(max(int(seqlens[b]), 0),
                                                               k_cache.shape[2])
        first = max(length - window, 0) if window else 0
        keys = torch.arange(first, length, device=k_cache.device)
        if key_mask is not None:
            keys = keys[key_mask[b, first:length].to(k_cache.device)]
        out, _ = attention_reference(q[b:b + 1, :, None], k_cache[b:b + 1, :, keys],
                                     v_cache[b:b + 1, :, keys], False, scale, softcap=softcap)
        outs.append(out[:, :, 0] if keys.numel() else torch.zeros_like(out[:, :, 0]))
    return torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v_cache.shape[-1]))


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def _check_decode(q, k_cache, v_cache, seqlens, scale, key_mask=None) -> None:
    """Validate decode_attention's arguments (once per layout: see ``_checked_plan``)."""
    name = "gemslib.decode_attention"
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"{name}: q must be (B, Hq, D), got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    _check(q[:, :, None], k_cache, v_cache, scale, name)
    batch = q.shape[0]
    if seqlens is not None and (not isinstance(seqlens, torch.Tensor) or seqlens.shape != (batch,)
                                or seqlens.is_floating_point() or seqlens.is_complex()
                                or seqlens.dtype == torch.bool or seqlens.device != q.device):
        raise ValueError(f"{name}: seqlens must be an integer tensor of shape ({batch},) on "
                         f"{q.device}, got {seqlens!r:.80}")
    shape = (batch, k_cache.shape[2])
    if key_mask is not None and (not isinstance(key_mask, torch.Tensor)
                                 or key_mask.dtype != torch.bool or key_mask.shape != shape
                                 or key_mask.device != q.device):
        got = (f"{key_mask.dtype} {tuple(key_mask.shape)} on {key_mask.device}"
               if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__)
        raise ValueError(f"{name}: key_mask must be a bool tensor of shape {shape} (batch, cache "
                         f"length) on {q.device}, got {got}")


def _checked_plan(q, k_cache, v_cache, seqlens, scale, layout: tuple | None, key_mask=None,
                  window: int = 0, softcap: float = 0.0):
    """decode_attention's arguments checked, and the plan of their kernel launch, both once per
    ``layout`` (their ``_decode_layout``; None: nothing is kept). Returns the plan, None where
    the call does not launch the kernel on its arguments as given (it copies them, hands them
    to torch or has nothing to compute), or ``_UNCHECKED`` where this call checked them (its
    scale still to be converted)."""
    plan = _decode_layouts.get(layout, _UNCHECKED) if layout is not None else _UNCHECKED
    if plan is not _UNCHECKED:
        return plan
    _check_decode(q, k_cache, v_cache, seqlens, scale, key_mask)
    if layout is not None and len(_decode_layouts) < 4096:
        plan = None
        if all(unit_last(t) is t for t in (q, k_cache, v_cache)) and \
                _kernels_take(q, k_cache, v_cache):
            scale = checks.as_float("gemslib.decode_attention", "scale", scale, optional=True)
            plan = _launch_plan(q, k_cache, v_cache, seqlens is not None,
                                default_scale(q.shape[-1]) if scale is None else scale,
                                key_mask=key_mask, window=window, softcap=softcap)
        _decode_layouts[layout] = plan
    return _UNCHECKED


_DECODE_CALLS = runtime.CallPlans("decode_attention")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seqlens: torch.Tensor | None = None, scale: float | None = None,
                     key_mask: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One new query per sequence: q (B, Hq, D) against the first ``seqlens[b]`` positions of
    k_cache (B, Hkv, L, D) and v_cache (B, Hkv, L, Dv); returns (B, Hq, Dv). ``key_mask``
    (B, L) bool, if given, keeps only the positions j with key_mask[b, j] (what SDPA's boolean
    mask does for one query row); blocks of positions it hides entirely are not read. The KV
    length is split over programs (flash-decoding) and the parts merged by log-sum-exp; the
    query heads of one KV head share a program, so K/V are read once. A sequence with no key
    gives 0.

    Args:
        q: (B, Hq, D) floating tensor, any strides (a non-unit last stride costs a copy). The
            kernel takes fp16, bf16 and fp32 on the kernel device with D and Dv in [1, 256];
            other calls, and calls that need gradients, are computed by torch.
        k_cache: (B, Hkv, L, D), q's dtype and device; Hq a multiple of Hkv (grouped-query).
        v_cache: (B, Hkv, L, Dv), q's dtype and device.
        seqlens: (B,) integer tensor on q's device, each in [0, L], or None for all L.
        scale: the scores' factor; None for 1 / sqrt(D).
        key_mask: (B, L) bool tensor on q's device, or None.
        window: a sliding window: only the last ``window`` of each sequence's positions
            count (the query is its last position). None for all.
        softcap: each score s (scaled) becomes softcap * tanh(s / softcap). None for none.

    Returns:
        (B, Hq, Dv) tensor of q's dtype.

    Raises:
        TypeError: q, k_cache or v_cache is not a floating-point tensor, or scale is not a
            real number.
        ValueError: q is not a 3-d tensor; shapes, dtypes or devices that do not agree as
            above; seqlens outside [0, L] on the CPU (on a GPU the kernel stops with a
            device-side assert); a window below 1 or a softcap not above 0.
    """
    args = (q, k_cache, v_cache, seqlens, scale, key_mask, window, softcap)
    key, planned = _DECODE_CALLS.replayed(*args)
    if planned is not None:
        return planned
    compiling = torch.compiler.is_compiling()  # traced: no Python caches (locks, dicts)
    window, softcap = band_arguments("gemslib.decode_attention", window, softcap)
    layout = None if compiling else _decode_layout(q, k_cache, v_cache, seqlens, scale, key_mask,
                                                   window, softcap)
    plan = _checked_plan(q, k_cache, v_cache, seqlens, scale, layout, key_mask, window, softcap)
    if plan is _UNCHECKED:
        scale = checks.as_float("gemslib.decode_attention", "scale", scale, optional=True)
    elif plan is not None and not (torch.is_grad_enabled() and (
            q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)):
        return _DECODE_CALLS.plan(key, args, lambda: _run_decode(plan, q, k_cache, v_cache, seqlens,
                                                                 key_mask=key_mask))
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or
                                    v_cache.requires_grad):
        # no backward kernel: the reference, in torch ops, keeps gradients right
        _check_seqlens_in_cache(seqlens, k_cache.shape[2], on_device_too=True)
        return decode_attention_reference(q, k_cache, v_cache, seqlens, scale, key_mask, window,
                                          softcap)
    if compiling:
        return _decode_attention_op(q, k_cache, v_cache, seqlens, scale, key_mask, window,
                                    softcap)
    return _decode_eager(q, k_cache, v_cache, seqlens, scale, key_mask, window, softcap)


def _decode_eager(q, k_cache, v_cache, seqlens, scale: float, key_mask=None, window: int = 0,
                  softcap: float = 0.0):
    if not _kernels_take(q, k_cache, v_cache):
        _check_seqlens_in_cache(seqlens, k_cache.shape[2], on_device_too=True)
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        return decode_attention_reference(q.to(work), k_cache.to(work), v_cache.to(work),
                                          seqlens, scale, key_mask, window,
                                          softcap).to(q.dtype)
    # on a GPU the kernel asserts the lengths itself: no host sync, no extra launch
    return _launch_decode(q, k_cache, v_cache, seqlens, scale, key_mask=key_mask,
                          window=window, softcap=softcap)


def _decode_attention_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seqlens: Optional[torch.Tensor], scale: float,
                           key_mask: Optional[torch.Tensor], window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    return _decode_eager(q, k_cache, v_cache, seqlens, scale, key_mask, window, softcap)


_decode_attention_op = runtime.CustomOp(
    "decode_attention", _decode_attention_impl,
    fake=lambda q, k_cache, v_cache, seqlens, scale, key_mask, window=0, softcap=0.0:
    q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1])))


# --------------------------------------------------------------------------------------------
# Self-checks for `python -m gemslib`
# --------------------------------------------------------------------------------------------


def _decode_inputs(device, dtype, cache_len):
    """One query per sequence against full caches of cache_len positions."""
    batch, heads, kv_heads, dim = (16, 32, 8, 128) if cache_len >= 1024 else (3, 4, 2, 64)
    return (torch.randn(batch, heads, dim, device=device, dtype=dtype),
            *(torch.randn(batch, kv_heads, cache_len, dim, device=device, dtype=dtype)
              for _ in range(2)))


SELF_CHECKS = (
    SelfCheck("decode_attention", _decode_inputs,
              run=decode_attention, reference=decode_attention_reference,
              torch_peer=lambda q, k, v: F.scaled_dot_product_attention(
                  q[:, :, None], k, v, enable_gqa=True)[:, :, 0],
              dtypes=_CHECK_DTYPES, term_scale=lambda q, k, v: v.abs().max().item()),
)


# --------------------------------------------------------------------------------------------
# Tuning (python -m gemslib.tune): candidates, and a problem per bucket
# --------------------------------------------------------------------------------------------

def _decode_problem(shapes: tuple[tuple[int, int], ...], dim: int, dtype: torch.dtype):
    """decode_attention at each (batch, cache length), Hq 32, Hkv 8, summed."""
    def make(device):
        problems = [(torch.randn(batch, 32, dim, device=device, dtype=dtype),
                     torch.randn(batch, 8, length, dim, device=device, dtype=dtype),
                     torch.randn(batch, 8, length, dim, device=device, dtype=dtype))
                    for batch, length in shapes]
        return lambda: [decode_attention(q, k_cache, v_cache) for q, k_cache, v_cache in problems]
    return make


# Compiling the candidates is most of a full tuner run, so the list leaves out what does not
# win (see docs/notes/decode.md): 4 programs per SM.
TUNING = (
    # no 2 warps, and 32-key blocks only for fp32 caches and wide heads: at B1 they are
    # latency-bound; 3 per SM: the 64-key configs fit three programs on an SM
    TuneSpace(DECODE,
              tuple({"BLOCK_N": n, "PROGRAMS_PER_SM": per_sm, "num_warps": 4, "num_stages": st}
                    for n, st in ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3))
                    for per_sm in (1, 2, 3))
              + tuple({"BLOCK_N": 32, "PROGRAMS_PER_SM": per_sm, "num_warps": 4, "num_stages": 2}
                      for per_sm in (1, 2)),
              # 16-bit: short caches (a static cache of a short prompt: few blocks a
              # sequence), then long ones; past head_dim 128 the long caches' tiles do not fit
              (TuneBucket({"seq_kv": 1024, "head_dim": 128, "elem_bytes": 2},
                          "B16 L192 + B16 L1024 D128 bf16",
                          _decode_problem(((16, 192), (16, 1024)), 128, torch.bfloat16)),
               # few KV heads (B1-B4 of 8): splits of a mid-length cache, where one call's
               # fixed costs (first loads, the merge) weigh most
               TuneBucket({"kv_heads": 32, "head_dim": 128, "elem_bytes": 2},
                          "B1 L8192 + B4 L4096 D128 bf16",
                          _decode_problem(((1, 8192), (4, 4096)), 128, torch.bfloat16)),
               TuneBucket({"head_dim": 128, "elem_bytes": 2}, "B16 L8192 + B8 L16384 D128 bf16",
                          _decode_problem(((16, 8192), (8, 16384)), 128, torch.bfloat16)),
               TuneBucket({"elem_bytes": 2}, "B4 L4096 D256 bf16",
                          _decode_problem(((4, 4096),), 256, torch.bfloat16)),
               TuneBucket({"head_dim": 128}, "B4 L4096 D128 fp32",
                          _decode_problem(((4, 4096),), 128, torch.float32)),
               TuneBucket(None, "B2 L2048 D256 fp32",
                          _decode_problem(((2, 2048),), 256, torch.float32)))),
)
