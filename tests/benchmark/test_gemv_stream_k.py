"""The stream-K GEMV experiment's kernel (benchmark/experiments/gemv_stream_k.py) against a
float64 reference: shares that start and end inside tiles, tiles met by many programs, a
program per iteration, one program for all; the counters back to 0 for the next call."""

import pytest
import torch

from benchmark.experiments.gemv_stream_k import StreamKGemv
from helpers import DEVICE


@pytest.mark.parametrize("n_out, n_in, programs, block_n, block_k", [
    (100, 300, 7, 16, 32),     # 7 tiles x 10 steps over 7 programs: shares end inside tiles
    (100, 300, 3, 16, 32),     # long shares: most tiles whole in one program
    (48, 64, 1000, 16, 32),    # more programs than iterations: one iteration each
    (33, 40, 1, 16, 32),       # one program takes everything
    (64, 512, 5, 32, 64),      # a tile cut between up to three programs
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stream_k_gemv_matches_float64(n_out, n_in, programs, block_n, block_k, dtype):
    torch.manual_seed(n_out * n_in + programs)
    weight = torch.randn(n_out, n_in, device=DEVICE, dtype=dtype)
    x = torch.randn(n_in, device=DEVICE, dtype=dtype)
    gemv = StreamKGemv(n_out, n_in, DEVICE, programs, block_n, block_k)
    padded = torch.full((n_out + 8,), 7.0, device=DEVICE, dtype=dtype)  # guards past the end
    for _ in range(2):  # the second call reuses the counters the first put back
        y = gemv(x, weight, out=padded[:n_out])
        expected = weight.double() @ x.double()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(y.double(), expected, rtol=tolerance,
                                   atol=tolerance * expected.abs().max().item())
        assert torch.all(gemv.arrivals == 0)
        assert torch.all(padded[n_out:] == 7.0)


@pytest.mark.parametrize("rows, n_out, n_in, programs", [
    (16, 100, 300, 7), (3, 64, 512, 5), (2, 48, 64, 1000), (1, 40, 96, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stream_k_gemv_of_several_rows_matches_float64(rows, n_out, n_in, programs, dtype):
    """Up to 16 rows: the tl.dot tile (fp16 and fp32: the interpreter's bf16 dot is wrong)."""
    torch.manual_seed(rows + n_out + programs)
    weight = torch.randn(n_out, n_in, device=DEVICE, dtype=dtype)
    x = torch.randn(rows, n_in, device=DEVICE, dtype=dtype)
    gemv = StreamKGemv(n_out, n_in, DEVICE, programs, 16, 32, rows=16)
    padded = torch.full((rows, n_out + 8), 7.0, device=DEVICE, dtype=dtype)
    for _ in range(2):
        y = gemv(x, weight, out=padded[:, :n_out])
        expected = x.double() @ weight.double().t()
        tolerance = 1e-4 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(y.double(), expected, rtol=tolerance,
                                   atol=tolerance * expected.abs().max().item())
        assert torch.all(gemv.arrivals == 0)
        assert torch.all(padded[:, n_out:] == 7.0)


def test_stream_k_gemv_says_which_argument_is_wrong():
    gemv = StreamKGemv(16, 32, DEVICE, 2, 16, 16)
    with pytest.raises(ValueError, match="weight: expected \\(16, 32\\)"):
        gemv(torch.randn(32, device=DEVICE), torch.randn(32, 16, device=DEVICE))
    with pytest.raises(ValueError, match="x: expected \\(n_in,\\) or \\(M, n_in\\) with n_in 32"):
        gemv(torch.randn(64, device=DEVICE)[::2], torch.randn(16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="M <= 1"):
        gemv(torch.randn(2, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="rows: expected 1 to 16, got 17"):
        StreamKGemv(16, 32, DEVICE, 2, 16, 16, rows=17)
