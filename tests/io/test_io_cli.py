"""``exitlm convert`` and ``exitlm info``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitlm.cli import main
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


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
