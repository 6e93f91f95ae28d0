"""Tiny random early-exit models for the decoding-strategy tests (imported by this folder)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch

from exitlm.config import ExitConfig, ModelConfig
from exitlm.model.transformer import EarlyExitLM

GPT2_STYLE = {"norm": "layernorm", "pos": "learned", "mlp": "gelu", "activation": "gelu_tanh",
              "qkv_bias": True}


def ee_model(
    head: str = "linear", *, every_layer: bool = False, layers: tuple[int, ...] = (1, 2, 3),
    vocab: int = 23, num_layers: int = 4, gpt2: bool = False, scale: float = 0.4, seed: int = 0,
    eos: tuple[int, ...] = (), hidden: int = 64,
) -> EarlyExitLM:
    """A random 4-layer model with exits; large weights make next-token distributions sharp
    enough that confidence exits happen at moderate thresholds. ``hidden``: the MLP width (48:
    MLP output layers whose input is not a multiple of the quantization group, as
    ``layerskip-code``'s 688)."""
    torch.manual_seed(seed)
    exits = (ExitConfig(every_layer=True, norm="final") if every_layer
             else ExitConfig(layers=layers, head=head))
    cfg = ModelConfig(
        vocab_size=vocab, dim=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
        hidden_dim=hidden, max_seq_len=160, exits=exits, eos_token_ids=eos,
        **(GPT2_STYLE if gpt2 else {}),
    )
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, scale)
    return model


def random_prompts(vocab: int = 23, sizes: tuple[int, ...] = (5, 9, 3)) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,)).tolist() for n in sizes]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models decode token by token: one thread avoids OpenMP hand-offs, which dominate
    on a busy machine. Restores torch's thread count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


BUDGETS = [3, 17, 9, 25]
"""Per-request ``max_new_tokens`` of :func:`self_spec_with_budgets`: rows leave at different
rounds and some ride along past their own budget."""


def self_spec_with_budgets(model: EarlyExitLM, prompts: list[list[int]], exit_layer: int
                           ) -> list[list[int]]:
    """Each prompt's tokens when one engine decodes them together by self-speculation
    (5 drafts a round), request ``i`` with its own budget ``BUDGETS[i]``."""
    from exitlm.infer.engine import Engine
    from exitlm.infer.options import SamplingOptions
    from exitlm.infer.self_speculative import SelfSpecOptions

    engine = Engine(model, None, "self-spec",
                    SelfSpecOptions(exit_layer=exit_layer, num_speculations=5),
                    max_batch=len(prompts))
    reqs = [engine.submit(p, SamplingOptions(max_new_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, BUDGETS, strict=True)]
    engine.run()
    return [r.result(model.num_layers).token_ids for r in reqs]


def exact_joint(model: EarlyExitLM, prompt: list[int], steps: int, temperature: float
                ) -> dict[tuple[int, ...], float]:
    """The exact probability of every continuation of ``steps`` tokens under the final layer
    at ``temperature`` (full forwards without a cache)."""
    vocab = model.config.vocab_size
    probs: dict[tuple[int, ...], float] = {}
    with torch.inference_mode():
        for seq in itertools.product(range(vocab), repeat=steps):
            full = torch.tensor([prompt + list(seq)])
            logp = torch.log_softmax(model(full).logits[0].double() / temperature, dim=-1)
            n = len(prompt)
            probs[seq] = math.exp(sum(float(logp[n - 1 + j, seq[j]]) for j in range(steps)))
    return probs


def chi_square(samples: list[list[int]], exact: dict[tuple[int, ...], float]
               ) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` against ``exact`` over the cells expecting at least
    5 samples, and its degrees of freedom."""
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for toks in samples:
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    chi2, cells = 0.0, 0
    for seq, p in exact.items():
        if n * p < 5:
            continue
        cells += 1
        chi2 += (counts.get(seq, 0) - n * p) ** 2 / (n * p)
    return chi2, cells - 1
