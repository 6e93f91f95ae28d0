"""Log-probabilities of given text under the model (no generation): the prompt logprobs of an
OpenAI ``echo`` + ``logprobs`` completion, and lm-evaluation-harness's log-likelihoods.

One forward over the tokens without a cache; position ``i``'s logits score token ``i + 1``
(the first token has no score). Any exit can be the scorer (``layer``; default: the final
layer), so a LayerSkip or EE-LLM model's exits can be evaluated the same way.
"""

from __future__ import annotations

import torch

from exitlm.config import ConfigError
from exitlm.infer.result import TokenLogprob
from exitlm.infer.sampling import token_logprobs
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner


@torch.inference_mode()
def score_tokens(model: EarlyExitLM | Runner, ids: list[int], *, top: int = 0,
                 layer: int | None = None) -> list[TokenLogprob | None]:
    """Per token of ``ids``: its log-probability given the tokens before it (``None`` for the
    first) and the ``top`` most likely alternatives, at exit ``layer`` (default: final)."""
    if not ids:
        return []
    runner = model if isinstance(model, Runner) else prepare(model)
    model = runner.model
    if len(ids) > model.config.max_seq_len:
        raise ConfigError(f"{len(ids)} tokens exceed the model's context of "
                          f"{model.config.max_seq_len}")
    layer = model.num_layers if layer is None else layer
    model.exit_route(layer, shared_ok=True, setting="layer")
    tokens = torch.tensor([ids], device=runner.device)
    h = runner.layers(runner.embed(tokens), 0, layer, None, None)
    logits = runner.logits(h, layer, shared_ok=True)[0, :-1]  # (T-1, V)
    return [None, *token_logprobs(logits, ids[1:], top)]
