"""PPD with its branches in a spawned worker process (``ppd_workers="process"``): token-identical
to greedy decoding with real processes (hits and misses), the CLI flag, and a worker that
dies, fails or hangs is reported and terminated, never waited on forever."""

from __future__ import annotations

import json
import os
import signal

import pytest

from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401
from exitlm.cli import main
from exitlm.config import ConfigError
from exitlm.infer import generate
from exitlm.infer.engine import Engine
from exitlm.infer.executors import ppd_worker as ppd_workers
from exitlm.infer.executors.ppd_worker import BranchWorker, BranchWorkerError
from exitlm.infer.options import SamplingOptions
from exitlm.infer.ppd import PPDOptions

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


@pytest.mark.parametrize(("head", "every", "gpt2"), [("linear", True, False),
                                                     ("block", False, True)])
def test_process_ppd_is_token_identical_to_greedy(head: str, every: bool, gpt2: bool) -> None:
    """Several prompts per engine (one worker serves them one after another); d_bar and k
    chosen so that some guesses miss and some hit."""
    model = ee_model(head, every_layer=every, gpt2=gpt2)
    prompts = random_prompts(sizes=(5, 2, 9))
    ar = generate(model, None, prompts, max_new_tokens=NEW).token_ids
    for d_bar, k in ((2, 1), (3, 2)):
        got = generate(model, None, prompts, strategy="ppd", ppd_layer=d_bar, ppd_k=k,
                       ppd_workers="process", max_new_tokens=NEW)
        assert got.token_ids == ar, (d_bar, k)
        st = got.stats
        assert st.forks == len(prompts) * (NEW - 2)
        assert 0 < st.matches < st.forks, (d_bar, k, st.matches)  # hits and misses
        assert got.options["ppd_workers"] == "process"
        # the worker makes the early predictions itself (linear exits): the same guesses as
        # the main thread's, so the same matches as sequential PPD and as pool threads
        for how in ({"parallel": False}, {"ppd_workers": "thread"}):
            ref = generate(model, None, prompts, strategy="ppd", ppd_layer=d_bar, ppd_k=k,
                           max_new_tokens=NEW, **how)  # type: ignore[arg-type]
            assert ref.token_ids == ar
            assert (ref.stats.forks, ref.stats.matches) == (st.forks, st.matches), how


def test_engine_shares_weights_restarts_and_stops_its_worker() -> None:
    model = ee_model(every_layer=True)
    prompt = random_prompts(sizes=(4,))[0]
    ar = generate(model, None, prompt, max_new_tokens=8).token_ids[0]
    engine = Engine(model, None, "ppd", PPDOptions(ppd_layer=3, ppd_workers="process"),
                    max_batch=1, threads=1, prefill_chunk=3)  # the prompt's parts: 3, then 1
    try:
        req = engine.submit(prompt, SamplingOptions(max_new_tokens=8))
        engine.run()
        first = engine.decoder.branches.worker  # type: ignore[attr-defined]
        assert req.token_ids == ar and first.alive
        # the worker built its model on the parent's parameter storage, in shared memory
        assert all(p.is_shared() for p in model.parameters())
        first.proc.kill()  # a worker lost between requests is replaced at the next prefill
        first.proc.join(10)
        req = engine.submit(prompt, SamplingOptions(max_new_tokens=8))
        engine.run()
        second = engine.decoder.branches.worker  # type: ignore[attr-defined]
        assert req.token_ids == ar and second is not first and second.alive
    finally:
        engine.close()
    assert not second.alive


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    out = []
    for extra in ([], ["--ppd-workers", "process"]):
        assert main(["generate", "Hi", "--model", "debug", "--max-new-tokens", "8", "--json",
                     "--ignore-eos", "--strategy", "ppd", "--ppd-layer", "2", *extra]) == 0
        out.append(json.loads(capsys.readouterr().out)["sequences"][0]["token_ids"])
    assert out[0] == out[1] and len(out[0]) == 8


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="no-parallel"):
        PPDOptions(ppd_workers="process", parallel=False)
    with pytest.raises(ConfigError, match="ppd_workers"):
        PPDOptions(ppd_workers="fork")  # type: ignore[arg-type]


def test_failing_dead_and_hung_workers_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three workers started together: one fails (a fork before its cache is attached), one
    is killed, one is stopped (SIGSTOP) and must time out; all end terminated."""
    model = ee_model(every_layer=True)
    failing, dead, hung = (BranchWorker(model, 1) for _ in range(3))
    try:
        for w in (failing, dead, hung):
            w.wait_ready()
        failing.fork(3, [1])
        with pytest.raises(BranchWorkerError, match="fork before attach"):
            failing.join()
        dead.proc.kill()
        dead.proc.join(10)
        with pytest.raises(BranchWorkerError, match=r"gone|exited"):
            dead.fork(3, [1])
            dead.join()
        monkeypatch.setattr(ppd_workers, "STEP_TIMEOUT_S", 0.5)
        os.kill(hung.proc.pid, signal.SIGSTOP)
        with pytest.raises(BranchWorkerError, match="did not answer"):
            hung.ping(1)
        for w in (failing, dead, hung):
            assert not w.alive
    finally:
        for w in (failing, dead, hung):
            w.close()


def test_process_ppd_at_the_pool_and_context_edges() -> None:
    """Every token a candidate (k = vocabulary): every fork is confirmed, each from another
    shared row; prompts crossing the pool's 64-position unit and filling the whole context."""
    model = ee_model(every_layer=True)
    prompts = random_prompts(sizes=(60, 150))
    ar = generate(model, None, prompts, max_new_tokens=10).token_ids
    got = generate(model, None, prompts, strategy="ppd", ppd_layer=2, ppd_k=23,
                   ppd_workers="process", max_new_tokens=10)
    assert got.token_ids == ar
    assert got.stats.matches == got.stats.forks == 2 * (10 - 2)
