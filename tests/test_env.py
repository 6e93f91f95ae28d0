"""One spelling of "off" for every ``EXITLM_*`` switch (``exitlm.env``), read by each switch's
own reader."""

from __future__ import annotations

import pytest

from exitlm.env import OFF, switched_off
from exitlm.runtime.graphs import graphs_wanted


@pytest.mark.parametrize("value", [*OFF, " OFF ", "No", "False"])
def test_off_spellings(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EXITLM_CUDA_GRAPHS", value)
    assert switched_off("EXITLM_CUDA_GRAPHS") and not graphs_wanted()


@pytest.mark.parametrize("value", [None, "1", "on", "yes", "true"])
def test_on_when_unset_or_anything_else(monkeypatch: pytest.MonkeyPatch,
                                        value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("EXITLM_CUDA_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("EXITLM_CUDA_GRAPHS", value)
    assert not switched_off("EXITLM_CUDA_GRAPHS") and graphs_wanted()
