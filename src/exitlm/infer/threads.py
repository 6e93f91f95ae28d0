"""CPU thread settings for decoding (``--threads`` on every command that decodes)."""

from __future__ import annotations

import torch

from exitlm.config import ConfigError


def set_threads(n: int) -> None:
    """Use ``n`` CPU threads for torch (and numpy's BLAS during decoding)."""
    if n < 1:
        raise ConfigError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
