"""``exitlm train`` and ``exitlm eval``.

    exitlm train --config FILE.yaml|PRESET [section.key=value ...] [--resume]
    exitlm eval MODEL [--data PATH] [--layers 4,8|all] [--json]

Multi-process training: ``torchrun --nproc-per-node N -m exitlm train ...`` runs data parallel
(DDP / FSDP), or pipeline parallel with ``parallel.pp=P`` (and ``parallel.dp=D``, P x D = N).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from exitlm.args import int_at_least, thread_count
from exitlm.config import ConfigError
from exitlm.errors import ExitlmError


def register(subparsers: Any) -> None:
    """Add the ``train`` and ``eval`` sub-commands."""
    from exitlm.train.presets import PRESETS  # lazy: loaded when the command runs

    p = subparsers.add_parser(
        "train", help="train a model with early exits (EE-LLM / LayerSkip / exit tuning)",
        description="Train from a YAML config or a preset; override any key with "
                    "section.key=value (YAML values). Presets: " + ", ".join(sorted(PRESETS)),
    )
    p.add_argument("--config", "-c", required=True, help="YAML file or preset name")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in train.out_dir from its newest readable checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a train.out_dir that holds a previous run: its outputs "
                        "(run.json, log.jsonl, checkpoints/, model/, ...) are deleted, nothing "
                        "else (a directory without the run's run.json is refused)")
    p.add_argument("--allow-changes", action="store_true",
                   help="with --resume: continue although model/data settings differ from "
                        "the run's (the differences are logged)")
    p.add_argument("--init-missing", action="store_true",
                   help="with --resume: tensors the checkpoint lacks (new layers, new exit "
                        "heads) start from scratch instead of being an error (logged)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    p.set_defaults(func=_train, extra_positionals="overrides")

    e = subparsers.add_parser(
        "eval", help="per-exit loss, perplexity, accuracy and agreement with the final layer",
        description="Evaluate every exit of MODEL on held-out text: loss / perplexity, top-1 "
                    "accuracy, and how often the exit's top-1 / top-k contain the final "
                    "layer's top-1 (PPD's p_correct).",
    )
    e.add_argument("model", help="model name or path (default, default-ee, a run's model dir)")
    e.add_argument("--data", action="append",
                   help="text file, directory or JSONL (all of it is evaluated); default: the "
                        "held-out files of the standard-library corpus")
    e.add_argument("--layers", default=None,
                   help="comma-separated 1-based layers, or 'all' (default: the model's exits)")
    e.add_argument("--tokenizer", default=None,
                   help="tokenizer spec (bytes, default, a directory); default: the model's")
    e.add_argument("--seq-len", type=int_at_least(2), default=128)
    e.add_argument("--batch-size", type=int_at_least(1), default=8)
    e.add_argument("--max-samples", type=int_at_least(1), default=64,
                   help="number of seq-len windows evaluated (spread over the data)")
    e.add_argument("--topk", type=int_at_least(1), default=5)
    e.add_argument("--threads", type=thread_count, default=None,
                   help="CPU threads (default: torch's, one per physical core)")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.set_defaults(func=_eval)


def _train(args: argparse.Namespace) -> int:
    from exitlm.train.config import load_config  # lazy: loaded when the command runs

    if (args.allow_changes or args.init_missing) and not args.resume:
        raise ConfigError("--allow-changes and --init-missing apply to --resume")
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from exitlm.train.trainer import Trainer  # lazy: loaded when the command runs

    trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite,
                      allow_changes=args.allow_changes, init_missing=args.init_missing)
    trainer.train()
    if trainer.rank == 0:
        out = Path(cfg.train.out_dir)
        result = out / ("exits" if cfg.tune.freeze_backbone else "model")
        print(f"done: {trainer.step} steps; model: {result}; log: {out / 'log.jsonl'}; "
              f"plot: {out / 'loss.png'}")
    return 0


def _eval_tokenizer_spec(name: str, model_dir: Path | None) -> str | None:
    from exitlm.io.st import read_json  # lazy: loaded when the command runs

    if name in ("default", "default-ee"):
        return "default"
    if model_dir is not None:
        info = model_dir / "exitlm_train.json"
        if info.is_file():
            spec = _dig(read_json(info), "data", "tokenizer")
            if not isinstance(spec, str):
                raise ExitlmError(f"{info}: expected data.tokenizer to be a string, got "
                                  f"{spec!r}")
            return spec
        bundle = model_dir / "exits.json"  # exit-head bundle: its backbone's tokenizer
        if bundle.is_file():
            meta = read_json(bundle)
            spec = _dig(meta, "info", "data", "tokenizer")
            if spec is None and isinstance(meta, dict) and meta.get("base") == "default":
                spec = "default"
            return None if spec is None else str(spec)
    return None


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _eval(args: argparse.Namespace) -> int:
    import torch

    # lazy: loaded when the command runs
    from exitlm.infer.per_exit import evaluate_exits, format_table
    from exitlm.io import load_model  # lazy: loaded when the command runs
    from exitlm.progress import phase, progress  # lazy: loaded when the command runs
    from exitlm.tokenizer import check_fits_vocab  # lazy: loaded when the command runs

    # lazy: loaded when the command runs
    from exitlm.train.data import ByteTokenizer, load_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with phase(f"loading {args.model}"):
        loaded = load_model(args.model)
    model = loaded.model
    path = Path(args.model)
    spec = args.tokenizer or _eval_tokenizer_spec(args.model, path if path.is_dir() else None)
    if spec is not None:
        setting = "--tokenizer" if args.tokenizer else f"{args.model}'s data.tokenizer"
        tok: Any = load_tokenizer(spec, setting) if spec != "default" or loaded.tokenizer is None \
            else loaded.tokenizer
    elif loaded.tokenizer is not None:
        tok, spec = loaded.tokenizer, str(path.resolve()) if path.exists() else args.model
    elif model.config.vocab_size == 256:
        tok, spec = ByteTokenizer(), "bytes"
    else:
        raise ConfigError("the model has no tokenizer; pass --tokenizer")
    cfg = model.config
    check_fits_vocab(getattr(tok, "source", None) or f"--tokenizer {spec!r}", tok.vocab_size,
                     tok.max_id, cfg.vocab_size, "use the model's own tokenizer")
    if args.seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's context "
                          f"(max_seq_len={cfg.max_seq_len})")
    L = model.num_layers
    if args.layers is None:
        layers = [*cfg.exit_layers, L]
    elif args.layers == "all":
        layers = list(range(1, L + 1))
    else:
        try:
            layers = sorted({int(x) for x in args.layers.split(",") if x.strip()})
        except ValueError:
            raise ConfigError(f"--layers must be integers or 'all', got {args.layers!r}"
                              ) from None
        bad = [k for k in layers if not 1 <= k <= L]
        if bad or not layers:
            raise ConfigError(f"--layers {args.layers!r}: expected layers in 1..{L}")
    with phase("preparing the evaluation data"):
        batches = eval_data(args.data, spec, tok, args.seq_len, args.batch_size,
                            args.max_samples)
    with torch.inference_mode(), progress(f"evaluating {len(layers)} exits",
                                          getattr(batches, "count", None), "batch") as bar:
        metrics = evaluate_exits(model, _counted(batches, bar), layers,
                                 topk=min(args.topk, cfg.vocab_size))
    if args.json:
        print(json.dumps({"model": args.model, "source": loaded.source,
                          "exits": [m.to_dict() for m in metrics]}, indent=2))
    else:
        print(f"{args.model} ({loaded.source})")
        print(format_table(metrics, args.topk))
    return 0


def _counted(items: Any, bar: Any) -> Any:
    """``items``, advancing ``bar`` after each."""
    for item in items:
        yield item
        bar.update(1)


def eval_data(
    paths: list[str] | None, spec: str, tok: Any, seq_len: int, batch_size: int,
    max_samples: int | None,
) -> Any:
    """Batches of ``(tokens, labels)``: the held-out split of the default corpus, or all of
    ``paths``."""
    import numpy as np

    from exitlm.io.corpus import DataConfig, iter_documents  # lazy: loaded when the command runs

    # lazy: loaded when the command runs
    from exitlm.train.data import TokenFile, prepare

    if not paths:
        cfg = DataConfig(tokenizer=spec, seq_len=seq_len)
        directory = prepare(cfg, tokenizer=tok, progress=sys.stderr.isatty())
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        data = TokenFile.open(directory / "val.bin", meta["dtype"], seq_len)
        return _Batches(data, batch_size, max_samples)
    cfg = DataConfig(paths=tuple(paths), tokenizer=spec, seq_len=seq_len)
    eos = getattr(tok, "eos_token_ids", ()) or (0,)
    ids: list[int] = []
    for _, text in iter_documents(cfg, "--data"):
        ids.extend(tok.encode(text, add_bos=False))
        ids.append(int(eos[0]))
    return _Batches(TokenFile(np.asarray(ids, dtype=np.int64), seq_len, "--data", "--seq-len"),
                    batch_size, max_samples)


class _Batches:
    """``eval_batches`` over a token file, with their ``count`` known before they are read."""

    def __init__(self, data: Any, batch_size: int, max_samples: int | None) -> None:
        self.data, self.batch_size, self.max_samples = data, batch_size, max_samples
        n = min(data.num_samples, max_samples or data.num_samples)
        self.count = -(-n // batch_size)

    def __iter__(self) -> Any:
        from exitlm.train.data import eval_batches  # lazy: loaded when the command runs

        return iter(eval_batches(self.data, self.batch_size, self.max_samples))
