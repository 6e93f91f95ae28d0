"""Admission prefills prompts of similar lengths together: padding stays bounded, and every
request still gets exactly what it gets alone."""

from __future__ import annotations

import itertools

import pytest
import torch

from _ee_models import ee_model, one_thread  # noqa: F401
from exitlm.config import ConfigError
from exitlm.infer import Engine, SamplingOptions, generate
from exitlm.infer.prefill_plan import (
    PrefillPart,
    alike_starts,
    held_start,
    plan_prefill,
    prefill_groups,
)
from exitlm.infer.strategies import get_strategy

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


# ----- long prompts in parts (prefill_chunk) -------------------------------------------------

CHUNKED = [("ar", {}), ("self-spec", {"exit_layer": 2, "num_speculations": 3}),
           ("early-exit", {"threshold": 1.0}), ("early-exit", {"exit_layer": 3}), ("ppd", {})]


def _count_prefill(engine: Engine) -> dict[int, int]:
    """Prompt positions prefilled per engine step (filled in parts or whole), by step."""
    per_step: dict[int, int] = {}
    step, fill, prefill = engine.step, engine.decoder.fill, engine.decoder.prefill
    count = [0]

    def counting_step():  # type: ignore[no-untyped-def]
        count[0] += 1
        return step()

    def add(batch, stop):  # type: ignore[no-untyped-def]
        held = int(batch.cache.lengths.min())
        n = sum(min(len(s.prompt), stop) - held for s in batch.seqs)
        per_step[count[0]] = per_step.get(count[0], 0) + n

    def counting_fill(batch, stop):  # type: ignore[no-untyped-def]
        add(batch, stop)
        return fill(batch, stop)

    def counting_prefill(batch):  # type: ignore[no-untyped-def]
        add(batch, 1 << 30)
        return prefill(batch)

    engine.step = counting_step  # type: ignore[method-assign]
    engine.decoder.fill = counting_fill  # type: ignore[method-assign]
    engine.decoder.prefill = counting_prefill  # type: ignore[method-assign]
    return per_step


@pytest.mark.parametrize(("strategy", "opts"), CHUNKED)
@pytest.mark.parametrize("head", ["linear", "block"])
def test_long_prompt_in_parts_while_others_decode(strategy: str, opts: dict, head: str) -> None:
    """A 41-token prompt fills in parts over several steps while the running request gains
    a token every step; no step prefills more than the budget (8) and a quarter; every
    request gets the tokens it gets alone, whole prefill."""
    model = ee_model(head, every_layer=head == "linear")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (5, 41, 7, 30, 3)]
    sampling = SamplingOptions(max_new_tokens=12, ignore_eos=True)
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts),
                    max_batch=3, prefill_chunk=8)
    per_step = _count_prefill(engine)
    reqs = [engine.submit(prompts[0], sampling)]
    engine.step()
    reqs += [engine.submit(p, sampling) for p in prompts[1:]]
    while strategy == "ppd" and not reqs[0].done:  # PPD holds one sequence at a time
        engine.step()
    first = len(reqs[0].token_ids)
    for k in range(4):  # 41 positions in parts of at most 8: at least 5 steps
        engine.step()
        assert engine.filling is reqs[1]
        assert len(reqs[1].token_ids) == 0
        if strategy != "ppd":
            assert len(reqs[0].token_ids) > first + k  # the running one went on
    engine.run()
    assert max(per_step.values()) <= 8 + 2 and sum(per_step.values()) == sum(map(len, prompts))
    for req, p in zip(reqs, prompts, strict=True):
        alone = generate(model, None, p, strategy=strategy, sampling=sampling, **opts)
        assert req.token_ids == alone.token_ids[0]
    cache = engine.pool.cache
    assert not engine.running and engine.filling is None
    assert cache is not None and int(cache.lengths.sum()) == 0 and int(cache.fill.sum()) == 0


def test_a_crowd_of_short_prompts_is_admitted_within_the_budget() -> None:
    """Eight prompts of 6 tokens arriving together with a budget of 16 positions a step are
    admitted two a step (first come first served), the first ones decoding meanwhile."""
    model = ee_model(every_layer=True)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 23, (6,), generator=g).tolist() for _ in range(8)]
    sampling = SamplingOptions(max_new_tokens=5, ignore_eos=True)
    engine = Engine(model, None, "ar", max_batch=8, prefill_chunk=16)
    per_step = _count_prefill(engine)
    reqs = [engine.submit(p, sampling) for p in prompts]
    engine.step()
    assert [r.status for r in reqs].count("running") == 2 and len(reqs[0].token_ids) == 2
    engine.run()
    assert list(per_step.values()) == [12, 12, 12, 12]
    for req, p in zip(reqs, prompts, strict=True):
        assert req.token_ids == generate(model, None, p, sampling=sampling).token_ids[0]


def _keeping_cache(prefill, n: int, into: list):  # type: ignore[no-untyped-def]
    """``prefill`` that also keeps the first ``n`` positions of every cache tensor of row 0
    afterwards (the prompt's last part: every position is in the cache then)."""
    def spy(batch):  # type: ignore[no-untyped-def]
        out = prefill(batch)
        assert int(batch.cache.lengths[0]) == n
        into.append([t[0, :, :n].clone() for t in (*batch.cache.keys, *batch.cache.values)])
        return out

    return spy


def test_parts_fill_the_cache_as_one_prefill() -> None:
    """The keys and values of a prompt prefilled in parts equal those of one prefill (up to
    float rounding of the split products), block exits' slots included."""
    model = ee_model("block")
    prompt = torch.randint(0, 23, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    caches = []
    for chunk in (None, 10):
        engine = Engine(model, None, "self-spec", get_strategy("self-spec").options(
            exit_layer=2, num_speculations=2), max_batch=2, prefill_chunk=chunk)
        engine.decoder.prefill = _keeping_cache(engine.decoder.prefill, 37, caches)  # type: ignore[method-assign]
        engine.submit(prompt, SamplingOptions(max_new_tokens=3, ignore_eos=True))
        engine.run()
    for a, b in zip(*caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    written = [bool(a.abs().sum() > 0) for a in caches[1]]
    assert sum(written) == 2 * (model.num_layers + 1)  # every layer's and exit 2's block's


def test_cancel_while_filling_and_rows_moving_under_it() -> None:
    """A request cancelled mid-fill frees its row; a decoding request leaving moves the
    filling row down; the next long prompt then fills and decodes like it does alone."""
    model = ee_model(every_layer=True)
    g = torch.Generator().manual_seed(3)
    short, long1, long2 = ([int(t) for t in torch.randint(0, 23, (n,), generator=g)]
                           for n in (4, 50, 33))
    engine = Engine(model, None, "ar", max_batch=4, prefill_chunk=6)
    quick = engine.submit(short, SamplingOptions(max_new_tokens=2, ignore_eos=True))
    slow = engine.submit(short, SamplingOptions(max_new_tokens=30, ignore_eos=True))
    engine.step()
    doomed = engine.submit(long1, SamplingOptions(max_new_tokens=5, ignore_eos=True))
    later = engine.submit(long2, SamplingOptions(max_new_tokens=6, ignore_eos=True))
    engine.step()  # quick finishes (row 0 freed: the others move down), long1's first part
    assert quick.done and engine.filling is doomed
    assert engine.running == [slow, doomed]
    engine.step()
    engine.cancel(doomed)
    engine.step()
    assert doomed.finish_reason == "cancelled" and doomed.token_ids == []
    engine.run()
    for req, p, n in ((slow, short, 30), (later, long2, 6)):
        sampling = SamplingOptions(max_new_tokens=n, ignore_eos=True)
        assert req.token_ids == generate(model, None, p, sampling=sampling).token_ids[0]
    cache = engine.pool.cache
    assert cache is not None and int(cache.lengths.sum()) == 0 and int(cache.fill.sum()) == 0


def test_the_plan_prefills_a_shared_prompt_once() -> None:
    prompts = [[1, 2, 3], [4], [1, 2, 3], [5, 6], [4], [7, 8], [1, 2, 3], [5, 6]]
    order, parts = plan_prefill(prompts)
    assert order == [0, 2, 6, 3, 7, 1, 4, 5]  # one-token prompts have nothing to share
    assert parts == [PrefillPart(0, 3, 2), PrefillPart(3, 5, 1), PrefillPart(5, 7),
                     PrefillPart(7, 8)]  # the rest in padded groups
    assert plan_prefill([[1, 2], [3, 4, 5]]) == ([0, 1], [PrefillPart(0, 2)])
    order, parts = plan_prefill(prompts, share=False)  # every prompt whole, by length
    assert [len(prompts[i]) for i in order] == [1, 1, 2, 2, 2, 3, 3, 3]
    assert all(p.start == 0 for p in parts)


def test_the_plan_copies_a_start_a_running_prompt_holds() -> None:
    """A running row's prompt sharing all but the last token, or at least 32 tokens, is
    copied from; the longest shared start wins; a shorter one is not worth a part."""
    system = list(range(40))
    held = [(0, [*system, 90, 91]), (3, [*system[:35], 99]), (5, [7, 7, 7])]
    assert held_start([*system, 50], held) == (0, 40)
    assert held_start([*system[:33], 60], held) == (0, 33)
    assert held_start([*system[:20], 1, 2], held) is None  # 20 shared positions: too few
    assert held_start([7, 7, 7], held) == (5, 2)  # the same prompt: all but the last
    assert held_start([7, 7], held) == (5, 1)
    prompts = [[3, 3], [*system, 50], [7, 7, 7], [*system, 50], [*system, 8]]
    order, parts = plan_prefill(prompts, held)
    assert order == [1, 3, 4, 2, 0]  # the copies of one start together, by the rest's length
    assert parts == [PrefillPart(0, 3, 40, 0), PrefillPart(3, 4, 2, 5), PrefillPart(4, 5)]


def test_prompts_with_a_common_start_are_clustered() -> None:
    """Prompts of one 40-token start and other tails cluster at the start they all share;
    one of 20 shared tokens stays alone, as do different prompts; a whole prompt repeated
    shares all but its last position, however short."""
    system = list(range(40))
    prompts = [[*system, 1, 2], [5, 5], [*system[:20], 9], [*system, 3], [5, 5],
               [*system, 1, 7, 7], [8, 8, 8]]
    clusters, alone = alike_starts(prompts, list(range(len(prompts))))
    assert clusters == [(40, [0, 5, 3]), (1, [1, 4])]  # in the order of the prompts
    assert sorted(alone) == [2, 6]
    order, parts = plan_prefill(prompts)
    assert order[:3] == [3, 0, 5]  # by the rest's length: 1, 2, 3
    # the rests (1, 2, 3 tokens) in padded groups: the first fills the start, then copies
    assert parts[0] == PrefillPart(0, 1, 40) and parts[1] == PrefillPart(1, 3, 40, None, 0)
    assert parts[2] == PrefillPart(3, 5, 1)


@pytest.mark.parametrize(("strategy", "opts"), CHUNKED[:4])
@pytest.mark.parametrize("head", ["linear", "block"])
def test_identical_prompts_are_prefilled_once(strategy: str, opts: dict, head: str) -> None:
    """Three choices of one 12-token prompt (seeded samples and a greedy one) and another
    prompt, admitted in one step: the shared prompt's positions are prefilled once (its last
    position once per choice), and every request gets the tokens it gets alone."""
    model = ee_model(head, every_layer=head == "linear")
    g = torch.Generator().manual_seed(3)
    shared, other = (torch.randint(0, 23, (n,), generator=g).tolist() for n in (12, 9))
    samplings = [SamplingOptions(max_new_tokens=10, ignore_eos=True, temperature=0.8,
                                 seed=s) for s in (0, 1)]
    samplings.append(SamplingOptions(max_new_tokens=10, ignore_eos=True))
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts),
                    max_batch=4)
    per_step = _count_prefill(engine)
    jobs = [(other, samplings[2])] + [(shared, s) for s in samplings]
    reqs = [engine.submit(p, s) for p, s in jobs]
    engine.run()
    assert per_step[1] == 11 + 3 + len(other)
    for req, (p, s) in zip(reqs, jobs, strict=True):
        alone = generate(model, None, p, strategy=strategy, sampling=s, **opts)
        assert req.token_ids == alone.token_ids[0]
    assert reqs[1].token_ids != reqs[2].token_ids  # the seeds gave different samples
    cache = engine.pool.cache
    assert cache is not None and int(cache.lengths.sum()) == 0


@pytest.mark.parametrize(("strategy", "opts"), CHUNKED[:4])
def test_a_prompt_a_running_sequence_holds_is_copied(strategy: str, opts: dict) -> None:
    """Two choices of a 30-token prompt under an 8-position budget: the first fills in
    parts, the second waits and starts from its row when the last part is prefilled (one
    position more), as does a third copy submitted while both decode. Every request gets
    the tokens it gets alone."""
    model = ee_model("block", every_layer=False)
    prompt = torch.randint(0, 23, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    samplings = [SamplingOptions(max_new_tokens=12, ignore_eos=True, temperature=0.8,
                                 seed=s) for s in (0, 1)]
    samplings.append(SamplingOptions(max_new_tokens=12, ignore_eos=True))
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts),
                    max_batch=4, prefill_chunk=8)
    per_step = _count_prefill(engine)
    reqs = [engine.submit(prompt, s) for s in samplings[:2]]
    while not reqs[1].token_ids:
        assert not reqs[0].token_ids
        engine.step()
    assert list(per_step.values()) == [8, 8, 8, 6 + 1]
    reqs.append(engine.submit(prompt, samplings[2]))
    engine.step()
    assert per_step[max(per_step)] == 1
    engine.run()
    assert sum(per_step.values()) == 30 + 1 + 1
    for req, s in zip(reqs, samplings, strict=True):
        alone = generate(model, None, prompt, strategy=strategy, sampling=s, **opts)
        assert req.token_ids == alone.token_ids[0]


@pytest.mark.parametrize(("strategy", "opts"), CHUNKED[:4])
@pytest.mark.parametrize("chunk", [None, 8])
def test_a_shared_start_is_copied_from_a_running_row(strategy: str, opts: dict,
                                                     chunk: int | None) -> None:
    """Prompts that begin with a running request's 40-token start (a system prompt) copy it
    from its row and prefill only their own tails - whole, or in parts when the tail exceeds
    the budget - and get the tokens they get alone; a prompt sharing fewer tokens does not."""
    model = ee_model("block", every_layer=False)
    g = torch.Generator().manual_seed(9)
    system = torch.randint(0, 23, (40,), generator=g).tolist()
    tails = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (5, 6, 20)]
    prompts = [system + tails[0], system + tails[1], system + tails[2],
               system[:10] + tails[1]]
    sampling = SamplingOptions(max_new_tokens=30, ignore_eos=True)
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts),
                    max_batch=4, prefill_chunk=chunk)
    per_step = _count_prefill(engine)
    reqs = [engine.submit(prompts[0], sampling)]
    while not reqs[0].token_ids:
        engine.step()
    reqs += [engine.submit(p, sampling) for p in prompts[1:]]
    engine.run()
    assert sum(per_step.values()) == 45 + 6 + 20 + 16
    for req, p in zip(reqs, prompts, strict=True):
        alone = generate(model, None, p, strategy=strategy, sampling=sampling, **opts)
        assert req.token_ids == alone.token_ids[0]


@pytest.mark.parametrize(("strategy", "opts"), CHUNKED[:4])
def test_a_start_shared_by_new_requests_is_filled_once(strategy: str, opts: dict) -> None:
    """Four requests admitted together, three with one 40-token start (a system prompt) and
    tails of 3, 4 and 30 tokens, one alike for 10 tokens only: the start is filled once, the
    tails prefilled from it, and every request gets the tokens it gets alone."""
    model = ee_model("block", every_layer=False)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 23, (40,), generator=g).tolist()
    tails = [torch.randint(0, 23, (n,), generator=g).tolist() for n in (3, 4, 30)]
    prompts = [system + t for t in tails] + [system[:10] + tails[1]]
    sampling = SamplingOptions(max_new_tokens=10, ignore_eos=True)
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts),
                    max_batch=4)
    per_step = _count_prefill(engine)
    reqs = [engine.submit(p, sampling) for p in prompts]
    engine.run()
    assert per_step[1] == 40 + 3 + 4 + 30 + 14
    for req, p in zip(reqs, prompts, strict=True):
        alone = generate(model, None, p, strategy=strategy, sampling=sampling, **opts)
        assert req.token_ids == alone.token_ids[0]


def test_prefill_chunk_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="prefill_chunk must be >= 1"):
        Engine(ee_model(), None, "ar", prefill_chunk=0)


@pytest.mark.parametrize("strategy", ["ar", "self-spec"])
def test_short_prompts_join_while_a_long_one_fills(strategy: str) -> None:
    """A short prompt arriving mid-fill is admitted at once and decodes beside the filling
    one (whose row moves after it); a long one waits for the fill to end."""
    model = ee_model(every_layer=True)
    g = torch.Generator().manual_seed(4)
    long1, short, long2 = ([int(t) for t in torch.randint(0, 23, (n,), generator=g)]
                           for n in (50, 4, 20))
    sampling = SamplingOptions(max_new_tokens=9, ignore_eos=True)
    engine = Engine(model, None, strategy, max_batch=4, prefill_chunk=6)
    first = engine.submit(long1, sampling)
    engine.step()
    engine.step()
    assert engine.filling is first
    joined, waits = engine.submit(short, sampling), engine.submit(long2, sampling)
    engine.step()
    assert engine.running == [joined, first] and engine.filling is first
    assert len(joined.token_ids) >= 2 and waits.status == "waiting"
    engine.run()
    for req, p in ((first, long1), (joined, short), (waits, long2)):
        assert req.token_ids == generate(model, None, p, strategy=strategy,
                                         sampling=sampling).token_ids[0]
