"""Bad input never crashes the server or leaks a slot: each is answered with its status and
OpenAI's error object naming the field, and the server goes on serving."""

from __future__ import annotations

from typing import Any

import pytest
from _serve_util import Server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (path, body, status, param): a dict is sent as JSON, bytes as they are
BAD: list[tuple[str, Any, int, str | None]] = [
    (COMPLETIONS, b"{bad json", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, b"\xff\xfe", 400, None),
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, 999]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, "prompt"),  # a lone surrogate
    (COMPLETIONS, b'{"prompt": ["ok", "\\udc00"]}', 400, "prompt[1]"),
    (COMPLETIONS, b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400, None),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "x"}, 400, "model"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 300, "stream": True}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "x" * 300}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "x", "n": 17}, 400, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "stop": ""}, 400, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": 1.0}, 400, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    (COMPLETIONS, {"prompt": "x", "threshold": 0.5}, 400, "threshold"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"x": 1}}, 400, "stream_options"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "messages[0].content"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_tokens": 500}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 400}]}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("/detokenize", {"tokens": [1, 300]}, 400, "tokens"),
    ("/v1/nowhere", {}, 404, None),
]


def test_bad_input_is_answered_and_the_server_goes_on(ar: Server) -> None:
    for path, body, status, param in BAD:
        got, answer = ar.call("POST", path, body)
        assert got == status, (path, body, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, answer
        assert error["param"] == param, (body, error)
        assert error["message"] and "Traceback" not in error["message"]
    assert ar.call("GET", COMPLETIONS)[0] == 405
    health = ar.health()
    assert health["running"] == 0 and health["waiting"] == 0  # no slot leaked
    res = ar.client().completions.create(model="tiny", prompt="ok", max_tokens=3)
    assert res.usage.completion_tokens == 3


def test_openai_client_sees_bad_request(ar: Server) -> None:
    import openai

    client = ar.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert info.value.status_code == 400
    assert "context" in info.value.message
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=USER)


def test_a_temperature_too_small_for_fp32_samples_and_spares_the_batch(ar: Server) -> None:
    """logits / 1e-40 overflows in fp32: it once failed the engine step, and with it every
    request decoding beside it. It samples the top logits now (greedy's tokens here)."""
    import concurrent.futures

    client = ar.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beside = pool.submit(client.completions.create, model="tiny", prompt="Hello",
                             max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        tiny = [client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                          temperature=t, extra_body={"ignore_eos": True})
                for t in (1e-40, 1e-300)]
        assert beside.result().usage.completion_tokens == 24
    greedy = client.completions.create(model="tiny", prompt="Hello", max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert [r.choices[0].text for r in tiny] == [greedy.choices[0].text] * 2
