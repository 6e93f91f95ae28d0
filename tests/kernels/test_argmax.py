"""exitlm.kernels.argmax.argmax is torch.argmax(x, dim=-1): same indices for ties, NaN, inf,
signed zeros, every float dtype, any shape and stride, CPU and (falling back) other dtypes."""

from __future__ import annotations

import pytest
import torch

from exitlm.kernels.argmax import argmax


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 50, generator=gen).to(dtype)
    ties = torch.randint(0, 3, (5, 40), generator=gen).to(dtype)  # many equal maxima
    special = torch.zeros(8, 7, dtype=dtype)
    special[0, 3] = float("nan")
    special[1, 2], special[1, 5] = float("nan"), float("inf")
    special[2, 4] = float("inf")
    special[2, 6] = float("inf")
    special[3] = float("-inf")
    special[4, 0], special[4, 1] = -0.0, 0.0
    special[5, 6] = float("nan")
    special[5, 0] = float("inf")
    special[6] = float("nan")
    special[7, 1] = -1.0  # max 0 at index 0
    wide = torch.randn(1, 49152, generator=gen).to(dtype)
    return [x, ties, special, x[:, ::3], x.t(), x.view(2, 3, 50), x[0], wide]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_matches_torch(dtype: torch.dtype) -> None:
    for x in _cases(dtype):
        got = argmax(x)
        want = torch.argmax(x, dim=-1)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want), (x, got, want)
