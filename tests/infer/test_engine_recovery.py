"""The engine after a failed step (what a server needs to go on serving): the running requests
end with finish reason ``error``, waiting ones stay queued, and later requests get exactly
what they get on a fresh engine; prompt token ids outside the vocabulary are refused."""

from __future__ import annotations

import pytest

from _ee_models import ee_model, one_thread  # noqa: F401
from exitlm.config import ConfigError
from exitlm.infer import Engine, SamplingOptions, generate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("where", ["prefill", "step"])
def test_failed_step_ends_running_requests_and_engine_goes_on(where: str) -> None:
    model = ee_model()
    engine = Engine(model, None, "ar", max_batch=2)
    real = getattr(engine.decoder, where)
    calls = {"n": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return real(batch)

    setattr(engine.decoder, where, flaky)
    sampling = SamplingOptions(max_new_tokens=6, ignore_eos=True)
    a = engine.submit([1, 2, 3], sampling)
    b = engine.submit([4, 5], sampling)
    c = engine.submit([6, 7, 8, 9], sampling)  # waits: max_batch is 2
    with pytest.raises(RuntimeError, match="injected"):
        while True:
            engine.step()
    failed = engine.abort_running()
    if where == "prefill":  # a and b were served; c's prefill (the 2nd) failed
        assert failed == [c]
        assert a.token_ids == generate(model, None, [1, 2, 3], sampling=sampling).token_ids[0]
    else:  # the first decoding step failed: a and b end, c stays queued
        assert set(failed) == {a, b}
        assert c.status == "waiting"
    for r in failed:
        assert r.finish_reason == "error" and r.done
    assert not engine.running
    engine.run()  # the rest is served on fresh rows
    alone = generate(model, None, [6, 7, 8, 9], sampling=sampling).token_ids[0]
    if c not in failed:
        assert c.token_ids == alone and c.finish_reason == "length"
    d = engine.submit([6, 7, 8, 9], sampling)
    engine.run()
    assert d.token_ids == alone


def test_prompt_ids_outside_the_vocabulary_are_refused() -> None:
    engine = Engine(ee_model(vocab=23), None, "ar")
    for bad in ([1, 23], [-1, 2]):
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            engine.submit(bad, SamplingOptions(max_new_tokens=2))
    assert not engine.has_work()
