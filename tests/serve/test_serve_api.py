"""``exitlm serve`` through the official ``openai`` client: completions and chat, streamed
text equal to unstreamed, usage, greedy output equal to generation alone, n and seeds, stop
strings, log-probabilities (echo included), exit layers, tokenize/detokenize, models,
metrics and the request log."""

from __future__ import annotations

import math

import pytest
from _serve_util import Reference, Server

from exitlm.infer.score import score_tokens

pytest.importorskip("openai")

PROMPTS = ["Hello", "def f(x):\n    return", "a"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_generate_and_stream(ar: Server, reference: Reference,
                                                      prompt: str) -> None:
    client = ar.client()
    res = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                    temperature=0)
    alone = reference.run(prompt, max_new_tokens=12)
    choice = res.choices[0]
    assert choice.text == alone.text
    assert choice.finish_reason == "length"
    assert res.usage.prompt_tokens == len(prompt.encode())
    assert res.usage.completion_tokens == 12 == len(alone.token_ids)
    assert res.usage.total_tokens == res.usage.prompt_tokens + 12
    assert res.model == "tiny" and res.object == "text_completion"

    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == res.usage.prompt_tokens


def test_chat_equals_generate_with_the_chat_template(ar: Server, reference: Reference) -> None:
    client = ar.client()
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    res = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                         temperature=0)
    alone = reference.run("What is 2+2?", chat=True, max_new_tokens=10)
    assert res.choices[0].message.content == alone.text
    assert res.choices[0].message.role == "assistant"
    assert res.usage.prompt_tokens == alone.prompt_tokens
    assert res.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.text
    assert chunks[-1].choices[0].finish_reason == "length"
    # parts of text content are joined; the default max_tokens is the rest of the context
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                          {"type": "text", "text": "2+2?"}]}]
    res2 = client.chat.completions.create(model="tiny", messages=parts, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert res2.choices[0].message.content.startswith(alone.text)
    assert res2.usage.total_tokens == 256  # the context


def test_n_and_seeds(ar: Server, reference: Reference) -> None:
    client = ar.client()
    kw = {"model": "tiny", "prompt": "Once", "max_tokens": 10, "temperature": 0.9, "seed": 7}
    a = client.completions.create(n=3, **kw)
    b = client.completions.create(n=3, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible
    assert [c.index for c in a.choices] == [0, 1, 2]
    for j, c in enumerate(a.choices):  # choice j is seeded seed + j, like generate()
        assert c.text == reference.run("Once", max_new_tokens=10, temperature=0.9,
                                       seed=7 + j).text
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 30 and a.usage.prompt_tokens == 4
    streamed = client.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]


def test_batched_prompts_and_token_ids(ar: Server, reference: Reference) -> None:
    client = ar.client()
    res = client.completions.create(model="tiny", prompt=["Hi", "Hello there"], n=2,
                                    max_tokens=6, temperature=0)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    want = [reference.run(p, max_new_tokens=6).text for p in ("Hi", "Hello there")]
    assert [c.text for c in res.choices] == [want[0], want[0], want[1], want[1]]
    ids = list(b"Hello there")
    res = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert res.choices[0].text == want[1]
    res = client.completions.create(model="tiny", prompt=[ids, list(b"Hi")], max_tokens=6,
                                    temperature=0)
    assert [c.text for c in res.choices] == [want[1], want[0]]


def test_a_shared_start_is_reported_cached(ar: Server, reference: Reference) -> None:
    """Two prompts beginning with one 40-token start: the engine fills it once and copies it
    for the other, which usage reports as that prompt's ``cached_tokens`` (and the metrics
    count); the texts are what each prompt gives alone. ``n`` choices of a prompt prefill it
    once among themselves: nothing of it was cached."""
    client = ar.client()
    start = "def shared_system_prompt(x):  return x + 1\n"[:40]
    prompts = [start + "a = 1", start + "b = 22"]
    before = ar.metric("exitlm_prompt_tokens_cached_total")
    res = client.completions.create(model="tiny", prompt=prompts, max_tokens=8,
                                    temperature=0)
    assert [c.text for c in res.choices] == [reference.run(p, max_new_tokens=8).text
                                             for p in prompts]
    assert res.usage.prompt_tokens_details.cached_tokens == 40
    ar.wait_for(lambda: ar.metric("exitlm_prompt_tokens_cached_total") >= before + 40)
    res = client.completions.create(model="tiny", prompt=start + "c", n=3, max_tokens=4,
                                    temperature=0.9, seed=1)
    assert res.usage.prompt_tokens_details.cached_tokens == 0


def test_stop_strings(ar: Server, reference: Reference) -> None:
    client = ar.client()
    full = reference.run("Hello", max_new_tokens=16).text
    stop = full[5:7]
    assert stop and stop not in full[:5]
    res = client.completions.create(model="tiny", prompt="Hello", max_tokens=16,
                                    temperature=0, stop=[stop, "never here"])
    assert res.choices[0].text == full[:5]
    assert res.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=16,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:5]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_echo(ar: Server, reference: Reference) -> None:
    client = ar.client()
    res = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                    temperature=0, logprobs=3)
    lp = res.choices[0].logprobs
    alone = reference.run("Hello", max_new_tokens=5, logprobs=3)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in alone.logprobs], abs=1e-5)
    assert len(lp.tokens) == 5
    for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the best one
        assert 3 <= len(top) <= 4

    # lm-evaluation-harness's log-likelihood request: token ids, echo, 1 new token
    ids = list(b"The cat sat")
    res = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0,
                                    logprobs=1, echo=True)
    choice = res.choices[0]
    assert choice.text.startswith("The cat sat")
    scored = score_tokens(reference.loaded.model, ids, top=1)
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids) + 1
    assert got[1:len(ids)] == pytest.approx([s.logprob for s in scored[1:]], abs=1e-4)
    assert all(math.isfinite(x) and x <= 0 for x in got[1:])
    # echo without new tokens returns the prompt
    res = client.completions.create(model="tiny", prompt="abc", max_tokens=0, echo=True)
    assert res.choices[0].text == "abc" and res.usage.completion_tokens == 0

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    raw = b"".join(bytes(c.bytes) for c in content)  # each token's own bytes
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content


def test_exit_layers_and_early_exit_summary(ar: Server) -> None:
    client = ar.client()
    res = client.completions.create(model="tiny", prompt="Hello", max_tokens=7,
                                    temperature=0, extra_body={"return_exit_layers": True})
    body = res.model_dump()
    assert body["choices"][0]["exit_layers"] == [4] * 7  # plain decoding: full depth
    summary = body["early_exit"]
    assert summary["strategy"] == "ar" and summary["tokens_per_layer"] == {"4": 7}
    assert summary["layer_evaluations"] == summary["full_depth_evaluations"] == 28
    chunks = [c.model_dump() for c in client.completions.create(
        model="tiny", prompt="Hello", max_tokens=7, temperature=0, stream=True,
        extra_body={"return_exit_layers": True})]
    assert [x for c in chunks for x in c["choices"][0]["exit_layers"]] == [4] * 7
    assert chunks[-1]["early_exit"]["tokens_per_layer"] == {"4": 7}


def test_models_tokenize_detokenize(ar: Server) -> None:
    models = ar.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    extra = models.data[0].model_dump()["exitlm"]
    assert extra["strategy"] == "ar" and extra["num_layers"] == 4
    status, body = ar.call("POST", "/tokenize", {"prompt": "héllo"})
    assert status == 200 and body["tokens"] == list("héllo".encode()) and body["count"] == 6
    status, body = ar.call("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "héllo"
    status, body = ar.call("POST", "/tokenize",
                           {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and bytes(body["tokens"]).decode().endswith("assistant\n")


def test_metrics_and_request_log(ar: Server) -> None:
    before = ar.metric("exitlm_generation_tokens_total")
    ar.client().completions.create(model="tiny", prompt="Hey", max_tokens=3, temperature=0)
    ar.wait_for(lambda: ar.metric("exitlm_generation_tokens_total") >= before + 3)
    assert ar.metric('exitlm_generation_tokens_by_exit_layer_total{layer="4"}') >= 3
    assert ar.metric("exitlm_queue_depth") == 0
    assert ar.metric("exitlm_layer_evaluations_saved") == 0
    assert any('"POST /v1/completions" 200' in line and "completion_tokens=3" in line
               for line in ar.lines)
