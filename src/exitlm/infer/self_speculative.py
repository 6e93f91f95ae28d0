"""Self-speculative decoding (LayerSkip Sec. 4.3, pseudo code in App. A.6).

Each round (one :meth:`SelfSpecDecoder.step`), for every sequence of the batch at once:

1. **Self-drafting** (Sec. 4.3.1): starting from the last accepted token ``x0``, draft up to
   ``d`` tokens autoregressively with the first ``E`` layers and exit ``E``.
2. **Self-verification** (Sec. 4.3.2): run layers ``E..L`` once over ``x0, d_1 .. d_n``.
3. **Cache reuse** (Sec. 4.3.3): there is a **single KV cache**: drafting writes layers
   ``1..E`` of every draft token, verification writes layers ``E+1..L`` - nothing is computed
   twice. The **exit-query cache** is the hidden state after layer ``E`` of each draft step
   (``(B, n+1, D)``), from which verification starts; only the last draft, never fed back
   during drafting, needs its first ``E`` layers run before verification.
4. Accept the longest agreeing prefix plus the verifier's own next token (the correction on a
   mismatch, the **bonus token** when every draft passes), and roll the cache back
   (:meth:`~exitlm.model.kv_cache.KVCache.crop`) to the accepted tokens.

Greedy decoding accepts a draft when it equals the final layer's argmax, so the output is
token-identical to plain greedy decoding. Sampling uses speculative rejection sampling
(Leviathan et al. 2023, Chen et al. 2023): accept ``x ~ q`` with probability
``min(1, p(x)/q(x))``, else sample ``norm(max(0, p - q))``; the emitted tokens are then
distributed exactly as plain sampling from ``p`` (draft ``q`` and target ``p`` both go through
the same temperature / top-k / top-p).

Sequences are independent: each drafts its own number of tokens ``n_i`` (its
``num_speculations``, its remaining budget, its ``draft_threshold``), draws from its own
generator, accepts its own prefix and is cropped to it. The batch drafts ``max n_i`` steps;
a sequence past its own ``n_i`` rides along as a dummy whose drafts are neither sampled nor
verified, so what it produces never depends on what else shares the batch.

Per-token exit layers report ``E`` for accepted drafts and ``L`` for the verifier's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import torch

from exitlm.config import ConfigError
from exitlm.infer.decoder import Batch, Decoder, Emit, Seq, last_positions, prefill_hidden
from exitlm.infer.options import option
from exitlm.infer.result import DecodeStats
from exitlm.infer.sampling import probabilities
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.runner import Chain, Pick, Runner
from exitlm.schema import PositiveInt, Range, UnitFloat, check

MAX_SPECULATIONS = 64
"""The most draft tokens a round may hold (bounds the cache slots a round writes)."""
Speculations = Annotated[int, Range(ge=1, le=MAX_SPECULATIONS)]


@dataclass(frozen=True)
class SelfSpecOptions:
    """Options of the ``self-spec`` strategy."""

    exit_layer: PositiveInt | None = option(
        None, "the draft exit E (default: the model's deepest exit head, or L // 2 for "
        "LayerSkip every-layer exits)")
    num_speculations: Speculations = option(
        4, "d, draft tokens per round (LayerSkip Sec. 4.3.1)", per_request=True)
    draft_vocab: PositiveInt | None = option(
        None, "draft only among the first N token ids (BPE ids roughly follow merge "
        "frequency): a cheaper exit projection; output unchanged")
    draft_threshold: UnitFloat | None = option(
        None, "stop a round's drafting once the exit's probability of its own draft falls "
        "below this (transformers' assistant_confidence_threshold); output unchanged",
        per_request=True)

    def __post_init__(self) -> None:
        check(self)


@dataclass
class SelfSpecStats(DecodeStats):
    """Per-sequence counters of self-speculative decoding."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def derived(self) -> dict[str, float]:
        return {"acceptance_rate": self.acceptance_rate,
                "tokens_per_round": (self.accepted + self.rounds) / self.rounds
                if self.rounds else 0.0}

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def describe(self) -> str:
        return f"acceptance {self.acceptance_rate:.1%}"


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
    if exit_layer >= model.num_layers:
        raise ConfigError(f"exit_layer {exit_layer} is not an early exit; the draft exit must "
                          f"lie in [1, {model.num_layers - 1}]")
    model.exit_route(exit_layer, setting="exit_layer")
    return exit_layer


class SelfSpecDecoder(Decoder):
    """Self-speculative decoding as a step machine (see the module docstring)."""

    name = "self-spec"
    multi_row = True
    stats_type = SelfSpecStats

    def __init__(self, runner: Runner, options: SelfSpecOptions) -> None:
        super().__init__(runner, options)
        model = runner.model
        self.e = resolve_exit_layer(model, options.exit_layer)
        vocab = model.config.vocab_size
        self.vocab = vocab if options.draft_vocab is None else min(options.draft_vocab, vocab)
        self.block = model.exit_route(self.e).has_block
        # where a product over several positions costs about one per position (large LM
        # heads on CPU), greedy verification projects one position at a time and stops at
        # the first rejection (_accept_greedy_lazy); elsewhere one product verifies them all
        self.lazy = not runner.supports("batched_head")

    def resolved_options(self) -> dict[str, object]:
        return {**super().resolved_options(), "exit_layer": self.e, "draft_vocab": self.vocab}

    def lookahead(self, seq: Seq) -> int:
        return min(seq.options.num_speculations, seq.remaining) + 1

    @property
    def max_lookahead(self) -> int:
        return MAX_SPECULATIONS + 1

    def prefill(self, batch: Batch) -> list[Emit]:
        num_layers = self.model.num_layers
        h, lens = prefill_hidden(self.runner, batch, exits=(self.e,) if self.block else ())
        logits = self.runner.logits(last_positions(h, lens), num_layers)
        return [Emit([t], [num_layers], num_layers) for t in batch.choose(logits)]

    def step(self, batch: Batch) -> list[Emit]:
        """One round: draft (a chain through layers ``1..E`` and exit ``E``), verify (layers
        ``E+1..L`` over the exit queries), accept, roll back."""
        runner, cache = self.runner, batch.cache
        limits = [max(0, min(s.options.num_speculations, s.remaining - 1)) for s in batch.seqs]
        counts = list(limits)
        q_probs: dict[int, list[torch.Tensor]] = {i: [] for i, s in enumerate(batch.seqs)
                                                  if not s.sampling.greedy}
        base = cache.lengths.to(self.device)  # (B,) position of x0
        drafts = runner.chain(batch.lasts(self.device)[:, 0], cache, max(limits), self.e,
                              vocab=self.vocab, pick=self._picker(batch, counts, q_probs))
        n = drafts.tokens.shape[1]
        pos = base[:, None] + torch.arange(n + 1, device=self.device)[None, :]  # (B, n+1)
        hv = runner.layers(drafts.hidden, self.e, self.model.num_layers, pos, cache)
        accepted, final = self._accept(batch, drafts, counts, q_probs, hv)
        self._record_logprobs(batch, drafts, hv, accepted, final)
        keep = cache.lengths + 1 + torch.tensor(accepted)  # x0 and the accepted drafts
        cache.lengths = keep
        cache.crop(keep)
        return [self._emit(s, drafts, counts[i], i, a, f) for i, (s, a, f) in
                enumerate(zip(batch.seqs, accepted, final, strict=True))]

    # ----- the parts of a round ------------------------------------------------------------
    def _picker(self, batch: Batch, counts: list[int],
                q_probs: dict[int, list[torch.Tensor]]) -> Pick | None:
        """How drafts are chosen (Sec. 4.3.1): the argmax (``None``: any runner's own greedy
        chain) unless a row samples or has a draft threshold; then :meth:`_pick`."""
        if not q_probs and all(s.options.draft_threshold is None for s in batch.seqs):
            return None

        def pick(j: int, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
            return self._pick(batch, logits, j, counts, q_probs), max(counts)

        return pick

    def _pick(self, batch: Batch, logits: torch.Tensor, j: int, counts: list[int],
              q_probs: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """Draft token ``j`` of every row from the exit's logits ``(B, N)``: argmax, or a
        sample from the row's own generator while it still drafts; a row whose own draft
        threshold is not met stops drafting after this token. Rows past their own count ride
        along (their drafts are neither sampled nor verified)."""
        tok = torch.argmax(logits, dim=-1)
        vocab = self.model.config.vocab_size
        for i, s in enumerate(batch.seqs):
            if j >= counts[i]:
                continue
            tau = s.options.draft_threshold
            if i in q_probs:
                q = probabilities(logits[i : i + 1], s.sampling)
                tok[i] = torch.multinomial(q, 1, generator=s.generator)[0, 0]
                q_probs[i].append(torch.nn.functional.pad(q, (0, vocab - q.shape[-1])))
                conf = float(q[0, tok[i]]) if tau is not None else 1.0
            else:
                conf = float(torch.softmax(logits[i].float(), -1).max()) if tau is not None \
                    else 1.0
            if tau is not None and j + 1 < counts[i] and conf < tau:
                counts[i] = j + 1  # verify this unsure draft, draft no further
        return tok

    def _accept(self, batch: Batch, drafts: Chain, counts: list[int],
                q_probs: dict[int, list[torch.Tensor]], hv: torch.Tensor
                ) -> tuple[list[int], list[int]]:
        """Accepted drafts and the verifier's token of every row: greedy rows by argmax
        agreement, sampled rows by rejection sampling with their own generator."""
        b = len(batch)
        accepted, final = [0] * b, [0] * b
        greedy = [i for i in range(b) if i not in q_probs]
        final_head = self._final_logits
        if greedy:
            g = torch.tensor(greedy, device=self.device)
            limit = torch.tensor([counts[i] for i in greedy], device=self.device)
            accept = _accept_greedy_lazy if self.lazy else _accept_greedy
            a, f = accept(final_head, drafts.tokens[g], hv[g], limit)
            for i, ai, fi in zip(greedy, a.tolist(), f.tolist(), strict=True):
                accepted[i], final[i] = ai, fi
        for i, qs in q_probs.items():
            s, k = batch.seqs[i], counts[i]
            p = probabilities(final_head(hv[i, : k + 1]), s.sampling)  # (k+1, V)
            q = torch.cat(qs, 0)[None] if qs else p.new_zeros(1, 0, p.shape[-1])
            a, f = _accept_sampled(drafts.tokens[i : i + 1, :k], q, p[None], s.generator)
            accepted[i], final[i] = int(a[0]), int(f[0])
        return accepted, final

    def _final_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.runner.logits(h, self.model.num_layers)

    def _record_logprobs(self, batch: Batch, drafts: Chain, hv: torch.Tensor,
                         accepted: list[int], final: list[int]) -> None:
        """Log-probabilities of the emitted tokens under the verifier (the final layer), for
        the sequences that want them: accepted drafts are the target model's tokens."""
        for i, s in enumerate(batch.seqs):
            if s.wants_logprobs:
                a = accepted[i]
                tokens = [*drafts.tokens[i, :a].tolist(), final[i]]
                batch.record(self._final_logits(hv[i, : a + 1]), tokens, [i] * (a + 1))

    def _emit(self, seq: Seq, drafts: Chain, n_i: int, i: int, a: int, final: int) -> Emit:
        st: SelfSpecStats = seq.stats  # type: ignore[assignment]
        st.rounds += 1
        st.drafted += n_i
        st.accepted += a
        toks = drafts.tokens[i, :a].tolist()
        num_layers = self.model.num_layers
        return Emit([*toks, final], [self.e] * a + [num_layers], (n_i + 1) * num_layers)


FinalHead = Callable[[torch.Tensor], torch.Tensor]


def _accept_greedy(head: FinalHead, drafts: torch.Tensor, hv: torch.Tensor,
                   limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the number of leading drafts (at most ``limit`` per row) equal to
    the final layer's argmax over ``hv`` ``(R, n+1, D)``, and the final layer's token right
    after them (correction or bonus) ``(R,)`` each."""
    return _agreement(drafts, torch.argmax(head(hv), dim=-1), limit)


def _agreement(drafts: torch.Tensor, target: torch.Tensor, limit: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The number of leading drafts ``(R, n)`` (at most ``limit`` per row) equal to the final
    layer's tokens ``target`` ``(R, n+1)``, and the final layer's token right after them."""
    n = drafts.shape[1]
    inside = torch.arange(n, device=drafts.device)[None, :] < limit[:, None]
    agree = ((drafts == target[:, :n]) & inside).to(torch.long)
    n_acc = agree.cumprod(dim=1).sum(dim=1)  # (R,)
    return n_acc, target.gather(1, n_acc[:, None])[:, 0]


def _accept_greedy_lazy(head: FinalHead, drafts: torch.Tensor, hv: torch.Tensor,
                        limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_accept_greedy` computing the final logits one draft position at a time, only
    for the rows whose drafts all passed so far: the LM head (the largest matrix of a small
    model) then runs ``accepted + 1`` times instead of ``d + 1``. Same result."""
    r, n = drafts.shape
    n_acc = torch.zeros(r, dtype=torch.long, device=drafts.device)
    final = torch.zeros(r, dtype=torch.long, device=drafts.device)
    alive = torch.arange(r, device=drafts.device)
    for j in range(n + 1):
        target = torch.argmax(head(hv[alive, j]), dim=-1)  # (R',)
        ok = (target == drafts[alive, j]) & (limit[alive] > j) if j < n else \
            torch.zeros_like(target, dtype=torch.bool)
        stop = ~ok
        n_acc[alive[stop]] = j
        final[alive[stop]] = target[stop]
        alive = alive[ok]
        if alive.numel() == 0:
            break
    return n_acc, final


def _accept_sampled(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    ``drafts`` ``(R, n)`` were drawn from ``q`` ``(R, n, V)``; ``p`` ``(R, n+1, V)`` is the
    target. Draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the
    first rejection the token is drawn from ``norm(max(0, p_j - q_j))``; when all pass, the
    bonus token is drawn from ``p_n``. Returns accepted counts and the final tokens ``(R,)``.
    """
    r, n = drafts.shape
    if n == 0:
        return (torch.zeros(r, dtype=torch.long, device=drafts.device),
                torch.multinomial(p[:, 0], 1, generator=generator)[:, 0])
    px = p[:, :n].gather(2, drafts[..., None])[..., 0]  # (R, n)
    qx = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(r, n, generator=generator, device=drafts.device)
    ok = (u * qx < px).to(torch.long)  # accept with probability min(1, p/q)
    n_acc = ok.cumprod(dim=1).sum(dim=1)  # (R,)
    rows = torch.arange(r, device=drafts.device)
    p_at = p[rows, n_acc]  # (R, V): target at the first rejection (or the bonus position)
    q_at = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, n_acc]  # 0 for the bonus
    residual = (p_at - q_at).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q exactly leaves no residual mass; any rejection then has probability 0, so fall
    # back to p itself (never reached in exact arithmetic, guards rounding).
    dist = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    final = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return n_acc, final

