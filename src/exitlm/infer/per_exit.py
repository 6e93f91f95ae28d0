"""Per-exit evaluation: loss / perplexity, top-1 accuracy, and agreement with the final layer.

For every evaluated exit layer ``l`` and every position with a label:

* ``loss``: mean next-token cross-entropy; ``ppl = exp(loss)``;
* ``acc``: top-1 accuracy against the label;
* ``agree_top1``: how often the exit's top-1 token equals the final layer's top-1;
* ``agree_topk``: how often the final layer's top-1 token is among the exit's top-``k`` -
  the match rate ``p_correct`` of Predictive Pipelined Decoding (Sec. 4, Table 2).

Layers that have no head of their own are read through the final norm and LM head (LayerSkip
Sec. 4.2), so an untuned model can be evaluated at any depth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from exitlm.model.transformer import EarlyExitLM, default_positions

IGNORE_INDEX = -100


@dataclass
class ExitMetrics:
    """Metrics of one exit layer."""

    layer: int
    head: str
    loss: float
    ppl: float
    acc: float
    agree_top1: float
    agree_topk: float
    tokens: int

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def exit_logits_any(
    model: EarlyExitLM, h: torch.Tensor, layer: int, ctx: object = None
) -> tuple[torch.Tensor, str]:
    """Logits after ``layer`` and how they were made: the exit's own head if it has one,
    else the shared final norm and head (``"shared"``; ``"final"`` at the last layer)."""
    route = model.exit_route(layer, shared_ok=True)
    kind = "final" if layer == model.num_layers else route.kind
    return model.exit_logits(h, layer, ctx=ctx, shared_ok=True), kind  # type: ignore[arg-type]


@torch.no_grad()
def evaluate_exits(
    model: EarlyExitLM,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    layers: Sequence[int] | None = None,
    *,
    topk: int = 5,
    ignore_index: int = IGNORE_INDEX,
) -> list[ExitMetrics]:
    """Evaluate ``layers`` (default: the model's exits + the final layer) on ``batches`` of
    ``(tokens, labels)``; returns one :class:`ExitMetrics` per layer, final layer last."""
    L = model.num_layers
    want = sorted(set(model.config.exit_layers if layers is None else layers) | {L})
    for k in want:
        if not 1 <= k <= L:
            raise ValueError(f"cannot evaluate layer {k}: the model has layers 1..{L}")
    was_training = model.training
    model.eval()
    device = model.embed_tokens.weight.device
    sums = {k: {"loss": 0.0, "acc": 0, "a1": 0, "ak": 0} for k in want}
    heads: dict[int, str] = {}
    count = 0
    try:
        for tokens, labels in batches:
            tokens, labels = tokens.to(device), labels.to(device)
            valid = labels != ignore_index
            n = int(valid.sum())
            if n == 0:
                continue
            pos = default_positions(tokens)
            ctx = model.context(pos)
            h0 = model.embed(tokens, pos)
            top1: dict[int, torch.Tensor] = {}
            topk_ids: dict[int, torch.Tensor] = {}
            for k, h in model.walk(h0, 0, L, want, ctx=ctx):
                logits, heads[k] = exit_logits_any(model, h, k, ctx)
                logits = logits.float()[valid]  # (N, V)
                lab = labels[valid]
                sums[k]["loss"] += float(F.cross_entropy(logits, lab, reduction="sum"))
                top1[k] = logits.argmax(-1)
                sums[k]["acc"] += int((top1[k] == lab).sum())
                topk_ids[k] = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices
            final = top1[L]
            for k in want:
                sums[k]["a1"] += int((top1[k] == final).sum())
                sums[k]["ak"] += int((topk_ids[k] == final[:, None]).any(-1).sum())
            count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no labelled tokens to evaluate")
    out = []
    for k in want:
        s = sums[k]
        loss = s["loss"] / count
        out.append(ExitMetrics(k, heads[k], loss, math.exp(min(loss, 50.0)), s["acc"] / count,
                               s["a1"] / count, s["ak"] / count, count))
    return out


def format_table(metrics: Sequence[ExitMetrics], topk: int = 5) -> str:
    """A plain-text table of per-exit metrics."""
    head = (f"{'layer':>5}  {'head':<7} {'loss':>7} {'ppl':>9} {'acc':>7} "
            f"{'top1=final':>10} {f'final in top{topk}':>13}")
    rows = [head, "-" * len(head)]
    for m in metrics:
        rows.append(f"{m.layer:>5}  {m.head:<7} {m.loss:>7.4f} {m.ppl:>9.3f} {m.acc:>7.2%} "
                    f"{m.agree_top1:>10.2%} {m.agree_topk:>13.2%}")
    rows.append(f"({metrics[0].tokens} tokens)" if metrics else "(no tokens)")
    return "\n".join(rows)
