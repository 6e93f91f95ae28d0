"""Chat HumanEval: the code is taken from answers of every usual shape (a fenced whole
function with prose around it, a primed block, a body alone, a cut-off answer, unfenced code
followed by prose, several blocks) and, run after the prompt, passes or fails as that code
would; a model without a chat template is refused."""

from __future__ import annotations

import pytest

from exitlm.eval.extract import RESPONSE_START, chat_prompt, code_block, completion_from_answer

PROMPT = ('from typing import List\n\n\ndef add_all(xs: List[int]) -> int:\n'
          '    """ Sum of xs.\n    >>> add_all([1, 2])\n    3\n    """\n')
CHECK = "\nassert add_all([1, 2, 3]) == 6 and add_all([]) == 0\n"


def _passes(completion: str) -> bool:
    try:
        exec(compile(PROMPT + completion + CHECK, "<program>", "exec"), {})  # trusted test code
    except Exception:
        return False
    return True


@pytest.mark.parametrize("answer", [
    RESPONSE_START + "def add_all(xs):\n    return sum(xs)\n",
    RESPONSE_START + "def add_all(xs):\n    return sum(xs)\n```\nThis sums the list.",
    RESPONSE_START + "    return sum(xs)\n",
    RESPONSE_START + "total = 0\nfor x in xs:\n    total += x\nreturn total\n",
    "Sure! Here is the function:\n\n```python\nimport math\n\ndef add_all(xs):\n"
    "    return math.fsum(xs)\n\nif __name__ == '__main__':\n    print(add_all(input()))\n```\n"
    "It uses math.fsum.",
    "```py\ndef helper(x):\n    return x\n\n@staticmethod\ndef unused():\n    pass\n\n"
    "def add_all(xs):\n    return sum(helper(x) for x in xs)\n\nprint(add_all([1]))\n```",
    "First an example:\n```\nadd_all([1])\n```\nThe code:\n```python\n"
    "def add_all(xs):\n    return sum(xs)\n```",
    "def add_all(xs):\n    return sum(xs)\n\nThis function returns the sum of the list.",
    RESPONSE_START + "def add_all(xs):\n    return sum(xs)\n\ndef other(y):\n    return y +",
    "```python\n    def add_all(xs):\n        return sum(xs)\n```",
], ids=["primed", "primed-closed", "body", "unindented-body", "prose-around", "helpers",
        "several-blocks", "unfenced", "cut-off-tail", "indented-def"])
def test_code_is_extracted_from_every_answer_shape(answer: str) -> None:
    completion = completion_from_answer(answer, PROMPT, "add_all")
    assert _passes(completion), completion
    assert "print(" not in completion and "__main__" not in completion


@pytest.mark.parametrize("answer", [
    "I cannot help with that.",
    RESPONSE_START + "def add_all(xs):\n    return 0\n",
    RESPONSE_START + "def add_all(xs):\n    total = 0\n    for x in xs:\n        total += x\n"
    "    return tot",
])
def test_wrong_answers_still_fail(answer: str) -> None:
    assert not _passes(completion_from_answer(answer, PROMPT, "add_all"))


def test_the_block_defining_the_entry_point_wins() -> None:
    answer = "```python\nprint('hi')\n```\nthen\n```python\ndef add_all(xs):\n    pass\n```"
    assert code_block(answer, "add_all").startswith("def add_all")


def test_chat_prompt_uses_the_template_and_primes_a_code_block() -> None:
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
            return f"<user>{messages[0]['content']}</user><assistant>"

    text = chat_prompt(Tok(), PROMPT)
    assert text.startswith("<user>") and text.endswith("<assistant>" + RESPONSE_START)
    assert "def add_all(xs: List[int]) -> int:" in text
