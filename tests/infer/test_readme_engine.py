"""The generation guide's engine example runs as written and prints each request's text on lines of
its own, never interleaved (the embedded default model)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from _default_model import requires_default_model

pytestmark = [pytest.mark.real_model, requires_default_model]

README = Path(__file__).resolve().parents[2] / "docs" / "guide" / "generation.md"


def test_readme_engine_example() -> None:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks
                if "Engine(" in b and "engine.step()" in b and "load_model(" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    from exitlm.infer import Engine, SamplingOptions
    from exitlm.io import load_model

    lm = load_model("default")
    lines = out.getvalue().splitlines()
    assert lines and all(re.match(r"\[[01]\] ", x) for x in lines)
    for rid, prompt in enumerate(["def fibonacci(n):", "The capital of France is"]):
        engine = Engine(lm.model, lm.tokenizer, "ar", max_batch=1)
        alone = engine.submit(prompt, SamplingOptions(max_new_tokens=48))
        engine.run()
        mine = "\n".join(x[len(f"[{rid}] "):] for x in lines if x.startswith(f"[{rid}] "))
        assert mine == alone.text
