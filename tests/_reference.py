"""The slowest, simplest decoding every strategy is checked against: whole-prefix forwards of
the model's own modules, no cache, no runner (imported by the conformance suite and the tests
that need a reference)."""

from __future__ import annotations

import torch

from exitlm.model.transformer import EarlyExitLM


@torch.inference_mode()
def greedy_reference(model: EarlyExitLM, prompt: list[int], steps: int, *,
                     depth: int | None = None) -> list[int]:
    """``steps`` greedy tokens, each from a full forward of the whole prefix (no cache) -
    through the final layer, or through layers ``1..depth`` and exit ``depth``."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        res = model(torch.tensor([seq]), exit_layers=() if depth is None else (depth,))
        logits = res.logits if depth is None or depth == model.num_layers else \
            res.exit_logits[depth]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


@torch.inference_mode()
def early_exit_reference(model: EarlyExitLM, prompt: list[int], steps: int,
                         checks: tuple[int, ...], threshold: float, max_pending: int
                         ) -> tuple[list[int], list[int]]:
    """Confidence early exit without a cache (EE-LLM's rule): every token re-runs the whole
    prefix through the full model and leaves at the first checked exit whose maximum
    probability reaches ``threshold``, or at the final layer after ``max_pending``
    consecutive early exits. Returns the tokens and their exit layers; the first token
    always comes from the final layer (the prompt forward is a full pass). With KV
    recomputation every key/value attended to is the full model's, so a cached decoder must
    give exactly these tokens."""
    seq = list(prompt)
    out: list[int] = []
    layers: list[int] = []
    pending = 0
    num_layers = model.num_layers
    for step in range(steps):
        res = model(torch.tensor([seq]), exit_layers=tuple(checks))
        layer, tok = num_layers, int(res.logits[0, -1].argmax())
        if step > 0 and threshold < 1.0 and pending < max_pending:
            for e in sorted(checks):
                logits = res.exit_logits[e][0, -1]
                if float(torch.softmax(logits.float(), -1).max()) >= threshold:
                    layer, tok = e, int(logits.argmax())
                    break
        pending = 0 if layer == num_layers else pending + 1
        out.append(tok)
        layers.append(layer)
        seq.append(tok)
    return out, layers
