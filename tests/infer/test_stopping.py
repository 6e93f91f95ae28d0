"""Stop tokens, stop strings, max_new_tokens, streaming, the result type and the entry point."""

from __future__ import annotations

import json

import pytest

from _tiny import byte_tokenizer, tiny_text_model
from exitlm.config import ConfigError
from exitlm.infer import GenerationResult, TextTracker, generate

PROMPTS = ["Hello", "A longer prompt here", "x"]


def _free_run(model, tok, n: int = 24) -> GenerationResult:
    return generate(model, tok, PROMPTS, max_new_tokens=n, ignore_eos=True)


def test_max_new_tokens_respected_per_sequence() -> None:
    model, tok = tiny_text_model(), byte_tokenizer()
    res = _free_run(model, tok, 9)
    assert [len(t) for t in res.token_ids] == [9, 9, 9]
    assert all(s.finish_reason == "length" for s in res.sequences)
    assert res.timings.new_tokens == 27 and res.timings.decode_tokens == 24
    empty = generate(model, tok, PROMPTS, max_new_tokens=0)
    assert empty.token_ids == [[], [], []] and empty.texts == ["", "", ""]


def test_stop_token_ends_each_sequence_independently() -> None:
    model, tok = tiny_text_model(), byte_tokenizer()
    free = _free_run(model, tok).token_ids
    stop = free[1][5]
    res = generate(model, tok, PROMPTS, max_new_tokens=24, ignore_eos=True,
                   stop_token_ids=(stop,))
    for full, seq in zip(free, res.sequences, strict=True):
        if stop in full:
            cut = full.index(stop) + 1
            assert seq.token_ids == full[:cut] and seq.finish_reason == "stop_token"
        else:
            assert seq.token_ids == full and seq.finish_reason == "length"
    assert res.sequences[1].finish_reason == "stop_token"


def test_model_eos_stops_unless_ignored() -> None:
    tok = byte_tokenizer()
    free = _free_run(tiny_text_model(), tok).token_ids
    eos = free[0][3]
    model = tiny_text_model(eos=(eos,))
    res = generate(model, None, [tok.encode(p) for p in PROMPTS], max_new_tokens=24)
    assert res.token_ids[0] == free[0][: free[0].index(eos) + 1]
    assert res.sequences[0].finish_reason == "stop_token"


def test_stop_string_cuts_text_and_ends_sequence() -> None:
    model, tok = tiny_text_model(), byte_tokenizer()
    free = _free_run(model, tok)
    target = free.texts[2]
    stop = target[6:9]
    assert len(stop) == 3
    res = generate(model, tok, PROMPTS, max_new_tokens=24, ignore_eos=True,
                   stop_strings=(stop,))
    seq = res.sequences[2]
    assert seq.finish_reason == "stop_string"
    assert seq.text == target[: target.index(stop)]
    assert stop not in seq.text
    # the tokens up to the one completing the stop string are kept
    assert tok.decode(seq.token_ids).startswith(seq.text + stop)
    for i in (0, 1):
        if stop not in free.texts[i]:
            assert res.sequences[i].text == free.texts[i]


def test_streaming_pieces_concatenate_to_final_text() -> None:
    model, tok = tiny_text_model(), byte_tokenizer()
    free = _free_run(model, tok)
    stop = free.texts[0][10:13]
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    res = generate(model, tok, PROMPTS, max_new_tokens=24, ignore_eos=True,
                   stop_strings=(stop, "zzz"), stream=lambda i, s: pieces[i].append(s))
    for i, seq in enumerate(res.sequences):
        assert "".join(pieces[i]) == seq.text
        assert all(pieces[i])  # no empty pieces
    assert len(pieces[1]) > 1  # really streamed, not one blob at the end


def test_tracker_holds_back_partial_utf8_and_stop_prefixes() -> None:
    tok = byte_tokenizer()
    got: list[str] = []
    tr = TextTracker(tok, stop_strings=("END",), stream=lambda _i, s: got.append(s))
    for b in "héllo E".encode():
        tr.push(b)
    assert "".join(got) == "héllo "  # 'E' may start "END"; 'é' came out whole
    for b in b"NDx":
        if tr.push(b):
            break
    assert tr.text == "héllo " and "".join(got) == "héllo "


def test_result_json_and_unknown_strategy() -> None:
    model, tok = tiny_text_model(), byte_tokenizer()
    res = generate(model, tok, "Hi", max_new_tokens=4, ignore_eos=True)
    d = json.loads(res.to_json())
    assert d["strategy"] == "ar"
    assert d["sequences"][0]["token_ids"] == res.token_ids[0]
    assert d["sequences"][0]["exit_layers"] == [model.num_layers] * 4
    assert set(d["timings"]) >= {"prefill_s", "decode_s", "decode_tokens_per_s",
                                 "time_to_first_token_s", "new_tokens"}
    assert res.text == res.sequences[0].text
    with pytest.raises(ConfigError, match=r"available: \['ar'"):
        generate(model, tok, "Hi", strategy="nope")
    with pytest.raises(ConfigError, match="unknown generation options"):
        generate(model, tok, "Hi", max_tokens=3)
