"""Chat templates arrive with checkpoints: rendering is bounded in size and time, and escapes,
syntax errors and limits are one-line errors."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from _robust_util import assert_clean_error, cli, cli_subprocess, tiny_model

from exitlm.chat_template import ChatTemplateError, TemplateLimits, render_chat_template
from exitlm.errors import ExitlmError
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.io import save_model
from exitlm.tokenizer import CHATML_TEMPLATE, Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
FAST = TemplateLimits(timeout_s=1.0)

HOSTILE = [
    ("{{ 'x' * 10000000000 }}", r"'\*'"),
    ("{{ 'x' * 400000 * 400000 }}", r"'\*'"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
     "characters|longer than"),
    ("{% set s = 'ab' * 400000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
     "longer than"),
    ("{{ 'x'|center(10000000000) }}", "center"),
    ("{{ '%10000000000s' % 'a' }}", "width"),
    ("{{ '%*s' % (10000000000, 'a') }}", "10000000000"),
    ("{{ '{:>10000000000}'.format(1) }}", "width"),
    ("{{ ('x' * 100000)|join('y' * 100000) }}", "join"),
    ("{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "replace"),
    ("{{ ('\\t' * 100000).expandtabs(100000) }}", "expandtabs"),
    ("{{ 'a\\nb'|indent(10000000) }}", "indent"),
    ("{{ 10 ** (10 ** 10) }}", r"'\*\*'"),
    ("{{ range(10 ** 9)|list }}", "1000000000"),
    ("{{ messages|tojson(indent=10 ** 9) }}", "tojson"),
    ("{{ [[1]]|sum(start=[]) }}", "sum"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ messages.__class__ }}", "unsafe"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "unsafe"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{% for %}", "syntax error"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ undefined_name.attr }}", "undefined"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("x" * 2_000_000, "characters"),
    # '~' (string concatenation) doubling a string: 2**28 characters without the check
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s|length }}", "'~'"),
    # many large constant parts: no folding at compile time, checked when rendering
    ("{{ " + " ~ ".join(["('x'|center(900000))"] * 40) + " }}", "'~'"),
    ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(30) %}{% set ns.s %}"
     "{{ ns.s }}{{ ns.s }}{% endset %}{% endfor %}", "a block"),
    ("{% set s = 'x' * 1000 %}{{ s.translate({120: s * 900}) }}", "translate"),
    ("{{ range(100000)|map('string')|map('center', 900000)|join }}", "filter map"),
    ("{{ lipsum(n=100000, max=100000) }}", "undefined"),
    # many values within the limit each, held at once: 100 x 900,000 characters in a list
    ("{{ [" + ", ".join(["'x' * 900000"] * 100) + "]|length }}", "in all"),
]


@pytest.mark.parametrize(("template", "needle"), HOSTILE, ids=[t[:40] for t, _ in HOSTILE])
def test_hostile_templates_fail_fast_and_cleanly(template: str, needle: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, FAST, messages=MESSAGES, add_generation_prompt=True)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert re.search(needle, message) and "\n" not in message
    assert isinstance(info.value, ExitlmError)


def test_ordinary_templates_render() -> None:
    tok = byte_level_tokenizer()
    tok.chat_template = CHATML_TEMPLATE
    long = [{"role": "user", "content": "y" * 3_000_000}]  # long prompts are not "too big"
    assert tok.apply_chat_template(long).count("y") == 3_000_000
    hf_style = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] | trim }}"
                "{{ '\\n' }}{% endfor %}{{ messages | tojson }}{{ '%-5s|' % 'ab' }}"
                "{{ '{:>4}'.format(7) }}{{ ', '.join(['a', 'b']) }}{{ range(3) | list }}")
    out = render_chat_template(hf_style, messages=MESSAGES)
    assert out == 'USER: hi\n[{"role": "user", "content": "hi"}]ab   |   7a, b[0, 1, 2]'


def test_namespaces_print_short() -> None:
    """Namespaces nested in each other and filled afterwards would print 2**30 copies of a
    string that no check saw being made; they print as a short placeholder instead."""
    nested = ("{% set a = namespace(s='') %}{% set ns = namespace(n=a) %}"
              "{% for i in range(30) %}{% set ns.n = namespace(l=ns.n, r=ns.n) %}{% endfor %}"
              "{% set a.s = 'x' * 100000 %}{{ ns.n }} {{ ns.n|string|length }} {{ a.s|length }}")
    assert render_chat_template(nested, messages=MESSAGES) == "<namespace> 11 100000"


def test_bad_messages() -> None:
    tok = byte_level_tokenizer()
    with pytest.raises(ChatTemplateError, match="'role' and 'content'"):
        tok.apply_chat_template([{"text": "x"}])  # type: ignore[list-item]


@pytest.fixture(scope="module")
def hostile_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok: Tokenizer = byte_level_tokenizer()
    tok.chat_template = "{{ 'x' * 10000000000 }}"
    return save_model(tiny_model(), tmp_path_factory.mktemp("tpl") / "ckpt", tokenizer=tok)


def _set_template(checkpoint: Path, template: object) -> None:
    import json

    cfg = checkpoint / "tokenizer_config.json"
    meta = json.loads(cfg.read_text())
    meta["chat_template"] = template
    cfg.write_text(json.dumps(meta))


@pytest.mark.parametrize(("template", "needle"), [
    ("{{ 'x' * 10000000000 }}", "'*'"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "longer than"),
])
def test_generate_chat_with_a_hostile_checkpoint(template: str, needle: str,
                                                 hostile_checkpoint: Path) -> None:
    """``exitlm generate --chat`` with the checkpoint's template: one line, in a process
    limited to 3 GiB, well within the time limit."""
    _set_template(hostile_checkpoint, template)
    start = time.monotonic()
    res = cli_subprocess(["generate", "hi", "--chat", "--model", hostile_checkpoint,
                          "--max-new-tokens", "2"], timeout=90)
    assert_clean_error(res, "chat template", needle)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(("template", "needle"), [
    ("{{ ''.__class__ }}", "unsafe"),
    ("{% if %}", "syntax error"),
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_generate_chat_template_errors_in_process(template: str, needle: str,
                                                  hostile_checkpoint: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _set_template(hostile_checkpoint, template)
    res = cli(["generate", "hi", "--chat", "--model", hostile_checkpoint,
               "--max-new-tokens", "2"], capsys)
    assert_clean_error(res, "chat template", needle)


@pytest.mark.parametrize("value", [12, ["x", "y"], [{"name": "default"}], {"a": 1}, True])
def test_a_chat_template_that_is_not_text_is_one_line(value: object, hostile_checkpoint: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """A ``chat_template`` that is neither text nor Hugging Face's list of named templates
    is an error naming the file and the key, not a model silently without a template."""
    _set_template(hostile_checkpoint, value)  # type: ignore[arg-type]
    res = cli(["generate", "hi", "--chat", "--model", hostile_checkpoint,
               "--max-new-tokens", "2"], capsys)
    assert_clean_error(res, "tokenizer_config.json: chat_template: expected a string")


def test_named_templates_keep_working(hostile_checkpoint: Path) -> None:
    _set_template(hostile_checkpoint, [{"name": "tool_use", "template": "T"},  # type: ignore
                                       {"name": "default", "template": "D"}])
    assert Tokenizer.load(hostile_checkpoint).chat_template == "D"
    _set_template(hostile_checkpoint, [{"name": "tool_use", "template": "T"}])  # type: ignore
    assert Tokenizer.load(hostile_checkpoint).chat_template is None


@pytest.mark.parametrize("make", [
    lambda d: d / "chat_template.jinja",  # a file over the 1 MiB limit
    lambda d: Path("/dev/zero"),  # endless: a size check by stat() sees 0 bytes
])
def test_template_files_are_read_within_a_limit(make, tmp_path: Path, hostile_checkpoint: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = make(tmp_path)
    if path.parent == tmp_path:
        path.write_bytes(b"x" * (2**20 + 1))
    res = cli(["generate", "hi", "--chat", "--model", hostile_checkpoint, "--chat-template",
               path, "--max-new-tokens", "2"], capsys)
    assert_clean_error(res, f"--chat-template {path}: ", "a Jinja template")


def test_a_checkpoints_template_file_is_read_within_a_limit(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = save_model(tiny_model(), tmp_path / "m", tokenizer=byte_level_tokenizer())
    (model / "chat_template.jinja").write_bytes(b"x" * (2**20 + 1))
    with pytest.raises(ExitlmError, match=r"chat_template.jinja: larger than 1 MiB"):
        Tokenizer.load(model)
    (model / "chat_template.jinja").unlink()
    (model / "chat_template.jinja").symlink_to("/dev/zero")
    res = cli(["info", model], capsys)
    assert_clean_error(res, "chat_template.jinja: a character device")
