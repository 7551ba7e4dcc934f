"""Host-side layout helpers the launchers rely on to address rows without copies."""

import itertools
import random

import pytest
import torch

from gemslib import layout, runtime


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 5, 6),                      # contiguous: used as it is
    lambda: torch.randn(6, 4, 5).permute(1, 2, 0)[..., :6].contiguous()[:, ::2],  # strided rows
    lambda: torch.randn(4, 12)[:, :6],                 # padded rows
    lambda: torch.randn(5, 4, 6).transpose(0, 1),      # leading dims do not merge: a copy
    lambda: torch.randn(6, 4).t(),                     # non-unit last stride: a copy
    lambda: torch.randn(7),                            # one row
])
def test_rows_of_addresses_every_row(make):
    t = make()
    rows, row_stride = layout.rows_of(t)
    n_cols = t.shape[-1]
    flat = torch.as_strided(rows, (t.numel() // n_cols, n_cols), (row_stride, 1))
    assert torch.equal(flat, t.reshape(-1, n_cols))
    if t.is_contiguous():
        assert rows is t


def test_next_power_of_2():
    assert [runtime.next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65, 5000)] == \
        [1, 1, 2, 4, 64, 128, 8192]


def test_an_output_is_viewed_never_copied():
    padded = torch.zeros(4, 12)[:, :6]
    rows, stride = layout.rows_of(padded, output=True)
    assert rows.data_ptr() == padded.data_ptr() and stride == 12
    with pytest.raises(RuntimeError):
        layout.rows_of(torch.zeros(5, 4, 6).transpose(0, 1), output=True)


def _element_offsets(t):
    base = t.storage_offset()
    return {base + sum(i * s for i, s in zip(index, t.stride()))
            for index in itertools.product(*(range(n) for n in t.shape))}


def test_may_share_elements_never_misses_a_shared_element():
    """Against a brute-force count on random strided views of one buffer: never False where
    two views share an element; False for disjoint slices of one buffer with one set of
    strides (q and k of a fused QKV projection, even and odd rows)."""
    generator = random.Random(0)
    buffer = torch.empty(400)
    for _ in range(2000):
        dims = generator.randint(1, 3)
        strides = [generator.choice([0, 1, 2, 3, 4, 5, 8, 12, 16, 20]) for _ in range(dims)]
        a, b = (buffer.as_strided([generator.randint(1, 4) for _ in range(dims)], strides,
                                  generator.randint(0, 40)) for _ in range(2))
        if _element_offsets(a) & _element_offsets(b):
            assert layout.may_share_elements(a, b), (a.shape, b.shape, strides)
    qkv = torch.empty(2, 5, (4 + 2 * 2) * 16)
    q, k, v = (qkv[..., lo:hi].view(2, 5, -1, 16) for lo, hi in ((0, 64), (64, 96), (96, 128)))
    assert not layout.may_share_elements(q, k) and not layout.may_share_elements(k, v)
    rows = torch.empty(8, 10)
    assert not layout.may_share_elements(rows[::2], rows[1::2])
    assert layout.may_share_elements(q[:, :, 1:], q[:, :, :2])


def test_may_share_elements_is_exact_for_one_layout_at_two_offsets():
    """The in-place alias check against brute force over small layouts: exact for one layout
    at two offsets (e.g. interleaved halves of a buffer), never a miss otherwise."""
    buffer = torch.zeros(96)
    layouts = [((3, 4), (8, 1)), ((3, 4), (4, 1)), ((2, 3, 2), (12, 4, 1)), ((4, 3), (1, 8)),
               ((2, 5), (10, 2)), ((6,), (3,)), ((1, 4), (50, 1)), ((3, 2), (2, 3))]
    elements = lambda t: {t.storage_offset() + sum(i * s for i, s in zip(index, t.stride()))
                          for index in itertools.product(*map(range, t.shape))}
    for (shape_a, strides_a), (shape_b, strides_b) in itertools.product(layouts, repeat=2):
        for offset_a, offset_b in ((0, 0), (0, 2), (0, 4), (3, 0), (0, 9), (0, 30)):
            a = buffer.as_strided(shape_a, strides_a, offset_a)
            b = buffer.as_strided(shape_b, strides_b, offset_b)
            shared = bool(elements(a) & elements(b))
            found = layout.may_share_elements(a, b)
            assert found or not shared, (shape_a, strides_a, offset_a, shape_b, strides_b, offset_b)
            if (shape_a, strides_a) == (shape_b, strides_b) and not layout.may_overlap_itself(a):
                assert found == shared, (a.shape, a.stride(), offset_a, offset_b)
