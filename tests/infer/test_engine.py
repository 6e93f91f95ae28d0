"""The engine under continuous batching: requests arriving at different steps, prompts and
budgets of different lengths, cancellations and queueing give every request exactly what it
gets alone (greedy AR, self-spec, early exit at threshold 1.0); KV recomputation matches the
cache-free reference per sequence; seeded sampling does not depend on the batch; limits,
per-request options, streaming and row bookkeeping."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401
from _reference import early_exit_reference as reference_decode
from exitlm.config import ConfigError
from exitlm.infer import (
    EarlyExitOptions,
    Engine,
    EngineFull,
    SamplingOptions,
    SelfSpecOptions,
    generate,
    get_strategy,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# (arrival step, prompt length, max_new_tokens); request 3 is cancelled at step 5
SCHEDULE = [(0, 5, 14), (0, 9, 6), (1, 3, 18), (2, 7, 10), (4, 2, 9), (6, 11, 12), (6, 4, 1)]
CANCEL = {3: 5}


def _prompts(vocab: int = 23) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for _, n, _ in SCHEDULE]


def _serve(engine: Engine, prompts: list[list[int]], sampling: list[SamplingOptions],
           options: list[dict] | None = None) -> list:
    """Submit requests at their arrival steps, cancel as scheduled, run to the end."""
    reqs: dict[int, object] = {}
    step = 0
    while len(reqs) < len(SCHEDULE) or engine.has_work():
        for i, (arrive, _, _) in enumerate(SCHEDULE):
            if arrive == step:
                reqs[i] = engine.submit(prompts[i], sampling[i], **(options or [{}] * 9)[i])
        for i, at in CANCEL.items():
            if at == step:
                engine.cancel(reqs[i])  # type: ignore[arg-type]
        engine.step()
        step += 1
        assert step < 500
    return [reqs[i] for i in range(len(SCHEDULE))]


@pytest.mark.parametrize(
    ("strategy", "opts"),
    [("ar", {}), ("self-spec", {"exit_layer": 2, "num_speculations": 3}),
     ("early-exit", {"threshold": 1.0}), ("early-exit", {"exit_layer": 3})],
)
@pytest.mark.parametrize("gpt2", [False, True])
def test_continuous_batching_equals_alone(strategy: str, opts: dict, gpt2: bool) -> None:
    model = ee_model(every_layer=True, gpt2=gpt2)
    prompts = _prompts()
    sampling = [SamplingOptions(max_new_tokens=n, ignore_eos=True) for _, _, n in SCHEDULE]
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts), max_batch=3)
    reqs = _serve(engine, prompts, sampling)
    for i, (req, p, s) in enumerate(zip(reqs, prompts, sampling, strict=True)):
        alone = generate(model, None, p, strategy=strategy, sampling=s, **opts).token_ids[0]
        if i in CANCEL:
            assert req.finish_reason == "cancelled"
            assert req.token_ids == alone[: len(req.token_ids)]
            assert len(req.token_ids) < len(alone)
        else:
            assert req.token_ids == alone, i
            assert req.finish_reason == "length"
    # every row was given back: nothing running, the pool's bookkeeping is clear
    assert not engine.running
    cache = engine.pool.cache
    assert cache is not None and int(cache.lengths.sum()) == 0 and int(cache.fill.sum()) == 0
    assert cache.batch_size <= 3


def test_kv_recomputation_matches_reference_per_sequence() -> None:
    model = ee_model("mlp")
    prompts = _prompts()
    checks = (1, 2, 3)
    sampling = [SamplingOptions(max_new_tokens=n, ignore_eos=True) for _, _, n in SCHEDULE]
    engine = Engine(model, None, "early-exit",
                    EarlyExitOptions(threshold=0.3, max_pending=3, exit_layers=checks),
                    max_batch=3)
    reqs = _serve(engine, prompts, sampling)
    early = 0
    for i, req in enumerate(reqs):
        ref, layers = reference_decode(model, prompts[i], len(req.token_ids), checks, 0.3, 3)
        assert req.token_ids == ref, i
        assert req.exit_layers == layers, i
        early += sum(x < 4 for x in layers)
    assert early > 10


@pytest.mark.parametrize(
    ("strategy", "opts"),
    [("ar", {}), ("early-exit", {"threshold": 0.4}), ("self-spec", {"exit_layer": 2})],
)
def test_seeded_request_ignores_its_batch(strategy: str, opts: dict) -> None:
    """A seeded sampled request draws the same tokens alone and in a busy batch that mixes
    greedy and other sampled requests (per-request generators)."""
    model = ee_model(every_layer=True)
    prompts = _prompts()
    mine = SamplingOptions(temperature=0.9, top_p=0.9, seed=11, max_new_tokens=12,
                           ignore_eos=True)
    alone = generate(model, None, prompts[0], strategy=strategy, sampling=mine,
                     **opts).token_ids[0]
    sampling = [mine] + [SamplingOptions(temperature=0.7 * (i % 2), seed=i, max_new_tokens=n,
                                         ignore_eos=True)
                         for i, (_, _, n) in enumerate(SCHEDULE[1:], start=1)]
    engine = Engine(model, None, strategy, get_strategy(strategy).options(**opts), max_batch=4)
    reqs = _serve(engine, prompts, sampling)
    assert reqs[0].token_ids == alone


def test_per_request_options() -> None:
    """Thresholds and speculation counts are per request; structural options are not."""
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    s = SamplingOptions(max_new_tokens=12, ignore_eos=True)
    engine = Engine(model, None, "early-exit", EarlyExitOptions(threshold=0.9), max_batch=3)
    thresholds = (0.2, 0.5, 1.0)
    reqs = [engine.submit(p, s, threshold=t) for p, t in zip(prompts, thresholds, strict=True)]
    engine.run()
    for req, p, t in zip(reqs, prompts, thresholds, strict=True):
        alone = generate(model, None, p, strategy="early-exit", threshold=t, sampling=s)
        assert req.token_ids == alone.token_ids[0]
        assert req.exit_layers == alone.sequences[0].exit_layers
    assert reqs[2].exit_layers == [4] * 12
    with pytest.raises(ConfigError, match="fixed when the engine starts"):
        engine.submit(prompts[0], s, kv="copy")
    spec = Engine(model, None, "self-spec", SelfSpecOptions(exit_layer=2), max_batch=2)
    a = spec.submit(prompts[0], s, num_speculations=1)
    b = spec.submit(prompts[1], s, num_speculations=6, draft_threshold=0.5)
    spec.run()
    assert 0 < a.stats.drafted <= a.stats.rounds  # type: ignore[attr-defined]
    assert b.token_ids == generate(model, None, prompts[1], sampling=s).token_ids[0]


def test_prompts_and_models_of_the_wrong_kind_are_named() -> None:
    import numpy as np

    from exitlm.infer.api import encode_prompts

    assert encode_prompts(None, np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert encode_prompts(None, torch.tensor([5, 6])) == [[5, 6]]
    assert encode_prompts(None, [torch.tensor([1, 2]), (3, 4)]) == [[1, 2], [3, 4]]
    for bad, shown in (([1.5], "float 1.5"), ([[1, "a"]], "list [1, 'a']"),
                       ([[True, 2]], "list [True, 2]"), ([None], "NoneType None"),
                       ([torch.tensor([1.0])], "Tensor")):
        with pytest.raises(ConfigError, match=rf"prompt 0: expected a string or a list of "
                                              rf"integer token ids, got {re.escape(shown)}"):
            encode_prompts(None, bad)
    with pytest.raises(ConfigError, match=r"model: expected an EarlyExitLM .* got str"):
        generate("default", None, [[1, 2]])  # type: ignore[arg-type]


def test_limits_and_lazy_memory() -> None:
    model = ee_model(every_layer=True)  # context 160
    engine = Engine(model, None, "self-spec", SelfSpecOptions(exit_layer=2), max_batch=2,
                    max_queue=2)
    with pytest.raises(ConfigError, match=r"exceeds the context of 160 tokens"):
        engine.submit([1] * 100, SamplingOptions(max_new_tokens=61))
    with pytest.raises(ConfigError, match="exceeds the context"):
        engine.submit([1, 2], SamplingOptions(max_new_tokens=10**9))
    with pytest.raises(ConfigError, match="empty"):
        engine.submit([], SamplingOptions())
    with pytest.raises(ConfigError, match="max_seq_len"):
        Engine(model, None, max_seq_len=161)
    a = engine.submit([1, 2, 3], SamplingOptions(max_new_tokens=5))
    engine.submit([4, 5], SamplingOptions(max_new_tokens=5))
    with pytest.raises(EngineFull):
        engine.submit([6], SamplingOptions(max_new_tokens=5))
    engine.step()
    assert engine.pool.length == 64  # sized to the requests, not to the context
    engine.run()
    assert a.done and a.finish_reason == "length" and len(a.token_ids) == 5
    # a request that fills the context exactly, on a learned-position model (drafts of other
    # rows must not run past the position table)
    gpt2 = ee_model(every_layer=True, gpt2=True)
    eng = Engine(gpt2, None, "self-spec", SelfSpecOptions(exit_layer=2, num_speculations=5),
                 max_batch=2)
    full = eng.submit([3] * 150, SamplingOptions(max_new_tokens=10, ignore_eos=True))
    other = eng.submit([4] * 20, SamplingOptions(max_new_tokens=40, ignore_eos=True))
    eng.run()
    assert full.token_ids == generate(gpt2, None, [3] * 150, max_new_tokens=10,
                                      ignore_eos=True).token_ids[0]
    assert len(other.token_ids) == 40


def test_zero_tokens_and_stop_conditions_per_request() -> None:
    model = ee_model(every_layer=True)
    prompts = random_prompts()
    free = generate(model, None, prompts, max_new_tokens=10).token_ids
    engine = Engine(model, None, "self-spec", SelfSpecOptions(exit_layer=2), max_batch=3)
    r0 = engine.submit(prompts[0], SamplingOptions(max_new_tokens=0))
    r1 = engine.submit(prompts[1], SamplingOptions(max_new_tokens=10,
                                                   stop_token_ids=(free[1][4],)))
    r2 = engine.submit(prompts[2], SamplingOptions(max_new_tokens=10))
    engine.run()
    assert r0.token_ids == [] and r0.finish_reason == "length"
    assert r1.token_ids == free[1][: free[1].index(free[1][4]) + 1]
    assert r1.finish_reason == "stop_token"
    assert r2.token_ids == free[2]


def test_cancel_from_another_thread() -> None:
    model = ee_model(every_layer=True)
    engine = Engine(model, None, "ar", max_batch=2)
    long = engine.submit([1, 2, 3], SamplingOptions(max_new_tokens=150, ignore_eos=True))
    short = engine.submit([4, 5], SamplingOptions(max_new_tokens=8, ignore_eos=True))
    stepped = threading.Event()

    def loop() -> None:
        while engine.has_work():
            engine.step()
            stepped.set()

    t = threading.Thread(target=loop)
    t.start()
    stepped.wait(10)
    engine.cancel(long)
    t.join(30)
    assert not t.is_alive()
    assert long.finish_reason == "cancelled" and len(long.token_ids) < 150
    assert short.finish_reason == "length" and len(short.token_ids) == 8


def test_streamed_updates_concatenate_per_request() -> None:
    """Each request's updates carry its own text only; concatenated they are its text."""
    from _tiny import byte_tokenizer, tiny_text_model

    model, tok = tiny_text_model(), byte_tokenizer()
    engine = Engine(model, tok, "ar", max_batch=3)
    texts: dict[int, list[str]] = {}
    finished: list[int] = []

    def collect(update) -> None:
        texts.setdefault(update.request.id, []).append(update.text)
        if update.finished:
            finished.append(update.request.id)

    reqs = [engine.submit(p, SamplingOptions(max_new_tokens=n, temperature=0.8, seed=1),
                          on_update=collect)
            for p, n in (("Hello", 20), ("The capital of", 7), ("x", 13))]
    engine.run()
    for r in reqs:
        assert "".join(texts[r.id]) == r.text == r.result(model.num_layers).text
    assert sorted(finished) == sorted(r.id for r in reqs)


@pytest.mark.parametrize(
    ("strategy", "opts"),
    [("ar", {}), ("self-spec", {"exit_layer": 2, "num_speculations": 3}),
     ("early-exit", {"threshold": 1.0}), ("ppd", {"ppd_layer": 3})],
)
def test_logprobs_are_the_final_layers_for_lossless_strategies(strategy: str, opts: dict) -> None:
    """Greedy lossless strategies report, per token, the final layer's log-probability (the
    token is its argmax) and the top alternatives - the same numbers a cache-free scoring of
    the output gives."""
    from exitlm.infer.score import score_tokens

    model = ee_model(every_layer=True)
    prompt = random_prompts(sizes=(6,))[0]
    res = generate(model, None, prompt, strategy=strategy, max_new_tokens=10,
                   ignore_eos=True, logprobs=3, **opts)
    seq = res.sequences[0]
    assert seq.logprobs is not None and len(seq.logprobs) == 10
    scored = score_tokens(model, prompt + seq.token_ids, top=3)[len(prompt):]
    for got, want in zip(seq.logprobs, scored, strict=True):
        assert want is not None and got.token == want.token
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert got.top[0][0] == got.token  # greedy: the chosen token is the most likely
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert "logprobs" in seq.to_dict()
    assert generate(model, None, prompt, max_new_tokens=3).sequences[0].logprobs is None


def test_early_exit_logprobs_come_from_the_exit() -> None:
    model = ee_model("linear")
    prompt = random_prompts(sizes=(6,))[0]
    res = generate(model, None, prompt, strategy="early-exit", threshold=0.3, max_new_tokens=12,
                   ignore_eos=True, logprobs=0)
    seq = res.sequences[0]
    assert seq.logprobs is not None
    early = [(lp, layer) for lp, layer in zip(seq.logprobs, seq.exit_layers, strict=True)
             if layer < 4]
    assert early
    for lp, _layer in early:
        assert lp.top == () and lp.logprob >= torch.log(torch.tensor(0.3)).item() - 1e-5
