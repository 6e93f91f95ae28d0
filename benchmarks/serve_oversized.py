"""``exitlm serve`` under oversized prompts: refusal time, /health latency meanwhile, and the
server's resident memory (RSS) before, after each phase and after a short rest.

One server process (``--model``, default: the embedded SmolLM2-135M-Instruct, one thread) gets,
one phase at a time, while a thread probes ``/health`` every 20 ms:

* ``body-30MiB``: a 30 MiB prompt (beyond ``--max-request-bytes``: refused by its length);
* ``bytes-3MiB``: 3 MiB prompts (parsed, refused by the byte bound without tokenizing);
* ``tokens-600KB``: prompts of ordinary text just inside the byte bound (tokenized on the
  worker thread, then refused for their token count) - the costliest refusal there is;
* ``valid``: short completions (the server still serves).

Linux only (RSS from ``/proc``). ``--src DIR`` runs another checkout's sources (to compare).
Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/serve_oversized.py
    python benchmarks/serve_oversized.py --repeat 5 --src /path/to/other/checkout/src
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MIB = 2**20


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post(port: int, path: str, body: bytes, timeout: float = 600) -> tuple[int, float, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        text = res.read().decode(errors="replace")
        return res.status, time.perf_counter() - t0, text[:200]
    except OSError as err:
        return 0, time.perf_counter() - t0, repr(err)
    finally:
        conn.close()


class Probe(threading.Thread):
    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.latencies, self.stop = port, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            self.latencies.append(time.perf_counter() - t0)
            conn.close()
            time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": args.src, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "exitlm", "serve", args.model, "--port", "0",
                             "--threads", "1", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line.rstrip(), file=sys.stderr)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    text = Path(json.__file__).read_text()  # ordinary text: about 4 bytes per token
    phases = {
        "body-30MiB": json.dumps({"prompt": "x" * (30 * MIB), "max_tokens": 1}).encode(),
        "bytes-3MiB": json.dumps({"prompt": "x" * (3 * MIB), "max_tokens": 1}).encode(),
        "tokens-600KB": json.dumps({"prompt": (text * 200)[:600_000], "max_tokens": 1}).encode(),
        "valid": json.dumps({"prompt": "def fib(n):", "max_tokens": 8}).encode(),
    }
    out: dict[str, Any] = {"src": args.src, "model": args.model, "rss_start_mib": rss_mib(proc.pid)}
    try:
        for name, body in phases.items():
            probe = Probe(port)
            probe.start()
            answers = [post(port, "/v1/completions", body) for _ in range(args.repeat)]
            probe.stop.set()
            probe.join()
            out[name] = {"status": sorted({a[0] for a in answers}),
                         "seconds_max": round(max(a[1] for a in answers), 3),
                         "health_max_ms": round(1000 * max(probe.latencies), 1),
                         "health_probes": len(probe.latencies),
                         "rss_after_mib": round(rss_mib(proc.pid), 1),
                         "answer": answers[-1][2][:160]}
            print(name, out[name], file=sys.stderr)
        time.sleep(2)
        out["rss_rested_mib"] = round(rss_mib(proc.pid), 1)
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
