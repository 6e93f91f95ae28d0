"""Predictive Pipelined Decoding (PPD Sec. 3, Alg. 1, and the general case Alg. 2 / App. C).

A model has ``d`` layers; the early prediction is made at exit ``d_bar`` (``d/2 <= d_bar <
d``). Per generated token ``x_t`` at position ``p``:

* **main** (sequential): run ``x_t`` up to layer ``d_bar`` - from layer 1, or, when the last
  early prediction was confirmed, from layer ``d - d_bar`` on the hidden state the matching
  branch produced (Alg. 2 line 12) - and take the top-``k`` tokens of exit ``d_bar``.
* **in parallel** (Alg. 2 lines 17-29): the main thread runs layers ``d_bar..d`` of ``x_t``
  while ``k`` worker threads each run one candidate ``x_hat_j`` at position ``p + 1`` through
  layers ``1..d - d_bar``. On CUDA every branch runs on its own stream.
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

Timing: ``stats`` reports the measured ``p_correct`` (a confirmed early prediction per fork)
and PPD Theorem 4.1's predicted latency for it (:mod:`exitlm.plan.ppd_theory`, in "time
units" = one layer). Batch size 1 and greedy decoding only (PPD is defined for greedy).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
from exitlm.infer.stopping import TextCallback
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan import ppd_theory
from exitlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class PPDOptions:
    """Options of the ``ppd`` strategy.

    Attributes:
        ppd_layer: ``d_bar``, the exit whose top-``k`` predictions start the next token
            (default: the model's deepest configured exit head >= d/2, else ``d/2``).
        ppd_k: ``k``, the number of candidate branches (sub-processes; PPD uses ``k + 1``
            compute units).
        parallel: run branches concurrently with the main process (threads / CUDA streams);
            ``False`` runs them one after the other (same tokens, for debugging and timing).
        draft_vocab: take the top-``k`` among the first ``N`` token ids only: the early
            projection on the main thread's critical path shrinks from ``V`` to ``N`` rows
            (Theorem 4.1 counts no cost for it). Output unchanged. ``None``: all ids.
    """

    ppd_layer: int | None = None
    ppd_k: int = 1
    parallel: bool = True
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if self.ppd_k < 1:
            raise ConfigError(f"ppd_k must be >= 1, got {self.ppd_k}")
        if self.draft_vocab is not None and self.draft_vocab < self.ppd_k:
            raise ConfigError(f"draft_vocab must be >= ppd_k, got {self.draft_vocab}")


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
    return require_exit(model, ppd_layer, "ppd_layer")


def generate_ppd(
    model: EarlyExitLM,
    prompt_ids: list[list[int]],
    sampling: SamplingOptions,
    *,
    tokenizer: Tokenizer | None = None,
    stream: TextCallback | None = None,
    options: PPDOptions | None = None,
    start_time: float | None = None,
) -> GenerationResult:
    """Greedy decoding with PPD (see the module docstring); one prompt at a time."""
    opts = options or PPDOptions()
    if len(prompt_ids) != 1:
        raise ConfigError(f"ppd decodes one prompt at a time, got a batch of {len(prompt_ids)}")
    if not sampling.greedy:
        raise ConfigError("ppd is exact greedy decoding; use temperature=0")
    d = model.num_layers
    d_bar = resolve_ppd_layer(model, opts.ppd_layer)
    k = min(opts.ppd_k, model.config.vocab_size)
    m = d - d_bar  # layers a branch runs before the main thread needs its state
    s = Session(model, prompt_ids, sampling, tokenizer=tokenizer, stream=stream,
                start_time=start_time, extra_slots=1)
    dev = s.device
    block = has_block_head(model, d_bar)
    vocab = model.config.vocab_size
    head = DraftHead(model, d_bar, vocab if opts.draft_vocab is None
                     else min(opts.draft_vocab, vocab))
    main = s.new_cache()
    cfg = model.config
    branches = [KVCache(m, 1, s.capacity, cfg.n_kv_heads, cfg.hdim, dtype=main.keys[0].dtype,
                        device=dev) for _ in range(k)]
    pool = ThreadPoolExecutor(max_workers=k) if opts.parallel else None
    streams = ([torch.cuda.Stream(device=dev) for _ in range(k)]
               if dev.type == "cuda" and opts.parallel else None)
    forks = matches = 0
    predicted: list[bool] = []
    try:
        with torch.inference_mode():
            s.start_prefill()
            h, _ = prefill_hidden(model, s.tokens, main, exits=(d_bar,) if block else ())
            n0 = int(s.lengths[0])
            for c in branches:  # the prompt's prefix entries, once
                for layer in range(m):
                    c.keys[layer][:, :, :n0] = main.keys[layer][:, :, :n0]
                    c.values[layer][:, :, :n0] = main.values[layer][:, :, :n0]
            x = int(model.final_logits(last_positions(h, s.lengths)).argmax(dim=-1)[0])
            s.push(0, [x], [d])
            s.layer_evals[0] += d
            s.end_prefill()
            p = n0
            carried: torch.Tensor | None = None  # branch state after layer m, when matched
            while s.running(0):
                pos = torch.full((1, 1), p, dtype=torch.long, device=dev)
                ctx = model.context(pos, main)
                if carried is None:  # Alg. 2 line 10: from the first layer
                    hm = model.run_layers(model.embed(torch.tensor([[x]], device=dev), pos),
                                          0, d_bar, cache=main, ctx=ctx)
                    s.layer_evals[0] += d_bar
                    _copy_entry(main, branches, m, p)
                else:  # line 12: continue the matching branch from layer d - d_bar
                    hm = model.run_layers(carried, m, d_bar, cache=main, ctx=ctx)
                    s.layer_evals[0] += d_bar - m
                fork = s.remaining(0) > 1
                cands: list[int] = []
                if fork:
                    early = head(hm, ctx, main)[0, -1]
                    cands = torch.topk(early, k).indices.tolist()
                elif block:
                    model.exit_features(hm, d_bar, cache=main, ctx=ctx)
                jobs = _start_branches(model, branches, cands, p + 1, m, pool, streams)
                hf = model.run_layers(hm, d_bar, d, cache=main, ctx=ctx)  # main, in parallel
                x = int(model.final_logits(hf)[0, -1].argmax())
                s.layer_evals[0] += d - d_bar
                states = _finish_branches(jobs, streams)
                carried = None
                if fork:
                    forks += 1
                    s.layer_evals[0] += k * m
                    hit = cands.index(x) if x in cands else -1
                    predicted.append(hit >= 0)
                    if hit >= 0:
                        matches += 1
                        carried = states[hit]
                        _adopt_entry(branches[hit], main, branches, m, p + 1)
                main.lengths[:] = p + 1
                s.push(0, [x], [d])
                p += 1
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    decode_tokens = max(0, len(s.trackers[0].ids) - 1)
    p_hat = matches / forks if forks else 0.0
    stats: dict[str, object] = {
        "ppd_layer": d_bar, "ppd_k": k, "forks": forks, "matches": matches,
        "p_correct": p_hat, "parallel": opts.parallel, "draft_vocab": head.vocab,
    }
    if decode_tokens >= 1:
        theory = ppd_theory.predict(d, d_bar, k, decode_tokens, p_hat)
        stats["theory"] = {"tokens": decode_tokens, **theory}
    s.seq_stats[0] = {"early_prediction_correct": predicted}
    return s.result("ppd", stats)


def _copy_entry(src: KVCache, dsts: list[KVCache], m: int, p: int) -> None:
    """Copy position ``p`` of layers ``[0, m)`` from ``src`` into every cache of ``dsts``."""
    for c in dsts:
        for layer in range(m):
            c.keys[layer][:, :, p] = src.keys[layer][:, :, p]
            c.values[layer][:, :, p] = src.values[layer][:, :, p]


def _adopt_entry(win: KVCache, main: KVCache, branches: list[KVCache], m: int, p: int) -> None:
    """The confirmed branch's entry at ``p`` becomes everyone's (main and the other branches)."""
    _copy_entry(win, [main, *(c for c in branches if c is not win)], m, p)


def _run_branch(
    model: EarlyExitLM, cache: KVCache, token: int, p: int, m: int,
    stream: torch.cuda.Stream | None, ready: torch.cuda.Event | None,
) -> torch.Tensor:
    """One PPD sub-process (Alg. 2 line 23): candidate ``token`` at position ``p`` through
    layers ``[0, m)`` on the branch's own cache; returns the hidden state ``(1, 1, D)``."""
    with torch.inference_mode():
        dev = model.embed_tokens.weight.device
        if stream is not None:
            assert ready is not None
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                return _branch_forward(model, cache, token, p, m, dev)
        return _branch_forward(model, cache, token, p, m, dev)


def _branch_forward(
    model: EarlyExitLM, cache: KVCache, token: int, p: int, m: int, dev: torch.device
) -> torch.Tensor:
    pos = torch.full((1, 1), p, dtype=torch.long, device=dev)
    ctx = model.context(pos, cache)
    h = model.embed(torch.tensor([[token]], device=dev), pos)
    return model.run_layers(h, 0, m, cache=cache, ctx=ctx)


Job = Future[torch.Tensor] | torch.Tensor


def _start_branches(
    model: EarlyExitLM, branches: list[KVCache], cands: list[int], p: int, m: int,
    pool: ThreadPoolExecutor | None, streams: list[torch.cuda.Stream] | None,
) -> list[Job]:
    """Launch one branch per candidate; with no pool they run here, one after another."""
    if not cands:
        return []
    ready = None
    if streams is not None:
        ready = torch.cuda.Event()
        ready.record()  # branches wait for the main stream's writes (prefix entries)
    jobs: list[Job] = []
    for j, tok in enumerate(cands):
        stream = streams[j] if streams is not None else None
        if pool is None:
            jobs.append(_run_branch(model, branches[j], tok, p, m, stream, ready))
        else:
            jobs.append(pool.submit(_run_branch, model, branches[j], tok, p, m, stream, ready))
    return jobs


def _finish_branches(
    jobs: list[Job], streams: list[torch.cuda.Stream] | None
) -> list[torch.Tensor]:
    """Wait for every branch (and its CUDA stream) and return their states."""
    out = [j.result() if isinstance(j, Future) else j for j in jobs]
    if streams is not None:
        cur = torch.cuda.current_stream()
        for st in streams[: len(jobs)]:
            cur.wait_stream(st)
    return out

