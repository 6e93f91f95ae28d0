"""``exitlm convert`` and ``exitlm info``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitlm.cli import main
from exitlm.config import DraftHint
from exitlm.io import load_model


def test_convert_preset_to_both_formats_and_info(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "debug", str(tmp_path / "ex")]) == 0
    assert main(["convert", str(tmp_path / "ex"), str(tmp_path / "hf"), "--to", "hf",
                 "--dtype", "bf16"]) == 0
    assert (tmp_path / "hf" / "exitlm_exits.json").is_file()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_model(str(tmp_path / "hf"), dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    capsys.readouterr()
    assert main(["info", str(tmp_path / "ex"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    p = info["parameters"]
    assert p["total"] == p["backbone"] + p["exit_heads"] and p["exit_heads"] > 0
    assert info["exits"]["layers"] == [1, 2] and info["layers"] == 4
    assert main(["info", "debug"]) == 0
    assert "exit heads" in capsys.readouterr().out


def test_convert_records_a_draft_hint(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``--draft E,D`` writes exits.draft into the copy (checked against its exits);
    ``exitlm info`` shows it and self-speculation on the copy drafts there."""
    dst = tmp_path / "hinted"
    assert main(["convert", "debug", str(dst), "--draft", "2,3"]) == 0
    assert load_model(str(dst)).config.exits.draft == DraftHint(2, 3)
    capsys.readouterr()
    assert main(["info", str(dst)]) == 0
    assert "measured best round: exit 2, 3 drafts" in capsys.readouterr().out
    assert main(["convert", "debug", str(tmp_path / "hf"), "--to", "hf", "--draft", "1,2"]) == 0
    assert load_model(str(tmp_path / "hf")).config.exits.draft == DraftHint(1, 2)
    # a round measured with a quantized copy's drafts (--draft-weights) names its weights
    for fmt in ("exitlm", "hf"):
        out = tmp_path / f"copy-{fmt}"
        assert main(["convert", "debug", str(out), "--to", fmt, "--draft", "2,4,int4"]) == 0
        assert load_model(str(out)).config.exits.draft == DraftHint(2, 4, "int4")
    capsys.readouterr()
    assert main(["info", str(tmp_path / "copy-exitlm")]) == 0
    assert "exit 2, 4 drafts through an int4 copy" in capsys.readouterr().out
    for args, needle in ((["--draft", "3,3"], "--draft 3,3: exits.draft.exit_layer is 3, "
                                              "which is not an exit of this model"),
                         (["--draft", "3,3,int8"], "--draft 3,3,int8: exits.draft.exit_layer "
                                                   "is 3"),
                         (["--draft", "2,3", "--to", "megatron"], "drop --to megatron")):
        assert main(["convert", "debug", str(tmp_path / "bad"), *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()
    with pytest.raises(SystemExit) as exit_:  # the argument itself: argparse's own line
        main(["convert", "debug", str(tmp_path / "bad"), "--draft", "2,0"])
    assert exit_.value.code == 2 and not (tmp_path / "bad").exists()
    assert "expected E,D with E >= 1 and D in [1, 64], got '2,0'" in capsys.readouterr().err


def test_convert_records_an_early_exit_threshold(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--threshold T`` writes exits.threshold into the copy (exitlm and HF formats; an
    exit-head bundle keeps it too); ``exitlm info`` shows it; early exit on the copy takes it
    as its default."""
    for fmt in ("exitlm", "hf"):
        out = tmp_path / fmt
        assert main(["convert", "debug", str(out), "--to", fmt, "--threshold", "0.95"]) == 0
        assert load_model(str(out)).config.exits.threshold == 0.95
    capsys.readouterr()
    assert main(["info", str(tmp_path / "exitlm")]) == 0
    assert "early exit    threshold 0.95" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "exitlm"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["exits"]["threshold"] == 0.95
    from exitlm.infer import generate

    res = generate(load_model(str(tmp_path / "exitlm")).model, None, [[1, 2, 3]],
                   strategy="early-exit", max_new_tokens=2)
    assert res.options["threshold"] == 0.95
    assert main(["convert", "debug", str(tmp_path / "bad"), "--threshold", "0.9", "--to",
                 "megatron"]) == 2
    assert "drop --to megatron" in capsys.readouterr().err
    for bad in ("1.5", "-0.1", "nan", "high"):
        with pytest.raises(SystemExit) as exit_:
            main(["convert", "debug", str(tmp_path / "bad"), "--threshold", bad])
        assert exit_.value.code == 2 and not (tmp_path / "bad").exists()
        err = capsys.readouterr().err
        assert "--threshold" in err and "Traceback" not in err, err


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_convert_a_quantized_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A quantized checkpoint is written again as it is; re-quantizing it to another kind or
    exporting float formats from it is refused (--quantize int8 on int4 weights had written
    int4 and said nothing), and --rank without --delta-from is not silently ignored."""
    q4 = tmp_path / "q4"
    assert main(["convert", "debug", str(q4), "--quantize", "int4"]) == 0
    assert main(["convert", str(q4), str(tmp_path / "again"), "--quantize", "int4"]) == 0
    capsys.readouterr()
    for argv, needle in (
            (["--quantize", "int8"], "int4-quantized already"),
            (["--to", "hf"], "--to hf needs float weights"),
            (["--to", "megatron"], "--to megatron needs float weights")):
        assert main(["convert", str(q4), str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()
    assert main(["convert", "debug", str(tmp_path / "out"), "--rank", "3"]) == 2
    assert "add --delta-from" in capsys.readouterr().err
