"""Shared fixtures: one intra-op thread and a seeded RNG (``_default_model`` says whether the
embedded SmolLM2 is installed)."""

from __future__ import annotations

import pytest
import torch

# One intra-op thread: tiny models gain nothing from more, and on a loaded 2-core machine
# (or with distributed tests spawning processes) extra OpenMP threads stall each other.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
