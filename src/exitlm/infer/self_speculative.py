"""Self-speculative decoding (LayerSkip Sec. 4.3, pseudo code in App. A.6).

Each round, for every sequence of the batch at once:

1. **Self-drafting** (Sec. 4.3.1): starting from the last accepted token ``x0``, draft ``d``
   tokens autoregressively with the first ``E`` layers and exit ``E`` (``forward_early``).
2. **Self-verification** (Sec. 4.3.2): run layers ``E..L`` once over ``x0, d_1 .. d_d``
   (``forward_remainder``) and compare.
3. **Cache reuse** (Sec. 4.3.3): there is a **single KV cache**: drafting writes layers
   ``1..E`` of every draft token, verification writes layers ``E+1..L`` - nothing is computed
   twice. The **exit-query cache** is the hidden state after layer ``E`` of each draft step
   (``(B, d+1, D)``, preallocated), from which verification starts; only the last draft, never
   fed back during drafting, needs its first ``E`` layers run before verification.
4. Accept the longest agreeing prefix plus the verifier's own next token (the correction on a
   mismatch, the **bonus token** when every draft passes), and roll the cache back
   (:meth:`~exitlm.model.kv_cache.KVCache.crop`) to the accepted tokens.

Greedy decoding accepts a draft when it equals the final layer's argmax, so the output is
token-identical to plain greedy decoding. Sampling uses speculative rejection sampling
(Leviathan et al. 2023, Chen et al. 2023): accept ``x ~ q`` with probability
``min(1, p(x)/q(x))``, else sample ``norm(max(0, p - q))``; the emitted tokens are then
distributed exactly as plain sampling from ``p`` (draft ``q`` and target ``p`` both go through
the same temperature / top-k / top-p). Sequences of a batch accept independently: each row
keeps its own length and is cropped to its own accepted prefix.

Per-token exit layers report ``E`` for accepted drafts and ``L`` for the verifier's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exitlm.config import ConfigError
from exitlm.infer.common import (
    DraftHead,
    Session,
    has_block_head,
    last_positions,
    prefill_hidden,
    require_exit,
)
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import GenerationResult
from exitlm.infer.sampling import choose, probabilities
from exitlm.infer.stopping import TextCallback
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class SelfSpecOptions:
    """Options of the ``self-spec`` strategy.

    Attributes:
        exit_layer: ``E``, the draft exit (default: the model's deepest configured exit head,
            or ``L // 2`` for LayerSkip-style ``every_layer`` models).
        num_speculations: ``d``, draft tokens per round (LayerSkip Sec. 4.3.1).
        draft_vocab: draft only among the first ``N`` token ids (BPE ids roughly follow merge
            frequency): the exit's output projection shrinks from ``V`` to ``N`` rows, which
            on small models costs as much as several layers. Still exact: verification uses
            the full vocabulary, and a draft distribution with zeros outside the subset is
            as valid for rejection sampling as any other. ``None``: the whole vocabulary.
        draft_threshold: stop drafting a round early once the exit's probability of its own
            draft falls below this (for every running sequence of the batch): an unsure draft
            is likely rejected, and drafting on after it wastes ``E`` layers per token. The
            unsure draft itself is still verified. Still exact, greedy or sampled: when to
            stop depends only on the drafts so far (``transformers`` calls this
            ``assistant_confidence_threshold``). ``None``: always draft ``d`` tokens, as
            LayerSkip does.
    """

    exit_layer: int | None = None
    num_speculations: int = 4
    draft_vocab: int | None = None
    draft_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.num_speculations < 1:
            raise ConfigError(f"num_speculations must be >= 1, got {self.num_speculations}")
        if self.draft_threshold is not None and not 0.0 <= self.draft_threshold <= 1.0:
            raise ConfigError(
                f"draft_threshold must lie in [0, 1] (or None: off), got {self.draft_threshold}"
            )
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ConfigError(f"draft_vocab must be >= 1 (or None: all), got {self.draft_vocab}")


def resolve_exit_layer(model: EarlyExitLM, exit_layer: int | None) -> int:
    """The draft exit ``E`` (see :attr:`SelfSpecOptions.exit_layer`), validated."""
    cfg = model.config
    if exit_layer is None:
        if cfg.exits.layers:
            return cfg.exits.layers[-1]
        if cfg.exits.every_layer:
            return max(1, model.num_layers // 2)
        raise ConfigError(
            "self-speculative decoding needs an early exit; load the model with exits "
            "(e.g. ExitConfig(every_layer=True)) or use strategy 'ar'"
        )
    return require_exit(model, exit_layer, "exit_layer")


def generate_self_spec(
    model: EarlyExitLM,
    prompt_ids: list[list[int]],
    sampling: SamplingOptions,
    *,
    tokenizer: Tokenizer | None = None,
    stream: TextCallback | None = None,
    options: SelfSpecOptions | None = None,
    start_time: float | None = None,
) -> GenerationResult:
    """Run self-speculative decoding (see the module docstring) on a batch of prompts."""
    opts = options or SelfSpecOptions()
    e = resolve_exit_layer(model, opts.exit_layer)
    n_max = opts.num_speculations
    num_layers = model.num_layers
    s = Session(model, prompt_ids, sampling, tokenizer=tokenizer, stream=stream,
                start_time=start_time, extra_slots=n_max + 1)
    b, dev = s.b, s.device
    block = has_block_head(model, e)
    vocab = model.config.vocab_size
    n_draft = vocab if opts.draft_vocab is None else min(opts.draft_vocab, vocab)
    head = DraftHead(model, e, n_draft)
    tau = opts.draft_threshold
    # fp32 GEMM with a few rows costs nearly a GEMV per row on CPU, so greedy verification
    # projects one position at a time and stops at the first rejection (see _accept_greedy_lazy)
    lazy = dev.type == "cpu" and model.embed_tokens.weight.dtype == torch.float32
    cache = s.new_cache()
    drafted = [0] * b
    accepted = [0] * b
    rounds = 0
    with torch.inference_mode():
        s.start_prefill()
        h, _ = prefill_hidden(model, s.tokens, cache, exits=(e,) if block else ())
        nxt = choose(model.final_logits(last_positions(h, s.lengths)), sampling, s.generator)
        cache.lengths = s.lengths.clone()
        cache.fill[:] = s.lengths[None, :]
        for i, tok in enumerate(nxt.tolist()):
            s.push(i, [tok], [num_layers])
            s.layer_evals[i] += num_layers
        s.end_prefill()
        # exit-query cache: hidden state after layer E of x0, d_1 .. d_n (LayerSkip 4.3.3)
        exit_query = torch.empty(b, n_max + 1, model.config.dim,
                                 dtype=model.embed_tokens.weight.dtype, device=dev)
        steps = torch.arange(n_max + 1, device=dev)
        x0 = nxt
        while s.num_running:
            rounds += 1
            n = max(0, min(n_max, max(s.remaining(i) for i in range(b)) - 1))
            base = cache.lengths.to(dev)  # (B,) position of x0
            live = [s.running(i) for i in range(b)]
            live_rows = torch.tensor(live, device=dev)
            # ---- self-drafting: first E layers + exit E, one token at a time ----
            drafts = torch.empty(b, n, dtype=torch.long, device=dev)
            q_probs = [] if not sampling.greedy else None
            tok = x0
            for j in range(n + 1):
                pos = (base + j)[:, None]  # (B, 1)
                ctx = model.context(pos, cache)
                hj = model.run_layers(model.embed(tok[:, None], pos), 0, e, cache=cache, ctx=ctx)
                exit_query[:, j] = hj[:, 0]
                if j == n:
                    if block:  # the exit block's cache slot needs the last draft too
                        model.exit_features(hj, e, cache=cache, ctx=ctx)
                    break  # the last draft only needs its first E layers for verification
                logits = head(hj, ctx, cache)[:, 0]  # (B, N)
                may_stop = tau is not None and j + 1 < n
                if q_probs is None:
                    tok = torch.argmax(logits, dim=-1)
                    if may_stop:
                        conf = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
                else:
                    q_small = probabilities(logits, sampling)
                    tok = torch.multinomial(q_small, 1, generator=s.generator)[:, 0]
                    if may_stop:
                        conf = q_small.gather(1, tok[:, None])[:, 0]
                    q = q_small if n_draft == vocab else torch.nn.functional.pad(
                        q_small, (0, vocab - n_draft))
                    q_probs.append(q)
                drafts[:, j] = tok
                if may_stop and bool((conf[live_rows] < tau).all()):
                    n = j + 1  # the next pass runs this last draft's first E layers only
            drafts = drafts[:, :n]
            # ---- self-verification: layers E..L over x0, d_1 .. d_n in one pass ----
            pos = base[:, None] + steps[None, : n + 1]  # (B, n+1)
            ctx = model.context(pos, cache)
            hv = model.run_layers(exit_query[:, : n + 1], e, num_layers, cache=cache, ctx=ctx)
            if q_probs is None and lazy:
                n_acc, final = _accept_greedy_lazy(model, drafts, hv)
            elif q_probs is None:
                n_acc, final = _accept_greedy(drafts, model.final_logits(hv))
            else:
                n_acc, final = _accept_sampled(drafts, q_probs, model.final_logits(hv),
                                               sampling, s.generator)
            # ---- bookkeeping and cache rollback ----
            acc = n_acc.tolist()
            fin = final.tolist()
            draft_rows = drafts.tolist()
            for i in range(b):
                if not live[i]:
                    acc[i] = -1  # finished rows do not advance
                    continue
                a = acc[i]
                drafted[i] += n
                accepted[i] += a
                s.layer_evals[i] += (n + 1) * num_layers
                s.push(i, [*draft_rows[i][:a], fin[i]], [e] * a + [num_layers])
                if not s.running(i):
                    acc[i] = -1  # done: stop advancing (keeps positions inside the cache)
            keep = cache.lengths + torch.tensor(acc) + 1  # x0 and the accepted drafts
            cache.lengths = cache.lengths + n + 1
            cache.crop(keep)
            x0 = torch.where(torch.tensor(acc, device=dev) >= 0, final, x0)
    for i in range(b):
        s.seq_stats[i] = {"drafted": drafted[i], "accepted": accepted[i],
                          "acceptance_rate": accepted[i] / drafted[i] if drafted[i] else 0.0}
    total_d, total_a = sum(drafted), sum(accepted)
    return s.result("self-spec", {
        "exit_layer": e, "num_speculations": n_max, "draft_vocab": n_draft,
        "draft_threshold": tau, "rounds": rounds,
        "drafted": total_d,
        "accepted": total_a, "acceptance_rate": total_a / total_d if total_d else 0.0,
        "tokens_per_round": sum(len(t.ids) - 1 for t in s.trackers) / max(1, rounds) / b,
    })


def _accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the number of leading drafts equal to the final layer's argmax and
    the final layer's token right after them (correction or bonus) ``(B,)`` each."""
    target = torch.argmax(logits, dim=-1)  # (B, n+1)
    n = drafts.shape[1]
    agree = (drafts == target[:, :n]).to(torch.long)
    n_acc = agree.cumprod(dim=1).sum(dim=1)  # (B,)
    final = target.gather(1, n_acc[:, None])[:, 0]
    return n_acc, final


def _accept_greedy_lazy(
    model: EarlyExitLM, drafts: torch.Tensor, hv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_accept_greedy` computing the final logits one draft position at a time, only
    for the sequences whose drafts all passed so far: the LM head (the largest matrix of a
    small model) then runs ``accepted + 1`` times instead of ``d + 1``. Same result."""
    b, n = drafts.shape
    n_acc = torch.zeros(b, dtype=torch.long, device=drafts.device)
    final = torch.zeros(b, dtype=torch.long, device=drafts.device)
    alive = torch.arange(b, device=drafts.device)
    for j in range(n + 1):
        target = torch.argmax(model.final_logits(hv[alive, j]), dim=-1)  # (R,)
        ok = target == drafts[alive, j] if j < n else torch.zeros_like(target, dtype=torch.bool)
        stop = ~ok
        n_acc[alive[stop]] = j
        final[alive[stop]] = target[stop]
        alive = alive[ok]
        if alive.numel() == 0:
            break
    return n_acc, final


def _accept_sampled(
    drafts: torch.Tensor,
    q_probs: list[torch.Tensor],
    logits: torch.Tensor,
    sampling: SamplingOptions,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    Draft ``x_j ~ q_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the
    first rejection the token is drawn from ``norm(max(0, p_j - q_j))``; when all pass, the
    bonus token is drawn from ``p_n``. Returns accepted counts and the final tokens ``(B,)``.
    """
    b, n = drafts.shape
    p = probabilities(logits.reshape(b * (n + 1), -1), sampling).view(b, n + 1, -1)
    if n == 0:
        return (torch.zeros(b, dtype=torch.long, device=drafts.device),
                torch.multinomial(p[:, 0], 1, generator=generator)[:, 0])
    q = torch.stack(q_probs, dim=1)  # (B, n, V)
    px = p[:, :n].gather(2, drafts[..., None])[..., 0]  # (B, n)
    qx = q.gather(2, drafts[..., None])[..., 0]
    r = torch.rand(b, n, generator=generator, device=drafts.device)
    ok = (r * qx < px).to(torch.long)  # accept with probability min(1, p/q)
    n_acc = ok.cumprod(dim=1).sum(dim=1)  # (B,)
    rows = torch.arange(b, device=drafts.device)
    p_at = p[rows, n_acc]  # (B, V): target at the first rejection (or the bonus position)
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_acc]  # 0 for the bonus
    residual = (p_at - q_at).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; any rejection then has probability 0, so fall
    # back to p itself (never reached in exact arithmetic, guards rounding).
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    final = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n_acc, final
