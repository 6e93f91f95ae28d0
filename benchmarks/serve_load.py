"""Load test of ``exitlm serve``: concurrent streaming clients against real server processes.

For every target - the default model (SmolLM2-135M-Instruct, greedy AR) and, with
``--layerskip PATH``, a LayerSkip-trained model (AR and self-speculative decoding) - one server
runs with continuous batching (``--max-batch``, default 8) and, in the same run, one with
``--max-batch 1`` (requests queue and are decoded one at a time). Each server gets, in turn,
1, 4 and 16 concurrent clients (``--concurrency``; at each level the batched server, then the
``--max-batch 1`` one, both started up front, so that load drifting during the run shifts both
alike); every client streams completions of mixed prompt lengths (short, medium and long
snippets of the Python standard library's source) until the level's requests
(``max(--min-requests, 2 x clients)``) are done. Reported per level: generated tokens / wall
time (throughput, and the batched server's over ``--max-batch 1``'s), requests / s, time to
first token p50/p99 and request latency p50/p99 (from the client's send), and for
self-speculative decoding the draft acceptance the server reports (``early_exit``).

With ``--llama-cpp PYTHON`` (a Python with ``llama-cpp-python[server]``), the same load goes to
llama.cpp's OpenAI server (``python -m llama_cpp.server``, which decodes one request at a
time; ``--interrupt_requests False`` so that a new request waits instead of cutting the running
one short) on the default model's GGUF, as a reference point. Every server process runs on
one thread (``--threads 1``; llama.cpp ``--n_threads 1``); the clients are plain HTTP in this
process. ``--tp N`` adds the default model served over N tensor-parallel processes (one thread
each) against one process with one thread and with N threads, all batched.

Prints one JSON object on stdout; progress and a table go to stderr.

    python benchmarks/serve_load.py --layerskip runs/scratch-layerskip/model
    python benchmarks/serve_load.py --llama-cpp /tmp/llamaenv/bin/python --concurrency 1,4
    python benchmarks/serve_load.py --tp 2 --only "tp"            # TP=2 vs one process
    python benchmarks/serve_load.py --quick                       # a smoke test
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from _bench import note, percentile

SRC = Path(__file__).resolve().parents[1] / "src"


# ----- prompts -------------------------------------------------------------------------------

def snippets(lengths: tuple[int, ...], count: int) -> list[str]:
    """``count`` prompts cycling through ``lengths`` (characters), cut at line starts from the
    standard library's source (files in sorted order: the same prompts on every machine with
    the same Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    out: list[str] = []
    for i in range(count):
        text = files[(7 * i) % len(files)].read_text(encoding="utf-8", errors="replace")
        text = text.encode("ascii", errors="ignore").decode()  # byte-level models: 1 char = 1 token
        start = text.find("\ndef ", (i * 977) % max(1, len(text) - 4000))
        start = max(0, start) + 1
        out.append(text[start:start + lengths[i % len(lengths)]])
    return out


# ----- servers ------------------------------------------------------------------------------------

@dataclass
class Target:
    """A server configuration to load."""

    name: str
    cmd: list[str]
    model: str
    prompt_chars: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    ready: str = r"listening on (http://\S+)"
    port: int = 0


class ServerProcess:
    """Start ``target.cmd``, wait until it listens, stop it with SIGINT."""

    def __init__(self, target: Target, timeout: float = 300.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, (str(SRC),
                                                           os.environ.get("PYTHONPATH"))))}
        self.proc = subprocess.Popen(target.cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.url = ""
        found = threading.Event()
        pattern = re.compile(target.ready)

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = pattern.search(line)
                if m and not self.url:
                    self.url = m.group(1) if m.groups() else f"http://127.0.0.1:{target.port}"
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(timeout) or not self.url:
            self.proc.kill()
            raise RuntimeError(f"{target.cmd} did not start:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----- one streamed request ---------------------------------------------------------------------

@dataclass
class Sample:
    ttft: float
    latency: float
    tokens: int
    early_exit: dict[str, Any] | None


def stream_once(url: str, body: dict[str, Any]) -> Sample:
    """POST a streamed completion; time its first chunk and its end."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        raise RuntimeError(f"HTTP {res.status}: {res.read()[:300]!r}")
    ttft, tokens, chunks, summary = 0.0, 0, 0, None
    while True:
        line = res.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("choices") and not ttft:
            ttft = time.perf_counter() - t0
        chunks += any(c.get("finish_reason") is None for c in chunk.get("choices", ()))
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        summary = chunk.get("early_exit", summary)
    latency = time.perf_counter() - t0
    conn.close()
    # a server that reports no usage in streams (llama-cpp-python): one chunk per token
    return Sample(ttft, latency, tokens or chunks, summary)


def run_level(url: str, target: Target, prompts: list[str], clients: int, max_tokens: int
              ) -> dict[str, Any]:
    """``len(prompts)`` requests from ``clients`` concurrent clients."""
    def body(prompt: str) -> dict[str, Any]:
        return {"model": target.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                **target.extra}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        samples = list(pool.map(lambda p: stream_once(url, body(p)), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    out: dict[str, Any] = {
        "clients": clients, "requests": len(samples), "wall_s": round(wall, 3),
        "generated_tokens": tokens, "throughput_tok_s": round(tokens / wall, 2),
        "requests_per_s": round(len(samples) / wall, 3),
        "ttft_p50_s": round(percentile([s.ttft for s in samples], 0.5), 3),
        "ttft_p99_s": round(percentile([s.ttft for s in samples], 0.99), 3),
        "latency_p50_s": round(percentile([s.latency for s in samples], 0.5), 3),
        "latency_p99_s": round(percentile([s.latency for s in samples], 0.99), 3),
    }
    stats = [s.early_exit["stats"] for s in samples if s.early_exit and s.early_exit["stats"]]
    if stats and "drafted" in stats[0]:
        drafted = sum(x["drafted"] for x in stats)
        out["draft_acceptance"] = round(sum(x["accepted"] for x in stats) / drafted, 3) \
            if drafted else 0.0
    return out


def _level_note(name: str, r: dict[str, Any]) -> None:
    note(f"[{name}] {r['clients']:>2} clients: {r['throughput_tok_s']:7.1f} tok/s, "
         f"TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, latency p50 "
         f"{r['latency_p50_s']:.2f}s p99 {r['latency_p99_s']:.2f}s"
         + (f", acceptance {r['draft_acceptance']:.0%}" if "draft_acceptance" in r else ""))


def load_group(group: list[Target], levels: list[int], min_requests: int, max_tokens: int,
               ratios: tuple[str, ...] = ("throughput_vs_max_batch_1",)
               ) -> list[dict[str, Any]]:
    """Load the servers of ``group`` (one configuration with different ``--max-batch``) level
    by level, one server after the other at each level: the servers wait idle while another
    one is measured, and a machine whose load drifts during the run shifts every server's
    figures of a level alike, so their ratios hold."""
    servers: list[ServerProcess] = []
    started: list[float] = []
    results: list[list[dict[str, Any]]] = [[] for _ in group]
    try:
        for target in group:
            note(f"[{target.name}] starting: {' '.join(target.cmd[1:])}")
            t0 = time.perf_counter()
            servers.append(ServerProcess(target))
            started.append(time.perf_counter() - t0)
            stream_once(servers[-1].url, {"model": target.model, "prompt": "warm up",
                                          "max_tokens": 4, "temperature": 0, "stream": True,
                                          **target.extra})
        for c in levels:
            for target, server, out in zip(group, servers, results, strict=True):
                prompts = snippets(target.prompt_chars, max(min_requests, 2 * c))
                out.append(run_level(server.url, target, prompts, c, max_tokens))
                _level_note(target.name, out[-1])
    finally:
        for server in servers:
            server.stop()
    # the first server's throughput over each other's, per level (named by ``ratios``)
    for name, other in zip(ratios, results[1:], strict=False):
        for first, second in zip(results[0], other, strict=True):
            first[name] = round(first["throughput_tok_s"] / second["throughput_tok_s"], 2)
    return [{"name": t.name, "command": t.cmd[1:], "startup_s": round(s, 2), "levels": r}
            for t, s, r in zip(group, started, results, strict=True)]


# ----- the run ------------------------------------------------------------------------------

def targets(args: argparse.Namespace) -> list[list[Target]]:
    """The server groups to load: each configuration batched and with ``--max-batch 1``."""
    exitlm = [sys.executable, "-m", "exitlm", "serve"]
    common = ["--threads", "1", "--port", "0", "--log-level", "warning"]
    long_prompts = (60, 300, 1200)
    out: list[list[Target]] = []
    # (label, model, strategy args, prompt lengths, extra body)
    configs: list[tuple[str, str, list[str], tuple[int, ...], dict[str, Any]]] = [
        ("default/ar", "default", [], long_prompts, {"ignore_eos": True})]
    if args.layerskip:
        short = (20, 60, 150)  # a 256-token context: prompt + max_tokens must fit
        configs += [("layerskip/ar", args.layerskip, [], short, {"ignore_eos": True}),
                    ("layerskip/self-spec", args.layerskip,
                     ["--strategy", "self-spec", *args.self_spec_args.split()], short,
                     {"ignore_eos": True})]
    for label, model, strat, lengths, extra in configs:
        out.append([Target(f"{label} max-batch {batch}",
                           [*exitlm, model, *strat, "--max-batch", str(batch), *common],
                           model, lengths, extra) for batch in (args.max_batch, 1)])
    if args.tp > 1:  # the same server over --tp processes (one thread each) and in one
        # process with one thread and with --tp threads (the same cores used the other way)
        base = [*exitlm, "default", "--max-batch", str(args.max_batch), "--port", "0",
                "--log-level", "warning"]
        out.append([
            Target(f"default/ar tp {args.tp} max-batch {args.max_batch}",
                   [*base, "--tp", str(args.tp), "--threads", "1"], "default", long_prompts,
                   {"ignore_eos": True}),
            Target(f"default/ar tp 1 max-batch {args.max_batch}",
                   [*base, "--threads", "1"], "default", long_prompts, {"ignore_eos": True}),
            Target(f"default/ar tp 1 threads {args.tp} max-batch {args.max_batch}",
                   [*base, "--threads", str(args.tp)], "default", long_prompts,
                   {"ignore_eos": True})])
    if args.llama_cpp:
        from exitlm.io.default_model import default_gguf_path
        from exitlm.io.loader import load_model

        eos = load_model("default").tokenizer.eos_token_ids  # type: ignore[union-attr]
        port = _free_port()
        gguf = str(default_gguf_path())
        out.append([Target(
            "llama.cpp (llama-cpp-python server)",
            [args.llama_cpp, "-m", "llama_cpp.server", "--model", gguf, "--n_threads", "1",
             "--n_threads_batch", "1", "--n_ctx", "2048", "--interrupt_requests", "False",
             "--host", "127.0.0.1",
             "--port", str(port)],
            gguf, long_prompts, {"logit_bias": {str(t): -100 for t in eos}},
            ready=r"Uvicorn running on", port=port)])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layerskip", default=None,
                   help="a LayerSkip-trained exitlm checkpoint (e.g. runs/scratch-layerskip/"
                        "model): served with AR and self-speculative decoding")
    p.add_argument("--self-spec-args", default="--num-speculations 3",
                   help="strategy flags of the LayerSkip self-spec server")
    p.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level at least")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    p.add_argument("--max-batch", type=int, default=8, help="the batched server's max batch")
    p.add_argument("--llama-cpp", default=None, metavar="PYTHON",
                   help="a Python with llama-cpp-python[server]: adds llama.cpp's server on "
                        "the same GGUF")
    p.add_argument("--tp", type=int, default=1,
                   help="also serve the default model over this many tensor-parallel "
                        "processes (one thread each) next to one process")
    p.add_argument("--only", default=None, help="run only targets whose name contains this")
    p.add_argument("--quick", action="store_true", help="1 and 2 clients, 4 tokens")
    args = p.parse_args()
    if args.quick:
        args.concurrency, args.min_requests, args.max_tokens = "1,2", 2, 4
    levels = [int(x) for x in args.concurrency.split(",")]
    runs = []
    for group in targets(args):
        group = [t for t in group if args.only is None or args.only in t.name]
        if group:
            tp = " tp " in group[0].name
            ratios = (("throughput_vs_one_process", "throughput_vs_one_process_threaded")
                      if tp else ("throughput_vs_max_batch_1",))
            runs += load_group(group, levels, args.min_requests, args.max_tokens, ratios)
    print(json.dumps({
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "threads_per_server": 1, "max_tokens": args.max_tokens, "concurrency": levels,
        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
