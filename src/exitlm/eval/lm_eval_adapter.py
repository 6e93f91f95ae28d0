"""An lm-evaluation-harness model for exitlm: any checkpoint, any exit, any decoding strategy.

Importing this module registers the model as ``exitlm`` (lm-eval has no plugin discovery)::
    from exitlm.eval.lm_eval_adapter import ExitlmLM
    import lm_eval
    lm = ExitlmLM(pretrained="default-ee", strategy="self-spec", exit_layer=20)
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=...)

or ``exitlm lm-eval --model default-ee --strategy self-spec --tasks ...`` (:mod:`exitlm.eval.cli`).

* ``loglikelihood`` / ``loglikelihood_rolling`` score text with one forward per batch (no
  cache), at the final layer or at any exit (``layer=``: EE-LLM / LayerSkip exits evaluated
  like the full model). Context / continuation encoding is lm-eval's own (its ``TemplateLM``:
  trailing spaces move to the continuation, an empty context is the prefix token), so the
  numbers are comparable with its ``hf`` model on the same weights.
* ``generate_until`` runs every request through one :class:`~exitlm.infer.engine.Engine`
  with the chosen strategy (``ar``, ``early-exit``, ``self-spec``, ``ppd``) and its options:
  requests are decoded together with continuous batching, each with its own stop strings
  and token budget.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from exitlm.config import ConfigError
from exitlm.infer import Engine, SamplingOptions, get_strategy
from exitlm.infer.cli import load_for_strategy, rank_draft_vocab, tokenizer_for
from exitlm.io.loader import parse_dtype
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.tokenizer import Tokenizer


@register_model("exitlm")
class ExitlmLM(TemplateLM):
    """lm-eval's view of an exitlm model (see the module docstring).

    Args:
        pretrained: a model name or path (:func:`exitlm.io.load_model`), or a built
            :class:`~exitlm.model.transformer.EarlyExitLM` (then pass ``tokenizer``).
        tokenizer: the tokenizer when ``pretrained`` is a model object.
        strategy: the decoding strategy of ``generate_until``.
        layer: the exit that scores ``loglikelihood*`` (default: the final layer).
        dtype: ``float32`` / ``float16`` / ``bfloat16`` when loading by name.
        head_dtype: ``int8``: quantize only the output embeddings when loading by name
            (``--head-dtype``).
        batch_size: sequences per scoring forward and per engine step.
        max_length: the longest scored window (default: the model's context).
        max_gen_toks: the default generation budget.
        threads: CPU threads (default: the engine's measuring policy).
        device, max_batch_size: accepted for lm-eval's command line; the model's own device
            is used and ``batch_size`` bounds the batches.
        **options: the strategy's options (``exit_layer=20``, ``threshold=0.8``, ...).
    """

    def __init__(
        self,
        pretrained: str | EarlyExitLM = "default",
        tokenizer: Tokenizer | None = None,
        strategy: str = "ar",
        layer: int | None = None,
        dtype: str = "float32",
        head_dtype: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        threads: int | None = None,
        device: str | None = None,
        max_batch_size: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if isinstance(pretrained, str):
            loaded = load_for_strategy(pretrained, parse_dtype(dtype), strategy, head_dtype)
            model, tokenizer = loaded.model, tokenizer or tokenizer_for(loaded, pretrained)
            rank_draft_vocab(model, tokenizer, options)
        else:
            model = pretrained
        if tokenizer is None:
            raise ConfigError("the model has no tokenizer; pass tokenizer=")
        self.model = model.eval()
        self.runner = prepare(self.model)
        self.tok = tokenizer
        self.strategy = get_strategy(strategy)
        self.options = self.strategy.options(**options)
        self.layer = model.num_layers if layer is None else int(layer)
        model.exit_route(self.layer, shared_ok=True, setting="layer")
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 8
        self._max_length = int(max_length) if max_length else model.config.max_seq_len
        self._max_gen_toks = int(max_gen_toks)
        self.threads = None if threads is None else int(threads)
        self.generate_s = 0.0
        self.generated_tokens = 0

    # ----- what TemplateLM needs -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        if not self.tok.eos_token_ids:
            raise ConfigError("the tokenizer has no end-of-sequence token")
        return self.tok.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """BOS when the tokenizer has one, else EOS (as lm-eval's ``hf`` model)."""
        return self.tok.bos_token_id if self.tok.bos_token_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids; a BOS token only where the tokenizer adds one and the caller allows it
        (as a Hugging Face tokenizer's ``add_special_tokens``)."""
        return self.tok.encode(string, add_bos=self.tok.add_bos and add_special_tokens is not False)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    # ----- scoring ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """Sum of the continuation's log-probabilities and whether it is the greedy one, for
        each ``(strings, context ids, continuation ids)``; longest first in batches."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for lo in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm,
                       desc="exitlm: scoring"):
            idx = order[lo : lo + self.batch_size]
            pairs = [(requests[i][1], requests[i][2]) for i in idx]
            for i, res in zip(idx, self._score_batch(pairs), strict=True):
                out[i] = res
        return out

    @torch.inference_mode()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]
                     ) -> list[tuple[float, bool]]:
        """One right-padded forward (causal, no cache) over ``context + continuation``
        windows (the last ``max_length + 1`` tokens); only the continuation positions go
        through the output layer."""
        windows, spans = [], []
        for ctx, cont in pairs:
            whole = (ctx + cont)[-(self.max_length + 1):]
            windows.append(whole[:-1])
            spans.append((len(whole) - 1 - len(cont), cont))
        dev = self.model.embed_tokens.weight.device
        tokens = torch.zeros(len(windows), max(len(w) for w in windows), dtype=torch.long)
        for r, w in enumerate(windows):
            tokens[r, : len(w)] = torch.tensor(w)
        h = self.runner.layers(self.runner.embed(tokens.to(dev)), 0, self.layer, None, None)
        rows = torch.cat([torch.full((len(c),), r) for r, (_, c) in enumerate(spans)])
        cols = torch.cat([torch.arange(s, s + len(c)) for s, c in spans])
        logits = self.runner.logits(h[rows.to(dev), cols.to(dev)][:, None], self.layer,
                                    shared_ok=True)[:, 0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor([t for _, c in spans for t in c], device=dev)
        chosen = logp.gather(1, target[:, None])[:, 0]
        greedy = logp.argmax(dim=-1) == target
        out, k = [], 0
        for _, c in spans:
            out.append((float(chosen[k : k + len(c)].sum()), bool(greedy[k : k + len(c)].all())))
            k += len(c)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Whole-text log-likelihoods in disjoint windows of ``max_length`` tokens (lm-eval's
        rolling scheme: every token scored once, with as much context as fits)."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="exitlm: rolling"):
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(("", ""), c, t) for c, t in windows],
                                                disable_tqdm=True)
            out.append(sum(s for s, _ in scores))
        return out

    # ----- generation ---------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continue every context until one of its ``until`` strings (or EOS) or its token
        budget, through the engine with the configured strategy."""
        engine = Engine(self.runner, self.tok, self.strategy.name, self.options,
                        max_batch=self.batch_size, threads=self.threads)
        eos = self.tok.decode([self.eot_token_id], skip_special_tokens=False) or None
        handles = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = [u for u in handle_stop_sequences(kw.pop("until", None), eos=eos) if u]
            budget = int(kw.pop("max_gen_toks"))
            ids = self.tok_encode(context)[-(self.max_length - budget):]
            temperature = float(kw.get("temperature", 0.0) or 0.0) if kw.get(
                "do_sample", False) else 0.0
            sampling = SamplingOptions(max_new_tokens=budget, stop_strings=tuple(until),
                                       temperature=temperature)
            handles.append(engine.submit(ids, sampling))
        t0 = time.perf_counter()
        bar = tqdm(total=len(handles), disable=disable_tqdm, desc="exitlm: generating")
        try:
            while engine.has_work():
                bar.update(sum(u.finished for u in engine.step()))
        finally:
            bar.close()
            engine.close()
        self.generate_s += time.perf_counter() - t0
        self.generated_tokens += sum(len(h.token_ids) for h in handles)
        return [h.result(self.model.num_layers).text for h in handles]
