"""Benchmarks of the decoding strategies (``exitlm bench``).

Every strategy runs over the same prompts with the same model weights in one process, so the
ratios are measured under the same machine load:

* ours: ``ar`` (baseline), ``early-exit``, ``self-spec``, ``ppd``;
* ``transformers`` on the same backbone weights: ``hf`` (greedy ``generate``) and ``hf-ee``
  (``generate(assistant_early_exit=E)``, its LayerSkip integration: the same model truncated
  to ``E`` layers drafts with its own KV cache, and verification re-runs all ``L`` layers).

Measured per strategy: decode tokens/s (tokens after each sequence's first over the time after
it), end-to-end tokens/s, acceptance rate (self-spec), p_correct (PPD), and agreement with our
autoregressive output (exact match, ROUGE-L F1 - :mod:`exitlm.infer.rouge`). For PPD the
measured decode time is compared with Theorem 4.1's prediction (:mod:`exitlm.plan.ppd_theory`)
for the measured p_correct, taking one "time unit" as a layer's share of the autoregressive
per-token time measured in the same run.

Sweeps: exit layer x speculations for self-spec (CSV + contour plot, LayerSkip Fig. 6) and
confidence thresholds for early exit (CSV + speed-up vs agreement plot, EE-LLM Fig. 8).
"""

from __future__ import annotations

import csv
import dataclasses
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exitlm.args import check_threads
from exitlm.bench.names import BUILTIN_PROMPTS, OURS, SWEEP_FILES, THEIRS
from exitlm.config import LAYERSKIP_EXITS, ConfigError, ExitConfig
from exitlm.infer.api import generate
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.infer.ppd import PPDStats, resolve_ppd_layer
from exitlm.infer.result import DecodeStats
from exitlm.infer.rouge import rouge_l
from exitlm.infer.self_speculative import SelfSpecStats, resolve_exit_layer
from exitlm.io import load_model
from exitlm.io.corpus import DataConfig, is_held_out, list_sources, parse_jsonl
from exitlm.io.default_model import default_gguf_path
from exitlm.io.loader import parse_dtype
from exitlm.io.save import export_hf
from exitlm.io.token_order import rank_model_tokens
from exitlm.plan import ppd_theory
from exitlm.runtime import prepare
from exitlm.textfile import MAX_PROMPTS_BYTES, read_text_file


@dataclass
class BenchConfig:
    """What ``exitlm bench`` runs (see the module docstring)."""

    model: str = "default-ee"
    dtype: str = "float32"
    head_dtype: str | None = None
    strategies: tuple[str, ...] = ("ar", "early-exit", "self-spec", "ppd", "hf", "hf-ee")
    prompts_file: str | None = None
    num_prompts: int | None = BUILTIN_PROMPTS
    """Prompts run: the first of ``prompts_file`` (``None``: all of them), else that many
    built-in ones (``None``: :data:`~exitlm.bench.names.BUILTIN_PROMPTS`)."""
    max_new_tokens: int = 64
    repeats: int = 1
    threads: int = 1
    layerskip_exits: bool = False
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [s for s in self.strategies if s not in OURS + THEIRS]
        if unknown:
            raise ConfigError(f"unknown strategies {unknown}; choose from {list(OURS + THEIRS)}")
        for flag, value in (("--num-prompts", self.num_prompts), ("--repeats", self.repeats)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag}: expected an integer >= 1, got {value}")
        check_threads(self.threads)


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----- prompts ---------------------------------------------------------------------------------

_DEF = re.compile(r"^(\s*)def \w+\(.*\).*:\s*$")


def builtin_prompts(n: int) -> list[str]:
    """Code-completion prompts from the held-out split of the standard library (the files the
    training data never sees, :mod:`exitlm.io.corpus`): a function's signature and
    docstring, ending where its body starts. Deterministic."""

    cfg = DataConfig()
    out: list[str] = []
    for key, path in list_sources(cfg):
        if not is_held_out(key, cfg.val_fraction, cfg.seed):
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = _DEF.match(line)
            if not m or i + 1 >= len(lines) or '"""' not in lines[i + 1]:
                continue
            block = [line]
            for nxt in lines[i + 1 : i + 9]:
                block.append(nxt)
                if (nxt.strip().endswith('"""') and len(block) > 2) or nxt.count('"""') == 2:
                    break
            else:
                continue
            cut = len(m.group(1))  # dedent methods to the top level
            prompt = "\n".join(x[cut:] for x in block) + "\n    "
            if len(prompt) <= 400:
                out.append(prompt)
            break  # one function per file: more variety
        if len(out) >= n:
            break
    if not out:
        raise ConfigError("no held-out standard-library functions found; pass --prompts FILE")
    return out


def load_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file: one JSON string or ``{"prompt": ...}`` object per line."""

    source = read_text_file(path, MAX_PROMPTS_BYTES, label=f"--prompts {path}",
                            expected="a JSONL prompts file")
    prompts = []
    for i, rec in parse_jsonl(path, source.split("\n")):
        text = rec if isinstance(rec, str) else rec.get("prompt") if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ConfigError(f"{path}:{i + 1}: expected a string or an object with 'prompt'")
        if not text:
            raise ConfigError(f"{path}:{i + 1}: the prompt is empty; expected some text to "
                              "continue")
        prompts.append(text)
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


# ----- running ---------------------------------------------------------------------------------

@dataclass
class Run:
    """One strategy on one prompt (the fastest of the repeats)."""

    tokens: list[int]
    text: str
    decode_s: float
    decode_tokens: int
    total_s: float
    stats: DecodeStats = field(default_factory=DecodeStats)
    exit_layers: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    """The strategy's options as resolved (``GenerationResult.options``; empty for
    ``transformers``)."""


class _StreamTimer:
    """A transformers streamer recording when each chunk of new tokens arrives."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class Bench:
    """Loads the models once and runs strategies on prompts."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        dtype = parse_dtype(cfg.dtype)
        # transformers runs quantized models' weights in fp32 (it has no CPU int8/int4 path)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        name = cfg.model
        heads = cfg.head_dtype
        try:
            loaded = load_model(name, dtype=dtype, head_dtype=heads)
        except Exception as err:  # default-ee may not be installed yet
            if name != "default-ee":
                raise
            _note(f"bench: 'default-ee' is unavailable ({err}); using the untuned 'default'")
            name = "default"
            loaded = load_model(name, dtype=dtype, head_dtype=heads)
        self._exits: ExitConfig | None = None
        if cfg.layerskip_exits or not loaded.model.config.exit_layers:
            # LayerSkip-style exits at every layer through the final norm + head (the exits
            # transformers' assistant_early_exit uses)
            self._exits = LAYERSKIP_EXITS
            loaded = load_model(name, dtype=dtype, head_dtype=heads, exits=self._exits)
        self.model_name = name
        self.loaded = loaded
        self.model = loaded.model
        self.runner = prepare(loaded.model)
        if loaded.tokenizer is None:  # presets: one token per byte

            self.tokenizer = byte_level_tokenizer()
        else:
            self.tokenizer = loaded.tokenizer
        if any(o.get("draft_vocab") for o in cfg.options.values()):
            n = min(o["draft_vocab"] for o in cfg.options.values() if o.get("draft_vocab"))
            rank_model_tokens(self.model, self.tokenizer, n)
        self._hf: Any = None
        self.prompts = (load_prompts(cfg.prompts_file) if cfg.prompts_file
                        else builtin_prompts(cfg.num_prompts or BUILTIN_PROMPTS))[: cfg.num_prompts]
        self.prompt_ids = self._fit_to_context([self.tokenizer.encode(p) for p in self.prompts])

    def load_again(self) -> Any:
        """The benchmarked model loaded anew, as it was (another copy: its own runners' costs
        and measured times, :func:`~exitlm.runtime.costs.costs_of`)."""
        return load_model(self.model_name, dtype=parse_dtype(self.cfg.dtype),
                          head_dtype=self.cfg.head_dtype, exits=self._exits)

    def _fit_to_context(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Check that each prompt plus ``max_new_tokens`` fits the model's context, before
        anything runs. The built-in prompts keep their last tokens (the signature and
        docstring the completion continues); a prompt from ``--prompts`` that does not fit is
        an error naming it."""
        ctx = self.model.config.max_seq_len
        new = self.cfg.max_new_tokens
        room = ctx - new
        if room < 1:
            raise ConfigError(f"--max-new-tokens {new} leaves no room for a prompt in the "
                              f"model's context of {ctx} tokens; use at most {ctx - 1}")
        out = []
        cut = 0
        for i, ids in enumerate(prompt_ids):
            if len(ids) > room:
                if self.cfg.prompts_file:
                    raise ConfigError(
                        f"{self.cfg.prompts_file}: prompt {i + 1} ({len(ids)} tokens) + "
                        f"max_new_tokens ({new}) exceeds the model's context of {ctx} tokens; "
                        "lower --max-new-tokens or shorten the prompt")
                ids = ids[len(ids) - room:]
                cut += 1
            out.append(ids)
        if cut:
            _note(f"bench: {cut} built-in prompt(s) keep their last {room} tokens to fit the "
                  f"context of {ctx} with {new} new tokens")
        return out

    # -- transformers --
    def hf_model(self) -> Any:
        """``transformers``' model with the benchmarked backbone's weights: the embedded
        default loads from its own GGUF (as a ``transformers`` user would load it), any other
        model through a temporary Hugging Face export (:func:`exitlm.io.save.export_hf`)."""
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            if self.model_name in ("default", "default-ee"):
                gguf = default_gguf_path()
                _note("bench: loading transformers' model from the same GGUF ...")
                self._hf = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=self.dtype).eval()
            else:
                model = self.model
                if self.cfg.dtype.startswith("int") or self.cfg.head_dtype is not None:
                    model = load_model(self.model_name).model  # the unquantized weights
                with tempfile.TemporaryDirectory() as tmp:
                    _note("bench: exporting the model for transformers ...")
                    path = export_hf(model, Path(tmp) / "hf")
                    self._hf = AutoModelForCausalLM.from_pretrained(
                        str(path), dtype=self.dtype).eval()
        return self._hf

    def run_hf(self, ids: list[int], new: int, early_exit: int | None,
               num_speculations: int, confidence: float | None = None) -> Run:
        """``transformers``' greedy ``generate``; with ``early_exit``, its LayerSkip
        integration (``assistant_early_exit``) drafting ``num_speculations`` tokens per round,
        stopping early below ``confidence`` (``assistant_confidence_threshold``; ``None``
        keeps ``transformers``' default, 0.4 in the versions tested)."""
        model = self.hf_model()
        inp = torch.tensor([ids])
        timer = _StreamTimer()
        extra: dict[str, Any] = {}
        if early_exit is not None:
            extra = {"assistant_early_exit": early_exit, "num_assistant_tokens": num_speculations,
                     "num_assistant_tokens_schedule": "constant"}
            if confidence is not None:
                extra["assistant_confidence_threshold"] = confidence
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=new,
                min_new_tokens=new, eos_token_id=None, pad_token_id=0, streamer=timer,
                temperature=None, top_p=None, top_k=None, **extra)
        t_end = time.perf_counter()
        tokens = out[0, len(ids):].tolist()
        t_first, n_first = timer.calls[1]  # calls[0] is the prompt
        return Run(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                   t_end - t_first, len(tokens) - n_first, t_end - t0)

    # -- ours --
    def run_ours(self, strategy: str, ids: list[int], new: int, opts: dict[str, Any]) -> Run:
        t0 = time.perf_counter()
        res = generate(self.runner, self.tokenizer, ids, strategy=strategy, max_new_tokens=new,
                       ignore_eos=True, **opts)
        t_end = time.perf_counter()
        seq = res.sequences[0]
        return Run(seq.token_ids, seq.text, res.timings.decode_s, res.timings.decode_tokens,
                   t_end - t0, seq.stats, seq.exit_layers, dict(res.options))

    def run(self, strategy: str, ids: list[int], new: int, opts: dict[str, Any]) -> Run:
        if strategy == "hf":
            return self.run_hf(ids, new, None, 1)
        if strategy == "hf-ee":
            e = opts.get("exit_layer") or self.default_exit()
            return self.run_hf(ids, new, e, opts.get("num_speculations", 4),
                               opts.get("draft_threshold"))
        return self.run_ours(strategy, ids, new, opts)

    def default_exit(self) -> int:
        return resolve_exit_layer(self.model, None)

    def measure(self, variants: dict[str, tuple[str, dict[str, Any]]], new: int,
                repeats: int) -> dict[str, list[Run]]:
        """Run every variant (``name -> (strategy, options)``) on every prompt, interleaved,
        ``repeats`` times; keep each variant's fastest run per prompt."""
        for strategy, opts in variants.values():  # warm-up (layout, allocator, transformers)
            self.run(strategy, self.prompt_ids[0], 4, opts)
        best: dict[str, list[Run]] = {k: [] for k in variants}
        for pi, ids in enumerate(self.prompt_ids):
            for name, (strategy, opts) in variants.items():
                runs = [self.run(strategy, ids, new, opts) for _ in range(repeats)]
                best[name].append(min(runs, key=lambda r: r.decode_s / max(1, r.decode_tokens)))
            _note(f"bench: prompt {pi + 1}/{len(self.prompt_ids)} done")
        return best


# ----- summaries -------------------------------------------------------------------------------

def summarize(runs: list[Run], ref: list[Run] | None) -> dict[str, Any]:
    """Throughput and agreement with the reference (autoregressive) runs."""
    dec_tok = sum(r.decode_tokens for r in runs)
    dec_s = sum(r.decode_s for r in runs)
    new = sum(len(r.tokens) for r in runs)
    total_s = sum(r.total_s for r in runs)
    out: dict[str, Any] = {
        "decode_tokens_per_s": dec_tok / dec_s if dec_s > 0 else 0.0,
        "end_to_end_tokens_per_s": new / total_s if total_s > 0 else 0.0,
        "new_tokens": new,
    }
    if ref is not None:
        out["exact_match"] = sum(r.tokens == a.tokens for r, a in zip(runs, ref, strict=True)
                                 ) / len(runs)
        out["rouge_l"] = sum(rouge_l(r.text, a.text).f for r, a in zip(runs, ref, strict=True)
                             ) / len(runs)
    acc = [r.stats for r in runs if isinstance(r.stats, SelfSpecStats)]
    if acc:
        out["acceptance_rate"] = SelfSpecStats.total(acc).acceptance_rate
    exits = [x for r in runs for x in r.exit_layers]
    if exits:
        out["mean_exit_layer"] = sum(exits) / len(exits)
    weights = _draft_weights(runs)
    if weights is not None:
        out["draft_weights"] = weights
    return out


def ppd_vs_theory(ppd: list[Run], ar: list[Run], d: int, d_bar: int, k: int) -> dict[str, Any]:
    """PPD's measured decode time against Theorem 4.1 for the measured p_correct; one time
    unit = the autoregressive decode time per token / d, from the same prompts and run."""
    p_hat = PPDStats.total(r.stats for r in ppd if isinstance(r.stats, PPDStats)).p_correct
    rows = []
    pred_total = meas_total = ar_total = 0.0
    for r, a in zip(ppd, ar, strict=True):
        if r.decode_tokens < 1 or a.decode_tokens < 1:
            continue
        unit = a.decode_s / a.decode_tokens / d
        lat = ppd_theory.expected_latency(d, d_bar, k, r.decode_tokens, p_hat)
        pred = lat * unit
        rows.append({"decode_tokens": r.decode_tokens, "measured_s": r.decode_s,
                     "predicted_s": pred, "ar_s": a.decode_s})
        pred_total += pred
        meas_total += r.decode_s
        ar_total += a.decode_s * r.decode_tokens / a.decode_tokens
    return {
        "p_correct": p_hat, "d": d, "d_bar": d_bar, "k": k,
        "predicted_speedup": ar_total / pred_total if pred_total else 0.0,
        "measured_speedup": ar_total / meas_total if meas_total else 0.0,
        "measured_over_predicted_latency": meas_total / pred_total if pred_total else 0.0,
        "per_prompt": rows,
    }


def default_variants(b: Bench) -> dict[str, tuple[str, dict[str, Any]]]:
    """The strategies of the config with their options."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for s in b.cfg.strategies:
        opts = dict(b.cfg.options.get(s, {}))
        if s == "hf-ee":
            opts = {k: v for k, v in b.cfg.options.get("self-spec", {}).items()
                    if k in ("exit_layer", "num_speculations")} | opts
        out[s] = (s, opts)
    if "ar" not in out:
        out = {"ar": ("ar", {}), **out}
    return out


def run_comparison(b: Bench) -> dict[str, Any]:
    """All configured strategies; ratios against ``ar`` (and self-spec against ``hf-ee``)."""
    variants = default_variants(b)
    runs = b.measure(variants, b.cfg.max_new_tokens, b.cfg.repeats)
    ref = runs["ar"]
    results = {name: summarize(r, ref) for name, r in runs.items()}
    base = results["ar"]["decode_tokens_per_s"]
    for res in results.values():
        res["decode_speedup_vs_ar"] = res["decode_tokens_per_s"] / base if base else 0.0
    ratios: dict[str, float] = {}
    # a ratio over a strategy whose decode time was not measured is left out
    if "self-spec" in results and results.get("hf-ee", {}).get("decode_tokens_per_s"):
        ratios["self_spec_over_hf_ee"] = (results["self-spec"]["decode_tokens_per_s"]
                                          / results["hf-ee"]["decode_tokens_per_s"])
    if "self-spec" in results:
        ratios["self_spec_over_ar"] = results["self-spec"]["decode_speedup_vs_ar"]
    if "ar" in results and results.get("hf", {}).get("decode_tokens_per_s"):
        ratios["ar_over_hf"] = base / results["hf"]["decode_tokens_per_s"]
    out: dict[str, Any] = {"results": results, "ratios": ratios}
    if "hf-ee" in results and b.model.config.exits.layers:
        out["note"] = ("transformers' assistant_early_exit drafts through the final norm + LM "
                       "head at layer E (it cannot use this model's own exit heads); ours "
                       "drafts through the model's exit head at E")
    if "ppd" in runs:
        opts = variants["ppd"][1]
        d_bar = resolve_ppd_layer(b.model, opts.get("ppd_layer"))
        out["ppd_theory"] = ppd_vs_theory(runs["ppd"], ref, b.model.num_layers, d_bar,
                                          opts.get("ppd_k", 1))
    return out


def sweep_self_spec(b: Bench, exits: list[int], specs: list[int], out_dir: Path) -> dict[str, Any]:
    """LayerSkip Fig. 6: self-spec speed-up over AR for every (exit layer, speculations), and
    adaptive self-spec (no exit or draft length given) against the grid in the same run; the
    other self-spec options given (``--draft-weights``, ``--draft-vocab``, ...) apply to
    every cell."""
    base = {k: v for k, v in b.cfg.options.get("self-spec", {}).items()
            if k not in ("exit_layer", "num_speculations")}
    variants: dict[str, tuple[str, dict[str, Any]]] = {"ar": ("ar", {}),
                                                       "adaptive": ("self-spec", base)}
    for e in exits:
        for d in specs:
            variants[f"E{e}-d{d}"] = ("self-spec", {**base, "exit_layer": e,
                                                    "num_speculations": d})
    runs = b.measure(variants, b.cfg.max_new_tokens, b.cfg.repeats)
    ref = summarize(runs["ar"], None)["decode_tokens_per_s"]
    adaptive = summarize(runs["adaptive"], runs["ar"])
    rows = []
    for e in exits:
        for d in specs:
            s = summarize(runs[f"E{e}-d{d}"], runs["ar"])
            rows.append({"exit_layer": e, "num_speculations": d,
                         "decode_tokens_per_s": s["decode_tokens_per_s"],
                         "speedup": s["decode_tokens_per_s"] / ref,
                         "acceptance_rate": s.get("acceptance_rate", 0.0),
                         "exact_match": s["exact_match"]})
    _, csv_name, png_name = SWEEP_FILES["speculation"]
    csv_path = _write_csv(out_dir / csv_name, rows)
    png = _contour(out_dir / png_name, exits, specs, rows)
    best = max(rows, key=lambda r: r["decode_tokens_per_s"])
    return {"ar_decode_tokens_per_s": ref, "rows": rows, "csv": str(csv_path), "plot": png,
            "best": {"exit_layer": best["exit_layer"],
                     "num_speculations": best["num_speculations"],
                     "draft_weights": _draft_weights(runs[f"E{best['exit_layer']}-d"
                                                         f"{best['num_speculations']}"]),
                     "speedup": best["speedup"], "exact_match": best["exact_match"]},
            "adaptive": {"decode_tokens_per_s": adaptive["decode_tokens_per_s"],
                         "speedup": adaptive["decode_tokens_per_s"] / ref,
                         "over_best_static": adaptive["decode_tokens_per_s"]
                         / best["decode_tokens_per_s"],
                         "exact_match": adaptive["exact_match"]}}


def _draft_weights(runs: list[Run]) -> str | None:
    """What a self-spec cell's drafts ran on (its resolved ``draft_weights``: the option, else
    the model's recorded round's where a copy could run), or None where not reported."""
    return next((r.options["draft_weights"] for r in runs if "draft_weights" in r.options),
                None)


def sweep_thresholds(b: Bench, thresholds: list[float], out_dir: Path) -> dict[str, Any]:
    """EE-LLM Fig. 8: early-exit speed-up over AR against agreement with AR per threshold."""
    base_opts = dict(b.cfg.options.get("early-exit", {}))
    variants: dict[str, tuple[str, dict[str, Any]]] = {"ar": ("ar", {})}
    for t in thresholds:
        variants[f"t{t}"] = ("early-exit", {**base_opts, "threshold": t})
    runs = b.measure(variants, b.cfg.max_new_tokens, b.cfg.repeats)
    ref = summarize(runs["ar"], None)["decode_tokens_per_s"]
    rows = []
    for t in thresholds:
        s = summarize(runs[f"t{t}"], runs["ar"])
        exits = [x for r in runs[f"t{t}"] for x in r.exit_layers]
        rows.append({"threshold": t, "decode_tokens_per_s": s["decode_tokens_per_s"],
                     "speedup": s["decode_tokens_per_s"] / ref,
                     "rouge_l": s["rouge_l"], "exact_match": s["exact_match"],
                     "early_exit_fraction": sum(x < b.model.num_layers for x in exits)
                     / max(1, len(exits))})
    _, csv_name, png_name = SWEEP_FILES["threshold"]
    csv_path = _write_csv(out_dir / csv_name, rows)
    png = _speed_quality(out_dir / png_name, rows)
    # the fastest threshold that kept plain decoding's output on every prompt: what a model's
    # config may record as early exit's default (exits.threshold)
    kept = [r for r in rows if r["exact_match"] == 1.0]
    best = max(kept, key=lambda r: r["speedup"], default=None)
    return {"ar_decode_tokens_per_s": ref, "rows": rows, "csv": str(csv_path), "plot": png,
            "best": None if best is None else {
                **{k: best[k] for k in ("threshold", "speedup")}, "prompts": len(runs["ar"])}}


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _contour(path: Path, exits: list[int], specs: list[int],
             rows: list[dict[str, Any]]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    z = np.array([[next(r["speedup"] for r in rows
                        if r["exit_layer"] == e and r["num_speculations"] == d) for e in exits]
                  for d in specs])  # (specs, exits)
    fig, ax = plt.subplots(figsize=(5, 4))
    if len(exits) > 1 and len(specs) > 1:
        cs = ax.contourf(exits, specs, z, levels=12, cmap="viridis")
        fig.colorbar(cs, ax=ax, label="speed-up over autoregressive")
    else:
        sc = ax.scatter(np.repeat(exits, len(specs)), np.tile(specs, len(exits)), c=z.T.ravel())
        fig.colorbar(sc, ax=ax, label="speed-up over autoregressive")
    for r in rows:
        ax.annotate(f"{r['speedup']:.2f}", (r["exit_layer"], r["num_speculations"]),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_xlabel("exit layer E")
    ax.set_ylabel("number of speculations d")
    ax.set_title("self-speculative decoding (cf. LayerSkip Fig. 6)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _speed_quality(path: Path, rows: list[dict[str, Any]]) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    xs = [r["speedup"] for r in rows]
    ax.plot(xs, [r["rouge_l"] for r in rows], "o-", label="ROUGE-L vs AR")
    ax.plot(xs, [r["exact_match"] for r in rows], "s--", label="exact match vs AR")
    for r in rows:
        ax.annotate(f"{r['threshold']:g}", (r["speedup"], r["rouge_l"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("decode speed-up over autoregressive")
    ax.set_ylabel("agreement with autoregressive output")
    ax.set_title("confidence early exit (cf. EE-LLM Fig. 8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def describe(b: Bench) -> dict[str, Any]:
    """Run metadata for the JSON report."""
    import platform

    from exitlm.kernels import native  # lazy: only the report needs the kernel path

    cfg = dataclasses.asdict(b.cfg)
    return {"model": b.loaded.source, "exits": dataclasses.asdict(b.model.config.exits),
            "num_layers": b.model.num_layers, "prompts": len(b.prompts),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "kernels": native.kernel_path().as_dict(),
            "config": cfg}

