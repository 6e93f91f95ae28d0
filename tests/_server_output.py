"""The output of an ``exitlm serve`` process read on a thread: its lines and the address of its
``listening on`` line (tests/serve/_serve_util.py's servers and tests/test_docs.py's)."""

from __future__ import annotations

import re
import subprocess
import threading


class ServerOutput:
    """Collects a server process's output (stdout, stderr merged) as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        self._proc = proc
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()  # the process ended without listening

    def wait_url(self, timeout: float) -> str:
        """The server's address once it listens ('' if it ended or ``timeout`` passed first)."""
        self._ready.wait(timeout)
        return self.url

    @property
    def text(self) -> str:
        return "\n".join(self.lines)
