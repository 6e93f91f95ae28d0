"""Code from an instruction model's answer, for the chat variant of HumanEval.

An instruction model answers a HumanEval problem in prose and markdown; evalplus (Liu et al.
2023) scores such models by asking for a self-contained function and sanitising the answer to
the code that defines it. This module does the same with the standard library:

* :func:`chat_prompt` - the problem as a user message through the model's chat template, and
  the start of the assistant's turn already inside a ```python block;
* :func:`completion_from_answer` - the code of the answer as a completion of the problem's
  prompt: a whole function (``def entry_point``) is kept with its imports and helpers and
  follows the prompt (it redefines the prompt's function); a body alone is indented under the
  prompt's own signature, so the prompt's imports and signature are kept.

The code is the fenced block that defines the entry point (else the first ``python`` block,
else the first block, else the answer itself from its first line of code). Only imports,
definitions and assignments stay at the top level: example calls, ``print`` and
``if __name__ == "__main__":`` blocks are dropped, and a cut-off tail is trimmed until it
parses.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import Any

INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
               "```python code block.\n\n```python\n{prompt}\n```\n")
RESPONSE_START = "```python\n"
"""The assistant's turn starts inside a code block (evalplus primes its answer the same way)."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(?:def |async def |class |import |from |@)", re.MULTILINE)
_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
         ast.Assign, ast.AnnAssign)


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The text sent for one problem: the chat template around the instruction, then the
    opening of the answer's code block."""
    message = {"role": "user", "content": INSTRUCTION.format(prompt=prompt.strip())}
    return tokenizer.apply_chat_template([message]) + RESPONSE_START


def code_block(answer: str, entry_point: str) -> str:
    """The answer's code: the fenced block defining ``entry_point``, else the first python
    block, else the first block, else the answer from its first line of code. A block cut
    off before its closing fence ends with the answer."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    if not blocks:
        found = _CODE_START.search(answer)
        return answer[found.start():] if found else answer
    defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    for _, body in blocks:
        if defines.search(body):
            return body
    for lang, body in blocks:
        if lang in ("python", "py", "python3"):
            return body
    return blocks[0][1]


def _parses(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _sanitise(code: str) -> tuple[str, ast.Module] | None:
    """``code`` cut to its longest prefix that parses, keeping only top-level imports,
    definitions and assignments; ``None`` when no prefix parses."""
    lines = code.splitlines()
    for end in range(len(lines), 0, -1):  # a cut-off answer: drop lines from the end
        tree = _parses("\n".join(lines[:end]))
        if tree is not None:
            break
    else:
        return None
    kept = [node for node in tree.body if isinstance(node, _KEEP)]
    source = "\n".join(lines[:end])
    parts = [ast.get_source_segment(source, n, padded=True) or "" for n in kept]
    # a decorator belongs with its definition
    for i, node in enumerate(kept):
        decos = getattr(node, "decorator_list", [])
        if decos:
            first = min(d.lineno for d in decos)
            parts[i] = "\n".join(lines[first - 1:node.end_lineno])
    out = "\n".join(p for p in parts if p)
    return out, ast.parse(out)


def completion_from_answer(answer: str, prompt: str, entry_point: str) -> str:
    """The completion of ``prompt`` that the answer amounts to (see the module docstring).
    An answer generated after :func:`chat_prompt` starts with :data:`RESPONSE_START`."""
    code = code_block(answer, entry_point)
    whole = _sanitise(textwrap.dedent(code))  # a whole function may come indented
    if whole is not None and any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == entry_point
            for n in whole[1].body):
        return "\n" + whole[0] + "\n"
    if whole is not None and any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.ClassDef)) for n in whole[1].body):
        return "\n" + whole[0] + "\n"  # other functions: scored as they are (they fail)
    body = textwrap.dedent(code.strip("\n"))
    return textwrap.indent(body, "    ") + "\n"  # a body: under the prompt's signature
