"""Building a model from tensors (:mod:`exitlm.io.materialize`) stays cheap and side-effect
free: every worker process (pipeline stages, TP ranks, PPD workers) starts with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from exitlm.config import preset
from exitlm.io.materialize import model_tensors, rebuild_model
from exitlm.model.transformer import EarlyExitLM


def test_rebuilt_model_equals_the_original() -> None:
    model = EarlyExitLM(preset("debug")).eval()
    again = rebuild_model(model.config, model_tensors(model), "test")
    assert again.state_dict().keys() == model.state_dict().keys()
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert again.rope_inv_freq is not None and torch.equal(again.rope_inv_freq,
                                                           model.rope_inv_freq)


def test_rebuilding_does_not_import_the_compiler() -> None:
    """On ``meta`` torch's init functions and arithmetic go through ``torch._refs``, whose
    first use imports ``torch._dynamo`` (~2 s of every process start); the build skips both."""
    code = ("import sys, torch\n"
            "from exitlm.config import preset\n"
            "from exitlm.io.materialize import model_tensors, rebuild_model\n"
            "from exitlm.model.transformer import EarlyExitLM\n"
            "m = EarlyExitLM(preset('debug'))\n"
            "rebuild_model(m.config, model_tensors(m), 'x')\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_init_functions_are_restored_after_a_failed_build() -> None:
    before = {n: getattr(nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_")}
    model = EarlyExitLM(preset("debug"))
    tensors = dict(model_tensors(model))
    tensors["no.such.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not belong"):
        rebuild_model(model.config, tensors, "test")
    assert {n: getattr(nn.init, n) for n in before} == before
    w = torch.empty(4, 4)
    nn.init.normal_(w)
    assert w.abs().sum() > 0  # a real init again
