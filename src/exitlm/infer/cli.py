"""``exitlm generate``: generate text from the command line.

    exitlm generate "def fibonacci(n):" --max-new-tokens 48
    exitlm generate "Tell me a joke" --chat --temperature 0.7 --top-p 0.9 --seed 1
    exitlm generate "a" "bb" --json            # several prompts run as one padded batch

One prompt streams its text to stdout as it is produced (timings go to stderr); several
prompts print each continuation when the batch is done. ``--json`` prints one JSON object
instead: the :class:`~exitlm.infer.result.GenerationResult` plus the model and prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from exitlm.config import ConfigError
from exitlm.infer.api import STRATEGIES, generate
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import GenerationResult
from exitlm.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def register(subparsers: Any) -> None:
    """Add the ``generate`` sub-command to the ``exitlm`` parser."""
    p = subparsers.add_parser(
        "generate", help="generate text with a model",
        description="Generate continuations of one or more prompts (one padded batch).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="file with one prompt per line (blank lines skipped), added to PROMPTs")
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), a checkpoint directory, "
                        "a .gguf file, or a preset name (random weights, byte tokenizer)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable); the text is cut before it")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end-of-sequence token")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the chat template")
    p.add_argument("--strategy", default="ar", choices=sorted(STRATEGIES),
                   help="decoding strategy")
    p.add_argument("--json", action="store_true", help="print one JSON object, no streaming")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm generate``; returns the exit status."""
    try:
        prompts = _collect_prompts(args)
        sampling = SamplingOptions(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        from exitlm.io import load_model

        loaded = load_model(args.model, dtype=DTYPES[args.dtype])
        tokenizer = loaded.tokenizer
        if tokenizer is None:
            tokenizer = byte_level_tokenizer()
            if loaded.config.vocab_size < 256:
                raise ConfigError(
                    f"model {args.model!r} has no tokenizer and its vocabulary "
                    f"({loaded.config.vocab_size}) is too small for the byte fallback (256)"
                )
            print(f"exitlm: {args.model!r} has no tokenizer; using one token per byte",
                  file=sys.stderr)
        stream = _print_piece if not args.json and len(prompts) == 1 else None
        result = generate(
            loaded.model, tokenizer, prompts, strategy=args.strategy, sampling=sampling,
            stream=stream, chat=args.chat,
        )
    except (ConfigError, ValueError, OSError) as err:
        print(f"exitlm generate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = {"model": loaded.source, "dtype": args.dtype, "prompts": prompts,
               **result.to_dict()}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if stream is not None:
        sys.stdout.write("\n")
    else:
        for i, seq in enumerate(result.sequences):
            print(f"--- [{i}] {prompts[i]!r}")
            print(seq.text)
    print(_summary(result), file=sys.stderr)
    return 0


def _print_piece(_index: int, piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _collect_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file is not None:
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("no prompt given: pass PROMPT arguments or --prompts-file")
    return prompts


def _summary(result: GenerationResult) -> str:
    t = result.timings
    return (
        f"[{t.new_tokens} new tokens in {len(result.sequences)} sequence(s); prefill "
        f"{t.prefill_s * 1e3:.0f} ms ({t.prompt_tokens} prompt tokens), decode "
        f"{t.decode_tokens_per_s:.1f} tokens/s]"
    )


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer with one token per byte (id = byte value) for models shipped without one
    (presets with ``vocab_size >= 256``)."""
    import tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    # GPT-2's byte -> unicode table, which the ByteLevel pre-tokenizer and decoder use.
    char_of = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    vocab = {char_of[b]: b for b in range(256)}
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(tk)
