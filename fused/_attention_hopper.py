"""Hopper (sm_90) prefill kernel for ``gemslib.attention``, written in Gluon.

Same math as the Triton kernel in ``attention.py`` (online softmax in the exp2 domain, fp32
accumulators, p rounded to the input dtype before p @ v, the row log-sum-exp), but scheduled the
way Triton's ``tl.dot`` cannot express (FlashAttention-3's schedule):

* one producer warp streams K and V by TMA through a ring of STAGES shared-memory buffers;
* two consumer warpgroups of ROWS = 64 query rows each (one program = 128 rows) take the
  buffers over by mbarriers alone (``ready``: the bytes landed; ``empty``: both consumers have
  finished p @ v on it), so they never wait for each other and one's softmax runs under the
  other's matmuls;
* within a warpgroup, q @ K_{j+1} and p_j @ V_j are in flight while the softmax of block j+1 is
  computed.

The descriptors are 4-d (B, H, S, D) with blocks (1, 1, rows, D): any strides that TMA accepts,
and rows past a head's end read as zeros, so ragged lengths need only the key mask on the last
block (keys >= Skv) and the causal diagonal (keys > row, top-left aligned). Used by
``attention._launch_forward`` for 16-bit inputs with D = Dv = 128 on sm_90; see ``eligible``.
The evidence for this schedule: docs/notes/attention.md.

The backward's dK/dV (``backward_dkdv``) follows the same plan with the roles of queries and
keys swapped: a program holds 128 keys of one KV head (64 per consumer warpgroup) in shared
memory for its whole life, the producer streams q and do tiles of 64 rows for every query head
of the group, and each consumer computes s^T = k q^T, dp^T = v do^T, then dv += p^T do and
dk += ds^T q with p^T and ds^T as register operands. Used while ``attention.HOPPER_BACKWARD``
is on (the default; see docs/notes/attention.md). With FUSED_DQ
(``backward``) it computes dQ too, from the ds it already has: dq += ds k over both
warpgroups' keys (ds through shared memory, each warpgroup one half of D), handed to
WRITER_WARPS writer warps that add the tiles into an fp32 buffer with atomics; no second pass
over s and dp. With DQ_BY_TMA the consumers add their tiles by TMA reduce-add instead, with no
writer (off: the writer warps serve better, see docs/notes/attention.md).
"""

from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton._C.libtriton import ir as _ir

from gemslib import layout, runtime
from gemslib.layout import LN2, LOG2E

ROWS = 64          # query rows per consumer warpgroup (the wgmma M); a program has two
HEAD_DIM = 128     # the head dim (of q, k and v) this kernel is built and tuned for
BLOCK_N = 128      # keys per block
STAGES = 3         # K/V ring depth: 32 KB of q + 3 x 64 KB of K/V fit the 227 KB of an SM
# the forward's (keys per block, ring depth) by head dim: at 64, 16 KB of q + 4 x 32 KB of
# K/V (a fifth stage would fit; four keep the loads ahead of matmuls half as long); at 256,
# 64 KB of q + 2 x 64 KB of K/V in 64-key blocks (128-key ones leave room for one stage)
FORWARD_TILES = {64: (BLOCK_N, 4), HEAD_DIM: (BLOCK_N, STAGES), 256: (64, 2)}
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# the backward's dK/dV kernel: KEYS keys per consumer warpgroup (two per program), query rows
# BWD_ROWS at a time through a ring of BWD_STAGES q / do tiles; K and V stay in shared memory
KEYS = 64
BWD_ROWS = 64
BWD_STAGES = 2
DQ_BY_TMA = False  # dQ's tiles added by the consumers' TMA reduce-adds, else by writer warps
WRITER_WARPS = 2   # the writer's warps: one cannot keep up with the consumers
# The dq matmuls issued between dv's and dk's and waited for with dk still running, so that the
# hand-off to the writer overlaps a matmul (wgmma groups complete in order: waiting for dq
# after dk waits for dk too); K's column half is indexed at run time, one path for both
# warpgroups (see docs/notes/attention.md). GEMSLIB_DQ_OVERLAP_DK=0 waits for dq after dk,
# read once per process (the kernels take it as a global when they compile)
DQ_OVERLAP_DK = gl.constexpr(os.environ.get("GEMSLIB_DQ_OVERLAP_DK", "1") == "1")
WRITER_REGS = 40   # the fused backward's dQ writer warps: they share the producer's warpgroup,
#                    whose registers setmaxnreg sets together (more would come out of a consumer's)

_DQ_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=3)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.constexpr_function
def _wgmma_layout(cols):
    """The register layout of one warpgroup's wgmma result with ``cols`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _register_operand_layout(cols):
    """A 16-bit left wgmma operand held in registers (p, p^T, ds^T), for a result of ``cols``
    columns."""
    return gl.DotOperandLayout(operand_index=0, parent=_wgmma_layout(cols), k_width=2)


@gluon.jit
def _softmax_block(b_s, b_row_max, scale_log2):
    """p = 2^(s * scale_log2 - new_max) for one block of scores b_s (scale_log2 >= 0); returns
    (p, new_max, alpha), alpha = 2^(old_max - new_max) rescales what was accumulated."""
    b_new_max = gl.maximum(b_row_max, gl.max(b_s, axis=1) * scale_log2)
    b_p = gl.exp2(b_s * scale_log2 - b_new_max[:, None])
    b_alpha = gl.exp2(b_row_max - b_new_max)
    return b_p, b_new_max, b_alpha


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
              i_b, i_h, i_hkv, first_query, n_blocks, STAGES: gl.constexpr):
    """One warp: both consumers' q tiles, then K_j and V_j into stage j % STAGES, each stage
    refilled once both consumers released it."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    for i_half in gl.static_range(2):
        mbarrier.expect(q_ready.index(i_half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_b, i_h, first_query + i_half * ROWS, 0],
                                        q_ready.index(i_half), q_smem.index(i_half))
    for i_n in range(n_blocks):
        stage = i_n % STAGES
        # the previous round of this stage must be released (the first round is free)
        mbarrier.wait(kv_empty.index(stage), ((i_n // STAGES) + 1) & 1, pred=i_n >= STAGES)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [i_b, i_hkv, i_n * BLOCK_N, 0],
                                        k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [i_b, i_hkv, i_n * BLOCK_N, 0],
                                        v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _mask(b_s, i_n, o_m, o_col, seq_kv, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """b_s with -inf where key block i_n's keys (columns o_col) are past seq_kv or, causal,
    past the query row o_m."""
    o_n = i_n * BLOCK_N + o_col[None, :]
    m_keep = (o_n < seq_kv) & (o_m[:, None] >= 0)  # the full (rows, keys) shape
    if CAUSAL:
        m_keep = m_keep & (o_n <= o_m[:, None])
    return gl.where(m_keep, b_s, -float("inf"))


@gluon.jit
def _consumer(i_half, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, p_out,
              stride_o_s, p_lse, first_query, seq_q, seq_kv, n_blocks, full_blocks, scale_log2,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: query rows first_query + i_half * ROWS + [0, ROWS) of one head against key
    blocks [0, n_blocks); blocks from full_blocks on are masked. Writes o rows and their lse
    (p_out / p_lse point at the head's (Sq, D) / (Sq,) slices, o's rows stride_o_s apart)."""
    ROWS: gl.constexpr = q_smem.shape[3]
    HEAD_D: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    DTYPE: gl.constexpr = q_smem.dtype
    S_LAYOUT: gl.constexpr = _wgmma_layout(BLOCK_N)
    O_LAYOUT: gl.constexpr = _wgmma_layout(HEAD_D)
    P_LAYOUT: gl.constexpr = _register_operand_layout(HEAD_D)
    q_tile = q_smem.index(i_half).reshape([ROWS, HEAD_D])
    o_m = first_query + i_half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT))
    o_col = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    b_row_max = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    b_row_sum = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    b_acc = gl.zeros([ROWS, HEAD_D], gl.float32, O_LAYOUT)
    b_zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, S_LAYOUT)

    # block 0: scores and softmax before the loop
    mbarrier.wait(q_ready.index(i_half), 0)
    mbarrier.wait(k_ready.index(0), 0)
    k_tile = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), b_zero_s, use_acc=False,
                            is_async=True)
    b_s, _, _ = warpgroup_mma_wait(0, deps=[s_token, q_tile, k_tile])
    if full_blocks == 0:
        b_s = _mask(b_s, 0, o_m, o_col, seq_kv, CAUSAL, BLOCK_N)
    b_p, b_row_max, b_alpha = _softmax_block(b_s, b_row_max, scale_log2)
    b_row_sum = b_row_sum * b_alpha + gl.sum(b_p, axis=1)

    for i_n in range(n_blocks - 1):
        stage = i_n % STAGES
        next_stage = (i_n + 1) % STAGES
        # tensor cores: q @ K_{j+1}, then p_j @ V_j, both in flight
        mbarrier.wait(k_ready.index(next_stage), ((i_n + 1) // STAGES) & 1)
        k_tile = k_smem.index(next_stage).reshape([BLOCK_N, HEAD_D])
        s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), b_zero_s, use_acc=False,
                                is_async=True)
        b_p_op = gl.convert_layout(b_p.to(DTYPE), P_LAYOUT)
        mbarrier.wait(v_ready.index(stage), (i_n // STAGES) & 1)
        v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_D])
        acc_token = warpgroup_mma(b_p_op, v_tile, b_acc, is_async=True)
        b_s, _ = warpgroup_mma_wait(1, deps=[s_token, k_tile])
        # CUDA cores: the softmax of block j+1 under p_j @ V_j. The branch (always taken) keeps
        # it in a basic block of its own: ptxas would otherwise hoist the wait for p_j @ V_j
        # into its first latency bubble and serialise the two (seen in the SASS)
        if seq_q > 0:
            if i_n + 1 >= full_blocks:
                b_s = _mask(b_s, i_n + 1, o_m, o_col, seq_kv, CAUSAL, BLOCK_N)
            b_p, b_row_max, b_alpha = _softmax_block(b_s, b_row_max, scale_log2)
            b_row_sum = b_row_sum * b_alpha + gl.sum(b_p, axis=1)
        else:
            b_p = b_s
            b_alpha = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, S_LAYOUT))
        b_acc, _ = warpgroup_mma_wait(0, deps=[acc_token, v_tile])
        mbarrier.arrive(kv_empty.index(stage))  # K_j and V_j are no longer read
        b_acc = b_acc * gl.convert_layout(b_alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]

    last = (n_blocks - 1) % STAGES
    b_p_op = gl.convert_layout(b_p.to(DTYPE), P_LAYOUT)
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    v_tile = v_smem.index(last).reshape([BLOCK_N, HEAD_D])
    acc_token = warpgroup_mma(b_p_op, v_tile, b_acc, is_async=True)
    b_acc, _ = warpgroup_mma_wait(0, deps=[acc_token, v_tile])

    m_m = o_m < seq_q
    gl.store(p_lse + o_m, (b_row_max + gl.log2(b_row_sum)) * LN2, mask=m_m)
    b_out = (b_acc / gl.convert_layout(b_row_sum, gl.SliceLayout(1, O_LAYOUT))[:, None]).to(DTYPE)
    o_m_out = first_query + i_half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_LAYOUT))
    o_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_LAYOUT))
    gl.store(p_out + o_m_out[:, None].to(gl.int64) * stride_o_s + o_d[None, :], b_out,
             mask=(o_m_out < seq_q)[:, None])


@gluon.jit
def _attention_fwd_hopper(q_desc, k_desc, v_desc, out_ptr, lse_ptr, seq_q, seq_kv, n_q_heads,
                          group_size, scale_log2, stride_o_b, stride_o_h, stride_o_s,
                          CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (B * Hq * cdiv(Sq, 2 * ROWS),) in layout.head_and_block's order, the query blocks
    from the last (the heaviest) to the first when causal. q_desc over (B, Hq, Sq, D) in
    (1, 1, ROWS, D) blocks, k_desc / v_desc over (B, Hkv, Skv, D) in (1, 1, BLOCK_N, D) blocks;
    out (B, Hq, Sq, D) with the strides given (unit last), lse (B, Hq, Sq) contiguous.
    scale_log2 = scale * log2(e) >= 0."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    DTYPE: gl.constexpr = q_desc.dtype
    n_query_blocks = gl.cdiv(seq_q, 2 * ROWS)
    i_bh, i_m = layout.head_and_block(n_query_blocks, CAUSAL)
    i_b = i_bh // n_q_heads
    i_h = i_bh % n_q_heads
    if CAUSAL:  # the last query blocks see the most keys
        i_m = n_query_blocks - 1 - i_m
    first_query = i_m * 2 * ROWS
    if CAUSAL:  # top-left aligned: row i sees keys j <= i
        n_blocks = gl.cdiv(gl.minimum(seq_kv, first_query + 2 * ROWS), BLOCK_N)
        full_blocks = gl.minimum(seq_kv, first_query) // BLOCK_N
    else:
        n_blocks = gl.cdiv(seq_kv, BLOCK_N)
        full_blocks = seq_kv // BLOCK_N

    q_smem = gl.allocate_shared_memory(DTYPE, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(DTYPE, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(DTYPE, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i_half in gl.static_range(2):
        mbarrier.init(q_ready.index(i_half), count=1)
    for i_stage in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i_stage), count=1)
        mbarrier.init(v_ready.index(i_stage), count=1)
        mbarrier.init(kv_empty.index(i_stage), count=2)  # one arrival per consumer warpgroup

    head_rows = i_bh.to(gl.int64) * seq_q
    p_out = out_ptr + i_b.to(gl.int64) * stride_o_b + i_h.to(gl.int64) * stride_o_h
    consumer_args = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                     p_out, stride_o_s, lse_ptr + head_rows, first_query, seq_q,
                     seq_kv, n_blocks, full_blocks, scale_log2, CAUSAL, STAGES)
    low, high = gl.to_tensor(0), gl.to_tensor(1)  # which 64 of the 128 rows
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                     kv_empty, i_b, i_h, i_h // group_size, first_query, n_blocks, STAGES)
    gl.warp_specialize([(_consumer, (low,) + consumer_args), (_consumer, (high,) + consumer_args),
                        (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Backward: dK and dV (dQ and delta come from the Triton kernels in attention.py)
# --------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                  qdo_ready, qdo_empty, i_b, i_hkv, first_key, group_size, first_row_block,
                  row_blocks, STAGES: gl.constexpr):
    """One warp: both consumers' K and V blocks once, then for each (group member, query block)
    the q and do tiles into stage step % STAGES, refilled once both consumers released it."""
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(kv_ready.index(0), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for i_half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [i_b, i_hkv, first_key + i_half * KEYS, 0],
                                        kv_ready.index(0), k_smem.index(i_half))
        tma.async_copy_global_to_shared(v_desc, [i_b, i_hkv, first_key + i_half * KEYS, 0],
                                        kv_ready.index(0), v_smem.index(i_half))
    for i_step in range(group_size * row_blocks):
        stage = i_step % STAGES
        i_h = i_hkv * group_size + i_step // row_blocks
        row = (first_row_block + i_step % row_blocks) * ROWS
        mbarrier.wait(qdo_empty.index(stage), ((i_step // STAGES) + 1) & 1, pred=i_step >= STAGES)
        mbarrier.expect(qdo_ready.index(stage),
                        q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_b, i_h, row, 0], qdo_ready.index(stage),
                                        q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [i_b, i_h, row, 0], qdo_ready.index(stage),
                                        do_smem.index(stage))


@gluon.jit
def _bwd_consumer(i_half, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, qdo_ready,
                  qdo_empty, ds_ready, ds_empty, dq_ready, dq_empty, p_lse, p_delta, p_dk, p_dv,
                  dq_desc, first_head, first_key, seq_q, seq_kv, group_size, first_row_block, row_blocks, scale,
                  scale_log2, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: keys first_key + i_half * KEYS + [0, KEYS) of one KV head, keys-major like
    the Triton kernel: s^T = k q^T and dp^T = v do^T (K and V straight from shared memory),
    p^T = 2^(s^T scale_log2 - lse log2 e), ds^T = p^T (dp^T - delta), then dv += p^T do and
    dk += ds^T q with p^T and ds^T as register operands. p_lse / p_delta point at the
    group's first query head ((Sq,) per member, consecutive); p_dk / p_dv at the KV head's
    (Skv, D) slices.

    FUSED_DQ (ds_smem of 4 buffers; a partition's constexpr arguments arrive as tensors, a
    shape stays constant): dQ's part too, from the ds both warpgroups computed (FlashAttention-3's plan):
    each writes its ds^T into ds_smem (two buffers of both halves, by step parity), the two
    meet at ds_ready, and warpgroup h computes dq[rows, h-th half of D] = ds[rows, 2 KEYS]
    k[2 KEYS, half] into dq_smem (two buffers of both halves, freed by dq_empty) for the
    writer warp (``_bwd_dq_writer``) to add; ds_empty frees a ds buffer once both have read
    it."""
    KEYS: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    ROWS: gl.constexpr = q_smem.shape[3]
    DTYPE: gl.constexpr = k_smem.dtype
    FUSED_DQ: gl.constexpr = ds_smem.shape[0] == 4
    KEY_SPLIT: gl.constexpr = dq_ready.shape[0] == 3  # see _attention_bwd_dkdv_hopper
    DQ_DIAG: gl.constexpr = dq_empty.shape[0] - 2  # 0 but in the diagnostics (_launch_backward)
    S_LAYOUT: gl.constexpr = _wgmma_layout(ROWS)
    ACC_LAYOUT: gl.constexpr = _wgmma_layout(HEAD_D)
    OPERAND_LAYOUT: gl.constexpr = _register_operand_layout(HEAD_D)
    k_tile = k_smem.index(i_half).reshape([KEYS, HEAD_D])
    v_tile = v_smem.index(i_half).reshape([KEYS, HEAD_D])
    o_n = first_key + i_half * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, S_LAYOUT))
    o_col = gl.arange(0, ROWS, layout=gl.SliceLayout(0, S_LAYOUT))
    b_dk = gl.zeros([KEYS, HEAD_D], gl.float32, ACC_LAYOUT)
    b_dv = gl.zeros([KEYS, HEAD_D], gl.float32, ACC_LAYOUT)
    b_zero_s = gl.zeros([KEYS, ROWS], gl.float32, S_LAYOUT)
    mbarrier.wait(kv_ready.index(0), 0)
    for i_step in range(group_size * row_blocks):
        stage = i_step % STAGES
        o_m = (first_row_block + i_step % row_blocks) * ROWS + o_col
        mbarrier.wait(qdo_ready.index(stage), (i_step // STAGES) & 1)
        q_tile = q_smem.index(stage).reshape([ROWS, HEAD_D])
        do_tile = do_smem.index(stage).reshape([ROWS, HEAD_D])
        s_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), b_zero_s, use_acc=False,
                                is_async=True)
        dp_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), b_zero_s, use_acc=False,
                                 is_async=True)
        # the rows' lse and delta load under the two matmuls
        o_row = (i_step // row_blocks).to(gl.int64) * seq_q + o_m
        m_m = o_m < seq_q
        b_lse_log2 = gl.load(p_lse + o_row, mask=m_m, other=0.0) * LOG2E
        b_delta = gl.load(p_delta + o_row, mask=m_m, other=0.0)
        b_st, b_dpt, _, _, _, _ = warpgroup_mma_wait(
            0, deps=[s_token, dp_token, k_tile, v_tile, q_tile, do_tile])
        m_keep = (o_n[:, None] < seq_kv) & m_m[None, :]
        if CAUSAL:  # top-left aligned: row i sees keys j <= i
            m_keep = m_keep & (o_n[:, None] <= o_m[None, :])
        b_pt = gl.where(m_keep, gl.exp2(b_st * scale_log2 - b_lse_log2[None, :]), 0.0)
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        buffer = i_step % 2  # FUSED_DQ's ds buffer
        if FUSED_DQ and not KEY_SPLIT:
            # both warpgroups read this buffer two steps ago: wait until both are done
            mbarrier.wait(ds_empty.index(buffer), ((i_step // 2) + 1) & 1, pred=i_step >= 2)
            ds_smem.index(2 * buffer + i_half).store(b_dst.to(DTYPE))
            fence_async_shared()
            gl.thread_barrier()  # every thread's part is in before the warpgroup arrives
            mbarrier.arrive(ds_ready.index(buffer))
        b_pt_op = gl.convert_layout(b_pt.to(DTYPE), OPERAND_LAYOUT)
        b_dst_op = gl.convert_layout(b_dst.to(DTYPE), OPERAND_LAYOUT)
        dv_token = warpgroup_mma(b_pt_op, do_tile, b_dv, is_async=True)
        if FUSED_DQ and KEY_SPLIT:
            # this warpgroup's partial dq over its own keys, from its own ds (no meeting); the
            # writer sums the two warpgroups' partials. dk's matmul runs on under the hand-off
            ds_tile = ds_smem.index(i_half)
            ds_tile.store(b_dst.to(DTYPE))
            fence_async_shared()
            gl.thread_barrier()  # every thread's part is in before the warpgroup's wgmma reads
            dq_token = warpgroup_mma(ds_tile.permute((1, 0)), k_tile,
                                     gl.zeros([ROWS, HEAD_D], gl.float32, ACC_LAYOUT),
                                     use_acc=False, is_async=True)
            dk_token = warpgroup_mma(b_dst_op, q_tile, b_dk, is_async=True)
            b_dq, _, _ = warpgroup_mma_wait(1, deps=[dq_token, ds_tile, k_tile])
            _hand_dq_to_writer(dq_smem, dq_ready, dq_empty, buffer, i_half, i_step, b_dq)
            b_dv, b_dk, _, _ = warpgroup_mma_wait(0, deps=[dv_token, dk_token, do_tile, q_tile])
            mbarrier.arrive(qdo_empty.index(stage))  # q and do of this stage are no longer read
        elif FUSED_DQ and DQ_OVERLAP_DK and DQ_DIAG == 0:
            HALF_D: gl.constexpr = HEAD_D // 2
            mbarrier.wait(ds_ready.index(buffer), (i_step // 2) & 1)
            ds_low = ds_smem.index(2 * buffer).permute((1, 0))       # [ROWS, KEYS]
            ds_high = ds_smem.index(2 * buffer + 1).permute((1, 0))
            k_low = _k_column_half(k_smem, 0, i_half)
            k_high = _k_column_half(k_smem, 1, i_half)
            dq_token = warpgroup_mma(ds_low, k_low,
                                     gl.zeros([ROWS, HALF_D], gl.float32, _wgmma_layout(HALF_D)),
                                     use_acc=False, is_async=True)
            dq_token = warpgroup_mma(ds_high, k_high, dq_token, is_async=True)
            dk_token = warpgroup_mma(b_dst_op, q_tile, b_dk, is_async=True)
            # dv's and dq's groups are done; dk's runs on under the hand-off
            b_dq, _, _, _, _ = warpgroup_mma_wait(1, deps=[dq_token, ds_low, ds_high, k_low,
                                                           k_high])
            mbarrier.arrive(ds_empty.index(buffer))
            _hand_dq_to_writer(dq_smem, dq_ready, dq_empty, buffer, i_half, i_step, b_dq)
            b_dv, b_dk, _, _ = warpgroup_mma_wait(0, deps=[dv_token, dk_token, do_tile, q_tile])
            mbarrier.arrive(qdo_empty.index(stage))  # q and do of this stage are no longer read
        else:
            dk_token = warpgroup_mma(b_dst_op, q_tile, b_dk, is_async=True)
            if FUSED_DQ:
                HALF_D: gl.constexpr = HEAD_D // 2
                DQ_LAYOUT: gl.constexpr = _wgmma_layout(HALF_D)
                mbarrier.wait(ds_ready.index(buffer), (i_step // 2) & 1)
                ds_low = ds_smem.index(2 * buffer).permute((1, 0))       # [ROWS, KEYS]
                ds_high = ds_smem.index(2 * buffer + 1).permute((1, 0))
                b_dq = gl.zeros([ROWS, HALF_D], gl.float32, DQ_LAYOUT)
                # the column half is a slice of constant offset, so each warpgroup has its branch
                if DQ_DIAG != 3:
                    if i_half == 0:
                        b_dq = _dq_half(ds_low, ds_high, k_smem, b_dq, 0)
                    else:
                        b_dq = _dq_half(ds_low, ds_high, k_smem, b_dq, HALF_D)
                mbarrier.arrive(ds_empty.index(buffer))
                if DQ_DIAG == 4:
                    # this buffer's reduce of two steps ago has read it: one reduce-add a step
                    tma.store_wait(1)
                    gl.thread_barrier()
                    dq_tile = dq_smem.index(2 * buffer + i_half)
                    dq_tile.reshape([ROWS, HALF_D]).store(b_dq)
                    fence_async_shared()
                    gl.thread_barrier()
                    _tma_reduce_add(dq_desc, [first_head + i_step // row_blocks,
                                              (first_row_block + i_step % row_blocks) * ROWS,
                                              i_half * HALF_D], dq_tile)
                else:
                    _hand_dq_to_writer(dq_smem, dq_ready, dq_empty, buffer, i_half, i_step, b_dq)
                b_dv, b_dk, _, _ = warpgroup_mma_wait(0, deps=[dv_token, dk_token, do_tile, q_tile])
                mbarrier.arrive(qdo_empty.index(stage))  # q and do of this stage are no longer read
            else:
                b_dv, b_dk, _, _ = warpgroup_mma_wait(0, deps=[dv_token, dk_token, do_tile, q_tile])
                mbarrier.arrive(qdo_empty.index(stage))  # q and do of this stage are no longer read

    if FUSED_DQ:
        if DQ_DIAG == 4:
            tma.store_wait(0)  # the last reduces have read their tiles
    o_n_out = first_key + i_half * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, ACC_LAYOUT))
    o_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_LAYOUT))
    o_dkv = o_n_out[:, None].to(gl.int64) * HEAD_D + o_d[None, :]
    m_n_out = (o_n_out < seq_kv)[:, None]
    gl.store(p_dk + o_dkv, (b_dk * scale).to(DTYPE), mask=m_n_out)
    gl.store(p_dv + o_dkv, b_dv.to(DTYPE), mask=m_n_out)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """TMA reduce-add of the shared tile ``src`` into ``tensor_desc``'s block at ``coord``
    (cp.reduce.async.bulk.tensor .add, one bulk group; ``tma.store_wait`` waits for it): the
    Gluon builder has the op, Triton 3.6's Hopper module does not name it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


@gluon.jit
def _hand_dq_to_writer(dq_smem, dq_ready, dq_empty, buffer, i_half, i_step, b_dq):
    """This warpgroup's dq tile of the step into dq_smem buffer ``buffer`` once the writer has
    added the tile it held two steps ago, then signalled to the writer."""
    mbarrier.wait(dq_empty.index(buffer), ((i_step // 2) + 1) & 1, pred=i_step >= 2)
    dq_smem.index(2 * buffer + i_half).store(b_dq)
    gl.thread_barrier()  # every thread's part is in before the warpgroup arrives
    mbarrier.arrive(dq_ready.index(buffer))


@gluon.jit
def _k_column_half(k_smem, i_block: gl.constexpr, i_half):
    """Columns i_half * D / 2 + [0, D / 2) of K block i_block ([KEYS, D / 2]): a [KEYS, 128]
    16-bit tile with a 128-byte swizzle lies in shared memory as two [KEYS, 64] tiles, one
    after the other (one TMA box each), so the half is an index, not a slice."""
    KEYS: gl.constexpr = k_smem.shape[3]
    HALF_D: gl.constexpr = k_smem.shape[4] // 2
    halves = k_smem._reinterpret(k_smem.dtype, [4, KEYS, HALF_D],
                                 gl.NVMMASharedLayout(swizzle_byte_width=128,
                                                      element_bitwidth=16, rank=2))
    return halves.index(2 * i_block + i_half)


@gluon.jit
def _dq_half(ds_low, ds_high, k_smem, b_zero, FIRST_COL: gl.constexpr):
    """ds[rows, 2 KEYS] k[2 KEYS, FIRST_COL + [0, D / 2)] from the two halves' ds ([ROWS, KEYS]
    views of ds^T) and K, both in shared memory."""
    KEYS: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    HALF_D: gl.constexpr = b_zero.shape[1]
    k_low = k_smem.index(0).reshape([KEYS, HEAD_D]).slice(FIRST_COL, HALF_D, dim=1)
    k_high = k_smem.index(1).reshape([KEYS, HEAD_D]).slice(FIRST_COL, HALF_D, dim=1)
    token = warpgroup_mma(ds_low, k_low, b_zero, use_acc=False, is_async=True)
    token = warpgroup_mma(ds_high, k_high, token, is_async=True)
    b_dq, _, _, _, _ = warpgroup_mma_wait(0, deps=[token, ds_low, ds_high, k_low, k_high])
    return b_dq


@gluon.jit
def _bwd_dq_writer(dq_smem, dq_ready, dq_empty, p_dq, seq_q, first_row_block, row_blocks,
                   n_steps):
    """WRITER_WARPS warps: for each step, the two warpgroups' dq halves ([ROWS, D / 2] fp32 in
    dq_smem buffer step % 2) added into the step's query rows of the fp32 (Sq, D) rows at p_dq
    (the group's first head; member after member) in [CHUNK, COLS] pieces, one 16-byte atomic
    a lane (more a lane would spill: the warps share the producer's 40 registers); then the
    buffer is released."""
    ROWS: gl.constexpr = dq_smem.shape[1]
    KEY_SPLIT: gl.constexpr = dq_ready.shape[0] == 3  # see _attention_bwd_dkdv_hopper
    if KEY_SPLIT:
        HEAD_D: gl.constexpr = dq_smem.shape[2]
    else:
        HEAD_D: gl.constexpr = 2 * dq_smem.shape[2]
    DQ_DIAG: gl.constexpr = dq_empty.shape[0] - 2
    WARPS: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = 8 * WARPS   # rows (a multiple of the swizzle's period), by COLS columns
    COLS: gl.constexpr = 16
    LAYOUT: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // COLS, COLS // 4], [WARPS, 1],
                                            [1, 0])
    for i_step in range(n_steps):
        buffer = i_step % 2
        mbarrier.wait(dq_ready.index(buffer), (i_step // 2) & 1)
        first_row = (first_row_block + i_step % row_blocks) * ROWS
        p_dq_rows = p_dq + ((i_step // row_blocks).to(gl.int64) * seq_q + first_row) * HEAD_D
        _write_dq_rows(dq_smem, buffer, p_dq_rows, first_row, seq_q, LAYOUT, CHUNK, COLS,
                       DQ_DIAG, KEY_SPLIT)
        mbarrier.arrive(dq_empty.index(buffer))


@gluon.jit
def _write_dq_rows(dq_smem, buffer, p_dq_rows, first_row, seq_q, LAYOUT: gl.constexpr,
                   CHUNK: gl.constexpr, COLS: gl.constexpr, DQ_DIAG: gl.constexpr,
                   KEY_SPLIT: gl.constexpr):
    """One step's two dq halves of dq_smem buffer ``buffer`` (KEY_SPLIT: the two warpgroups'
    partial sums over their own keys, summed here) added into its rows at p_dq_rows (rows
    from first_row; those at seq_q and past are left out) in [CHUNK, COLS] pieces, one
    16-byte atomic a lane."""
    ROWS: gl.constexpr = dq_smem.shape[1]
    HALF_D: gl.constexpr = dq_smem.shape[2]
    if KEY_SPLIT:
        HEAD_D: gl.constexpr = HALF_D
        N_HALVES: gl.constexpr = 1
    else:
        HEAD_D: gl.constexpr = 2 * HALF_D
        N_HALVES: gl.constexpr = 2
    o_chunk_m = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LAYOUT))
    o_chunk_d = gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    for i_half in gl.static_range(N_HALVES):
        half = dq_smem.index(2 * buffer + i_half)
        other = dq_smem.index(2 * buffer + 1)  # KEY_SPLIT: the other warpgroup's partial
        for i_chunk in gl.static_range(ROWS // CHUNK):
            rows = half.slice(i_chunk * CHUNK, CHUNK, dim=0)
            o_m = i_chunk * CHUNK + o_chunk_m
            m_m = (first_row + o_m < seq_q)[:, None]
            for i_cols in gl.static_range(HALF_D // COLS):
                if DQ_DIAG < 2:
                    b_dq = rows.slice(i_cols * COLS, COLS, dim=1).load(LAYOUT)
                    if KEY_SPLIT:
                        b_dq += other.slice(i_chunk * CHUNK, CHUNK, dim=0).slice(
                            i_cols * COLS, COLS, dim=1).load(LAYOUT)
                    o_d = i_half * HALF_D + i_cols * COLS + o_chunk_d
                    p_tile = p_dq_rows + (o_m[:, None] * HEAD_D + o_d[None, :])
                    if DQ_DIAG == 1:
                        gl.store(p_tile, b_dq, mask=m_m)
                    else:
                        gl.atomic_add(p_tile, b_dq, mask=m_m, sem="relaxed")


@gluon.jit
def _attention_bwd_dkdv_hopper(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dk_ptr,
                               dv_ptr, dq_ptr, dq_desc, seq_q, seq_kv, n_kv_heads, group_size, scale,
                               scale_log2, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                               FUSED_DQ: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
                               WRITER_WARPS: gl.constexpr, DQ_DIAG: gl.constexpr = 0):
    """Grid (B * Hkv * cdiv(Skv, 2 * KEYS),) in layout.head_and_block's order: one program
    per 2 * KEYS keys of one KV head (causal: the first key blocks are the heavy ones).
    q_desc / do_desc over (B, Hq, Sq, D) in (1, 1, ROWS, D) blocks, k_desc / v_desc over (B, Hkv, Skv, D) in
    (1, 1, KEYS, D) blocks; lse and delta (B, Hq, Sq) fp32, dk and dv (B, Hkv, Skv, D)
    contiguous. Rows and keys past the ends read as zeros and are masked. FUSED_DQ: dq_ptr is
    a zeroed fp32 (B, Hq, Sq, D) that receives sum_j ds_ij k_j (unscaled; see _bwd_consumer),
    else unused."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    DTYPE: gl.constexpr = q_desc.dtype
    KEY_SPLIT: gl.constexpr = FUSED_DQ and HEAD_D == 64
    i_bhkv, i_n = layout.head_and_block(gl.cdiv(seq_kv, 2 * KEYS), CAUSAL)
    i_b = i_bhkv // n_kv_heads
    i_hkv = i_bhkv % n_kv_heads
    first_key = i_n * 2 * KEYS
    if CAUSAL:  # query rows before the first key see none of the program's keys
        first_row_block = gl.minimum(first_key, seq_q) // ROWS
    else:
        first_row_block = first_key * 0
    row_blocks = gl.cdiv(seq_q, ROWS) - first_row_block

    q_smem = gl.allocate_shared_memory(DTYPE, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(DTYPE, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(DTYPE, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(DTYPE, [2] + v_desc.block_type.shape, v_desc.layout)
    # FUSED_DQ: ds^T of both warpgroups, two steps' worth ([buffer * 2 + half])
    ds_smem = gl.allocate_shared_memory(
        DTYPE, [4 if FUSED_DQ else 1, KEYS, ROWS],
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # FUSED_DQ: the warpgroups' dq halves for the writer, two steps' worth ([buffer * 2 + half])
    if DQ_DIAG == 4:
        dq_smem = gl.allocate_shared_memory(gl.float32, [4] + dq_desc.block_type.shape,
                                            dq_desc.layout)
    else:
        # KEY_SPLIT (dQ fused at D = 64, where half of a 64-wide K tile would start inside its
        # swizzle): each warpgroup's whole-width partial over its own keys, not a column half
        dq_smem = gl.allocate_shared_memory(
            gl.float32, [4 if FUSED_DQ else 1, ROWS if FUSED_DQ else 1,
                         HEAD_D if KEY_SPLIT else HEAD_D // 2],
            gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # KEY_SPLIT rides on dq_ready's length (a third, unused barrier), as DQ_DIAG on dq_empty's
    dq_ready = gl.allocate_shared_memory(gl.int64, [3 if KEY_SPLIT else 2, 1],
                                         mbarrier.MBarrierLayout())
    # DQ_DIAG rides on dq_empty's length (partitions receive constexprs as tensors)
    dq_empty = gl.allocate_shared_memory(gl.int64, [2 + DQ_DIAG, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for i_stage in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(i_stage), count=1)
        mbarrier.init(qdo_empty.index(i_stage), count=2)  # one arrival per consumer warpgroup
    for i_buffer in gl.static_range(2):
        mbarrier.init(ds_ready.index(i_buffer), count=2)
        mbarrier.init(ds_empty.index(i_buffer), count=2)
        mbarrier.init(dq_ready.index(i_buffer), count=2)  # both warpgroups' halves
        mbarrier.init(dq_empty.index(i_buffer), count=1)  # the writer

    group_rows = (i_b * n_kv_heads + i_hkv).to(gl.int64) * group_size * seq_q
    kv_rows = i_bhkv.to(gl.int64) * seq_kv
    consumer_args = (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, kv_ready, qdo_ready,
                     qdo_empty, ds_ready, ds_empty, dq_ready, dq_empty, lse_ptr + group_rows,
                     delta_ptr + group_rows, dk_ptr + kv_rows * HEAD_D,
                     dv_ptr + kv_rows * HEAD_D, dq_desc,
                     (i_b * n_kv_heads + i_hkv) * group_size, first_key, seq_q, seq_kv, group_size,
                     first_row_block, row_blocks, scale, scale_log2, CAUSAL, STAGES)
    low, high = gl.to_tensor(0), gl.to_tensor(1)  # which KEYS of the program's keys
    producer_args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                     qdo_ready, qdo_empty, i_b, i_hkv, first_key, group_size,
                     first_row_block, row_blocks, STAGES)
    if DQ_DIAG == 4:
        gl.warp_specialize([(_bwd_consumer, (low,) + consumer_args),
                            (_bwd_consumer, (high,) + consumer_args),
                            (_bwd_producer, producer_args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])
    elif FUSED_DQ:
        writer_args = (dq_smem, dq_ready, dq_empty, dq_ptr + group_rows * HEAD_D, seq_q,
                       first_row_block, row_blocks, group_size * row_blocks)
        gl.warp_specialize([(_bwd_consumer, (low,) + consumer_args),
                            (_bwd_consumer, (high,) + consumer_args),
                            (_bwd_producer, producer_args), (_bwd_dq_writer, writer_args)],
                           [4, 1, WRITER_WARPS], [CONSUMER_REGS, PRODUCER_REGS, WRITER_REGS])
    else:
        gl.warp_specialize([(_bwd_consumer, (low,) + consumer_args),
                            (_bwd_consumer, (high,) + consumer_args),
                            (_bwd_producer, producer_args)], [4, 1],
                           [CONSUMER_REGS, PRODUCER_REGS])


# The forward's launch kept past Triton's and recorded for call plans (runtime.KeptKernel, its
# tensor descriptors replayed as tensor maps on the call's tensors), so that a repeated SDPA
# call under enable() replays without Python (GEMSLIB_KEEP_FORWARD_LAUNCH=0: Triton's launch)
KEEP_FORWARD_LAUNCH = os.environ.get("GEMSLIB_KEEP_FORWARD_LAUNCH", "1") != "0"
_FORWARD = runtime.KeptKernel(_attention_fwd_hopper)


@functools.cache  # building them is host time that every forward call would pay again
def shared_layouts(dtype: torch.dtype, head_dim: int = HEAD_DIM):
    """NVMMA shared layouts of the forward's q and K/V blocks for ``dtype`` and ``head_dim``."""
    element = _GL_DTYPES[dtype]
    keys = FORWARD_TILES[head_dim][0]
    return (gl.NVMMASharedLayout.get_default_for([1, 1, ROWS, head_dim], element),
            gl.NVMMASharedLayout.get_default_for([1, 1, keys, head_dim], element))


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             head_dims: tuple[int, ...] = (HEAD_DIM,)) -> bool:
    """Whether ``forward`` takes these (validated, non-empty) inputs: CUDA sm_90, fp16/bf16,
    D = Dv = 128 (or one of ``head_dims``), bases and strides TMA can address (16-byte
    aligned, unit last stride)."""
    if not q.is_cuda or q.dtype not in _GL_DTYPES or torch.cuda.get_device_capability(q.device) \
            != (9, 0) or q.shape[-1] not in head_dims or v.shape[-1] != q.shape[-1]:
        return False
    return all(layout.tma_addressable(t) for t in (q, k, v))


# The forward at head dims 64 and 256 too (the same kernel: its tiles take D and the keys a
# block from the descriptors, FORWARD_TILES). Each opt-in (GEMSLIB_GLUON_FORWARD_D64=1,
# GEMSLIB_GLUON_FORWARD_D256=1) until timed against the Triton kernel those head dims run by
# default (see docs/notes/attention.md)
FORWARD_HEAD_DIMS = tuple(sorted(
    {HEAD_DIM} | {dim for dim in (64, 256)
                  if os.environ.get(f"GEMSLIB_GLUON_FORWARD_D{dim}") == "1"}))


def eligible_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``forward`` takes these inputs: ``eligible`` at FORWARD_HEAD_DIMS."""
    return eligible(q, k, v, FORWARD_HEAD_DIMS)


# The dK/dV kernel at head dim 64 too (its dQ then the Triton kernel's: the fused dQ splits D
# between the warpgroups, and a 32-column half of a 64-wide K tile starts inside its swizzle).
# Opt-in (GEMSLIB_GLUON_BACKWARD_D64=1): by default D64 stays on the Triton kernels, the path
# the shipped configs are tuned for (see docs/notes/attention.md)
BACKWARD_HEAD_DIMS = (64, HEAD_DIM) if os.environ.get("GEMSLIB_GLUON_BACKWARD_D64") == "1" \
    else (HEAD_DIM,)


# dQ fused at head dim 64 too (KEY_SPLIT: each warpgroup's partial over its own keys, summed
# by the writer); with BACKWARD_HEAD_DIMS's 64. Opt-in, as that one: GEMSLIB_FUSED_DQ_D64=1
FUSED_DQ_HEAD_DIMS = (64, HEAD_DIM) if os.environ.get("GEMSLIB_FUSED_DQ_D64") == "1" \
    else (HEAD_DIM,)


def eligible_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``backward_dkdv`` takes these inputs: ``eligible`` at BACKWARD_HEAD_DIMS."""
    return eligible(q, k, v, BACKWARD_HEAD_DIMS)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            out: torch.Tensor) -> torch.Tensor:
    """lse (B, Hq, Sq) fp32 for ``eligible_forward`` q (B, Hq, Sq, D), k and v (B, Hkv, Skv,
    D), D one of FORWARD_TILES' head dims, with Sq, Skv >= 1 and scale >= 0; o written into
    ``out`` (B, Hq, Sq, D) of q's dtype, any strides with a unit last one."""
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv = k.shape[1], k.shape[2]
    keys, stages = FORWARD_TILES[head_dim]
    lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    q_layout, kv_layout = shared_layouts(q.dtype, head_dim)
    q_desc = TensorDescriptor.from_tensor(q, [1, 1, ROWS, head_dim], q_layout)
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [1, 1, keys, head_dim], kv_layout)
                      for t in (k, v))
    grid = (batch * n_q_heads * runtime.cdiv(seq_q, 2 * ROWS),)
    constexprs = dict(CAUSAL=causal, STAGES=stages,
                      CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    with torch.cuda.device(q.device):
        if KEEP_FORWARD_LAUNCH:
            _FORWARD.launch(grid, (q_desc, k_desc, v_desc, out, lse, seq_q, seq_kv, n_q_heads,
                                   n_q_heads // n_kv_heads, scale * LOG2E.value,
                                   *out.stride()[:3]),
                            constexprs, num_warps=4)
        else:
            _attention_fwd_hopper[grid](
                q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, out_ptr=out, lse_ptr=lse,
                seq_q=seq_q, seq_kv=seq_kv, n_q_heads=n_q_heads,
                group_size=n_q_heads // n_kv_heads, scale_log2=scale * LOG2E.value,
                stride_o_b=out.stride(0), stride_o_h=out.stride(1), stride_o_s=out.stride(2),
                **constexprs, num_warps=4)
    return lse


def backward_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) for ``eligible_backward`` q, k, v (head dim D) with a TMA-addressable
    grad_out (B, Hq, Sq, D), the forward's lse and delta = rowsum(o * do) - grad_lse, both
    (B, Hq, Sq) fp32 contiguous: dk, dv (B, Hkv, Skv, D) contiguous in k's dtype."""
    return _launch_backward(q, k, v, grad_out, lse, delta, causal, scale, None)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as ``backward_dkdv`` takes them, at a head dim of FUSED_DQ_HEAD_DIMS, dq
    from the same kernel (FUSED_DQ: no second pass over s and dp): accumulated in fp32, then
    scaled and rounded to q's dtype."""
    dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk, dv = _launch_backward(q, k, v, grad_out, lse, delta, causal, scale, dq_sum,
                              4 if DQ_BY_TMA and q.shape[-1] == HEAD_DIM else 0)
    return dq_sum.mul_(scale).to(q.dtype), dk, dv


def _launch_backward(q, k, v, grad_out, lse, delta, causal: bool, scale: float,
                     dq_sum: torch.Tensor | None,
                     dq_diag: int = 0,
                     writer_warps: int = WRITER_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """dq_diag (benchmark/experiments/attention_backward_parts.py only; wrong dq): 1 the writer
    stores instead of adding, 2 the writer only meets the consumers, 3 also no dq matmul; 4 no
    writer, the consumers add their dq halves by TMA reduce-add."""
    batch, n_q_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_kv = k.shape[1], k.shape[2]
    dk = torch.empty((batch, n_kv_heads, seq_kv, head_dim), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    block_layout = gl.NVMMASharedLayout.get_default_for([1, 1, KEYS, head_dim],
                                                        _GL_DTYPES[q.dtype])
    q_desc, do_desc = (TensorDescriptor.from_tensor(t, [1, 1, BWD_ROWS, head_dim], block_layout)
                       for t in (q, grad_out))
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [1, 1, KEYS, head_dim], block_layout)
                      for t in (k, v))
    dq_flat = (dk.view(torch.float32) if dq_sum is None else dq_sum).flatten(0, 1)
    dq_desc = TensorDescriptor.from_tensor(dq_flat, [1, BWD_ROWS, head_dim // 2], _DQ_LAYOUT)
    with torch.cuda.device(q.device):
        _attention_bwd_dkdv_hopper[(batch * n_kv_heads * runtime.cdiv(seq_kv, 2 * KEYS),)](
            q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, do_desc=do_desc, lse_ptr=lse,
            delta_ptr=delta, dk_ptr=dk, dv_ptr=dv, dq_ptr=dk if dq_sum is None else dq_sum, dq_desc=dq_desc,
            seq_q=seq_q, seq_kv=seq_kv, n_kv_heads=n_kv_heads,
            group_size=n_q_heads // n_kv_heads, scale=scale, scale_log2=scale * LOG2E.value,
            CAUSAL=causal, STAGES=BWD_STAGES, FUSED_DQ=dq_sum is not None,
            CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, WRITER_REGS=WRITER_REGS,
            WRITER_WARPS=writer_warps, DQ_DIAG=dq_diag, num_warps=4)
    return dk, dv
