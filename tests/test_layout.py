"""Host-side layout helpers the launchers rely on to address rows without copies."""

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
