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
Measured in benchmark/NOTES.md (issue 4's H200 runs).

The backward's dK/dV (``backward_dkdv``) follows the same plan with the roles of queries and
keys swapped: a program holds 128 keys of one KV head (64 per consumer warpgroup) in shared
memory for its whole life, the producer streams q and do tiles of 64 rows for every query head
of the group, and each consumer computes s^T = k q^T, dp^T = v do^T, then dv += p^T do and
dk += ds^T q with p^T and ds^T as register operands. Used while ``attention.HOPPER_BACKWARD``
is on (the default; measured in benchmark/NOTES.md, issue 6's H200 runs).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemslib import layout, runtime
from gemslib.layout import LOG2E

ROWS = 64          # query rows per consumer warpgroup (the wgmma M); a program has two
HEAD_DIM = 128     # the head dim (of q, k and v) this kernel is built and tuned for
BLOCK_N = 128      # keys per block
STAGES = 3         # K/V ring depth: 32 KB of q + 3 x 64 KB of K/V fit the 227 KB of an SM
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# the backward's dK/dV kernel: KEYS keys per consumer warpgroup (two per program), query rows
# BWD_ROWS at a time through a ring of BWD_STAGES q / do tiles; K and V stay in shared memory
KEYS = 64
BWD_ROWS = 64
BWD_STAGES = 2

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
def _softmax_block(s, row_max, scale_log2):
    """p = 2^(s * scale_log2 - new_max) for one block of scores (scale_log2 >= 0); returns
    (p, new_max, alpha), alpha = 2^(old_max - new_max) rescales what was accumulated."""
    new_max = gl.maximum(row_max, gl.max(s, axis=1) * scale_log2)
    p = gl.exp2(s * scale_log2 - new_max[:, None])
    alpha = gl.exp2(row_max - new_max)
    return p, new_max, alpha


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
              batch, head, kv_head, first_query, n_blocks, STAGES: gl.constexpr):
    """One warp: both consumers' q tiles, then K_j and V_j into stage j % STAGES, each stage
    refilled once both consumers released it."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    for half in gl.static_range(2):
        mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, head, first_query + half * ROWS, 0],
                                        q_ready.index(half), q_smem.index(half))
    for block in range(n_blocks):
        stage = block % STAGES
        # the previous round of this stage must be released (the first round is free)
        mbarrier.wait(kv_empty.index(stage), ((block // STAGES) + 1) & 1, pred=block >= STAGES)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [batch, kv_head, block * BLOCK_N, 0],
                                        k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [batch, kv_head, block * BLOCK_N, 0],
                                        v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _mask(s, block, rows, cols, seq_kv, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    keys = block * BLOCK_N + cols[None, :]
    keep = (keys < seq_kv) & (rows[:, None] >= 0)  # the full (rows, keys) shape
    if CAUSAL:
        keep = keep & (keys <= rows[:, None])
    return gl.where(keep, s, -float("inf"))


@gluon.jit
def _consumer(half, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, out_ptr, lse_ptr,
              first_query, seq_q, seq_kv, n_blocks, full_blocks, scale_log2,
              CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: query rows first_query + half * ROWS + [0, ROWS) of one head against key
    blocks [0, n_blocks); blocks from full_blocks on are masked. Writes o rows and their lse
    (out_ptr / lse_ptr point at the head's (Sq, D) / (Sq,) slices)."""
    ROWS: gl.constexpr = q_smem.shape[3]
    HEAD_D: gl.constexpr = q_smem.shape[4]
    BLOCK_N: gl.constexpr = k_smem.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    p_layout: gl.constexpr = _register_operand_layout(HEAD_D)
    q_tile = q_smem.index(half).reshape([ROWS, HEAD_D])
    rows = first_query + half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    row_max = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    row_sum = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # block 0: scores and softmax before the loop
    mbarrier.wait(q_ready.index(half), 0)
    mbarrier.wait(k_ready.index(0), 0)
    k_tile = k_smem.index(0).reshape([BLOCK_N, HEAD_D])
    s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=[s_token, q_tile, k_tile])
    if full_blocks == 0:
        s = _mask(s, 0, rows, cols, seq_kv, CAUSAL, BLOCK_N)
    p, row_max, alpha = _softmax_block(s, row_max, scale_log2)
    row_sum = row_sum * alpha + gl.sum(p, axis=1)

    for block in range(n_blocks - 1):
        stage = block % STAGES
        next_stage = (block + 1) % STAGES
        # tensor cores: q @ K_{j+1}, then p_j @ V_j, both in flight
        mbarrier.wait(k_ready.index(next_stage), ((block + 1) // STAGES) & 1)
        k_tile = k_smem.index(next_stage).reshape([BLOCK_N, HEAD_D])
        s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)
        p_operand = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(stage), (block // STAGES) & 1)
        v_tile = v_smem.index(stage).reshape([BLOCK_N, HEAD_D])
        o_token = warpgroup_mma(p_operand, v_tile, acc, is_async=True)
        s, _ = warpgroup_mma_wait(1, deps=[s_token, k_tile])
        # CUDA cores: the softmax of block j+1 under p_j @ V_j. The branch (always taken) keeps
        # it in a basic block of its own: ptxas would otherwise hoist the wait for p_j @ V_j
        # into its first latency bubble and serialise the two (seen in the SASS)
        if seq_q > 0:
            if block + 1 >= full_blocks:
                s = _mask(s, block + 1, rows, cols, seq_kv, CAUSAL, BLOCK_N)
            p, row_max, alpha = _softmax_block(s, row_max, scale_log2)
            row_sum = row_sum * alpha + gl.sum(p, axis=1)
        else:
            p = s
            alpha = gl.full([ROWS], 1.0, gl.float32, gl.SliceLayout(1, s_layout))
        acc, _ = warpgroup_mma_wait(0, deps=[o_token, v_tile])
        mbarrier.arrive(kv_empty.index(stage))  # K_j and V_j are no longer read
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]

    last = (n_blocks - 1) % STAGES
    p_operand = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    v_tile = v_smem.index(last).reshape([BLOCK_N, HEAD_D])
    o_token = warpgroup_mma(p_operand, v_tile, acc, is_async=True)
    acc, _ = warpgroup_mma_wait(0, deps=[o_token, v_tile])

    in_range = rows < seq_q
    gl.store(lse_ptr + rows, (row_max + gl.log2(row_sum)) * 0.6931471805599453, mask=in_range)
    out = (acc / gl.convert_layout(row_sum, gl.SliceLayout(1, o_layout))[:, None]).to(dtype)
    out_rows = first_query + half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + out_rows[:, None].to(gl.int64) * HEAD_D + dims[None, :], out,
             mask=(out_rows < seq_q)[:, None])


@gluon.jit
def _attention_fwd_hopper(q_desc, k_desc, v_desc, out_ptr, lse_ptr, seq_q, seq_kv, n_q_heads,
                          group_size, scale_log2, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (B * Hq * cdiv(Sq, 2 * ROWS),) in layout.head_and_block's order, the query blocks
    from the last (the heaviest) to the first when causal. q_desc over (B, Hq, Sq, D) in
    (1, 1, ROWS, D) blocks, k_desc / v_desc over (B, Hkv, Skv, D) in (1, 1, BLOCK_N, D) blocks; out (B, Hq, Sq, D) and
    lse (B, Hq, Sq) contiguous. scale_log2 = scale * log2(e) >= 0."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    n_query_blocks = gl.cdiv(seq_q, 2 * ROWS)
    batch_head, query_block = layout.head_and_block(n_query_blocks, CAUSAL)
    batch = batch_head // n_q_heads
    head = batch_head % n_q_heads
    if CAUSAL:  # the last query blocks see the most keys
        query_block = n_query_blocks - 1 - query_block
    first_query = query_block * 2 * ROWS
    if CAUSAL:  # top-left aligned: row i sees keys j <= i
        n_blocks = gl.cdiv(gl.minimum(seq_kv, first_query + 2 * ROWS), BLOCK_N)
        full_blocks = gl.minimum(seq_kv, first_query) // BLOCK_N
    else:
        n_blocks = gl.cdiv(seq_kv, BLOCK_N)
        full_blocks = seq_kv // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup

    head_rows = batch_head.to(gl.int64) * seq_q
    consumer_args = (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty,
                     out_ptr + head_rows * HEAD_D, lse_ptr + head_rows, first_query, seq_q,
                     seq_kv, n_blocks, full_blocks, scale_log2, CAUSAL, STAGES)
    low, high = gl.to_tensor(0), gl.to_tensor(1)  # which 64 of the 128 rows
    producer_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
                     kv_empty, batch, head, head // group_size, first_query, n_blocks, STAGES)
    gl.warp_specialize([(_consumer, (low,) + consumer_args), (_consumer, (high,) + consumer_args),
                        (_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Backward: dK and dV (dQ and delta come from the Triton kernels in attention.py)
# --------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                  qdo_ready, qdo_empty, batch, kv_head, first_key, group_size, first_row_block,
                  row_blocks, STAGES: gl.constexpr):
    """One warp: both consumers' K and V blocks once, then for each (group member, query block)
    the q and do tiles into stage step % STAGES, refilled once both consumers released it."""
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(kv_ready.index(0), 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [batch, kv_head, first_key + half * KEYS, 0],
                                        kv_ready.index(0), k_smem.index(half))
        tma.async_copy_global_to_shared(v_desc, [batch, kv_head, first_key + half * KEYS, 0],
                                        kv_ready.index(0), v_smem.index(half))
    for step in range(group_size * row_blocks):
        stage = step % STAGES
        head = kv_head * group_size + step // row_blocks
        row = (first_row_block + step % row_blocks) * ROWS
        mbarrier.wait(qdo_empty.index(stage), ((step // STAGES) + 1) & 1, pred=step >= STAGES)
        mbarrier.expect(qdo_ready.index(stage),
                        q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, head, row, 0], qdo_ready.index(stage),
                                        q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [batch, head, row, 0], qdo_ready.index(stage),
                                        do_smem.index(stage))


@gluon.jit
def _bwd_consumer(half, q_smem, do_smem, k_smem, v_smem, kv_ready, qdo_ready, qdo_empty, lse_ptr,
                  delta_ptr, dk_ptr, dv_ptr, first_key, seq_q, seq_kv, group_size,
                  first_row_block, row_blocks, scale, scale_log2,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: keys first_key + half * KEYS + [0, KEYS) of one KV head, keys-major like
    the Triton kernel: s^T = k q^T and dp^T = v do^T (K and V straight from shared memory),
    p^T = 2^(s^T scale_log2 - lse log2 e), ds^T = p^T (dp^T - delta), then dv += p^T do and
    dk += ds^T q with p^T and ds^T as register operands. lse_ptr / delta_ptr point at the
    group's first query head ((Sq,) per member, consecutive); dk_ptr / dv_ptr at the KV head's
    (Skv, D) slices."""
    KEYS: gl.constexpr = k_smem.shape[3]
    HEAD_D: gl.constexpr = k_smem.shape[4]
    ROWS: gl.constexpr = q_smem.shape[3]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(ROWS)
    acc_layout: gl.constexpr = _wgmma_layout(HEAD_D)
    operand_layout: gl.constexpr = _register_operand_layout(HEAD_D)
    k_tile = k_smem.index(half).reshape([KEYS, HEAD_D])
    v_tile = v_smem.index(half).reshape([KEYS, HEAD_D])
    keys = first_key + half * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, HEAD_D], gl.float32, acc_layout)
    zero_s = gl.zeros([KEYS, ROWS], gl.float32, s_layout)
    mbarrier.wait(kv_ready.index(0), 0)
    for step in range(group_size * row_blocks):
        stage = step % STAGES
        rows = (first_row_block + step % row_blocks) * ROWS + cols
        mbarrier.wait(qdo_ready.index(stage), (step // STAGES) & 1)
        q_tile = q_smem.index(stage).reshape([ROWS, HEAD_D])
        do_tile = do_smem.index(stage).reshape([ROWS, HEAD_D])
        s_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)
        dp_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), zero_s, use_acc=False,
                                 is_async=True)
        # the rows' lse and delta load under the two matmuls
        row_offsets = (step // row_blocks).to(gl.int64) * seq_q + rows
        in_rows = rows < seq_q
        lse_log2 = gl.load(lse_ptr + row_offsets, mask=in_rows, other=0.0) * LOG2E
        delta = gl.load(delta_ptr + row_offsets, mask=in_rows, other=0.0)
        s_t, dp_t, _, _, _, _ = warpgroup_mma_wait(
            0, deps=[s_token, dp_token, k_tile, v_tile, q_tile, do_tile])
        keep = (keys[:, None] < seq_kv) & in_rows[None, :]
        if CAUSAL:  # top-left aligned: row i sees keys j <= i
            keep = keep & (keys[:, None] <= rows[None, :])
        p_t = gl.where(keep, gl.exp2(s_t * scale_log2 - lse_log2[None, :]), 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        p_operand = gl.convert_layout(p_t.to(dtype), operand_layout)
        ds_operand = gl.convert_layout(ds_t.to(dtype), operand_layout)
        dv_token = warpgroup_mma(p_operand, do_tile, dv, is_async=True)
        dk_token = warpgroup_mma(ds_operand, q_tile, dk, is_async=True)
        dv, dk, _, _ = warpgroup_mma_wait(0, deps=[dv_token, dk_token, do_tile, q_tile])
        mbarrier.arrive(qdo_empty.index(stage))  # q and do of this stage are no longer read

    out_keys = first_key + half * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    dims = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    offsets = out_keys[:, None].to(gl.int64) * HEAD_D + dims[None, :]
    in_keys = (out_keys < seq_kv)[:, None]
    gl.store(dk_ptr + offsets, (dk * scale).to(dtype), mask=in_keys)
    gl.store(dv_ptr + offsets, dv.to(dtype), mask=in_keys)


@gluon.jit
def _attention_bwd_dkdv_hopper(q_desc, k_desc, v_desc, do_desc, lse_ptr, delta_ptr, dk_ptr,
                               dv_ptr, seq_q, seq_kv, n_kv_heads, group_size, scale, scale_log2,
                               CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (B * Hkv * cdiv(Skv, 2 * KEYS),) in layout.head_and_block's order: one program
    per 2 * KEYS keys of one KV head (causal: the first key blocks are the heavy ones).
    q_desc / do_desc over (B, Hq, Sq, D) in (1, 1, ROWS, D) blocks, k_desc / v_desc over (B, Hkv, Skv, D) in
    (1, 1, KEYS, D) blocks; lse and delta (B, Hq, Sq) fp32, dk and dv (B, Hkv, Skv, D)
    contiguous. Rows and keys past the ends read as zeros and are masked."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    KEYS: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    batch_kv_head, key_block = layout.head_and_block(gl.cdiv(seq_kv, 2 * KEYS), CAUSAL)
    batch = batch_kv_head // n_kv_heads
    kv_head = batch_kv_head % n_kv_heads
    first_key = key_block * 2 * KEYS
    if CAUSAL:  # query rows before the first key see none of the program's keys
        first_row_block = gl.minimum(first_key, seq_q) // ROWS
    else:
        first_row_block = first_key * 0
    row_blocks = gl.cdiv(seq_q, ROWS) - first_row_block

    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(i), count=1)
        mbarrier.init(qdo_empty.index(i), count=2)  # one arrival per consumer warpgroup

    group_rows = (batch * n_kv_heads + kv_head).to(gl.int64) * group_size * seq_q
    kv_rows = batch_kv_head.to(gl.int64) * seq_kv
    consumer_args = (q_smem, do_smem, k_smem, v_smem, kv_ready, qdo_ready, qdo_empty,
                     lse_ptr + group_rows, delta_ptr + group_rows, dk_ptr + kv_rows * HEAD_D,
                     dv_ptr + kv_rows * HEAD_D, first_key, seq_q, seq_kv, group_size,
                     first_row_block, row_blocks, scale, scale_log2, CAUSAL, STAGES)
    low, high = gl.to_tensor(0), gl.to_tensor(1)  # which KEYS of the program's keys
    producer_args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
                     qdo_ready, qdo_empty, batch, kv_head, first_key, group_size,
                     first_row_block, row_blocks, STAGES)
    gl.warp_specialize([(_bwd_consumer, (low,) + consumer_args),
                        (_bwd_consumer, (high,) + consumer_args),
                        (_bwd_producer, producer_args)], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def shared_layouts(dtype: torch.dtype):
    """NVMMA shared layouts of the q and the K/V blocks for ``dtype``."""
    element = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([1, 1, ROWS, HEAD_DIM], element),
            gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, HEAD_DIM], element))


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``forward`` takes these (validated, non-empty) inputs: CUDA sm_90, fp16/bf16,
    D = Dv = 128, bases and strides TMA can address (16-byte aligned, unit last stride)."""
    if not q.is_cuda or q.dtype not in _GL_DTYPES or torch.cuda.get_device_capability(q.device) \
            != (9, 0) or q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return False
    return all(layout.tma_addressable(t) for t in (q, k, v))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) for ``eligible`` q (B, Hq, Sq, 128), k and v (B, Hkv, Skv, 128) with Sq, Skv
    >= 1 and scale >= 0: o (B, Hq, Sq, 128) contiguous in q's dtype, lse (B, Hq, Sq) fp32."""
    batch, n_q_heads, seq_q, _ = q.shape
    n_kv_heads, seq_kv = k.shape[1], k.shape[2]
    out = torch.empty((batch, n_q_heads, seq_q, HEAD_DIM), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_q_heads, seq_q), dtype=torch.float32, device=q.device)
    q_layout, kv_layout = shared_layouts(q.dtype)
    q_desc = TensorDescriptor.from_tensor(q, [1, 1, ROWS, HEAD_DIM], q_layout)
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [1, 1, BLOCK_N, HEAD_DIM], kv_layout)
                      for t in (k, v))
    with torch.cuda.device(q.device):
        _attention_fwd_hopper[(batch * n_q_heads * runtime.cdiv(seq_q, 2 * ROWS),)](
            q_desc, k_desc, v_desc, out, lse, seq_q, seq_kv, n_q_heads, n_q_heads // n_kv_heads,
            scale * LOG2E.value, CAUSAL=causal, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out, lse


def backward_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                  lse: torch.Tensor, delta: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) for ``eligible`` q, k, v with a TMA-addressable grad_out (B, Hq, Sq, 128), the
    forward's lse and delta = rowsum(o * do) - grad_lse, both (B, Hq, Sq) fp32 contiguous:
    dk, dv (B, Hkv, Skv, 128) contiguous in k's dtype."""
    batch, n_q_heads, seq_q, _ = q.shape
    n_kv_heads, seq_kv = k.shape[1], k.shape[2]
    dk = torch.empty((batch, n_kv_heads, seq_kv, HEAD_DIM), dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    block_layout = gl.NVMMASharedLayout.get_default_for([1, 1, KEYS, HEAD_DIM],
                                                        _GL_DTYPES[q.dtype])
    q_desc, do_desc = (TensorDescriptor.from_tensor(t, [1, 1, BWD_ROWS, HEAD_DIM], block_layout)
                       for t in (q, grad_out))
    k_desc, v_desc = (TensorDescriptor.from_tensor(t, [1, 1, KEYS, HEAD_DIM], block_layout)
                      for t in (k, v))
    with torch.cuda.device(q.device):
        _attention_bwd_dkdv_hopper[(batch * n_kv_heads * runtime.cdiv(seq_kv, 2 * KEYS),)](
            q_desc, k_desc, v_desc, do_desc, lse, delta, dk, dv, seq_q, seq_kv, n_kv_heads,
            n_q_heads // n_kv_heads, scale, scale * LOG2E.value, CAUSAL=causal,
            STAGES=BWD_STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
            num_warps=4)
    return dk, dv
