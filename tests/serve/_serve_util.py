"""Helpers of the server tests: a seeded tiny early-exit checkpoint with a byte-level
tokenizer, a real ``exitlm serve`` process on 127.0.0.1 (any free port), plain HTTP calls,
and the single-request reference output computed in this process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import exitlm
from _byte_models import sharp_byte_model
from _server_output import ServerOutput
from exitlm.infer import SamplingOptions, generate
from exitlm.infer.cli import byte_level_tokenizer
from exitlm.io import load_model
from exitlm.io.native import save_native

SRC = Path(exitlm.__file__).resolve().parents[1]
"""The source tree these tests import: server processes import the same code."""
START_TIMEOUT = 90.0
API_KEY = "sesame"
"""The key of the servers started with ``--api-key``."""


def build_checkpoint(path: Path) -> Path:
    """A random 4-layer LayerSkip-style model (every layer exits through the final norm +
    head) over bytes, saved with a byte-level tokenizer. Large weights make its
    distributions sharp, so greedy ties are rare and confidence exits happen."""
    model = sharp_byte_model(4, 256)
    return save_native(model, path, byte_level_tokenizer())


class Reference:
    """What a request gets alone, from :func:`exitlm.infer.generate` in this process."""

    def __init__(self, checkpoint: Path) -> None:
        self.loaded = load_model(str(checkpoint))

    def run(self, prompt: str | list[int], strategy: str = "ar", *, chat: bool = False,
            **kwargs: Any) -> Any:
        options = {k: kwargs.pop(k) for k in list(kwargs)
                   if k not in SamplingOptions.__dataclass_fields__}
        sampling = SamplingOptions(**kwargs)
        return generate(self.loaded.model, self.loaded.tokenizer, prompt, strategy=strategy,
                        sampling=sampling, chat=chat, threads=1, **options).sequences[0]


class Server:
    """``python -m exitlm serve ARGS --port 0 --threads 1`` (or ``python SCRIPT ARGS``) with
    this checkout's sources; its combined output is collected in :attr:`lines`."""

    def __init__(self, args: list[str], *, script: Path | None = None) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH"))
                                            if p)
        env["OMP_NUM_THREADS"] = "1"
        head = [sys.executable, str(script)] if script else [sys.executable, "-m", "exitlm"]
        self.cmd = [*head, "serve", *args, "--host", "127.0.0.1", "--port", "0",
                    "--threads", "1"]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.output = ServerOutput(self.proc)

    @property
    def lines(self) -> list[str]:
        return self.output.lines

    @property
    def url(self) -> str:
        return self.output.url

    def wait_ready(self) -> Server:
        if not self.output.wait_url(START_TIMEOUT):
            self.proc.kill()
            raise RuntimeError(f"{self.cmd} did not start:\n{self.output.text}")
        return self

    @property
    def log(self) -> str:
        return self.output.text

    def client(self, **kwargs: Any) -> Any:
        """An ``openai.OpenAI`` client of this server (no retries: every answer is seen)."""
        import openai

        kwargs.setdefault("api_key", "unused")
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, **kwargs)

    def call(self, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One plain HTTP request; ``body`` as bytes is sent as it is. Returns the status and
        the JSON answer (text when it is not JSON)."""
        status, answer, _ = self.exchange(method, path, body, headers)
        return status, answer

    def exchange(self, method: str, path: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        """:meth:`call`, with the response's headers (lower-case names)."""
        u = urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        res = conn.getresponse()
        raw = res.read().decode()
        got = {k.lower(): v for k, v in res.getheaders()}
        conn.close()
        try:
            return res.status, json.loads(raw), got
        except ValueError:
            return res.status, raw, got

    def health(self) -> dict[str, Any]:
        status, body = self.call("GET", "/health")
        assert status == 200, body
        return body

    def metric(self, name: str) -> float:
        """The value of one series of ``/metrics`` (0 when absent)."""
        _, text = self.call("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > end:
                raise AssertionError(f"timed out; server log:\n{self.log}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_all(specs: dict[str, tuple[list[str], Path | None]]) -> dict[str, Server]:
    """Start several servers at once and wait until all listen."""
    servers = {name: Server(args, script=script) for name, (args, script) in specs.items()}
    try:
        for s in servers.values():
            s.wait_ready()
    except BaseException:
        for s in servers.values():
            s.proc.kill()
        raise
    return servers


def open_stream(server: Server, body: dict[str, Any], path: str = "/v1/completions"
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Start a streamed request and return its connection and response (read its lines)."""
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse_events(res: http.client.HTTPResponse) -> list[str]:
    """Every ``data:`` payload of a finished SSE response."""
    return [line[len("data: "):] for line in res.read().decode().splitlines()
            if line.startswith("data: ")]
