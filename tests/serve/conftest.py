"""Server processes shared by the server tests, on a seeded tiny checkpoint: one per strategy
and one with a failing strategy and room for one request, all started together the first
time a test asks for one and stopped (SIGINT) at the end of the session."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from _serve_util import API_KEY, Reference, Server, build_checkpoint, start_all

HERE = Path(__file__).resolve().parent
SPECS: dict[str, tuple[list[str], Path | None]] = {
    "ar": (["--max-batch", "8"], None),
    # prompts over 5 tokens prefilled in parts, between the others' steps
    "early-exit": (["--strategy", "early-exit", "--max-batch", "8", "--prefill-chunk", "5"],
                   None),
    "self-spec": (["--strategy", "self-spec", "--exit-layer", "2", "--max-batch", "8",
                   "--prefill-chunk", "5"], None),
    "ppd": (["--strategy", "ppd", "--ppd-layer", "2", "--ppd-k", "2", "--no-parallel",
             "--api-key", API_KEY], None),
    # small request limits (tests/serve/test_serve_limits.py)
    "limits": (["--max-batch", "2", "--max-queue", "8", "--max-prompts", "4",
                "--max-request-bytes", "65536", "--max-prompt-tokens", "64",
                "--max-completion-tokens", "8"], None),
    # a short deadline for sending a request, and few connections
    "guarded": (["--request-timeout", "5", "--max-connections", "4"], None),
    # one row, one queued request; decoding steps fail for prompts containing "FAIL"
    "faulty": (["--strategy", "faulty", "--max-batch", "1", "--max-queue", "1",
                "--drain-timeout", "20"], HERE / "_faulty_serve.py"),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="session")
def reference(checkpoint: Path) -> Reference:
    return Reference(checkpoint)


def _spec(checkpoint: Path, name: str) -> tuple[list[str], Path | None]:
    args, script = SPECS[name]
    return [str(checkpoint), "--served-model-name", "tiny", *args], script


@pytest.fixture(scope="session")
def servers(checkpoint: Path) -> Iterator[dict[str, Server]]:
    """The servers of :data:`SPECS`, by name."""
    running = start_all({name: _spec(checkpoint, name) for name in SPECS})
    yield running
    for s in running.values():  # all drain at once
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGINT)
    for s in running.values():
        s.stop()


@pytest.fixture
def ar(servers: dict[str, Server]) -> Server:
    return servers["ar"]


@pytest.fixture
def faulty(servers: dict[str, Server], checkpoint: Path) -> Server:
    """The one-row server with the failing strategy (restarted if a test stopped it)."""
    if servers["faulty"].proc.poll() is not None:
        servers["faulty"] = start_all({"faulty": _spec(checkpoint, "faulty")})["faulty"]
    return servers["faulty"]
