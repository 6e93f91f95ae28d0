"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

Pure functions over ``(B, V)`` logits, in the order ``transformers`` applies its logits
warpers (temperature, then top-k, then top-p, then softmax and ``torch.multinomial``) so that
a given distribution means the same thing here and there. Speculative decoding reuses
:func:`probabilities` to compare draft and target distributions.
"""

from __future__ import annotations

import torch

from exitlm.errors import ExitlmError
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import TokenLogprob
from exitlm.kernels.argmax import argmax


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension, ties to the lowest id (like ``transformers``), NaN
    counting as the maximum (:func:`exitlm.kernels.argmax.argmax`)."""
    return argmax(logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` (``temperature > 0``). A temperature so small that the quotient
    overflows (1e-38 in fp32) divides ``logits - max`` instead (by at least the dtype's
    smallest normal number): the same distribution (softmax does not see a shift), all of it
    on the largest logits, where the plain quotient would hold infinities and softmax NaN."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to scale logits, got {temperature}")
    if temperature == 1.0:
        return logits
    scaled = logits / temperature
    if bool(torch.isfinite(scaled.amax(dim=-1)).all()):
        return scaled  # the common case: no second pass over the logits
    peak = logits.amax(dim=-1, keepdim=True)
    if bool(torch.isfinite(peak).all()):
        tiny = torch.finfo(logits.dtype).tiny  # a smaller Python float is 0 in the tensor's dtype
        scaled = (logits - peak) / max(temperature, tiny)
    return scaled


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the ``k``-th largest to ``-inf`` (ties with it are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens whose probabilities sum to ``p``.

    A token is dropped when the total probability of the tokens *less* likely than it, plus
    its own, stays within ``1 - p``; the most likely token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1.0 - p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """Temperature, top-k and top-p applied to fp32 ``logits`` ``(B, V)`` (sampling only)."""
    scores = apply_temperature(logits.float(), opts.temperature)
    scores = top_k_filter(scores, opts.top_k)
    return top_p_filter(scores, opts.top_p)


def probabilities(logits: torch.Tensor, opts: SamplingOptions) -> torch.Tensor:
    """The sampling distribution ``(B, V)`` that ``opts`` defines over ``logits``."""
    return torch.softmax(process_logits(logits, opts), dim=-1)


def make_generator(opts: SamplingOptions, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``opts.seed``, or from torch's global generator when ``None``."""
    gen = torch.Generator(device=device)
    if opts.seed is not None:
        gen.manual_seed(int(opts.seed))
    else:
        gen.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
    return gen


class NonFiniteLogits(ExitlmError):
    """Sampling met logits that are not finite: no distribution to draw from."""


def choose(
    logits: torch.Tensor, opts: SamplingOptions, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token ids ``(B,)`` from logits ``(B, V)``: argmax when greedy, else a sample."""
    if opts.greedy:
        return greedy(logits)
    probs = probabilities(logits, opts)
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteLogits(
            "cannot sample: the model's logits are NaN or infinite (non-finite weights in the "
            "checkpoint, or activations that overflow in this dtype)",
            hint="check the load warnings; retrain or reconvert the model, or try --dtype "
                 "float32")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose_rows(
    logits: torch.Tensor, sampling: list[SamplingOptions],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Next token of every row of ``logits`` ``(R, V)``, each under its own options and
    random generator: a seeded request draws the same tokens whatever else shares its batch."""
    tokens = greedy(logits).tolist()
    for i, (opts, gen) in enumerate(zip(sampling, generators, strict=True)):
        if not opts.greedy:
            tokens[i] = int(choose(logits[i : i + 1], opts, gen)[0])
    return tokens


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under ``logits`` ``(R, V)`` (one token per row) and
    each row's ``top`` most likely alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if top > 0:
        vals, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
        alts = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                                strict=True)]
    else:
        alts = [()] * len(tokens)
    return [TokenLogprob(t, lp, a) for t, lp, a in zip(tokens, chosen, alts, strict=True)]
