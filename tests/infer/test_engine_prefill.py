"""Admission prefills prompts of similar lengths together: padding stays bounded, and every
request still gets exactly what it gets alone."""

from __future__ import annotations

import itertools

import pytest

from _ee_models import ee_model, one_thread  # noqa: F401
from exitlm.infer import Engine, SamplingOptions, generate
from exitlm.infer.engine import prefill_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefill_groups_bound_the_padding() -> None:
    assert prefill_groups([]) == []
    assert prefill_groups([5]) == [(0, 1)]
    assert prefill_groups([7, 7, 8, 8]) == [(0, 4)]  # 32 padded positions for 30 real
    assert prefill_groups([14, 17, 67, 424]) == [(0, 2), (2, 3), (3, 4)]
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89]
    groups = prefill_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    for (_, b), (c, _) in itertools.pairwise(groups):
        assert b == c  # consecutive, covering every prompt
    for a, b in groups:
        part = lengths[a:b]
        assert b - a == 1 or len(part) * max(part) <= 1.25 * sum(part)


@pytest.mark.parametrize("strategy", ["ar", "self-spec", "early-exit"])
def test_mixed_lengths_admitted_together_equal_alone(strategy: str) -> None:
    model = ee_model(every_layer=True, vocab=23)
    prompts = [[(3 * i + j) % 23 for j in range(n)] for i, n in enumerate((30, 3, 12, 4, 29))]
    engine = Engine(model, None, strategy, max_batch=8)
    calls: list[int] = []
    real = engine.decoder.prefill

    def spy(batch):  # type: ignore[no-untyped-def]
        calls.append(len(batch))
        return real(batch)

    engine.decoder.prefill = spy  # type: ignore[method-assign]
    sampling = SamplingOptions(max_new_tokens=8, ignore_eos=True)
    reqs = [engine.submit(p, sampling) for p in prompts]
    engine.step()
    assert sorted(calls) == [1, 2, 2]  # (3, 4), (12), (29, 30)
    engine.run()
    for p, r in zip(prompts, reqs, strict=True):
        assert r.token_ids == generate(model, None, p, strategy=strategy,
                                       sampling=sampling).token_ids[0]
