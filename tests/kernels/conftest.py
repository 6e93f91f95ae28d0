"""Fixtures of the backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from exitlm.kernels import native


@pytest.fixture
def int8_activations(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The native blocks' int8-activation setting for one test (``indirect`` parameter, or on
    when not parametrized); the previous setting is restored after it."""
    on = bool(getattr(request, "param", True))
    prev = native.set_int8_activations(on)
    yield on
    native.set_int8_activations(prev)
