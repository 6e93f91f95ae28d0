"""What self-speculation can gain on a model shape when every draft is accepted (one JSON).

A random model of the given shape (the default is ``layerskip-code``'s: 24 byte-level layers of
dim 256) whose layers after the draft exit ``E`` add nothing to the residual stream (their
output projections are zero), so the exit at ``E`` (through the shared final norm and head)
predicts exactly what the last layer predicts: every draft is accepted, and the speed-up over
plain decoding is the runtime's ceiling for that ``(E, d)`` - what drafting ``d`` tokens
through ``E`` layers and verifying them with the remaining layers costs, against ``d + 1``
plain steps. A trained model accepts fewer drafts and gains less.

For each prompt length, plain decoding and self-speculation alternate ``--repeats`` times in
one process (best decode tokens/s of each); the outputs must be identical. Costs grow with the
context (attention reads the cache), so the ratio is reported per length.

    python benchmarks/self_spec_ceiling.py --threads 1
    python benchmarks/self_spec_ceiling.py --dtype float16 --exit-layer 6 --drafts 4

``--scale S`` multiplies those projections by ``S`` instead of zeroing them (drafts then fail
more often: with ``S = 1`` the layers are as random as the others), and ``--save DIR`` writes
the model in exitlm's format, e.g. for ``benchmarks/adaptive_self_spec.py --model DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _bench import machine, note, one_line_errors
from exitlm.args import int_at_least, int_list


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int_at_least(2), default=24)
    p.add_argument("--dim", type=int_at_least(8), default=256)
    p.add_argument("--heads", type=int_at_least(1), default=4)
    p.add_argument("--hidden", type=int_at_least(8), default=688)
    p.add_argument("--vocab", type=int_at_least(2), default=256)
    p.add_argument("--exit-layer", type=int_at_least(1), default=7, help="draft exit E")
    p.add_argument("--drafts", type=int_at_least(1), default=6, help="drafts per round d")
    p.add_argument("--dtype", choices=("float32", "float16", "int8", "int4"), default="float32")
    p.add_argument("--contexts", type=int_list, default=[20, 200, 450],
                   help="prompt lengths (default 20,200,450)")
    p.add_argument("--new-tokens", type=int_at_least(1), default=100)
    p.add_argument("--repeats", type=int_at_least(1), default=3)
    p.add_argument("--threads", type=int_at_least(1), default=1)
    p.add_argument("--scale", type=float, default=0.0,
                   help="the output projections after the exit times this (default 0)")
    p.add_argument("--save", default=None, metavar="DIR", help="also write the model here")
    args = p.parse_args(argv)
    if not 0.0 <= args.scale <= 10.0:
        p.error(f"--scale must lie in [0, 10], got {args.scale}")
    if args.exit_layer >= args.layers:
        p.error(f"--exit-layer must be below --layers ({args.layers}), got {args.exit_layer}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if max(args.contexts) + args.new_tokens + args.drafts + 1 > 4096:
        p.error("--contexts + --new-tokens must stay within 4096 positions")
    return args


def _model(args: argparse.Namespace):  # -> EarlyExitLM
    import torch

    from exitlm.config import ExitConfig, preset
    from exitlm.kernels.quantized import quantize_model
    from exitlm.model.transformer import EarlyExitLM

    cfg = preset("debug", dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                 num_kv_heads=args.heads, hidden_dim=args.hidden, vocab_size=args.vocab,
                 max_seq_len=4096).replace(exits=ExitConfig(every_layer=True, norm="final"))
    torch.manual_seed(0)
    model = EarlyExitLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        for layer in model.layers[args.exit_layer:]:  # no contribution after the exit
            layer.attn.wo.weight.mul_(args.scale)
            layer.mlp.w_out.weight.mul_(args.scale)
    if args.dtype == "float16":
        return model.half()
    if args.dtype in ("int8", "int4"):
        return quantize_model(model, args.dtype)
    return model


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import torch

    from exitlm.infer.api import generate

    torch.set_num_threads(args.threads)
    model = _model(args)
    if args.save:
        from exitlm.infer.cli import byte_level_tokenizer
        from exitlm.io import save_model

        save_model(model, args.save, byte_level_tokenizer() if args.vocab >= 256 else None)
    kw = {"max_new_tokens": args.new_tokens, "threads": args.threads, "ignore_eos": True}
    spec = {"strategy": "self-spec", "exit_layer": args.exit_layer,
            "num_speculations": args.drafts}
    rows = []
    for n in args.contexts:
        prompt = [(7 * i + 3) % args.vocab for i in range(n)]
        generate(model, None, prompt, **{**kw, "max_new_tokens": 4})  # warm-up
        best = {"ar": 0.0, "self-spec": 0.0}
        same = True
        acceptance = None
        for r in range(args.repeats):
            ar = generate(model, None, prompt, **kw)
            ss = generate(model, None, prompt, **kw, **spec)
            same = same and ss.token_ids == ar.token_ids
            acceptance = ss.stats.acceptance_rate
            best["ar"] = max(best["ar"], ar.timings.decode_tokens_per_s)
            best["self-spec"] = max(best["self-spec"], ss.timings.decode_tokens_per_s)
            note(f"context {n}: pass {r + 1}/{args.repeats}")
        rows.append({"context": n, "ar_tokens_per_s": round(best["ar"], 1),
                     "self_spec_tokens_per_s": round(best["self-spec"], 1),
                     "ratio": round(best["self-spec"] / best["ar"], 3),
                     "acceptance": acceptance, "identical": same})
    report = {"benchmark": "self_spec_ceiling", **machine(),
              "shape": {k: getattr(args, k) for k in ("layers", "dim", "heads", "hidden",
                                                     "vocab")},
              "dtype": args.dtype, "exit_layer": args.exit_layer, "drafts": args.drafts,
              "scale": args.scale,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads,
              "results": rows}
    print(json.dumps(report, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1  # (acceptance < 1 when scale > 0)


if __name__ == "__main__":
    with one_line_errors("self_spec_ceiling.py"):
        sys.exit(main(sys.argv[1:]))
