"""Trainer: runs, logs, checkpoints, kill-and-resume reproduces the loss curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _train_util import tiny_config
from exitlm.config import ConfigError
from exitlm.train.checkpoint import latest_checkpoint
from exitlm.train.losses import exit_kl
from exitlm.train.trainer import Trainer, lr_at


def _losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records]


def test_lr_schedule() -> None:
    assert lr_at(0, 1.0, 4, 20, 0.1) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 20, 0.1) == pytest.approx(1.0)
    assert lr_at(4, 1.0, 4, 20, 0.1) == pytest.approx(1.0)
    assert lr_at(12, 1.0, 4, 20, 0.1) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(20, 1.0, 4, 20, 0.1) == pytest.approx(0.1)


def test_train_logs_checkpoints_and_model(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, train={"checkpoint_every": 3, "eval_every": 3,
                                       "eval_samples": 4})
    t = Trainer(cfg)
    recs = t.train()
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert recs[-1]["loss_1"] > 0
    assert set(recs[0]["weights"]) == {"1", "2", "4"}
    out = tmp_path / "run"
    lines = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert any(r.get("split") == "val" and "val_ppl_2" in r for r in lines)
    assert (out / "loss.png").stat().st_size > 1000
    assert latest_checkpoint(out).name == "step-00000006"
    assert (out / "model" / "config.json").is_file()


def test_kill_and_resume_reproduces_losses(tmp_path: Path) -> None:
    extra = {"train": {"checkpoint_every": 2}, "dropout": {"p_max": 0.5, "seed": 3}}
    full = Trainer(tiny_config(tmp_path, "a", **extra)).train()
    # "crash" after step 5: the last checkpoint is step 4, step 5 is lost
    cfg = tiny_config(tmp_path, "b", **extra)
    Trainer(cfg).train(until_step=5)
    assert latest_checkpoint(tmp_path / "b").name == "step-00000004"
    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 4
    rest = resumed.train()
    assert [s for s, _ in _losses(rest)] == [5, 6]
    for (s1, a), (s2, b) in zip(_losses(full)[4:], _losses(rest), strict=True):
        assert s1 == s2
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    log_a = [json.loads(x)["loss"] for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    log_b = [json.loads(x)["loss"] for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert log_a == pytest.approx(log_b, rel=1e-6)
    pa = dict(Trainer(tiny_config(tmp_path, "a"), resume=True).model.named_parameters())
    pb = dict(resumed.model.named_parameters())
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-6, atol=1e-7)


def test_exit_tuning_freezes_backbone(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, model={"exits": {"layers": [1, 2], "head": "mlp"}},
                      loss={"kind": "ee-llm", "exit_weights": [1.0, 1.0], "final_weight": 0.0,
                            "weight_schedule": "constant"},
                      tune={"freeze_backbone": True}, train={"steps": 2, "checkpoint_every": 2})
    t = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == n.startswith("exits."), n
    state = latest_checkpoint(tmp_path / "run") / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(state), "pt") as f:
        assert all(k.startswith("exits.") for k in f.keys())  # noqa: SIM118


def test_bad_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exits are counted from 1"):
        Trainer(tiny_config(tmp_path, model={"exits": {"layers": [0, 2]}}))
    with pytest.raises(ConfigError, match="2 exits"):
        Trainer(tiny_config(tmp_path, loss={"exit_weights": [0.1, 0.2, 0.3]}))
    with pytest.raises(ConfigError, match="unknown train keys"):
        tiny_config(tmp_path, train={"stepz": 3})
    with pytest.raises(ConfigError, match="vocab_size"):
        Trainer(tiny_config(tmp_path, model={"overrides": {"vocab_size": 100}}))


def test_distill_through_the_trainer_pulls_exits_towards_the_final_layer(
        tmp_path: Path) -> None:
    """loss.distill reaches the loss: same data, seed and schedule, the distilled run's first
    exit ends closer (in KL) to its own final layer than the run trained on the data alone."""
    def gap(trainer: Trainer) -> float:
        model = trainer.layout.host_model().eval()
        tokens, labels = trainer.val_data.batch(range(trainer.val_data.num_samples))
        with torch.no_grad():
            out = model(tokens, exit_layers=(1,))
            return float(exit_kl(torch.log_softmax(out.logits, -1), out.exit_logits[1],
                                 labels))

    train = {"steps": 40}  # (at 12 steps both exits sit on the unigram distribution)
    loss = {"kind": "ee-llm", "exit_weights": [1.0, 1.0], "weight_schedule": "constant"}
    data_only = Trainer(tiny_config(tmp_path, "ce", train=train, loss=loss))
    data_only.train()
    distilled = Trainer(tiny_config(tmp_path, "kd", train=train, loss={**loss, "distill": 0.9}))
    recs = distilled.train()
    assert recs[-1]["loss_1"] > 0  # the logged exit loss is still the cross-entropy
    assert gap(distilled) < 0.8 * gap(data_only)
    with pytest.raises(ConfigError, match=r"loss\.distill=0\.9 .*parallel\.pp=1"):
        tiny_config(tmp_path, "pp", loss={**loss, "distill": 0.9}, parallel={"pp": 2})


def test_fused_adamw_trains_like_the_loop(tmp_path: Path) -> None:
    loop = Trainer(tiny_config(tmp_path, "loop")).train()
    fused_cfg = tiny_config(tmp_path, "fused", optim={"fused": True})
    trainer = Trainer(fused_cfg)
    assert trainer.optimizer.defaults["fused"] is True
    fused = trainer.train()
    # same data, dropout and schedule: the losses follow the loop's within rounding
    assert [r["step"] for r in fused] == [r["step"] for r in loop]
    for a, b in zip(loop, fused, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    assert (tmp_path / "fused" / "model" / "config.json").is_file()


def test_bf16_autocast_on_cpu_trains_near_fp32(tmp_path: Path) -> None:
    """train.amp=bf16 on a CPU runs the products under bf16 autocast (the master weights and
    the optimizer stay fp32): the same data and schedule give losses within bf16's rounding
    of fp32's; auto stays fp32 on CPU and fp16 is refused there in one line."""
    fp32 = Trainer(tiny_config(tmp_path, "fp32"))
    assert fp32.amp_dtype is None
    ref = fp32.train()
    bf16 = Trainer(tiny_config(tmp_path, "bf16", train={"amp": "bf16"}))
    assert bf16.amp_dtype == torch.bfloat16
    got = bf16.train()
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.03)
    assert any(b["loss"] != a["loss"] for a, b in zip(ref, got, strict=True))  # bf16 ran
    with pytest.raises(ConfigError, match=r"train\.amp: fp16 needs a CUDA device"):
        Trainer(tiny_config(tmp_path, "fp16", train={"amp": "fp16"}))
