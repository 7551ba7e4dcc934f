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
Measured in benchmark/NOTES.md (the session of 2026-11-30 05:14).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gemslib import layout, runtime

ROWS = 64          # query rows per consumer warpgroup (the wgmma M); a program has two
HEAD_DIM = 128     # the head dim (of q, k and v) this kernel is built and tuned for
BLOCK_N = 128      # keys per block
STAGES = 3         # K/V ring depth: 32 KB of q + 3 x 64 KB of K/V fit the 227 KB of an SM
CONSUMER_REGS = 232
PRODUCER_REGS = 40
LOG2E = 1.4426950408889634

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


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
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
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
    """Grid (cdiv(Sq, 2 * ROWS), B * Hq). q_desc over (B, Hq, Sq, D) in (1, 1, ROWS, D) blocks,
    k_desc / v_desc over (B, Hkv, Skv, D) in (1, 1, BLOCK_N, D) blocks; out (B, Hq, Sq, D) and
    lse (B, Hq, Sq) contiguous. scale_log2 = scale * log2(e) >= 0."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    dtype: gl.constexpr = q_desc.dtype
    batch_head = gl.program_id(1)
    batch = batch_head // n_q_heads
    head = batch_head % n_q_heads
    first_query = gl.program_id(0) * 2 * ROWS
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
        _attention_fwd_hopper[(runtime.cdiv(seq_q, 2 * ROWS), batch * n_q_heads)](
            q_desc, k_desc, v_desc, out, lse, seq_q, seq_kv, n_q_heads, n_q_heads // n_kv_heads,
            scale * LOG2E, CAUSAL=causal, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
            PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    return out, lse


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, causal: bool = False):
    """Compile the kernel for sm_90 without a GPU (tests): returns triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    q_layout, kv_layout = shared_layouts(dtype)
    signature = {"q_desc": f"tensordesc<{name}[1, 1, {ROWS}, {HEAD_DIM}],{q_layout!r}>",
                 "k_desc": f"tensordesc<{name}[1, 1, {BLOCK_N}, {HEAD_DIM}],{kv_layout!r}>",
                 "v_desc": f"tensordesc<{name}[1, 1, {BLOCK_N}, {HEAD_DIM}],{kv_layout!r}>",
                 "out_ptr": f"*{name}", "lse_ptr": "*fp32", "seq_q": "i32", "seq_kv": "i32",
                 "n_q_heads": "i32", "group_size": "i32", "scale_log2": "fp32",
                 "CAUSAL": "constexpr", "STAGES": "constexpr", "CONSUMER_REGS": "constexpr",
                 "PRODUCER_REGS": "constexpr"}
    constexprs = {"CAUSAL": causal, "STAGES": STAGES, "CONSUMER_REGS": CONSUMER_REGS,
                  "PRODUCER_REGS": PRODUCER_REGS}
    source = GluonASTSource(_attention_fwd_hopper, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
