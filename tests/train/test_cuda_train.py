"""Training on a CUDA device with bf16 autocast (skipped without one; CI has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _train_util import tiny_config
from exitlm.io import load_model
from exitlm.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_bf16_training_on_cuda_learns_and_resumes(tmp_path: Path) -> None:
    extra = {"train": {"device": "cuda", "amp": "bf16", "steps": 30, "checkpoint_every": 10}}
    t = Trainer(tiny_config(tmp_path, **extra))
    assert t.device.type == "cuda" and t.amp_dtype == torch.bfloat16
    recs = t.train(until_step=20)
    # it learns (on CPU in fp32 these 20 steps take the loss from 6.6 to ~4.7)
    assert recs[-1]["loss"] < 0.85 * recs[0]["loss"]
    resumed = Trainer(tiny_config(tmp_path, **extra), resume=True)
    assert resumed.step == 20
    rest = resumed.train()
    assert [r["step"] for r in rest] == list(range(21, 31))
    # the saved model loads on the CPU and is fp32 there
    model = load_model(str(tmp_path / "run" / "model")).model
    assert next(model.parameters()).device.type == "cpu"
    assert next(model.parameters()).dtype == torch.float32
