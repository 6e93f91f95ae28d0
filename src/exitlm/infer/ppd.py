"""Predictive Pipelined Decoding (PPD Sec. 3, Alg. 1, and the general case Alg. 2 / App. C).

A model has ``d`` layers; the early prediction is made at exit ``d_bar`` (``d/2 <= d_bar <
d``). Per generated token ``x_t`` at position ``p`` (one :meth:`PPDDecoder.step`):

* **main** (sequential): run ``x_t`` up to layer ``d_bar`` - from layer 1, or, when the last
  early prediction was confirmed, from layer ``d - d_bar`` on the hidden state the matching
  branch produced (Alg. 2 line 12). The top-``k`` tokens of exit ``d_bar`` (the early
  prediction) are taken on the branch's side - the pool thread or the worker process - so
  that projection, several layers' worth of work over a large vocabulary, is not on the main
  token's path, where Theorem 4.1 does not count it; exits with a transformer-block head
  (whose KV cache slot the main thread fills) and CUDA streams take it on the main thread.
* **in parallel** (Alg. 2 lines 17-29): the main thread runs layers ``d_bar..d`` of ``x_t``
  while ``k`` branches each run one candidate ``x_hat_j`` at position ``p + 1`` through layers
  ``1..d - d_bar``: on worker threads, on CUDA streams launched from this thread (a graph
  runner replays them there beside the main token's last layers), or, with
  ``ppd_workers="process"`` (CPU), in one spawned worker process on keys/values in shared
  memory - threads share the GIL, so on CPU only processes overlap the branch with the main
  token (:mod:`exitlm.infer.ppd_branches`).
* if the final layer's argmax equals a candidate, that branch's hidden state and its new
  keys/values are kept and the next token starts at layer ``d - d_bar``; otherwise every
  branch is discarded and the next token starts from layer 1.

**KV sharing.** Branches read the prefix keys/values of layers ``1..d - d_bar``, which the
main thread has already written for every position ``<= p`` before the fork and never touches
during it (it writes only layers ``> d_bar >= d - d_bar``). Each branch owns a cache of just
those ``d - d_bar`` layers; after every token the new prefix entry (position ``p``, or the
winning branch's ``p + 1``) is copied into the other caches: ``O(d - d_bar)`` small copies per
token, no prefix is ever copied twice. Every token goes through exactly the same single-row
computations as plain greedy decoding, so the output is token-identical to greedy decoding.

PPD holds one sequence at a time (``max_batch = 1``: the engine queues the others) and is
defined for greedy decoding only. :class:`PPDStats` reports the measured ``p_correct`` and
:meth:`PPDStats.theory` PPD Theorem 4.1's prediction for it (:mod:`exitlm.plan.ppd_theory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.decoder import Batch, Decoder, Emit, Seq, last_positions, prefill_hidden
from exitlm.infer.ppd_branches import Branches, SerialBranches, StreamBranches, ThreadBranches
from exitlm.infer.result import DecodeStats
from exitlm.infer.strategy_options import PPDOptions
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan import ppd_theory
from exitlm.runtime.runner import Runner


@dataclass
class PPDStats(DecodeStats):
    """Per-sequence counters of PPD: forks (early predictions made) and matches (confirmed)."""

    forks: int = 0
    matches: int = 0

    @property
    def p_correct(self) -> float:
        return self.matches / self.forks if self.forks else 0.0

    def derived(self) -> dict[str, float]:
        return {"p_correct": self.p_correct}

    def describe(self) -> str:
        return f"p_correct {self.p_correct:.1%}"

    def theory(self, d: int, d_bar: int, k: int, tokens: int) -> dict[str, float]:
        """PPD Theorem 4.1 for the measured ``p_correct`` over ``tokens`` decoded tokens."""
        return ppd_theory.predict(d, d_bar, k, tokens, self.p_correct)


def resolve_ppd_layer(model: EarlyExitLM, ppd_layer: int | None) -> int:
    """``d_bar`` (see :attr:`PPDOptions.ppd_layer`), checked against Theorem 4.1's range."""
    d = model.num_layers
    cfg = model.config
    if ppd_layer is None:
        deep = [x for x in cfg.exits.layers if 2 * x >= d]
        if deep:
            ppd_layer = deep[-1]
        elif cfg.exits.every_layer:
            ppd_layer = (d + 1) // 2
        else:
            raise ConfigError(
                "PPD needs an early exit at a layer >= num_layers / 2 (set ppd_layer, or load "
                "the model with exits, e.g. ExitConfig(every_layer=True))"
            )
    if not (2 * ppd_layer >= d and ppd_layer < d):
        raise ConfigError(
            f"ppd_layer (d_bar) must satisfy d/2 <= d_bar < d (PPD App. C), got {ppd_layer} "
            f"for d={d}"
        )
    model.exit_route(ppd_layer, setting="ppd_layer")
    return ppd_layer


class PPDDecoder(Decoder):
    """Greedy decoding with PPD (see the module docstring); one sequence at a time."""

    name = "ppd"
    stats_type = PPDStats
    max_batch = 1

    def __init__(self, runner: Runner, options: PPDOptions,
                 branches: type[Branches] | None = None) -> None:
        super().__init__(runner, options)
        model = runner.model
        self.d = model.num_layers
        self.d_bar = resolve_ppd_layer(model, options.ppd_layer)
        self.k = min(options.ppd_k, model.config.vocab_size)
        self.m = self.d - self.d_bar  # layers a branch runs before the main thread needs it
        vocab = model.config.vocab_size
        self.vocab = vocab if options.draft_vocab is None else min(options.draft_vocab, vocab)
        self.block = model.exit_route(self.d_bar).has_block
        self.branches = self._branches(options, branches)
        self.carried: torch.Tensor | None = None  # branch state after layer m, when matched

    def _branches(self, options: PPDOptions, kind: type[Branches] | None) -> Branches:
        """Where the branches run (:mod:`exitlm.infer.ppd_branches`): ``kind`` when the
        executor gives one (a worker process), else serial, on CUDA streams or on threads.
        The early prediction is made on the branches' side where they run apart from the main
        thread (threads on CPU, the worker process), except for exits with a block head,
        whose KV cache slot the main thread fills."""
        head = (self.d_bar, self.vocab)
        predicts = not self.block
        if kind is not None:
            return kind(self.runner, self.m, self.k, head, predicts=predicts)
        if options.ppd_workers == "process":
            raise ConfigError("ppd_workers='process' runs the branches in a worker process: an "
                              "engine over a BranchWorkerExecutor (exitlm.infer.executors; "
                              "generate() and Engine start one for these options)")
        if not options.parallel:
            return SerialBranches(self.runner, self.m, self.k, head)
        if self.runner.supports("streams"):
            return StreamBranches(self.runner, self.m, self.k, head)
        return ThreadBranches(self.runner, self.m, self.k, head, predicts=predicts)

    def resolved_options(self) -> dict[str, Any]:
        return {**super().resolved_options(), "ppd_layer": self.d_bar, "ppd_k": self.k,
                "draft_vocab": self.vocab}

    def lookahead(self, seq: Seq) -> int:
        """A confirmed branch's entry lands one position past the token being decoded."""
        return 2

    @property
    def max_lookahead(self) -> int:
        return 2

    @property
    def startup_s(self) -> float:
        """Seconds spent starting the branches' worker process (``--ppd-workers process``)."""
        return float(getattr(self.branches, "startup_s", 0.0))

    def check(self, seq: Seq) -> None:
        if not seq.sampling.greedy:
            raise ConfigError("ppd is exact greedy decoding; use temperature=0")

    def close(self) -> None:
        self.branches.close()

    def prefill_span(self) -> tuple[int | None, tuple[int, ...]]:
        return None, (self.d_bar,) if self.block else ()

    def prefill(self, batch: Batch) -> list[Emit]:
        runner = self.runner
        h, lens = prefill_hidden(runner, batch, *self.prefill_span())
        seq, main = batch.seqs[0], batch.cache
        capacity = len(seq.prompt) + seq.sampling.max_new_tokens + 2
        self.branches.start(main, int(lens[0]), capacity)
        self.carried = None
        x = batch.choose(runner.logits(last_positions(h, lens), self.d))[0]  # greedy
        return [Emit([x], [self.d], self.d)]

    def step(self, batch: Batch) -> list[Emit]:
        """One token: main thread to ``d_bar``, fork ``k`` branches for the next token while
        the main thread finishes, keep the branch the final layer confirms (Alg. 2)."""
        runner, seq, br = self.runner, batch.seqs[0], self.branches
        main = br.main_view(batch.cache)
        p = int(main.lengths[0])
        pos = torch.full((1, 1), p, dtype=torch.long, device=self.device)
        if self.carried is None:  # Alg. 2 line 10: from the first layer
            h0 = runner.embed(batch.lasts(self.device), pos)
            hm = runner.layers(h0, 0, self.d_bar, pos, main)
            evals = self.d_bar
            br.share(main, p)
        else:  # line 12: continue the matching branch from layer d - d_bar
            hm = runner.layers(self.carried, self.m, self.d_bar, pos, main)
            evals = self.d_bar - self.m
        fork = seq.remaining > 1
        if fork and br.predicts:  # the branch side makes the early prediction
            br.predict(hm, p + 1)
        elif fork:  # lines 14-16: top-k of exit d_bar (an exit block writes its slot)
            early = runner.logits(hm, self.d_bar, vocab=self.vocab, positions=pos, cache=main)
            br.fork(runner.draft_tokens(torch.topk(early[0, -1], self.k).indices, self.vocab),
                    p + 1)
        elif self.block:
            runner.logits(hm, self.d_bar, positions=pos, cache=main)
        hf = runner.layers(hm, self.d_bar, self.d, pos, main)  # main, beside the branches
        x = batch.choose(runner.logits(hf[:, -1], self.d))[0]  # greedy
        cands, states = br.join() if fork else ([], [])
        evals += self.m + len(cands) * self.m
        self.carried = self._resolve(seq, main, cands, states, x, p + 1)
        main.lengths = torch.tensor([p + 1])
        return [Emit([x], [self.d], evals)]

    def _resolve(self, seq: Seq, main: KVCache, cands: list[int],
                 states: list[torch.Tensor], x: int, p: int) -> torch.Tensor | None:
        """Count the fork; on a confirmed candidate its entry at ``p`` becomes everyone's
        and its state carries into the next token."""
        if not cands:
            return None
        st: PPDStats = seq.stats  # type: ignore[assignment]
        st.forks += 1
        if x not in cands:
            return None
        st.matches += 1
        j = cands.index(x)
        self.branches.adopt(j, main, p)
        return states[j]
