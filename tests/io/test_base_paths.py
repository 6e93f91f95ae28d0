"""A bundle's or a delta's relative ``base`` is relative to its own directory, not to the
working directory: what ``exitlm train`` (exit tuning) and ``exitlm convert --delta-from``
record loads from anywhere. Bundles written by older exitlm (format 1, a path relative to the
working directory of the run that wrote them) still load, never silently from another model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exitlm.cli import main
from exitlm.config import ExitConfig, preset
from exitlm.errors import ExitlmWarning
from exitlm.io import load_model, save_model
from exitlm.io.bundle import BUNDLE_META, save_bundle
from exitlm.io.delta import DELTA_META
from exitlm.io.hf_map import CheckpointError
from exitlm.model.transformer import EarlyExitLM

HEADS = ExitConfig(layers=(1,), head="mlp")


def _base(path: Path, seed: int = 0) -> Path:
    """A tiny saved backbone (2 layers, dim 32)."""
    torch.manual_seed(seed)
    cfg = preset("debug", dim=32, num_layers=2, num_heads=2, num_kv_heads=2, hidden_dim=64,
                 exits=ExitConfig())
    return save_model(EarlyExitLM(cfg).eval(), path)


def _heads_on(base: Path) -> EarlyExitLM:
    return load_model(str(base), exits=HEADS).model


def _final(model: EarlyExitLM) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(8)[None]).logits


def _set_base(bundle: Path, base: str, fmt: int) -> None:
    meta = json.loads((bundle / BUNDLE_META).read_text())
    (bundle / BUNDLE_META).write_text(json.dumps({**meta, "base": base, "format": fmt}))


def test_a_bundle_on_a_relative_path_loads_from_any_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit tuning records ``model.init`` as the user gave it (relative to where the run
    started); the bundle records it relative to itself."""
    work = tmp_path / "work"
    base = _base(work / "runs" / "ls" / "model")
    monkeypatch.chdir(work)
    bundle = save_bundle(_heads_on(base), Path("runs/tuned/exits"), "runs/ls/model",
                         dtype=torch.float32)
    assert json.loads((bundle / BUNDLE_META).read_text())["base"] == "../../ls/model"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = load_model(str(work / bundle))
    assert got.config.exits.layers == (1,)
    torch.testing.assert_close(_final(got.model), _final(load_model(str(base)).model))


def test_a_bundle_beside_its_base_moves_with_it(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base(tmp_path / "a" / "model")
    save_bundle(_heads_on(base), tmp_path / "a" / "exits", str(base))
    _set_base(tmp_path / "a" / "exits", "../model", 2)
    (tmp_path / "a").rename(tmp_path / "b")
    monkeypatch.chdir(tmp_path)
    assert load_model(str(tmp_path / "b" / "exits")).config.exits.layers == (1,)


def test_a_format_2_base_only_in_the_working_directory_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The working directory's ``model`` is some other model: refused, not loaded."""
    base = _base(tmp_path / "model")
    bundle = save_bundle(_heads_on(base), tmp_path / "run" / "exits", str(base))
    _set_base(bundle, "model", 2)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["info", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(bundle / BUNDLE_META) in err, err
    assert "does not exist relative to the bundle's directory" in err, err


def test_an_older_bundle_relative_to_the_working_directory_loads_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Format 1 (older exitlm): the path was relative to the working directory the run
    started in; where nothing of that name is beside the bundle, that is loaded, saying so."""
    base = _base(tmp_path / "runs" / "model")
    bundle = save_bundle(_heads_on(base), tmp_path / "out" / "exits", str(base))
    _set_base(bundle, "runs/model", 1)
    monkeypatch.chdir(tmp_path)
    with pytest.warns(ExitlmWarning, match=r"runs/model.*working directory"):
        got = load_model(str(bundle))
    torch.testing.assert_close(_final(got.model), _final(load_model(str(base)).model))


def test_an_older_bundle_naming_two_models_is_refused(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A format-1 relative base that exists both beside the bundle and in the working
    directory, as two different models: which one the heads were tuned on is unknown."""
    _base(tmp_path / "model", seed=0)
    bundle = save_bundle(_heads_on(tmp_path / "model"), tmp_path / "run" / "exits",
                         str(tmp_path / "model"))
    _base(bundle / "model", seed=1)
    _set_base(bundle, "model", 1)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"names both .* older exitlm") as err:
        load_model(str(bundle))
    assert str(bundle / BUNDLE_META) in str(err.value)
    monkeypatch.chdir(bundle)  # both names are one directory: no doubt
    assert load_model(str(bundle)).config.exits.layers == (1,)


def test_convert_protects_the_base_beside_a_bundle(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = _base(tmp_path / "a" / "model")
    bundle = save_bundle(_heads_on(base), tmp_path / "a" / "exits", str(base))
    _set_base(bundle, "../model", 2)
    monkeypatch.chdir(tmp_path)
    before = (base / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["convert", str(bundle), str(base)]) == 2
    err = capsys.readouterr().err
    assert "source" in err and "Traceback" not in err, err
    assert (base / "model.safetensors").read_bytes() == before


def test_a_delta_from_a_relative_base_loads_from_any_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``convert --delta-from runs/base`` records the base relative to the delta."""
    work = tmp_path / "work"
    base = _base(work / "runs" / "base")
    tuned = load_model(str(base)).model
    with torch.no_grad():
        tuned.layers[0].attn.wo.weight.add_(0.01)
    save_model(tuned, work / "tuned")
    monkeypatch.chdir(work)
    assert main(["convert", "tuned", "out/delta", "--delta-from", "runs/base",
                 "--rank", "2"]) == 0
    assert json.loads((work / "out" / "delta" / DELTA_META).read_text())["base"] == \
        "../../runs/base"
    monkeypatch.chdir(tmp_path)
    got = load_model(str(work / "out" / "delta"))
    torch.testing.assert_close(_final(got.model), _final(tuned), atol=1e-3, rtol=1e-3)


def test_convert_protects_the_base_of_a_delta(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Writing a delta's merged model over the base it loads from would leave the delta
    without its base: refused like writing over the source."""
    base = _base(tmp_path / "base")
    tuned = load_model(str(base)).model
    with torch.no_grad():
        tuned.layers[0].attn.wo.weight.add_(0.01)
    save_model(tuned, tmp_path / "tuned")
    assert main(["convert", str(tmp_path / "tuned"), str(tmp_path / "delta"), "--delta-from",
                 str(base), "--rank", "2"]) == 0
    before = (base / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "delta"), str(base), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "source" in err and "Traceback" not in err, err
    assert (base / "model.safetensors").read_bytes() == before
