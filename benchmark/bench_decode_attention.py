"""decode_attention (bf16) against SDPA with one query row per sequence and FlashInfer's batch
decode as an engine runs it (its own paged copy of the same K/V, pages of 16 positions, HND;
tensor cores where 4 or more query heads share a KV head, as FlashInfer advises).

    python -m benchmark --ops decode_attention

Reports the bandwidth of reading the K/V caches (2 * B * Hkv * L * D elements). The static
cache's form is a case of its own: a boolean mask of the visible prefix of a longer cache
(transformers' static cache), which the graph pass hands to decode_attention with each
sequence's extent as its lengths; its bandwidth counts the visible positions' K/V only, and
SDPA attends over the whole cache under the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemslib
from benchmark.harness import Case, optional_peer, outputs_close
from gemslib.fused import decode_attention as decode_ops

# the Case names cases() yields (python -m benchmark --ops selects among them)
OPS = ("decode_attention",)
DTYPE = torch.bfloat16
# (batch, cache length)
QUICK_DECODE = [(1, 8192), (16, 32768)]
EXTRA_DECODE = [(1, 32768), (1, 131072), (16, 8192)]
# (batch, cache length, visible prefix)
STATIC_CACHE_DECODE = [(16, 4096, 2048)]
DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM = 32, 8, 128
# the other families' heads (batch, cache length, q heads, kv heads, head dim): Llama-3.2-1B's
# 64, Phi-3's 96 (no grouping), Gemma-7B's 256 (no grouping)
FAMILY_DECODE = [(16, 8192, 32, 8, 64), (16, 8192, 32, 32, 96), (16, 8192, 16, 16, 256)]


FLASHINFER_PAGE = 16


def _flashinfer_decode(flashinfer, q, k_cache, v_cache, visible: int | None = None):
    """FlashInfer's batch decode over a paged copy of ``k_cache`` and ``v_cache`` (the same
    values, ``visible`` positions a sequence, all by default), planned once here as an engine
    plans once per step. A cache of one page a sequence (gemslib's own tensors as they are)
    would leave it one program per KV head: its splits are whole pages."""
    try:
        return _planned_flashinfer_decode(flashinfer, q, k_cache, v_cache, visible)
    except Exception as err:  # a shape it does not build for: reported as the peer's failure
        def failed(err=err):
            raise err
        return failed


def paged_kv(cache: torch.Tensor, visible: int, page: int):
    """(pages, indptr, indices, last_page_len): the first ``visible`` positions of each
    sequence of ``cache`` (B, Hkv, L, D) as FlashInfer's HND paged layout, pages (P, Hkv, page,
    D) with sequence b's ``ceil(visible / page)`` pages at indices[indptr[b]:indptr[b + 1]]
    in order, the last one holding ``last_page_len[b]`` positions (the rest zeros)."""
    batch, kv_heads, _, dim = cache.shape
    per_seq = -(-visible // page)
    padded = cache.new_zeros(batch, kv_heads, per_seq * page, dim)
    padded[:, :, :visible] = cache[:, :, :visible]
    pages = (padded.view(batch, kv_heads, per_seq, page, dim).transpose(1, 2)
             .reshape(batch * per_seq, kv_heads, page, dim))
    int32 = dict(dtype=torch.int32, device=cache.device)
    indptr = torch.arange(batch + 1, **int32) * per_seq
    indices = torch.arange(batch * per_seq, **int32)
    last_page_len = torch.full((batch,), visible - (per_seq - 1) * page, **int32)
    return pages, indptr, indices, last_page_len


def _planned_flashinfer_decode(flashinfer, q, k_cache, v_cache, visible):
    batch, kv_heads, cache_len, dim = k_cache.shape
    visible = visible or cache_len
    k_pages, indptr, indices, last_page_len = paged_kv(k_cache, visible, FLASHINFER_PAGE)
    v_pages = paged_kv(v_cache, visible, FLASHINFER_PAGE)[0]
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "HND", use_tensor_cores=q.shape[1] // kv_heads >= 4)
    wrapper.plan(indptr, indices, last_page_len, q.shape[1], kv_heads, dim, FLASHINFER_PAGE,
                 pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype)
    return lambda: wrapper.run(q, (k_pages, v_pages))


def cases(quick: bool = False, backward: bool = False):
    flashinfer = optional_peer("flashinfer")
    shapes = [(batch, cache_len, DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM)
              for batch, cache_len in QUICK_DECODE + ([] if quick else EXTRA_DECODE)]
    for batch, cache_len, heads, kv_heads, dim in shapes + ([] if quick else FAMILY_DECODE):
        q = torch.randn(batch, heads, dim, device="cuda", dtype=DTYPE)
        k_cache, v_cache = (torch.randn(batch, kv_heads, cache_len, dim,
                                        device="cuda", dtype=DTYPE) for _ in range(2))
        impls = {"gemslib": lambda: gemslib.decode_attention(q, k_cache, v_cache),
                 "SDPA default": lambda: F.scaled_dot_product_attention(
                     q[:, :, None], k_cache, v_cache, enable_gqa=True)}
        if flashinfer:
            impls["FlashInfer"] = _flashinfer_decode(flashinfer, q, k_cache, v_cache)
            if batch == 1:  # one sequence: its single-request decode reads the cache as it is
                impls["FlashInfer single"] = lambda: flashinfer.single_decode_with_kv_cache(
                    q[0], k_cache[0], v_cache[0], kv_layout="HND",
                    use_tensor_cores=heads // kv_heads >= 4)
        bytes_moved = 2 * k_cache.numel() * k_cache.element_size()
        yield Case("decode_attention", f"B{batch} Hq{heads} Hk{kv_heads} L{cache_len} D{dim}",
                   "bf16", bytes_moved, impls,
                   outputs_agree=outputs_close(
                       lambda: gemslib.decode_attention(q, k_cache, v_cache),
                       lambda: decode_ops.decode_attention_reference(
                           q.float(), k_cache.float(), v_cache.float())))
        del q, k_cache, v_cache
    for batch, cache_len, visible in STATIC_CACHE_DECODE:
        yield _static_cache_case(batch, cache_len, visible, flashinfer)


def _static_cache_case(batch: int, cache_len: int, visible: int, flashinfer=None) -> Case:
    """decode_attention as the graph pass runs a static cache's step (lengths and the mask),
    beside it with only one of them, SDPA under the mask (what inductor runs) and FlashInfer
    over the visible prefix of each sequence's page."""
    q = torch.randn(batch, DECODE_HEADS, DECODE_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(batch, DECODE_KV_HEADS, cache_len, DECODE_DIM,
                                    device="cuda", dtype=DTYPE) for _ in range(2))
    key_mask = (torch.arange(cache_len, device="cuda") < visible).expand(batch, cache_len)
    seqlens = torch.full((batch,), visible, device="cuda", dtype=torch.int32)
    impls = {"gemslib": lambda: gemslib.decode_attention(q, k_cache, v_cache, seqlens,
                                                         key_mask=key_mask),
             "gemslib mask only": lambda: gemslib.decode_attention(q, k_cache, v_cache,
                                                                   key_mask=key_mask),
             "gemslib lengths only": lambda: gemslib.decode_attention(q, k_cache, v_cache,
                                                                      seqlens),
             "SDPA default": lambda: F.scaled_dot_product_attention(
                 q[:, :, None], k_cache, v_cache, attn_mask=key_mask[:, None, None],
                 enable_gqa=True)}
    if flashinfer:
        impls["FlashInfer"] = _flashinfer_decode(flashinfer, q, k_cache, v_cache, visible)
    bytes_moved = 2 * batch * DECODE_KV_HEADS * visible * DECODE_DIM * k_cache.element_size()
    return Case("decode_attention", f"B{batch} Hq{DECODE_HEADS} Hk{DECODE_KV_HEADS} "
                f"L{cache_len} D{DECODE_DIM}, {visible} visible", "bf16", bytes_moved, impls,
                outputs_agree=outputs_close(
                    impls["gemslib"], lambda: decode_ops.decode_attention_reference(
                        q.float(), k_cache.float(), v_cache.float(), seqlens,
                        key_mask=key_mask)))


