"""One spelling of "off" for every ``EXITLM_*`` switch (``exitlm.env``), read by each switch's
own reader."""

from __future__ import annotations

import pytest

from exitlm.env import OFF, ON, switched_off
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


@pytest.mark.parametrize("name", ["EXITLM_COST_CACHE", "EXITLM_HUGE_PAGES", "EXITLM_CUDA_GRAPHS",
                                  "EXITLM_SCREEN", "EXITLM_SHM", "EXITLM_Q4_PACKED"])
def test_unknown_spelling_warns_once_and_stays_on(monkeypatch: pytest.MonkeyPatch,
                                                  name: str) -> None:
    import warnings

    from exitlm.errors import ExitlmWarning

    monkeypatch.setattr("exitlm.env._warned", set())
    monkeypatch.setenv(name, "maybe")
    with pytest.warns(ExitlmWarning) as caught:
        assert not switched_off(name)
    (message,) = [str(w.message) for w in caught]
    assert f"{name}='maybe'" in message and "off" in message and "no" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second read is silent
        assert not switched_off(name)


@pytest.mark.parametrize("value", [*ON, " On ", "TRUE"])
def test_known_spellings_do_not_warn(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    import warnings

    monkeypatch.setattr("exitlm.env._warned", set())
    monkeypatch.setenv("EXITLM_SCREEN", value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not switched_off("EXITLM_SCREEN")
