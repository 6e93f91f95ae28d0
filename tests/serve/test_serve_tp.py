"""``exitlm serve --tp 2``: real server processes whose engine runs on two tensor-parallel
ranks (rank 0 serves, the follower replays its submissions and cancellations), driven by the
official ``openai`` client. Answers equal one process's ``generate`` (greedy, seeded
sampling, stop strings, self-speculative decoding, echo log-probabilities) under concurrent
requests, cancellations and idle spells longer than ``--dist-timeout``; a killed follower turns
requests into errors instead of hangs, and ``/health`` into a 503."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _serve_util import Reference, Server, open_stream, start_all

TIMEOUT = ["--dist-timeout", "5"]


@pytest.fixture(scope="module")
def tp_servers(checkpoint: Path) -> Iterator[dict[str, Server]]:
    common = [str(checkpoint), "--served-model-name", "tiny", "--tp", "2", *TIMEOUT]
    running = start_all({
        "ar": ([*common, "--max-batch", "4"], None),
        "self-spec": ([*common, "--strategy", "self-spec", "--exit-layer", "2"], None),
    })
    yield running
    for s in running.values():
        assert s.stop() == 0, s.log


def _complete(server: Server, prompt: str, **kw: object) -> str:
    r = server.client().completions.create(model="tiny", prompt=prompt, **kw)
    return r.choices[0].text


PROMPTS = ["def add(a, b):", "The tensor", "import os\n", "x = [1, 2"]


def test_concurrent_greedy_and_seeded_requests_equal_one_process(
        tp_servers: dict[str, Server], reference: Reference) -> None:
    server = tp_servers["ar"]
    assert "tensor-parallel over 2 processes" in server.log
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        kw = {"max_tokens": 24, "temperature": 0} if i % 2 == 0 else {
            "max_tokens": 24, "temperature": 0.9, "seed": 7 + i}
        answers[i] = _complete(server, PROMPTS[i], **kw)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, prompt in enumerate(PROMPTS):
        kw = {"max_new_tokens": 24} if i % 2 == 0 else {
            "max_new_tokens": 24, "temperature": 0.9, "seed": 7 + i}
        assert answers[i] == reference.run(prompt, **kw).text, i


def test_unseeded_sampling_keeps_the_ranks_together(tp_servers: dict[str, Server],
                                                    reference: Reference) -> None:
    """Each rank drawing its own seed would desynchronise the ranks; a greedy request after
    unseeded sampled ones still gets one process's answer."""
    server = tp_servers["ar"]
    for _ in range(3):
        _complete(server, "Once", max_tokens=30, temperature=1.2)
    assert _complete(server, PROMPTS[0], max_tokens=16, temperature=0) == \
        reference.run(PROMPTS[0], max_new_tokens=16).text


def test_stop_strings_echo_logprobs_and_self_spec(tp_servers: dict[str, Server],
                                                  reference: Reference) -> None:
    server = tp_servers["ar"]
    want = reference.run(PROMPTS[2], max_new_tokens=30)
    stop = want.text[5:7]
    got = _complete(server, PROMPTS[2], max_tokens=30, temperature=0, stop=[stop])
    assert got == reference.run(PROMPTS[2], max_new_tokens=30, stop_strings=(stop,)).text
    assert len(got) < len(want.text)
    r = server.client().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=1,
                                           echo=True, logprobs=1, temperature=0)
    from exitlm.infer.score import score_tokens

    ids = reference.loaded.tokenizer.encode(PROMPTS[1])
    ref = [None if e is None else e.logprob for e in
           score_tokens(reference.loaded.model, ids, top=1)]
    got_lp = r.choices[0].logprobs.token_logprobs[: len(ids)]
    assert got_lp[0] is None and ref[0] is None
    assert got_lp[1:] == pytest.approx(ref[1:], abs=1e-4)
    spec = tp_servers["self-spec"]
    for prompt in PROMPTS[:2]:
        assert _complete(spec, prompt, max_tokens=20, temperature=0) == \
            reference.run(prompt, "self-spec", exit_layer=2, max_new_tokens=20).text


def test_cancelled_streams_and_idle_spells(tp_servers: dict[str, Server],
                                           reference: Reference) -> None:
    """A client that leaves mid-stream is cancelled on both ranks at the same step; an idle
    spell longer than --dist-timeout does not end the follower."""
    server = tp_servers["ar"]
    for _ in range(3):
        conn, res = open_stream(server, {"prompt": "def slow():", "max_tokens": 200,
                                         "temperature": 0, "ignore_eos": True})
        assert res.readline().startswith(b"data: ")
        conn.close()
    time.sleep(6)  # > --dist-timeout 5
    for prompt in PROMPTS[:2]:
        assert _complete(server, prompt, max_tokens=20, temperature=0) == \
            reference.run(prompt, max_new_tokens=20).text


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(x) for x in f.read().split()]


def _follower(pid: int) -> int:
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
            return child
    raise AssertionError(f"no follower process under {pid}")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_followers_leave_signals_to_rank_0(tp_servers: dict[str, Server],
                                           reference: Reference) -> None:
    """A terminal's Ctrl-C (and systemd's SIGTERM) reaches every process of the server; the
    follower ignores them, so rank 0 can drain its requests through it (before, a group
    SIGINT killed the follower and the request in flight failed)."""
    server = tp_servers["ar"]
    follower = _follower(server.proc.pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(follower, sig)
        time.sleep(0.3)
        assert _complete(server, PROMPTS[0], max_tokens=12, temperature=0) == \
            reference.run(PROMPTS[0], max_new_tokens=12).text
    assert _follower(server.proc.pid) == follower


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_a_killed_follower_makes_errors_not_hangs(checkpoint: Path) -> None:
    server = start_all({"tp": ([str(checkpoint), "--served-model-name", "tiny", "--tp", "2",
                               *TIMEOUT], None)})["tp"]
    try:
        assert _complete(server, "a", max_tokens=4, temperature=0)
        os.kill(_follower(server.proc.pid), signal.SIGKILL)
        t0 = time.monotonic()
        status, body = server.call("POST", "/v1/completions",
                                   {"prompt": "b", "max_tokens": 8, "temperature": 0})
        assert status == 500, body
        assert "tensor-parallel decoding worker rank 1 exited" in body["error"]["message"]
        assert time.monotonic() - t0 < 20
        # from then on: 503 at once, and /health says so (a supervisor restarts it)
        status, body = server.call("POST", "/v1/completions", {"prompt": "c", "max_tokens": 2})
        assert status == 503 and "restart the server" in body["error"]["message"], body
        status, body = server.call("GET", "/health")
        assert status == 503 and body["status"] == "unavailable", body
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "2", "--strategy", "ppd"], "--tp runs --strategy ar / early-exit / self-spec"),
    (["--tp", "3"], "--tp 3: expected at most the model's 2 key/value heads"),
    (["--tp", "2", "--strategy", "early-exit", "--kv", "pipeline"], "--kv recompute"),
])
def test_bad_tp_flags_are_one_line(checkpoint: Path, flags: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from exitlm.cli import main

    assert main(["serve", str(checkpoint), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
