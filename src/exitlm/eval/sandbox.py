"""Run an untrusted program (model-written code) in an isolated process.

    from exitlm.eval.sandbox import Limits, run_python
    out = run_python("print(sum(range(10)))", timeout=5.0, limits=Limits(memory_mb=512))
    out.status, out.stdout  # ("ok", "45\\n")

Every run gets a fresh temporary directory - the program's working directory and the only
place it can write - and an empty environment. The isolation is Linux's own, needs no root and
no package: a **Landlock** domain (Linux >= 5.13) lets the program read and execute only the
Python installation and the system directories (``/usr``, ``/lib``...), never the user's files,
home, ``/tmp`` or ``/proc``; a **seccomp** filter refuses ``socket()`` (no network, no Unix
socket to another service), io_uring and ``kill(-1)``; where unprivileged **user namespaces**
are allowed the program also runs in new user, network and PID namespaces (no capability
outside, no network device, and every process it starts dies with it). It runs under resource
limits (CPU time, address space, processes, file size, open files) in a session of its own
that is killed at the time limit. All of it is inherited by the program's children, so a shell
started through ``os.system``, ``subprocess`` or ``ctypes.CDLL(None).system`` is confined too.
The mechanics live in ``sandbox_launcher.py`` (a script, started with ``python -I -S -B``).

Where the kernel lacks Landlock or seccomp, :func:`run_python` raises
:class:`SandboxUnavailable` unless the caller passes ``isolate=False`` (then only the empty
environment, the temporary directory and the resource limits apply).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from exitlm.errors import ExitlmError

_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
_SETUP_FAILED = 125
_OUTPUT_CAP = 64 * 1024
"""At most this many characters of each of stdout and stderr come back (the end of each)."""


class SandboxUnavailable(ExitlmError):
    """This system cannot isolate untrusted code (the message says what is missing)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed program (each applies to every process it starts)."""

    cpu_s: float = 10.0
    memory_mb: int = 2048
    processes: int = 32
    file_mb: int = 16
    open_files: int = 64


@dataclass
class Outcome:
    """What a sandboxed program did.

    ``status``: ``"ok"`` (exit status 0), ``"error"`` (another exit status), ``"killed"`` (a
    signal: ``returncode`` is 128 + its number; a resource limit ends a program this way) or
    ``"timeout"`` (still running at the time limit; it was killed).
    """

    status: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _read_paths() -> tuple[list[str], list[str], list[str]]:
    """Directories the program may read and execute, files it may read, files it may write."""
    home = Path.home().resolve()
    python = {sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable))}
    dirs = []
    for p in [*sorted(python), "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]:
        real = Path(p).resolve()
        if real == Path("/") or real in home.parents or real == home:
            continue  # never the whole file system or the user's home
        dirs.append(str(real))
    files = ["/etc/ld.so.cache", "/etc/localtime", "/dev/zero", "/dev/urandom", "/dev/random"]
    return dirs, files, ["/dev/null"]


def _config(work: str, argv: list[str], limits: Limits, isolate: bool) -> str:
    read, read_files, write_files = _read_paths()
    return json.dumps({"dir": work, "argv": argv, "limits": asdict(limits), "isolate": isolate,
                       "read": read, "read_files": read_files, "write_files": write_files})


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - _OUTPUT_CAP))
        return f.read().decode("utf-8", "replace")


def _launch(work: str, argv: list[str], timeout: float, limits: Limits,
            isolate: bool) -> Outcome:
    """Start the launcher on ``argv``; wait at most ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="exitlm-sandbox-io-") as io_dir:
        out_p, err_p = Path(io_dir) / "stdout", Path(io_dir) / "stderr"
        with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(_LAUNCHER),
                 _config(work, argv, limits, isolate)],
                stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, cwd=work, env={},
                start_new_session=True, close_fds=True)
            try:
                code = proc.wait(timeout)
                status = "ok" if code == 0 else "killed" if code > 128 else "error"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole session, finished or not
                code = proc.wait()
            seconds = time.monotonic() - t0
        return Outcome(status, code, _tail(out_p), _tail(err_p), seconds)


def run_python(source: str, *, timeout: float = 10.0, limits: Limits | None = None,
               isolate: bool = True) -> Outcome:
    """Run ``source`` as ``program.py`` with this Python (``-I -S -B``: no site-packages, no
    environment variables) in a sandbox, for at most ``timeout`` seconds of wall time.

    Raises:
        SandboxUnavailable: ``isolate`` and this system cannot isolate the program (see
            :func:`unavailable_reason`); ``isolate=False`` runs it without isolation.
    """
    limits = limits or Limits(cpu_s=timeout)
    if isolate:
        reason = unavailable_reason()
        if reason:
            raise SandboxUnavailable(f"cannot isolate untrusted code here: {reason}")
    work = tempfile.mkdtemp(prefix="exitlm-sandbox-")
    try:
        Path(work, "program.py").write_text(source, encoding="utf-8")
        argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", "program.py"]
        out = _launch(work, argv, timeout, limits, isolate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if out.returncode == _SETUP_FAILED and "exitlm-sandbox:" in out.stderr:
        line = [x for x in out.stderr.splitlines() if x.startswith("exitlm-sandbox:")][-1]
        raise SandboxUnavailable(f"the sandbox could not start: {line.split(':', 1)[1].strip()}")
    return out


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why this system cannot isolate untrusted code, or ``None`` when it can (checked once,
    by running a probe program in the sandbox)."""
    if sys.platform != "linux":
        return f"the sandbox needs Linux (Landlock and seccomp); this is {sys.platform}"
    try:
        abi = subprocess.run([sys.executable, "-I", "-S", "-B", str(_LAUNCHER),
                              "--landlock-abi"], capture_output=True, text=True, env={},
                             timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the sandbox launcher did not run ({err})"
    if abi in ("", "0"):
        return "the kernel has no Landlock (Linux >= 5.13 with landlock in the LSM list)"
    work = tempfile.mkdtemp(prefix="exitlm-sandbox-")
    try:
        Path(work, "program.py").write_text("print('ok')\n", encoding="utf-8")
        argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", "program.py"]
        out = _launch(work, argv, 60.0, Limits(), True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if out.stdout.strip() != "ok":
        why = [x for x in out.stderr.splitlines() if x.strip()][-1:] or [out.status]
        return f"a probe program failed in the sandbox: {why[0].strip()}"
    return None
