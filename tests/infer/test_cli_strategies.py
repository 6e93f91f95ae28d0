"""``exitlm generate --strategy ...``: strategy options, --json exit layers, --show-exits."""

from __future__ import annotations

import json

import pytest

from exitlm.cli import main


@pytest.mark.parametrize(
    ("strategy", "flags"),
    [
        ("early-exit", ["--threshold", "0.01", "--max-pending", "2", "--exit-layers", "1,2"]),
        ("early-exit", ["--exit-layer", "2"]),
        ("self-spec", ["--exit-layer", "2", "--num-speculations", "3"]),
        ("ppd", ["--ppd-layer", "2", "--ppd-k", "2"]),
    ],
)
def test_strategies_json(
    strategy: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["Hello"] if strategy == "ppd" else ["Hello", "a longer prompt"]
    rc = main(["generate", *prompts, "--model", "debug", "--max-new-tokens", "6", "--json",
               "--ignore-eos", "--strategy", strategy, *flags])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == strategy
    for seq in out["sequences"]:
        assert len(seq["exit_layers"]) == len(seq["token_ids"]) == 6
        assert all(1 <= x <= 4 for x in seq["exit_layers"])
    if strategy == "early-exit" and "--threshold" in flags:
        assert any(x < 4 for s in out["sequences"] for x in s["exit_layers"])


def test_greedy_strategies_agree_on_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    texts = []
    for strategy in ("ar", "self-spec", "ppd"):
        assert main(["generate", "Hi", "--model", "debug", "--max-new-tokens", "8", "--json",
                     "--strategy", strategy]) == 0
        texts.append(json.loads(capsys.readouterr().out)["sequences"][0]["token_ids"])
    assert texts[0] == texts[1] == texts[2]


def test_ppd_reports_theorem_4_1_next_to_its_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary line and --json give Theorem 4.1's prediction for the measured p_correct."""
    from exitlm.plan.ppd_theory import predict

    args = ["generate", "Hello", "--model", "debug", "--max-new-tokens", "12", "--ignore-eos",
            "--strategy", "ppd", "--ppd-layer", "2", "--ppd-k", "3"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    p = out["stats"]["p_correct"]
    assert out["ppd_theorem_4_1"]["speedup"] == pytest.approx(predict(4, 2, 3, 12, p)["speedup"])
    assert main(args) == 0
    err = capsys.readouterr().err
    expect = predict(4, 2, 3, 12, p)["speedup"]
    assert f"p_correct {p:.1%} (Theorem 4.1 predicts {expect:.2f}x over greedy" in err
    assert main(["generate", "Hello", "--model", "debug", "--max-new-tokens", "4", "--json"]) == 0
    assert "ppd_theorem_4_1" not in json.loads(capsys.readouterr().out)


def test_show_exits_colours_stream(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Hello", "--model", "debug", "--max-new-tokens", "6", "--ignore-eos",
               "--strategy", "early-exit", "--threshold", "0.0", "--show-exits",
               "--color", "always"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "\033[38;5;" in cap.out  # early-exited tokens are coloured
    assert "[exit layers" in cap.err
    rc = main(["generate", "Hello", "--model", "debug", "--max-new-tokens", "6", "--ignore-eos",
               "--strategy", "early-exit", "--threshold", "0.0", "--show-exits"])
    assert "\033[" not in capsys.readouterr().out  # not a terminal: no escapes


def test_option_of_another_strategy_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "Hi", "--model", "debug", "--strategy", "ppd", "--threshold", "0.5"])
    assert rc == 2
    assert "--threshold does not apply to --strategy ppd" in capsys.readouterr().err
