"""``exitlm generate``: generate text from the command line.

    exitlm generate "def fibonacci(n):" --max-new-tokens 48
    exitlm generate "Tell me a joke" --chat --temperature 0.7 --top-p 0.9 --seed 1
    exitlm generate "a" "bb" --json            # several prompts run as one padded batch
    exitlm generate "def f(x):" --strategy self-spec --exit-layer 20 --num-speculations 4
    exitlm generate "def f(x):" --strategy early-exit --threshold 0.8 --show-exits
    exitlm generate "def f(x):" --strategy self-spec --compare   # speed-up over plain decoding
    exitlm generate "def f(x):" --strategy early-exit --kv pipeline --stages 2   # 2 processes
    exitlm generate "def f(x):" --tp 2                                           # 2 processes
    torchrun --nproc-per-node 2 -m exitlm generate "def f(x):" --tp 2

One prompt streams its text to stdout as it is produced (timings go to stderr); several
prompts print each continuation when the batch is done. ``--json`` prints one JSON object
instead: the :class:`~exitlm.infer.result.GenerationResult` plus the model and prompts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exitlm.args import float_at_least, int_at_least, thread_count
from exitlm.config import LAYERSKIP_EXITS, ConfigError
from exitlm.infer.flags import add_head_dtype_flag, add_strategy_flags, strategy_overrides
from exitlm.infer.strategies import STRATEGIES
from exitlm.textfile import MAX_PROMPTS_BYTES, read_text_file

if TYPE_CHECKING:
    import torch

    from exitlm.infer.result import GenerationResult
    from exitlm.tokenizer import Tokenizer


class _Dtypes(Mapping[str, Any]):
    """``--dtype`` names -> torch dtypes (or the quantized formats' names); the names are
    known without importing torch, the values import it when first read."""

    NAMES = ("float32", "float16", "bfloat16", "int8", "int4")

    def __getitem__(self, name: str) -> torch.dtype | str:
        if name not in self.NAMES:
            raise KeyError(name)
        from exitlm.io.loader import parse_dtype  # lazy: --help and argument errors import no torch

        return parse_dtype(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


DTYPES: Mapping[str, Any] = _Dtypes()


def register(subparsers: Any) -> None:
    """Add the ``generate`` sub-command to the ``exitlm`` parser."""
    p = subparsers.add_parser(
        "generate", help="generate text with a model",
        description="Generate continuations of one or more prompts (one padded batch).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (repeatable)")
    p.add_argument("-p", "--prompt", action="append", default=[], dest="prompt_flags",
                   metavar="TEXT", help="a prompt, as a PROMPT argument is (repeatable; "
                                        "PROMPTs come first)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="file with one prompt per line (blank lines skipped), added to PROMPTs")
    p.add_argument("--model", default="default",
                   help="'default' (embedded SmolLM2-135M-Instruct), a checkpoint directory, "
                        "a .gguf file, or a preset name (random weights, byte tokenizer)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights: float32/float16/bfloat16, or int8/int4 weight-only "
                        "quantized (GGUF Q8_0/Q4_0/Q4_1 blocks are used as they are)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string (repeatable; \\n, \\t, \\xNN, \\uNNNN escapes are "
                        "understood); the text is cut before it")
    p.add_argument("--logprobs", type=int_at_least(0), default=None, metavar="N",
                   help="with --json: each token's log-probability and its N most likely "
                        "alternatives")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end-of-sequence token")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message with the model's chat template "
                        "(a model without one is refused unless --chat-template is given)")
    p.add_argument("--chat-template", default=None, metavar="FILE|chatml",
                   help="with --chat: a Jinja chat template file to use instead of the "
                        "model's, or 'chatml' for ChatML (<|im_start|>role ... <|im_end|>)")
    p.add_argument("--strategy", default="ar", choices=sorted(STRATEGIES),
                   help="decoding strategy")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="CPU threads per decoding step (default: measured while decoding: "
                        "more threads only while they are faster, see docs/guide/performance.md)")
    p.add_argument("--tp", type=int_at_least(1), default=1, metavar="T",
                   help="tensor-parallel decoding over T processes (ar, early-exit, self-spec): "
                        "started here, or the ones torchrun started")
    p.add_argument("--dist-timeout", type=float_at_least(1.0), default=300.0, metavar="S",
                   help="with --tp or --kv pipeline: seconds a process waits for another "
                        "before giving up")
    add_head_dtype_flag(p)
    add_strategy_flags(p)
    p.add_argument("--show-exits", action="store_true",
                   help="colour each token by the layer it exited at (ANSI colours on a "
                        "terminal, see --color) and print a per-layer summary to stderr")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours for --show-exits: auto = only when stdout is a terminal")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with per-token exit layers), no streaming")
    p.add_argument("--compare", action="store_true",
                   help="then decode the same prompts with plain autoregressive decoding (same "
                        "weights and threads) and print the strategy's decode speed-up over it "
                        "and whether the outputs are identical")
    p.set_defaults(func=run)


def unescape(text: str) -> str:
    r"""``\n``, ``\t``, ``\r``, ``\\``, ``\xNN`` and ``\uNNNN`` in ``text`` as the characters
    they name (a shell passes ``--stop "\n\n"`` as backslashes)."""
    simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "0": "\0"}

    def one(m: re.Match[str]) -> str:
        code = m.group(1)
        return simple[code] if code in simple else chr(int(code[1:], 16))

    return re.sub(r"\\(n|t|r|0|\\|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4})", one, text)


def load_for_strategy(source: str, dtype: torch.dtype | str, strategy: str,
                      head_dtype: str | None = None) -> Any:
    """Load a model for decoding; strategies other than ``ar`` need exits, so a model without
    any gets LayerSkip-style exits at every layer (through the final norm and head).
    ``head_dtype``: quantize only its output embeddings (``--head-dtype``)."""
    from exitlm.io import load_model  # lazy: the commands' parsers import no torch

    loaded = load_model(source, dtype=dtype, head_dtype=head_dtype)
    if strategy != "ar" and not loaded.model.config.exit_layers:
        print(f"exitlm: {source!r} has no exit heads; exiting through the final norm + head "
              "at every layer (LayerSkip style, untrained exits)", file=sys.stderr)
        loaded = load_model(source, dtype=dtype, head_dtype=head_dtype,
                            exits=LAYERSKIP_EXITS)
    return loaded


def rank_draft_vocab(model: Any, tokenizer: Any, options: Any) -> None:
    """A draft vocabulary of ``N < V`` ids (``draft_vocab`` in ``options``, a dict or a
    strategy's options) drafts over the model's ``N`` most frequent tokens: rank them on the
    default corpus with ``tokenizer`` once (cached, :mod:`exitlm.io.token_order`)."""
    from exitlm.io.token_order import rank_model_tokens  # lazy: parsers import no torch

    n = options.get("draft_vocab") if isinstance(options, dict) else \
        getattr(options, "draft_vocab", None)
    rank_model_tokens(model, tokenizer, n)


def tokenizer_for(loaded: Any, source: str) -> Tokenizer:
    """The loaded model's tokenizer, or one token per byte for models shipped without one
    (presets with ``vocab_size >= 256``; a note goes to stderr)."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    if loaded.config.vocab_size < 256:
        raise ConfigError(f"model {source!r} has no tokenizer and its vocabulary "
                          f"({loaded.config.vocab_size}) is too small for the byte fallback "
                          "(256)")
    print(f"exitlm: {source!r} has no tokenizer; using one token per byte", file=sys.stderr)
    return byte_level_tokenizer()


def use_chat_template(tokenizer: Tokenizer, source: str, template: str | None,
                      chat: bool = True) -> None:
    """``--chat``: the model's own template, or the one ``--chat-template`` names; a model
    without a template is refused instead of wrapped in a format it was never trained on."""
    if template is not None and not chat:
        raise ConfigError("--chat-template applies to --chat; add --chat")
    if template is None:
        if tokenizer.chat_template:
            return
        raise ConfigError(
            f"--chat: model {source!r} has no chat template, so there is no format it was "
            "trained to read messages in",
            hint="pass --chat-template FILE (a Jinja template) or --chat-template chatml to "
                 "choose one, or drop --chat to send the prompt as it is")
    if template == "chatml":
        from exitlm.tokenizer import CHATML_TEMPLATE  # lazy: no torch for --help

        tokenizer.chat_template = CHATML_TEMPLATE
        return
    from exitlm.chat_template import MAX_TEMPLATE_BYTES  # lazy: no jinja2 for --help

    tokenizer.chat_template = read_text_file(
        Path(template).expanduser(), MAX_TEMPLATE_BYTES, label=f"--chat-template {template}",
        expected="a Jinja template file or 'chatml'")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm generate``; returns the exit status (bad input raises an
    :class:`~exitlm.errors.ExitlmError`, which ``exitlm`` prints as one line)."""
    from exitlm.infer.api import generate  # lazy: no torch for --help
    from exitlm.infer.executors.run import (  # lazy: no torch for --help
        distributed_generate,
        distributed_mode,
    )
    from exitlm.infer.options import SamplingOptions  # lazy: no torch for --help
    from exitlm.infer.threads import set_threads  # lazy: no torch for --help
    from exitlm.runtime import prepare  # lazy: no torch for --help

    if args.logprobs is not None and not args.json:
        raise ConfigError(f"--logprobs {args.logprobs}: log-probabilities are printed only in "
                          "the JSON output; add --json")
    prompts = _collect_prompts(args)
    sampling = SamplingOptions(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(unescape(x) for x in args.stop),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )
    overrides = strategy_overrides(args, args.strategy)
    mode = distributed_mode(args.tp, args.strategy, overrides)
    if args.compare and args.strategy == "ar":
        raise ConfigError("--compare decodes the prompts again with plain decoding to compare "
                          "a strategy with it; --strategy ar is plain decoding (choose "
                          "early-exit, self-spec or ppd)")
    if args.compare and mode is not None:
        raise ConfigError("--compare runs plain decoding in this process; it does not combine "
                          "with --tp or --kv pipeline (see benchmarks/dist_decode.py)")
    if mode is not None and args.threads is None:
        args.threads = 1  # one thread per process: the processes share the cores
    if args.threads is not None:
        set_threads(args.threads)  # loading and prefill use them too
    loaded = load_for_strategy(args.model, DTYPES[args.dtype], args.strategy, args.head_dtype)
    tokenizer = tokenizer_for(loaded, args.model)
    if args.chat or args.chat_template is not None:
        use_chat_template(tokenizer, args.model, args.chat_template, args.chat)
    rank_draft_vocab(loaded.model, tokenizer, overrides)
    num_layers = loaded.model.num_layers
    colour = args.show_exits and (
        args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    )
    stream: Any = None
    if not args.json and len(prompts) == 1:
        stream = ExitColourStream(num_layers) if colour else _print_piece
    try:
        if mode is not None:
            res = distributed_generate(
                mode, loaded.model, tokenizer, prompts, tp=args.tp, strategy=args.strategy,
                timeout_s=args.dist_timeout, threads=args.threads, sampling=sampling,
                stream=stream, chat=args.chat, **overrides)
            if res is None:
                return 0  # a rank other than 0 of a torchrun job: rank 0 prints
            result = res
        else:
            runner = prepare(loaded.model)
            result = generate(
                runner, tokenizer, prompts, strategy=args.strategy, sampling=sampling,
                stream=stream, chat=args.chat, threads=args.threads, **overrides,
            )
    except BaseException:
        if stream is not None:  # end the streamed line: the error message starts its own
            sys.stdout.write(RESET + "\n" if colour else "\n")
            sys.stdout.flush()
        raise
    theory = ppd_theory_of(result, num_layers)
    compared = None
    if args.compare:
        def again(strategy: str) -> Callable[[], GenerationResult]:
            return lambda: generate(runner, tokenizer, prompts, strategy=strategy,
                                    sampling=sampling, chat=args.chat, threads=args.threads,
                                    **(overrides if strategy == args.strategy else {}))

        compared = comparison(result, again(args.strategy), again("ar"))
    if args.json:
        from exitlm.kernels import native  # lazy: loaded when the command runs

        out = {"model": loaded.source, "dtype": args.dtype, "head_dtype": args.head_dtype,
               "prompts": prompts,
               **result.to_dict(), "kernels": native.kernel_path().describe()}
        if theory is not None:
            out["ppd_theorem_4_1"] = theory
        if compared is not None:
            out["compare_ar"] = compared
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if stream is not None:
        sys.stdout.write(RESET + "\n" if colour else "\n")
    else:
        for i, seq in enumerate(result.sequences):
            print(f"--- [{i}] {prompts[i]!r}")
            if colour:
                print(colour_tokens(tokenizer, seq.token_ids, seq.exit_layers, num_layers)
                      + RESET)
            else:
                print(seq.text)
    if args.show_exits:
        print(exit_summary(result, colour), file=sys.stderr)
    print(_summary(result, theory), file=sys.stderr)
    if compared is not None:
        same = "identical to" if compared["identical"] else "different from"
        runs = compared["runs"]
        best = f" (the fastest of {runs} runs each)" if runs > 1 else ""
        if compared["speedup"] is None:  # nothing decoded after the first token (its end)
            print(f"[{args.strategy} and plain decoding stopped after the first token: no "
                  f"decoding to time; its output is {same} plain decoding's]", file=sys.stderr)
        else:
            print(f"[plain decoding {compared['ar_decode_tokens_per_s']:.1f} tokens/s: "
                  f"{args.strategy} decodes {compared['speedup']:.2f}x as fast{best}; its "
                  f"output is {same} plain decoding's]", file=sys.stderr)
    return 0


COMPARE_RUNS = 3
"""The most runs of each side ``--compare`` takes (short generations only)..."""
COMPARE_SHORT_S = 0.5
"""... while every run so far decoded in less than this many seconds: one run of a few dozen
tokens is timed over a tenth of a second, where a preempted moment moves the ratio by a
quarter (64 bytes of ``layerskip-code``, one thread: 1.17-2.04x over four single runs)."""


def comparison(result: GenerationResult, again: Callable[[], GenerationResult],
               plain: Callable[[], GenerationResult]) -> dict[str, Any]:
    """``--compare``: the strategy's decode speed (``result``, then ``again()``) over plain
    decoding's (``plain()``), alternating, the fastest run of each (short generations run up
    to :data:`COMPARE_RUNS` times each), and whether every run's tokens are the first plain
    run's."""
    runs, plains = [result], [plain()]
    while len(runs) < COMPARE_RUNS and all(
            r.timings.decode_s < COMPARE_SHORT_S for r in (*runs, *plains)):
        runs.append(again())
        plains.append(plain())
    a = max(r.timings.decode_tokens_per_s for r in runs)
    b = max(r.timings.decode_tokens_per_s for r in plains)
    ref = plains[0].token_ids
    return {"ar_decode_tokens_per_s": b, "decode_tokens_per_s": a,
            "speedup": a / b if a > 0 and b > 0 else None, "runs": len(runs),
            "identical": all(r.token_ids == ref for r in (*runs, *plains))}


# ----- --show-exits ------------------------------------------------------------------------
RESET = "\033[0m"
_PALETTE = (196, 202, 208, 214, 220, 190, 118, 48, 45, 39)  # red (shallow) ... blue (deep)


def exit_colour(layer: int, num_layers: int) -> str:
    """ANSI 256-colour escape for a token that exited at ``layer`` (the final layer keeps
    the terminal's default colour)."""
    if layer >= num_layers:
        return RESET
    idx = min(len(_PALETTE) - 1, (layer - 1) * len(_PALETTE) // max(1, num_layers - 1))
    return f"\033[38;5;{_PALETTE[idx]}m"


class ExitColourStream:
    """A stream callback that prints each piece in the colour of its token's exit layer
    (:func:`~exitlm.infer.api.generate` passes the layer since ``wants_layers`` is set)."""

    wants_layers = True

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def __call__(self, _index: int, piece: str, layer: int | None = None) -> None:
        sys.stdout.write(exit_colour(layer or self.num_layers, self.num_layers) + piece)
        sys.stdout.flush()


def colour_tokens(
    tokenizer: Tokenizer, ids: list[int], layers: list[int], num_layers: int
) -> str:
    """The decoded text with each token's piece coloured by its exit layer."""
    out, prev = [], ""
    for n, layer in enumerate(layers, start=1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue  # an incomplete character: it is coloured with the token that ends it
        out.append(exit_colour(layer, num_layers) + text[len(prev):])
        prev = text
    return "".join(out)


def exit_summary(result: GenerationResult, colour: bool) -> str:
    """``exit layer: count`` over all generated tokens, coloured like the tokens."""
    counts: dict[int, int] = {}
    for seq in result.sequences:
        for layer in seq.exit_layers:
            counts[layer] = counts.get(layer, 0) + 1
    n = result.num_layers
    parts = []
    for layer in sorted(counts):
        label = f"L{layer}:{counts[layer]}"
        parts.append(exit_colour(layer, n) + label + RESET if colour else label)
    return "[exit layers " + " ".join(parts) + "]"


def _print_piece(_index: int, piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _collect_prompts(args: argparse.Namespace) -> list[str]:
    prompts = [*args.prompts, *args.prompt_flags]
    if args.prompts_file is not None:
        lines = read_text_file(args.prompts_file, MAX_PROMPTS_BYTES,
                               label=f"--prompts-file {args.prompts_file}",
                               expected="a prompts file (one prompt a line)").splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("no prompt given: pass PROMPT arguments, --prompt or --prompts-file")
    return prompts


def ppd_theory_of(result: GenerationResult, num_layers: int) -> dict[str, float] | None:
    """PPD Theorem 4.1's prediction for a ``ppd`` result's measured ``p_correct`` (per
    sequence of the mean length), or ``None`` for other strategies / nothing forked."""
    from exitlm.infer.ppd import PPDStats  # lazy: the commands' parsers import no torch

    st = result.stats
    if not isinstance(st, PPDStats) or not st.forks or not result.sequences:
        return None
    ell = max(1, round(result.timings.new_tokens / len(result.sequences)))
    return st.theory(num_layers, int(result.options["ppd_layer"]), int(result.options["ppd_k"]),
                     ell)


def _summary(result: GenerationResult, theory: dict[str, float] | None = None) -> str:
    t = result.timings
    extra = result.stats.describe()
    if theory is not None:
        extra += f" (Theorem 4.1 predicts {theory['speedup']:.2f}x over greedy at this rate)"
    if not extra and result.strategy == "early-exit":
        extra = f"early exits {result.exits().early_exit_fraction:.1%}"
    extra = f"; {extra}" if extra else ""
    if t.startup_s > 0:
        extra += f"; worker start {t.startup_s:.1f} s (not in prefill)"
    return (
        f"[{t.new_tokens} new tokens in {len(result.sequences)} sequence(s); prefill "
        f"{t.prefill_s * 1e3:.0f} ms ({t.prompt_tokens} prompt tokens), decode "
        f"{t.decode_tokens_per_s:.1f} tokens/s{extra}]"
    )


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer with one token per byte (id = byte value) for models shipped without one
    (presets with ``vocab_size >= 256``)."""
    import tokenizers

    from exitlm.tokenizer import Tokenizer, byte_level_alphabet  # lazy: parsers import no torch

    char_of = byte_level_alphabet()
    vocab = {char_of[b]: b for b in range(256)}
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(tk)
