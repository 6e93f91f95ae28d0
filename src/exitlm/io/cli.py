"""``exitlm convert`` and ``exitlm info``: checkpoint conversion and inspection."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from exitlm.args import draft_round, finite_float, int_at_least, unit_float
from exitlm.config import LAYERSKIP_EXITS, PRESETS, ConfigError
from exitlm.io.cache import KINDS as KIND_NAMES

_DTYPES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")  # names load_model takes


def register(subparsers: Any) -> None:
    """Add the ``convert`` and ``info`` sub-commands."""
    p = subparsers.add_parser(
        "convert", help="convert a checkpoint (default, .gguf, HF, exitlm or Megatron dir, preset)",
        description="Load SRC (anything exitlm.io.load_model accepts) and write it to DST.",
    )
    p.add_argument("src", metavar="SRC", help="'default', a preset, a .gguf file or a directory")
    p.add_argument("dst", metavar="DST", help="output directory (replaced atomically)")
    p.add_argument("--to", choices=("exitlm", "hf", "megatron"), default="exitlm",
                   help="output format: exitlm's own (default), a Hugging Face directory, or "
                        "a Megatron-LM / EE-LLM checkpoint split --tp x --pp")
    p.add_argument("--tp", type=int, default=1, metavar="T",
                   help="with --to megatron: tensor-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, metavar="P",
                   help="with --to megatron: pipeline stages (default 1)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                   help="parameter dtype of the written weights (default float32)")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="write weight-only quantized linear layers and embedding (groups of "
                        "32; exitlm format only): int8 ~1/4, int4 ~1/7 of the fp32 size")
    p.add_argument("--quantize-head", choices=("int8",), default=None,
                   help="write only the output embeddings int8 (the LM head, exits' own "
                        "matrices, an int8 copy of a tied embedding: +28%% of its fp32 size; "
                        "exitlm format only); loading it needs no --head-dtype")
    p.add_argument("--draft", type=draft_round, default=None, metavar="E,D[,W]",
                   help="record the self-speculative round measured fastest with these "
                        "weights (exitlm bench --sweep speculation; W: what its drafts ran "
                        "on, model (default), int8 or int4, --draft-weights) as the config's "
                        "exits.draft, which --strategy self-spec prefers (exitlm and hf "
                        "formats)")
    p.add_argument("--threshold", type=unit_float, default=None, metavar="T",
                   help="record the early-exit confidence threshold measured to keep plain "
                        "decoding's output with these weights (exitlm bench --sweep "
                        "threshold) as the config's exits.threshold, --strategy early-exit's "
                        "default for the model (exitlm and hf formats)")
    p.add_argument("--delta-from", default=None, metavar="BASE",
                   help="write SRC as a low-rank delta over BASE (a name or path SRC was "
                        "trained from; BASE's weights are fingerprinted): a fine-tuned model in "
                        "a few per cent of its size, loaded on top of BASE")
    p.add_argument("--rank", type=int_at_least(1), default=None, metavar="R",
                   help="with --delta-from: rank of each matrix's difference (default 32); "
                        "the largest relative error is printed")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST even when it holds files exitlm did not write (never "
                        "allowed when DST is the source or contains it)")
    p.set_defaults(func=_convert)

    q = subparsers.add_parser("info", help="describe this installation (kernel path, torch) "
                                           "and a model: architecture, parameters, exits")
    q.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="'default', a preset, a .gguf or a directory (omit it to describe only "
                        "the installation)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_info)

    c = subparsers.add_parser(
        "cache", help="list or prune exitlm's cache ($EXITLM_CACHE, default ~/.cache/exitlm)",
        description="List what exitlm's cache holds (converted models, tokenized data, token "
                    "orders, compiled kernels), or remove some of it. Only entries exitlm "
                    "wrote (its own sub-folders and names) are listed or removed.")
    c.add_argument("action", nargs="?", choices=("list", "prune", "clear"), default="list",
                   help="list (default); prune: remove entries chosen by --older-than / "
                        "--max-size; clear: remove every entry (of --kind)")
    c.add_argument("--kind", action="append", choices=sorted(KIND_NAMES), default=None,
                   help="only this kind of entry (repeatable; default: all)")
    c.add_argument("--older-than", type=finite_float, default=None, metavar="DAYS",
                   help="prune: entries not modified for more than DAYS days")
    c.add_argument("--max-size", default=None, metavar="SIZE",
                   help="prune: remove the oldest entries until the rest fits in SIZE "
                        "(e.g. 500M, 2G)")
    c.add_argument("--dry-run", action="store_true",
                   help="prune/clear: show what would be removed, remove nothing")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=_cache)


def _convert(args: argparse.Namespace) -> int:
    from exitlm.io import export_hf, load_model, save_model  # lazy: loaded when the command runs
    from exitlm.io.dirs import check_creatable  # lazy: loaded when the command runs
    from exitlm.io.st import check_replaceable  # lazy: loaded when the command runs

    dst = Path(args.dst).expanduser()
    check_not_source(dst, source_paths(args.src))
    for flag, value in (("--quantize", args.quantize), ("--quantize-head", args.quantize_head)):
        if value and args.to != "exitlm":
            raise ConfigError(f"{flag} writes exitlm checkpoints only; drop --to {args.to}")
    for given, name in ((args.draft, "--draft"), (args.threshold is not None, "--threshold")):
        if given and args.to == "megatron":
            raise ConfigError(f"{name} is recorded in exitlm and Hugging Face checkpoints "
                              "(their exit configuration); drop --to megatron")
    if args.quantize and args.quantize_head:
        raise ConfigError(f"--quantize {args.quantize} quantizes the heads already; drop "
                          "--quantize-head")
    if (args.tp, args.pp) != (1, 1) and args.to != "megatron":
        raise ConfigError("--tp and --pp split Megatron checkpoints only; add --to megatron")
    if args.rank is not None and args.delta_from is None:
        raise ConfigError(f"--rank {args.rank} is the rank of a delta; add --delta-from BASE")
    if args.delta_from is not None:
        for flag, bad in ((f"--to {args.to}", args.to != "exitlm"),
                          (f"--quantize {args.quantize}", args.quantize),
                          (f"--quantize-head {args.quantize_head}", args.quantize_head),
                          (f"--dtype {args.dtype}", args.dtype not in ("float32", "fp32"))):
            if bad:
                raise ConfigError(f"--delta-from writes a delta of the fp32 weights (its "
                                  f"factors in fp16); drop {flag}")
        if args.delta_from in PRESETS:
            raise ConfigError(f"--delta-from {args.delta_from}: a preset has random weights, "
                              "no base to load again; pass the checkpoint SRC was trained from")
    check_replaceable(dst, args.overwrite)  # before the (slow) load
    check_creatable(dst, beside=True)  # a file in the way, /proc, a read-only file system
    loaded = load_model(args.src, dtype=args.quantize or args.dtype,
                        head_dtype=args.quantize_head)
    _check_quantized_source(args, loaded.model)
    if (args.draft is not None or args.threshold is not None) and not loaded.config.exit_layers:
        # a measured round or threshold lives in the exits: LayerSkip's, which decoding gives
        # a model without exits (every layer through the shared final norm + head)
        print(f"exitlm: {args.src!r} has no exit heads; recording LayerSkip style exits with "
              "it (every layer through the final norm + head)", file=sys.stderr)
        loaded.model.config = loaded.config = loaded.config.replace(exits=LAYERSKIP_EXITS)
    if args.draft is not None:
        with_draft(loaded, *args.draft)
    if args.threshold is not None:
        loaded.model.config = loaded.config = loaded.model.config.with_threshold(args.threshold)
    if args.delta_from is not None:
        return _write_delta(args, loaded, dst)
    if args.to == "megatron":
        from exitlm.io.megatron_write import save_megatron  # lazy: loaded when the command runs

        out = save_megatron(loaded, dst, tp=args.tp, pp=args.pp, overwrite=args.overwrite)
    else:
        write = export_hf if args.to == "hf" else save_model
        out = write(loaded, dst, overwrite=args.overwrite)
    print(f"wrote {args.to} checkpoint to {out}")
    return 0


def _check_quantized_source(args: argparse.Namespace, model: Any) -> None:
    """A source already quantized can be written again as it is (exitlm's format), not
    re-quantized to another kind nor exported as float weights it no longer has."""
    from exitlm.kernels.quantized import is_quantized  # lazy: loaded when the command runs

    kind = is_quantized(model.layers)
    if kind is None:
        return
    if args.to != "exitlm" or args.delta_from is not None:
        what = f"--to {args.to}" if args.to != "exitlm" else "--delta-from"
        raise ConfigError(f"{args.src} holds {kind}-quantized weights; {what} needs float "
                          "weights: convert the float checkpoint it was made from")
    if args.quantize is not None and args.quantize != kind:
        raise ConfigError(f"--quantize {args.quantize}: {args.src} is {kind}-quantized "
                          "already; quantize the float checkpoint it was made from")


def _write_delta(args: argparse.Namespace, loaded: Any, dst: Path) -> int:
    """``convert SRC DST --delta-from BASE``: SRC as a low-rank delta over BASE."""
    from exitlm.io import load_model  # lazy: loaded when the command runs
    from exitlm.io.delta import save_delta  # lazy: loaded when the command runs

    check_not_source(dst, source_paths(args.delta_from))
    base = load_model(args.delta_from)
    rank = 32 if args.rank is None else args.rank
    out, errors = save_delta(args.delta_from, base.model, loaded.model, dst, rank,
                             overwrite=args.overwrite)
    size = sum(p.stat().st_size for p in out.iterdir())
    worst = max(errors.items(), key=lambda kv: kv[1], default=None)
    print(f"wrote a rank-{rank} delta over {args.delta_from} to {out} ({size / 1e6:.1f} MB)"
          + (f"; largest relative error {worst[1]:.2%} ({worst[0]})" if worst else ""))
    return 0


def with_draft(loaded: Any, exit_layer: int, drafts: int, weights: str = "model") -> None:
    """Give ``loaded``'s config the draft hint ``(exit_layer, drafts, weights)``
    (``--draft``), checked against the model's exits."""
    try:
        cfg = loaded.model.config.with_draft(exit_layer, drafts, weights)
    except ConfigError as err:
        shown = "" if weights == "model" else f",{weights}"
        raise ConfigError(f"--draft {exit_layer},{drafts}{shown}: {err}") from None
    loaded.model.config = loaded.config = cfg


def source_paths(src: str) -> list[Path]:
    """The files and directories that loading ``src`` reads (what a write must not touch)."""
    from exitlm.io.bundle import find_bundle  # lazy: loaded when the command runs

    paths: list[Path] = []
    bundle = find_bundle(src)
    if bundle is not None:
        paths.append(bundle)
        meta = bundle / "exits.json"
        try:
            base = json.loads(meta.read_text(encoding="utf-8")).get("base")
        except (OSError, ValueError, AttributeError):
            base = None
        if isinstance(base, str):  # beside the bundle, or (format 1) in the working directory
            for where in (str(bundle / Path(base).expanduser()), base):
                if find_bundle(where) is None:
                    paths += source_paths(where)
    elif src == "default":
        # lazy: loaded when the command runs
        from exitlm.io.default_model import cache_dir_for, default_gguf_path
        from exitlm.io.hf_map import CheckpointError  # lazy: loaded when the command runs

        try:
            gguf = default_gguf_path()
            paths += [gguf, cache_dir_for(gguf)]
        except CheckpointError:
            pass  # not installed: loading fails with its own message
    elif Path(src).expanduser().exists():
        paths.append(Path(src).expanduser())
        paths += _delta_base_paths(Path(src).expanduser())
    return paths


def _delta_base_paths(path: Path) -> list[Path]:
    """What loading the base of the delta in ``path`` reads (nothing when it is no delta, or
    its ``delta.json`` is broken: loading it fails with its own message)."""
    from exitlm.io.delta import base_of, is_delta_dir  # lazy: loaded when the command runs
    from exitlm.io.hf_map import CheckpointError  # lazy: loaded when the command runs
    from exitlm.io.st import read_json_object  # lazy: loaded when the command runs

    if not is_delta_dir(path):
        return []
    try:
        meta = read_json_object(path / "delta.json")
        base = base_of(path, meta) if isinstance(meta.get("base"), str) else None
    except CheckpointError:
        return []
    return [] if base is None else source_paths(base)


def check_not_source(dst: Path, sources: list[Path]) -> None:
    """Refuse an output directory that is a source of the conversion or contains one."""
    from exitlm.io.hf_map import CheckpointError  # lazy: loaded when the command runs

    target = dst.resolve()
    for src in sources:
        real = src.resolve()
        if real == target or target in real.parents:
            what = "is" if real == target else "contains"
            raise CheckpointError(
                f"DST {dst} {what} the source {src}; writing there would replace what is "
                "being read",
                hint="choose another output directory (--overwrite does not change this)",
            )


def describe(loaded: Any) -> dict[str, Any]:
    """Facts about a :class:`~exitlm.io.LoadedModel` (what ``exitlm info`` prints)."""
    from exitlm.kernels.quant import QuantizedWeight  # lazy: loaded when the command runs
    from exitlm.kernels.quantized import (  # lazy: loaded when the command runs
        is_quantized,
        quantized_numel,
    )

    model, cfg, tok = loaded.model, loaded.config, loaded.tokenizer
    copy = model.tied_head  # an int8 head's copy of the embedding: no parameters of its own
    total = model.num_parameters() + quantized_numel(model) - (
        0 if copy is None else quantized_numel(copy))
    exits = model.num_parameters(exits_only=True) + quantized_numel(model.exits)
    quant = is_quantized(model.layers)
    head = model.output_embedding()
    float_dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    info: dict[str, Any] = {
        "name": cfg.name,
        "source": loaded.source,
        "architecture": "gpt2" if cfg.pos == "learned" else "llama",
        "layers": cfg.num_layers, "dim": cfg.dim, "heads": cfg.num_heads,
        "kv_heads": cfg.n_kv_heads, "head_dim": cfg.hdim, "hidden_dim": cfg.hidden_dim,
        "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len,
        "tie_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope_theta,
        "dtype": quant or float_dtype,
        "head_dtype": head.kind if isinstance(head, QuantizedWeight) else float_dtype,
        "parameters": {"total": total, "backbone": total - exits, "exit_heads": exits},
        "exits": {**dataclasses.asdict(cfg.exits), "layers": list(cfg.exits.layers),
                  "exit_layers": list(cfg.exit_layers)},
        "tokenizer": None,
    }
    if tok is not None:
        info["tokenizer"] = {
            "vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id,
            "eos_token_ids": list(tok.eos_token_ids), "pad_token_id": tok.pad_token_id,
            "add_bos": tok.add_bos, "chat_template": tok.chat_template is not None,
        }
    return info


def installation() -> dict[str, Any]:
    """Facts about this installation: versions, threads, and which kernels run and why
    (:func:`exitlm.kernels.loader.kernel_path`)."""
    import platform

    import torch  # lazy: loaded when the command runs

    from exitlm import __version__  # lazy: loaded when the command runs
    from exitlm.kernels import native  # lazy: loaded when the command runs

    return {"exitlm": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "kernels": native.kernel_path().as_dict()}


def _info(args: argparse.Namespace) -> int:
    from exitlm.io import load_model  # lazy: loaded when the command runs
    from exitlm.kernels.loader import KernelPath  # lazy: loaded when the command runs

    system = installation()
    if args.model is None:
        if args.json:
            print(json.dumps(system, indent=2))
            return 0
        print(f"exitlm {system['exitlm']}  (torch {system['torch']}, python {system['python']}, "
              f"{system['machine']}, {system['threads']} threads)")
        print(f"  kernels       {KernelPath(**system['kernels']).describe()}")
        if system["kernels"]["library"]:
            print(f"  library       {system['kernels']['library']}")
        return 0
    info = describe(load_model(args.model))
    if args.json:
        print(json.dumps({**info, "installation": system}, indent=2))
        return 0
    p = info["parameters"]
    print(f"{info['name']}  ({info['source']})")
    print(f"  architecture  {info['architecture']}: {info['layers']} layers, dim {info['dim']}, "
          f"{info['heads']} heads / {info['kv_heads']} kv heads, mlp {info['hidden_dim']}, "
          f"vocab {info['vocab_size']}, tied embeddings {info['tie_embeddings']}")
    print(f"  parameters    {p['total']:,} total = {p['backbone']:,} backbone + "
          f"{p['exit_heads']:,} exit heads ({info['dtype']})")
    ex = info["exits"]
    print(f"  exits         layers {ex['layers']} every_layer={ex['every_layer']} "
          f"head={ex['head']} norm={ex['norm']} output={ex['output']}")
    if ex["draft"] is not None:
        weights = ex["draft"].get("weights", "model")
        print(f"  self-spec     measured best round: exit {ex['draft']['exit_layer']}, "
              f"{ex['draft']['num_speculations']} drafts"
              f"{'' if weights == 'model' else f' through an {weights} copy'} (exits.draft; "
              "preferred when the exit is left open)")
    if ex["threshold"] is not None:
        print(f"  early exit    threshold {ex['threshold']:g}, measured to keep plain decoding's "
              "output (exits.threshold; the default when --threshold is not given)")
    t = info["tokenizer"]
    if t is None:
        print("  tokenizer     none")
    else:
        print(f"  tokenizer     vocab {t['vocab_size']}, bos {t['bos_token_id']}, eos "
              f"{t['eos_token_ids']}, pad {t['pad_token_id']}, add_bos {t['add_bos']}, "
              f"chat template {'yes' if t['chat_template'] else 'no'}")
    print(f"  kernels       {KernelPath(**system['kernels']).describe()}")
    return 0


def _cache(args: argparse.Namespace) -> int:
    """``exitlm cache``: list, prune or clear exitlm's own cache entries."""
    from exitlm.io import cache  # lazy: loaded when the command runs
    from exitlm.io.dirs import check_cache_root  # lazy: loaded when the command runs

    max_size = None
    if args.max_size is not None:
        try:
            max_size = cache.parse_size(args.max_size)
        except ValueError as err:
            raise ConfigError(f"--max-size: {err}") from None
    if args.action != "prune" and (args.older_than is not None or max_size is not None):
        raise ConfigError("--older-than and --max-size choose what 'exitlm cache prune' "
                          "removes; add 'prune'")
    if args.action == "list" and args.dry_run:
        raise ConfigError("--dry-run applies to prune and clear")
    root = check_cache_root()  # a file there is an error, not an empty cache
    found = cache.entries(root, args.kind)
    if args.action == "list":
        chosen, verb = found, None
    else:
        if args.older_than is not None and args.older_than < 0:
            raise ConfigError(f"--older-than {args.older_than:g}: expected days >= 0")
        chosen = found if args.action == "clear" else cache.select(
            found, older_than_days=args.older_than, max_size=max_size)
        verb = "would remove" if args.dry_run else "removed"
        if not args.dry_run:
            for entry in chosen:
                cache.remove(entry)
    total = sum(e.size for e in chosen)
    if args.json:
        print(json.dumps({"root": str(root), "action": args.action, "dry_run": args.dry_run,
                          "entries": [{"kind": e.kind, "path": str(e.path), "bytes": e.size,
                                       "mtime": e.mtime} for e in chosen],
                          "bytes": total}, indent=2))
        return 0
    if verb is None:
        print(f"exitlm cache: {root}")
        if not found:
            print("  (empty)")
        for kind in KIND_NAMES:
            mine = [e for e in found if e.kind == kind]
            if mine:
                print(f"  {kind:<13} {len(mine):>4} entr{'y' if len(mine) == 1 else 'ies'}  "
                      f"{cache.human(sum(e.size for e in mine)):>10}")
                for e in mine:
                    print(f"      {cache.human(e.size):>10}  {e.path.name}")
        print(f"  {'total':<13} {len(found):>4} entries  {cache.human(total):>10}")
        return 0
    for e in chosen:
        print(f"{verb} {e.kind:<13} {cache.human(e.size):>10}  {e.path}")
    print(f"{verb} {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'}, "
          f"{cache.human(total)}; {len(found) - len(chosen)} kept")
    return 0
