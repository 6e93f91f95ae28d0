"""Per-exit evaluation metrics against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from exitlm.config import ExitConfig, preset
from exitlm.infer.per_exit import evaluate_exits, format_table
from exitlm.model.transformer import EarlyExitLM


def test_metrics_match_direct_computation() -> None:
    model = EarlyExitLM(preset("debug", exits=ExitConfig(layers=(2,)))).eval()
    x = torch.randint(0, 256, (3, 17))
    tokens, labels = x[:, :-1], x[:, 1:].clone()
    labels[0, :4] = -100
    metrics = evaluate_exits(model, [(tokens, labels)], layers=[1, 2], topk=3)
    assert [m.layer for m in metrics] == [1, 2, 4]
    assert [m.head for m in metrics] == ["shared", "linear", "final"]
    with torch.no_grad():
        out = model(tokens, exit_layers=(2,))
        h1 = model.run_layers(model.embed(tokens), 0, 1)
        by_layer = {1: model.final_logits(h1), 2: out.exit_logits[2], 4: out.logits}
    keep = labels != -100
    final_top = by_layer[4][keep].argmax(-1)
    for m in metrics:
        logits = by_layer[m.layer][keep]
        ce = torch.nn.functional.cross_entropy(logits, labels[keep]).item()
        assert m.loss == pytest.approx(ce, rel=1e-5)
        assert m.ppl == pytest.approx(math.exp(ce), rel=1e-5)
        assert m.acc == pytest.approx((logits.argmax(-1) == labels[keep]).float().mean().item())
        assert m.agree_top1 == pytest.approx((logits.argmax(-1) == final_top).float().mean().item())
        top3 = logits.topk(3, -1).indices
        assert m.agree_topk == pytest.approx((top3 == final_top[:, None]).any(-1).float().mean()
                                             .item())
        assert m.tokens == int(keep.sum())
    assert metrics[-1].agree_top1 == 1.0
    assert "top1=final" in format_table(metrics, 3)


def test_bad_layer() -> None:
    model = EarlyExitLM(preset("debug"))
    with pytest.raises(ValueError, match=r"layers 1\.\.4"):
        evaluate_exits(model, [], layers=[5])
