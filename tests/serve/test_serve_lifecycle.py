"""The server under failure and load, on one row and a queue of one: an engine failure is a
500 (mid-stream: one error event, then ``[DONE]``) and the server goes on; a full queue is a
503 with Retry-After at once (and only when the queue has no room); a client that disconnects
frees its row; SIGINT drains requests in flight and exits with status 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from _serve_util import Server, open_stream, sse_events

# at least 240 x 5 ms on the faulty server (SLOW), however fast the machine decodes
LONG = {"prompt": "SLOW: tell me", "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def _cancelled(server: Server) -> float:
    return server.metric('exitlm_requests_total{finish_reason="cancelled"}')


def test_engine_failure_is_a_500_and_the_server_goes_on(faulty: Server) -> None:
    import openai

    status, body = faulty.call("POST", "/v1/completions",
                               {"prompt": "FAIL now", "max_tokens": 5, "temperature": 0})
    assert status == 500
    assert body["error"]["type"] == "server_error" and "injected" in body["error"]["message"]
    # streamed: chunks of the first token (from the prefill), one error event, [DONE]
    conn, res = open_stream(faulty, {"prompt": "FAIL now", "max_tokens": 5, "temperature": 0})
    events = sse_events(res)
    conn.close()
    assert res.status == 200 and events[-1] == "[DONE]"
    assert "injected" in json.loads(events[-2])["error"]["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])
    with pytest.raises(openai.APIError, match="injected"):
        list(faulty.client().completions.create(model="tiny", prompt="FAIL", max_tokens=5,
                                                stream=True, temperature=0))
    res = faulty.client().completions.create(model="tiny", prompt="fine", max_tokens=4,
                                             temperature=0)
    assert res.usage.completion_tokens == 4
    health = faulty.health()
    assert health["engine_failures"] == 3 and health["running"] == 0
    assert "engine step failed" in faulty.log and "RuntimeError: injected failure" in faulty.log


def test_full_queue_is_a_503_at_once_and_disconnects_free_the_row(faulty: Server) -> None:
    cancelled = _cancelled(faulty)
    conn, res = open_stream(faulty, LONG)  # takes the only row
    assert res.readline().startswith(b"data: ")
    queued: dict[str, object] = {}

    def wait_in_queue() -> None:
        queued["answer"] = faulty.call("POST", "/v1/completions",
                                       {"prompt": "queued", "max_tokens": 3, "temperature": 0})

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    faulty.wait_for(lambda: faulty.health()["waiting"] == 1)
    t0 = time.monotonic()
    status, body, headers = faulty.exchange("POST", "/v1/completions", {"prompt": "one more"})
    assert status == 503 and body["error"]["code"] == "queue_full"
    assert headers["retry-after"] == "1"
    assert time.monotonic() - t0 < 5
    # even now, a request that can never be served is a 400, not a 503: too long a prompt,
    # and more prompts than the whole queue holds (queued first, it would never fit)
    for bad, option in (({"prompt": "x" * 300}, "context"), ({"prompt": ["a", "b"]},
                                                             "--max-queue")):
        status, body = faulty.call("POST", "/v1/completions", bad)
        assert status == 400 and option in body["error"]["message"], body
    assert faulty.health()["waiting"] == 1  # the refused requests left nothing queued
    conn.close()  # the streaming client goes away: its row goes to the queued request
    waiter.join(30)
    status, body = queued["answer"]  # type: ignore[misc]
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    faulty.wait_for(lambda: _cancelled(faulty) == cancelled + 1)
    assert faulty.health()["running"] == 0


def test_unstreamed_client_that_disconnects_frees_the_row(faulty: Server) -> None:
    import openai

    cancelled = _cancelled(faulty)
    with pytest.raises(openai.APITimeoutError):
        faulty.client(timeout=0.2).completions.create(
            model="tiny", prompt=LONG["prompt"], max_tokens=LONG["max_tokens"],
            temperature=0, extra_body={"ignore_eos": True})
    faulty.wait_for(lambda: _cancelled(faulty) == cancelled + 1)
    faulty.wait_for(lambda: faulty.health()["running"] == 0)
    res = faulty.client().completions.create(model="tiny", prompt="next", max_tokens=2)
    assert res.usage.completion_tokens == 2


def test_sigint_drains_requests_in_flight(faulty: Server) -> None:
    conn, res = open_stream(faulty, LONG)
    assert res.readline().startswith(b"data: ")
    faulty.proc.send_signal(signal.SIGINT)
    events = sse_events(res)  # the stream runs to its end
    conn.close()
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["choices"] for e in events[:-1]]
    assert [c[0]["finish_reason"] for c in texts if c][-1] == "length"
    assert faulty.proc.wait(30) == 0
    assert "shutting down" in faulty.log and "exitlm serve: stopped" in faulty.log
    # one log line per request, the drained one included
    drained = [line for line in faulty.lines if "completion_tokens=240" in line]
    assert len(drained) == 1 and '"POST /v1/completions" 200' in drained[0]
