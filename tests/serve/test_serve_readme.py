"""The serving guide's examples run as written against a real server (the tiny self-spec
server stands in for ``default-ee``): the ``openai`` client example, and the ``curl``
requests' bodies."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from _serve_util import Server

pytest.importorskip("openai")

README = Path(__file__).resolve().parents[2] / "docs" / "guide" / "serving.md"


def _section() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_openai_example(servers: dict[str, Server]) -> None:
    server = servers["self-spec"]
    code = next(b for b in re.findall(r"```python\n(.*?)```", _section(), re.S)
                if "OpenAI(" in b)
    code = code.replace("http://127.0.0.1:8000", server.url).replace('"default-ee"', '"tiny"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    lines = out.getvalue().splitlines()  # text, exit layers, statistics, streamed text
    at = max(i for i, x in enumerate(lines) if re.fullmatch(r"\[\d+(, \d+)*\]", x))
    layers = json.loads(lines[at])
    assert len(layers) == 32 and all(1 <= x <= 4 for x in layers)
    rate, spent, full = lines[at + 1].split()
    assert 0 <= float(rate) <= 1 and int(full) == 4 * 32 and int(spent) > 0


def test_readme_curl_bodies(ar: Server) -> None:
    commands = re.findall(r"curl (?:-N )?http://127\.0\.0\.1:8000(\S+) .*?-d '(.*?)'",
                          _section(), re.S)
    assert len(commands) == 2
    for path, body in commands:
        request = {**json.loads(body), "model": "tiny", "max_tokens": 4}
        status, answer = ar.call("POST", path, request)
        assert status == 200, answer
        if request.get("stream"):
            assert answer.rstrip().endswith("data: [DONE]")
        else:
            assert answer["usage"]["completion_tokens"] == 4
