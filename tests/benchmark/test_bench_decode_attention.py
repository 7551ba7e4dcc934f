"""The FlashInfer peer's paged copy of a decode cache (benchmark/bench_decode_attention.py):
every visible position lands on its page, in order, and nothing else is kept."""

import pytest
import torch

from benchmark.bench_decode_attention import paged_kv


@pytest.mark.parametrize("cache_len, visible, page", [(64, 64, 16), (64, 37, 16), (40, 40, 16),
                                                      (8, 3, 16)])
def test_paged_copy_holds_each_sequences_visible_positions_in_order(cache_len, visible, page):
    batch, kv_heads, dim = 3, 2, 4
    cache = torch.randn(batch, kv_heads, cache_len, dim)
    pages, indptr, indices, last_page_len = paged_kv(cache, visible, page)
    assert pages.shape[1:] == (kv_heads, page, dim)
    for b in range(batch):
        seq_pages = pages[indices[indptr[b]:indptr[b + 1]].long()]  # (n, Hkv, page, D)
        positions = seq_pages.transpose(0, 1).reshape(kv_heads, -1, dim)
        kept = (len(seq_pages) - 1) * page + int(last_page_len[b])
        assert kept == visible and 0 < int(last_page_len[b]) <= page
        torch.testing.assert_close(positions[:, :visible], cache[b, :, :visible],
                                   rtol=0, atol=0)
        assert not positions[:, visible:].any()
