"""Greedy steps through the screened LM head against the whole head, per precision, same run.

A greedy step needs only the argmax of the head's logits. The native runner screens the head
(``exitlm.kernels.screen``: an int8 copy of a float head, ``GreedyScreen``; the head's own
integer product with int8 activations for a quantized head, ``QuantizedScreen``) and
recomputes only the rows that can still win. For each precision this script loads the model in
it and measures, in one process:

* one head step on the final-layer features of held-out text (teacher-forced rows, one at a
  time): the screen against the head's own product and its argmax, alternating, microseconds
  (best and median); the rows the screen recomputed per step (median, p90, max), the steps it
  left to the full head (``undecided``), and whether every screened token is the full head's
  argmax (``agree``: it is by construction, the script checks);
* plain greedy decoding with screens on and off, alternating per prompt: tokens/s of the
  fastest and of the median runs, and whether the tokens are identical - for the heads greedy
  steps screen (``greedy_screens``; ``exitlm.kernels.screen.screens_head``: float32, float16
  and int4 heads; the int8 head's screen is timed all the same, which is why it is not used).

    python benchmarks/greedy_heads.py                            # fp32, fp16, int8, int4
    python benchmarks/greedy_heads.py --model SmolLM2.Q4_0.gguf --precisions int4
    EXITLM_NATIVE=avx2 python benchmarks/greedy_heads.py --quick

(``--dtype int4`` quantizes the embedded model's layers to int4 and its tied head to int8; a
GGUF file's Q4_0 / Q4_1 head stays int4 - ``decode_vs_llamacpp.py`` caches such files.)

Prints one JSON object on stdout; progress goes to stderr. On a shared machine compare the
two arms of the same run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any

import torch

from _bench import held_out_prompt_ids, machine, note, one_line_errors, percentile

PRECISIONS = ("float32", "float16", "int8", "int4")


def features(model: Any, ids: list[int], rows: int) -> torch.Tensor:
    """The final layer's normed features ``(rows, D)`` float32 of a teacher-forced pass."""
    got: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda mod, inp, out: got.append(out.detach()))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return got[0].reshape(-1, got[0].shape[-1])[-rows:].float().contiguous()


def head_steps(runner: Any, feats: torch.Tensor, passes: int) -> dict[str, Any]:
    """The screen against the whole head on each row of ``feats`` (module docstring)."""
    from exitlm.kernels.quant import QuantizedWeight
    from exitlm.kernels.screen import screen_for

    model = runner.model
    weight = model.output_embedding()
    if isinstance(weight, torch.Tensor):
        weight = weight.detach()
    t0 = time.perf_counter()
    screen = screen_for(weight)
    made_s = time.perf_counter() - t0
    if isinstance(weight, torch.Tensor) and weight.dtype is torch.float16:
        rows = feats.half()
    else:
        rows = feats
    screened: list[float] = []
    full: list[float] = []
    cands: list[int] = []
    undecided = 0
    agree = True
    with torch.inference_mode():
        for i in range(rows.shape[0]):
            x = feats[i : i + 1].contiguous()
            h = rows[i : i + 1]
            best_s = best_f = float("inf")
            for p in range(passes):
                for arm in (("s", "f") if p % 2 == 0 else ("f", "s")):
                    t = time.perf_counter()
                    if arm == "s":
                        tok = screen.argmax(x, weight, 1)
                        best_s = min(best_s, time.perf_counter() - t)
                    else:
                        ref = int(runner.project(h, weight).float().argmax())
                        best_f = min(best_f, time.perf_counter() - t)
            screened.append(best_s * 1e6)
            full.append(best_f * 1e6)
            cands.extend(screen.candidates)
            if tok is None:
                undecided += 1
            elif tok != [ref]:
                agree = False
    kind = weight.kind if isinstance(weight, QuantizedWeight) else str(weight.dtype)[6:]
    return {
        "head": kind, "screen": type(screen).__name__, "screen_made_s": round(made_s, 3),
        "steps": rows.shape[0],
        "screened_us_median": round(statistics.median(screened), 1),
        "full_us_median": round(statistics.median(full), 1),
        "screened_us_best": round(min(screened), 1), "full_us_best": round(min(full), 1),
        "speedup_median": round(statistics.median(full) / statistics.median(screened), 3),
        "candidates_median": statistics.median(cands) if cands else None,
        "candidates_p90": percentile([float(c) for c in cands], 0.9),
        "candidates_max": max(cands) if cands else None,
        "undecided": undecided, "agree": agree,
    }


def decode_ab(runner: Any, prompts: list[list[int]], new: int, repeats: int) -> dict[str, Any]:
    """Greedy decoding with screens on and off, alternating per prompt."""
    from exitlm.infer import generate
    from exitlm.kernels.screen import set_screens

    runs: dict[bool, list[list[tuple[float, list[int]]]]] = {
        True: [[] for _ in prompts], False: [[] for _ in prompts]}
    old = set_screens(True)
    try:
        for rep in range(repeats):
            for i, ids in enumerate(prompts):
                for on in ((True, False) if (rep + i) % 2 == 0 else (False, True)):
                    set_screens(on)
                    res = generate(runner, None, ids, max_new_tokens=new, ignore_eos=True)
                    tm = res.timings
                    runs[on][i].append((tm.decode_tokens / tm.decode_s,
                                        list(res.token_ids[0])))
    finally:
        set_screens(old)

    def rate(on: bool, pick: Any) -> float:
        return statistics.mean(pick(sorted(r for r, _ in p)) for p in runs[on])

    out = {f"{arm}_tokens_per_s_{how}": round(rate(on, pick), 1)
           for arm, on in (("screened", True), ("full", False))
           for how, pick in (("best", lambda r: r[-1]), ("median", lambda r: r[(len(r) - 1) // 2]))}
    out["speedup_best"] = round(out["screened_tokens_per_s_best"]
                                / out["full_tokens_per_s_best"], 3)
    out["speedup_median"] = round(out["screened_tokens_per_s_median"]
                                  / out["full_tokens_per_s_median"], 3)
    out["identical"] = all(a[1] == b[1] for i in range(len(prompts))
                           for a, b in zip(runs[True][i], runs[False][i], strict=True))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="model name or path (default: embedded)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help=f"comma-separated subset of {list(PRECISIONS)}")
    ap.add_argument("--steps", type=int, default=96, help="head steps timed per precision")
    ap.add_argument("--passes", type=int, default=3, help="timings per step and arm (best)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts decoded")
    ap.add_argument("--repeats", type=int, default=3, help="decoding runs per prompt and arm")
    ap.add_argument("--quick", action="store_true", help="16 steps, one prompt of 32 tokens")
    args = ap.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise SystemExit(f"greedy_heads.py: --precisions {args.precisions!r}: expected a "
                         f"comma-separated subset of {list(PRECISIONS)}")
    if min(args.steps, args.passes, args.new_tokens, args.prompts, args.repeats) < 1:
        raise SystemExit("greedy_heads.py: --steps, --passes, --new-tokens, --prompts and "
                         "--repeats must be at least 1")
    steps, new, n_prompts, repeats = ((16, 32, 1, 1) if args.quick else
                                      (args.steps, args.new_tokens, args.prompts, args.repeats))
    from exitlm.io import load_model
    from exitlm.kernels.screen import screens_head
    from exitlm.runtime import prepare

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    source = None
    for prec in precisions:
        note(f"{prec}: loading {args.model} ...")
        loaded = load_model(args.model, dtype=prec)
        source = loaded.source
        tok = loaded.tokenizer
        cfg = loaded.model.config
        if tok is not None:
            text_ids = held_out_prompt_ids(tok, 1, cfg.max_seq_len, 0, keep=steps)[0]
            prompts = held_out_prompt_ids(tok, n_prompts, cfg.max_seq_len, new, keep=64)
        else:  # a model without a tokenizer (a random preset): seeded random ids
            gen = torch.Generator().manual_seed(0)
            text_ids = torch.randint(cfg.vocab_size, (min(steps, cfg.max_seq_len),),
                                     generator=gen).tolist()
            keep = max(1, min(64, cfg.max_seq_len - new - 1))
            prompts = [torch.randint(cfg.vocab_size, (keep,), generator=gen).tolist()
                       for _ in range(n_prompts)]
        runner = prepare(loaded.model)
        heads = head_steps(runner, features(loaded.model, text_ids, steps), args.passes)
        note(f"{prec}: head {heads['screened_us_median']} us screened, "
             f"{heads['full_us_median']} us whole")
        screens = screens_head(loaded.model.output_embedding())
        results[prec] = {"runner": runner.kind, "head_step": heads, "greedy_screens": screens,
                         "decoding": decode_ab(runner, prompts, new, repeats) if screens
                         else None}
        if screens:
            note(f"{prec}: decoding {results[prec]['decoding']['speedup_best']}x (best runs)")
    report = {
        "date": datetime.date.today().isoformat(), "model": source, "threads": 1,
        "steps": steps, "new_tokens": new, "prompts": n_prompts, "repeats": repeats,
        **machine(), "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    with one_line_errors("greedy_heads.py"):
        sys.exit(main())
