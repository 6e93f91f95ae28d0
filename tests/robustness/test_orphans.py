"""``kill -9`` of a command whose worker processes exitlm started itself: the workers end by
themselves, during start-up too, and leave no files behind (no ``pytorch-errorfile-*``, no
``pymp-*``) - each command runs with ``TMPDIR`` in the test's own directory, so only what it
left there is counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _robust_util import ON_LINUX_SYS, ROOT, tiny_checkpoint

pytestmark = pytest.mark.skipif(not ON_LINUX_SYS, reason="reads processes from /proc")

GONE_S = 90.0
"""How long killed commands' workers may take to end (they take a second or two; unfixed,
they waited out a 300 s rendezvous)."""
START_S = 180.0
"""How long a command may take to start its worker (or a server to listen)."""


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid`` -> their command lines."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_text()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _start(args: list[str], tmp: Path, log: Path) -> subprocess.Popen[bytes]:
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=str(ROOT))


def _wait_for(what: str, done: object, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while not done():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what} never happened (status {proc.poll()}):\n{log.read_text()}")
        time.sleep(0.02)


def _kill_and_watch(proc: subprocess.Popen[bytes], tmp: Path) -> None:
    """SIGKILL ``proc``; every process it had started must end within :data:`GONE_S`
    (killed if not, after the assertion) and leave nothing in ``tmp``."""
    kids = _children(proc.pid)
    assert any("spawn_main" in c for c in kids.values()), kids
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_S
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = {k: c.replace("\0", " ")[:120] for k, c in kids.items() if _alive(k)}
    for k in alive:
        os.kill(k, signal.SIGKILL)
    assert not alive, f"still running {GONE_S:g} s after their parent was killed: {alive}"
    time.sleep(0.5)  # the last ones' exits are done writing
    left = sorted(p.name for p in tmp.iterdir()
                  if p.name.startswith(("pytorch-errorfile-", "pymp-")))
    assert not left, f"left behind in TMPDIR: {left}"


@pytest.mark.parametrize("how", [["--tp", "2"], ["--strategy", "early-exit", "--kv", "pipeline"]],
                         ids=["tp", "pipeline"])
def test_a_parent_killed_during_worker_start_up_takes_its_workers(tmp_path: Path,
                                                                  how: list[str]) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    log = tmp_path / "log"
    proc = _start(["-m", "exitlm", "generate", "hi", "--model", str(model), *how,
                   "--max-new-tokens", "2"], tmp_path / "tmp", log)
    # the worker exists, and is still importing torch / joining the rendezvous
    _wait_for("a worker start", lambda: any("spawn_main" in c
                                            for c in _children(proc.pid).values()), proc, log)
    _kill_and_watch(proc, tmp_path / "tmp")


def test_a_tensor_parallel_server_killed_mid_run_leaves_no_error_file(tmp_path: Path) -> None:
    model = tiny_checkpoint(tmp_path / "m")
    log = tmp_path / "log"
    proc = _start(["-m", "exitlm", "serve", str(model), "--tp", "2", "--host", "127.0.0.1",
                   "--port", "0", "--threads", "1"], tmp_path / "tmp", log)
    _wait_for("the server listening", lambda: "http://127.0.0.1:" in log.read_text(), proc,
              log)
    _kill_and_watch(proc, tmp_path / "tmp")


_PPD_PARENT = textwrap.dedent("""
    import time
    import torch
    from exitlm.comm.lifeline import parent_tempdir
    from exitlm.config import ExitConfig, preset
    from exitlm.infer.executors.ppd_worker import BranchCache, BranchWorker
    from exitlm.model.transformer import EarlyExitLM

    if __name__ == "__main__":
        model = EarlyExitLM(preset("debug", dim=32, num_layers=2, num_heads=2, num_kv_heads=2,
                                   hidden_dim=64, exits=ExitConfig(layers=(1,)))).eval()
        worker = BranchWorker(model, 1)
        worker.attach(BranchCache(1, 1, 16, model.config, torch.float32))
        print("attached", parent_tempdir(), flush=True)
        time.sleep(600)
""")


def test_a_ppd_parent_killed_after_attaching_leaves_no_temporary_directory(
        tmp_path: Path) -> None:
    """Handing the shared cache to the worker made the parent's ``pymp-*`` directory (a
    socket there passes the file descriptors); the worker removes it when the parent dies."""
    script = tmp_path / "parent.py"
    script.write_text(_PPD_PARENT)
    log = tmp_path / "log"
    proc = _start([str(script)], tmp_path / "tmp", log)
    _wait_for("the attach", lambda: "attached" in log.read_text(), proc, log)
    made = Path(log.read_text().split("attached", 1)[1].split()[0])
    assert made.parent == tmp_path / "tmp" and made.is_dir(), made
    _kill_and_watch(proc, tmp_path / "tmp")
