"""``exitlm generate`` on presets and on a tiny saved model."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from _tiny import byte_tokenizer, tiny_text_model
from exitlm.cli import main
from exitlm.infer.cli import COMPARE_RUNS, COMPARE_SHORT_S, comparison
from exitlm.io import save_model


def test_generate_json_on_preset(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Hello", "a longer prompt", "--model", "debug",
               "--max-new-tokens", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"] == ["Hello", "a longer prompt"]
    assert [len(s["token_ids"]) for s in out["sequences"]] == [5, 5]
    assert out["timings"]["new_tokens"] == 10 and "decode_tokens_per_s" in out["timings"]
    # -p / --prompt add prompts after the PROMPT arguments (and --prompt is not taken for an
    # abbreviation of --prompts-file)
    rc = main(["generate", "Hello", "--prompt", "a longer prompt", "-p", "third", "--model",
               "debug", "--max-new-tokens", "2", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == ["Hello", "a longer prompt", "third"]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    save_model(tiny_text_model(), d, byte_tokenizer())
    return d


def test_generate_streams_single_prompt(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Hi", "--model", str(saved), "--max-new-tokens", "6",
               "--ignore-eos"])
    assert rc == 0
    cap = capsys.readouterr()
    rc = main(["generate", "Hi", "--model", str(saved), "--max-new-tokens", "6",
               "--ignore-eos", "--json"])
    expected = json.loads(capsys.readouterr().out)["sequences"][0]["text"]
    assert cap.out == expected + "\n"
    assert "tokens/s" in cap.err


def test_generate_sampling_stop_and_prompts_file(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pf = tmp_path / "prompts.txt"
    pf.write_text("first\n\nsecond\n")
    args = ["generate", "--prompts-file", str(pf), "--model", str(saved), "--json",
            "--max-new-tokens", "8", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9",
            "--seed", "3", "--stop", "\x00", "--dtype", "bfloat16"]
    assert main(args) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["prompts"] == ["first", "second"]
    assert [s["token_ids"] for s in a["sequences"]] == [s["token_ids"] for s in b["sequences"]]


def test_generate_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "debug"]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "debug", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    # a probability threshold above 1 is refused (it would silently never exit)
    assert main(["generate", "x", "--model", "debug", "--strategy", "early-exit",
                 "--threshold", "2"]) == 2
    assert "threshold" in capsys.readouterr().err


def test_generate_compare_reports_speedup_and_identity(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--compare decodes the prompts with plain decoding too: self-spec (lossless) is
    reported identical, an early exit at threshold 0 (lossy) is not; the JSON carries the
    figures; it refuses to combine with --tp."""
    base = ["generate", "Hello there", "--model", str(saved), "--max-new-tokens", "12",
            "--ignore-eos", "--threads", "1", "--compare"]
    assert main([*base, "--strategy", "self-spec", "--exit-layer", "1"]) == 0
    err = capsys.readouterr().err
    assert "self-spec decodes" in err and "identical to plain decoding" in err
    # 12 tokens decode in well under COMPARE_SHORT_S: the fastest of COMPARE_RUNS runs each
    assert f"(the fastest of {COMPARE_RUNS} runs each)" in err
    assert main([*base, "--strategy", "early-exit", "--threshold", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cmp = out["compare_ar"]
    assert cmp["speedup"] > 0 and cmp["ar_decode_tokens_per_s"] > 0
    assert cmp["runs"] == COMPARE_RUNS
    assert main([*base[:-1], "--json"]) == 0  # plain decoding on its own
    ar = json.loads(capsys.readouterr().out)
    same = out["sequences"][0]["token_ids"] == ar["sequences"][0]["token_ids"]
    assert cmp["identical"] is same
    assert main([*base, "--tp", "2"]) == 2
    assert "--compare" in capsys.readouterr().err
    assert main(base) == 2  # plain decoding compared with itself
    assert "--strategy ar is plain decoding" in capsys.readouterr().err


def test_compare_repeats_short_runs_only_and_keeps_the_fastest() -> None:
    def run(seconds: float, rate: float, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(token_ids=[tokens], timings=SimpleNamespace(
            decode_s=seconds, decode_tokens_per_s=rate))

    rates = iter([30.0, 50.0, 20.0, 10.0, 40.0])
    short = COMPARE_SHORT_S / 10
    got = comparison(run(short, 100.0, [1, 2]), lambda: run(short, next(rates), [1, 2]),
                     lambda: run(short, next(rates), [1, 2]))
    assert got["runs"] == COMPARE_RUNS and got["identical"]
    # alternating: plain 30, strategy 50, plain 20, strategy 10, plain 40
    assert got["decode_tokens_per_s"] == 100.0 and got["ar_decode_tokens_per_s"] == 40.0
    calls: list[int] = []
    long = comparison(run(2 * COMPARE_SHORT_S, 60.0, [1]), lambda: calls.append(1) or run(
        0.0, 1.0, [1]), lambda: run(2 * COMPARE_SHORT_S, 30.0, [1]))
    assert long["runs"] == 1 and not calls and long["speedup"] == 2.0
    # a repeat that differs from plain decoding's tokens makes the output not identical
    seq = iter([[1, 2], [1, 3]])
    odd = comparison(run(short, 1.0, [1, 2]), lambda: run(short, 1.0, next(seq)),
                     lambda: run(short, 1.0, [1, 2]))
    assert not odd["identical"]


def test_compare_with_nothing_decoded_after_the_first_token_says_so(
        saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--max-new-tokens 1: the first token comes from the prompt, nothing is decoded, so
    there is no speed to compare: the line says so (no "nanx as fast"), the JSON's speedup is
    null (valid JSON, no NaN)."""
    base = ["generate", "Hello there", "--model", str(saved), "--max-new-tokens", "1",
            "--threads", "1", "--compare", "--strategy", "self-spec", "--exit-layer", "1"]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "stopped after the first token" in err and "nan" not in err
    assert "identical to plain decoding" in err
    assert main([*base, "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out and json.loads(out)["compare_ar"]["speedup"] is None


@pytest.mark.parametrize("make", [
    lambda d: Path("/dev/zero"),  # endless: stat() says 0 bytes
    lambda d: d,  # a directory
])
def test_prompts_file_is_read_within_a_limit(make, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = make(tmp_path)
    assert main(["generate", "--prompts-file", str(path), "--model", "debug"]) == 2
    err = capsys.readouterr().err
    assert f"--prompts-file {path}: " in err and "not a regular file" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_prompts_file_over_the_limit_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("exitlm.infer.cli.MAX_PROMPTS_BYTES", 10)
    pf = tmp_path / "p.txt"
    pf.write_text("0123456789\n")
    assert main(["generate", "--prompts-file", str(pf), "--model", "debug"]) == 2
    assert "larger than 10 bytes" in capsys.readouterr().err
