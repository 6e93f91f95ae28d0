"""``exitlm train`` / ``exitlm eval`` end to end on a tiny corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from _train_util import tiny_config
from exitlm.cli import main
from exitlm.config import ConfigError
from exitlm.train.config import PRESETS, load_config


def test_train_then_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tmp_path, train={"steps": 3})
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["train", "--config", str(file), "train.steps=2", "loss.kind=final"]) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps" in out
    model_dir = tmp_path / "run" / "model"
    corpus = cfg.data.paths[0]
    assert main(["eval", str(model_dir), "--data", corpus, "--seq-len", "32",
                 "--max-samples", "4", "--json", "--layers", "all"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [e["layer"] for e in res["exits"]] == [1, 2, 3, 4]
    assert res["exits"][-1]["agree_top1"] == 1.0
    assert main(["eval", str(model_dir), "--data", corpus, "--seq-len", "32",
                 "--max-samples", "4"]) == 0
    assert "ppl" in capsys.readouterr().out


def test_config_errors_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", "tiny", "model.exits.layers=[7]"]) == 2
    assert "exits are counted from 1" in capsys.readouterr().err
    assert main(["train", "--config", "nope"]) == 2
    assert main(["train", "--config", "tiny", "bogus.key=1"]) == 2
    assert main(["train", "--config", "tiny", "optim.lr=-1"]) == 2


def test_presets_and_yaml_files_parse() -> None:
    for name in PRESETS:
        load_config(name)
    for file in sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml")):
        load_config(str(file))


def test_overridden_depth_takes_the_given_exits() -> None:
    """model.overrides.num_layers with model.exits: the new exits are checked against the new
    depth; the preset's own exits (deeper than 2 layers) once were, and refused the config."""
    cfg = load_config("tiny", ["model.overrides.num_layers=2", "model.exits.layers=[1]",
                               "loss.exit_weights=[0.5]"])
    model = cfg.model.preset_config()
    assert model.num_layers == 2 and model.exit_layers == (1,)
    with pytest.raises(ConfigError, match=r"exits\.layers contains 3"):
        load_config("tiny", ["model.overrides.num_layers=2",
                             "model.exits.layers=[3]"]).model.preset_config()
