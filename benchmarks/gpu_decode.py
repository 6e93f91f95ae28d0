"""GPU decoding: exitlm with and without CUDA graphs against ``transformers``' ``generate``.

One process, one GPU, every variant over the same prompts in turn (``--repeats`` rounds,
each variant's fastest round kept), so the ratios share the machine's state:

* ``ar_eager`` - exitlm's plain greedy decoding, kernels launched one by one;
* ``ar_graphs`` - the same on the CUDA-graph runner (:mod:`exitlm.runtime.graphs`): each
  step one replay;
* ``self_spec_graphs`` / ``self_spec_eager`` (LayerSkip-trained model) - self-speculative
  decoding on the graph runner (a round: the drafts' chain, the verification's layers and
  head, three replays) or the eager one;
* ``ppd_graphs`` (LayerSkip model, batch 1) - PPD on the graph runner from one thread, its
  branch replayed on a second CUDA stream, with Theorem 4.1's prediction for the measured p_correct
  (one time unit: a layer's share of ``ar_graphs``' time per token); ``--ppd-eager`` adds
  the eager path (branches on Python threads);
* ``ar_fused`` / ``self_spec_fused`` / ``ppd_fused`` (``--fused``) - the same on the graph
  runner whose layer steps are compiled by ``torch.compile`` (:mod:`exitlm.runtime.fused`);
* ``hf_generate`` - ``transformers``' greedy ``generate`` on an export of the same weights;
  ``hf_assistant_early_exit`` (LayerSkip model, batch 1) - its LayerSkip integration.

Batch ``B`` decodes ``B`` prompts of one length together (no padding on either side); batch
1 decodes ``--prompts`` prompts one after the other. Decode tokens/s counts the tokens after
each sequence's first over the time after it; exactly ``--new-tokens`` per sequence (EOS
ignored). SmolLM2-135M's architecture runs with random weights when its GGUF is not installed
(decode speed does not depend on the values; outputs are then compared, not judged).

    python benchmarks/gpu_decode.py --layerskip runs/scratch-layerskip/model
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _bench import StreamTimer, held_out_prompt_ids, note, one_line_errors
from exitlm.args import int_at_least
from exitlm.bench.run import Run, ppd_vs_theory
from exitlm.infer.engine import Engine
from exitlm.infer.options import SamplingOptions
from exitlm.infer.strategies import get_strategy
from exitlm.io import load_model
from exitlm.runtime import GraphRunner, prepare
from exitlm.runtime.runner import Runner

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompt_sets(tokenizer: Any, vocab: int, batch: int, count: int, length: int,
                new: int, context: int) -> list[list[list[int]]]:
    """Groups of ``batch`` prompts of ``length`` tokens: held-out standard-library code when
    there is a tokenizer, seeded random ids otherwise. Batch 1 gives ``count`` groups."""
    groups = count if batch == 1 else 1
    need = groups * batch
    if tokenizer is not None:
        ids = held_out_prompt_ids(tokenizer, need, context, new, keep=length)
        ids = [p for p in ids if len(p) >= length][:need]
    else:
        ids = []
    if len(ids) < need:
        gen = torch.Generator().manual_seed(len(ids))
        ids += [torch.randint(0, vocab, (length,), generator=gen).tolist()
                for _ in range(need - len(ids))]
    ids = [p[-length:] for p in ids]
    return [ids[g * batch:(g + 1) * batch] for g in range(groups)]


def run_ours(engines: dict[tuple[object, ...], Engine], runner: Runner,
             prompts: list[list[int]], new: int, strategy: str, opts: dict[str, Any]
             ) -> list[Run]:
    """One group through a long-lived engine of its own (a server's situation: its KV pool,
    and so its captured graphs, outlive a request; a one-shot ``generate`` call builds a new
    pool and captures its graphs again)."""
    key = (strategy, tuple(sorted(opts.items())), runner.kind, len(prompts))
    engine = engines.get(key)
    if engine is None:
        engine = engines[key] = Engine(runner, None, strategy,
                                       get_strategy(strategy).options(None, **opts),
                                       max_batch=len(prompts))
    model = runner.model
    before = engine.decode_s
    t0 = time.perf_counter()
    reqs = [engine.submit(p, SamplingOptions(max_new_tokens=new, ignore_eos=True))
            for p in prompts]
    engine.run()
    _sync()
    total = time.perf_counter() - t0
    seqs = [r.result(model.num_layers) for r in reqs]
    stats = engine.decoder.stats_type.total(s.stats for s in seqs)
    return [Run([t for s in seqs for t in s.token_ids], "", engine.decode_s - before,
                sum(len(s.token_ids) - 1 for s in seqs), total, stats)]


def run_hf(hf: Any, prompts: list[list[int]], new: int, early_exit: int | None = None,
           speculations: int = 4) -> list[Run]:
    inp = torch.tensor(prompts, device=hf.device)
    timer = StreamTimer()
    extra: dict[str, Any] = {}
    if early_exit is not None:
        extra = {"assistant_early_exit": early_exit, "num_assistant_tokens": speculations,
                 "num_assistant_tokens_schedule": "constant"}
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                          pad_token_id=0, streamer=timer, temperature=None, top_p=None,
                          top_k=None, **extra)
    _sync()
    t_end = time.perf_counter()
    tokens = out[:, inp.shape[1]:]
    first = timer.calls[1]  # calls[0] is the prompt
    # assisted generation streams several tokens per call; count what came after the first
    decoded = tokens.numel() - tokens.shape[0]
    return [Run(tokens.flatten().tolist(), "", t_end - first, decoded, t_end - t0)]


def measure(variants: dict[str, Callable[[list[list[int]], int], list[Run]]],
            groups: list[list[list[int]]], new: int, repeats: int) -> dict[str, list[Run]]:
    """Every variant on every group, in turn, ``repeats`` rounds; the fastest round of each
    (variant, group) is kept. One short warm-up call each first (graph capture, cuBLAS)."""
    for fn in variants.values():
        fn(groups[0], 8)
    best: dict[str, list[Run | None]] = {k: [None] * len(groups) for k in variants}
    for _ in range(repeats):
        for gi, group in enumerate(groups):
            for name, fn in variants.items():
                (run,) = fn(group, new)
                old = best[name][gi]
                if old is None or run.decode_s / max(1, run.decode_tokens) < \
                        old.decode_s / max(1, old.decode_tokens):
                    best[name][gi] = run
    return {k: [r for r in v if r is not None] for k, v in best.items()}


def summarize(runs: dict[str, list[Run]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        dec_tok = sum(r.decode_tokens for r in rs)
        dec_s = sum(r.decode_s for r in rs)
        out[name] = {"decode_tokens_per_s": dec_tok / dec_s if dec_s else 0.0,
                     "ms_per_token": 1e3 * dec_s / max(1, dec_tok)}
        stats = [r.stats for r in rs if hasattr(r.stats, "acceptance_rate")]
        if stats:
            out[name]["acceptance_rate"] = type(stats[0]).total(stats).acceptance_rate
    ref = runs.get("ar_eager")
    for name, rs in runs.items():
        if ref is not None and name != "ar_eager":
            out[name]["identical_to_ar_eager"] = [r.tokens == a.tokens for r, a in
                                                  zip(rs, ref, strict=True)]
    base = out.get("hf_generate", {}).get("decode_tokens_per_s")
    eager = out.get("ar_eager", {}).get("decode_tokens_per_s")
    for res in out.values():
        if base:
            res["vs_hf_generate"] = res["decode_tokens_per_s"] / base
        if eager:
            res["vs_ar_eager"] = res["decode_tokens_per_s"] / eager
    return out


def hf_export(model: Any, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    from exitlm.io.save import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = export_hf(model, Path(tmp) / "hf")
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return hf.to(model.embed_tokens.weight.device).eval()


def bench_model(label: str, model: Any, tokenizer: Any, dtype: torch.dtype,
                args: argparse.Namespace, layerskip: bool) -> dict[str, Any]:
    # a CPU run is a smoke test: the graph runner's static code, eagerly
    cpu = model.embed_tokens.weight.device.type == "cpu"
    graphed = prepare(model, backend="static" if cpu else "graphs")
    eager = prepare(model, backend="eager")
    fused = prepare(model, backend="fused") if args.fused else None
    assert isinstance(graphed, GraphRunner)
    note(f"{label}: exporting for transformers ...")
    hf = hf_export(model, dtype)
    cfg = model.config
    e = args.exit_layer or max(1, cfg.num_layers // 2)
    spec = {"exit_layer": e, "num_speculations": args.num_speculations}
    out: dict[str, Any] = {"num_layers": cfg.num_layers, "dim": cfg.dim,
                           "vocab": cfg.vocab_size, "batches": {}}
    for batch in args.batches:
        groups = prompt_sets(tokenizer, cfg.vocab_size, batch, args.prompts, args.prompt_len,
                             args.new_tokens, cfg.max_seq_len)
        engines: dict[tuple[object, ...], Engine] = {}

        def ours(strategy: str, opts: dict[str, Any], graphs: bool | Runner,
                 engines: dict[tuple[object, ...], Engine] = engines
                 ) -> Callable[[list[list[int]], int], list[Run]]:
            runner = graphs if isinstance(graphs, Runner) else graphed if graphs else eager
            return lambda p, n: run_ours(engines, runner, p, n, strategy, opts)

        variants: dict[str, Callable[[list[list[int]], int], list[Run]]] = {
            "ar_eager": ours("ar", {}, False),
            "ar_graphs": ours("ar", {}, True),
            "hf_generate": lambda p, n: run_hf(hf, p, n),
        }
        if layerskip:
            variants["self_spec_graphs"] = ours("self-spec", spec, True)
            variants["self_spec_eager"] = ours("self-spec", spec, False)
            if batch == 1:
                variants["hf_assistant_early_exit"] = lambda p, n: run_hf(
                    hf, p, n, e, args.num_speculations)
                ppd = {"ppd_layer": args.ppd_layer or e, "ppd_k": 1}
                variants["ppd_graphs"] = ours("ppd", ppd, True)
                if args.ppd_eager:
                    variants["ppd_eager_threads"] = ours("ppd", ppd, False)
        if fused is not None:  # the layer steps compiled, inside the graphs
            variants["ar_fused"] = ours("ar", {}, fused)
            if layerskip:
                variants["self_spec_fused"] = ours("self-spec", spec, fused)
                if batch == 1:
                    variants["ppd_fused"] = ours("ppd", {"ppd_layer": args.ppd_layer or e,
                                                         "ppd_k": 1}, fused)
        note(f"{label}: batch {batch}, {len(groups)} group(s) x {args.new_tokens} tokens ...")
        runs = measure(variants, groups, args.new_tokens, args.repeats)
        res: dict[str, Any] = {"results": summarize(runs)}
        if "ppd_graphs" in runs:  # time unit: a layer of the graphed plain step
            res["ppd_theory"] = ppd_vs_theory(runs["ppd_graphs"], runs["ar_graphs"],
                                              cfg.num_layers, args.ppd_layer or e, 1)
        out["batches"][str(batch)] = res
        for name, r in res["results"].items():
            note(f"  {name}: {r['decode_tokens_per_s']:.0f} tok/s "
                 f"({r.get('vs_hf_generate', 0):.2f}x hf)")
    out["graphs_captured"] = graphed.captures
    out["graph_capture_s"] = graphed.capture_s
    if isinstance(fused, GraphRunner):  # capture_s includes the compiles (warm-up runs)
        out["fused_captured"] = fused.captures
        out["fused_capture_s"] = fused.capture_s
    hf.to("cpu")  # free the GPU for the next model
    return out


def _batches(text: str) -> list[int]:
    """``--batches``: comma-separated integers >= 1."""
    return [int_at_least(1)(x) for x in text.split(",")]


def _device(text: str) -> str:
    """``--device``: anything ``torch.device`` accepts (a one-line error otherwise)."""
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a device such as cuda or cpu, got {text!r}"
                                         ) from None
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layerskip", default="runs/scratch-layerskip/model",
                    help="a LayerSkip-trained model (every layer exits through the final head)")
    ap.add_argument("--smollm2", choices=("auto", "random", "skip"), default="auto",
                    help="SmolLM2-135M: the embedded GGUF when installed (auto), else its "
                         "architecture with random weights")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--batches", type=_batches, default=[1, 8],
                    help="comma-separated batch sizes (each >= 1)")
    ap.add_argument("--prompts", type=int_at_least(1), default=4,
                    help="prompts decoded one by one at batch 1")
    ap.add_argument("--prompt-len", type=int_at_least(1), default=64)
    ap.add_argument("--new-tokens", type=int_at_least(2), default=128)
    ap.add_argument("--repeats", type=int_at_least(1), default=2)
    ap.add_argument("--exit-layer", type=int_at_least(1), default=None)
    ap.add_argument("--num-speculations", type=int_at_least(1), default=4)
    ap.add_argument("--ppd-layer", type=int_at_least(1), default=None)
    ap.add_argument("--ppd-eager", action="store_true",
                    help="also PPD's eager path (branches on Python threads + CUDA streams)")
    ap.add_argument("--fused", action="store_true",
                    help="also the layer steps compiled by torch.compile inside the graphs "
                         "(ar_fused, self_spec_fused, ppd_fused; compiles take minutes)")
    ap.add_argument("--device", type=_device, default="cuda",
                    help="cuda, or cpu for a smoke test of this script (no graphs are captured)")
    args = ap.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_decode.py: needs a CUDA device (none is visible here; --device cpu runs a "
              "smoke test)", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    dev = args.device
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev != "cpu" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.machine(), "models": {}}
    import transformers

    report["transformers"] = transformers.__version__
    with one_line_errors("gpu_decode.py"):
        if args.layerskip:
            loaded = load_model(args.layerskip, dtype=dtype, device=dev)
            report["models"]["layerskip"] = {"path": args.layerskip, **bench_model(
                "layerskip", loaded.model, loaded.tokenizer, dtype, args, True)}
            del loaded
        if args.smollm2 != "skip":
            name, source = "smollm2-135m", "random weights (SmolLM2-135M architecture)"
            if args.smollm2 == "auto":
                from exitlm.io.default_model import DefaultModelMissing, default_gguf_path

                try:
                    default_gguf_path()
                    name, source = "default", "SmolLM2-135M-Instruct (embedded GGUF)"
                except DefaultModelMissing:
                    pass
            loaded = load_model(name, dtype=dtype, device=dev)
            report["models"]["smollm2"] = {"weights": source, **bench_model(
                "smollm2", loaded.model, loaded.tokenizer, dtype, args, False)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
