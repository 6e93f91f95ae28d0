"""The installed native builds against the developer ``-march=native`` build, in one run.

Runs ``benchmarks/gemv_kernels.py`` and ``benchmarks/decode_vs_llamacpp.py`` once per build
and round, each in a fresh process with ``EXITLM_NATIVE`` naming the build (``build``: the
developer build compiled with ``-march=native``; ``auto``: the installed build the loader
picks for this CPU; ``avx2``/``avx512``/``baseline``: that installed build), alternating the
builds within each round so that background load hits all of them. Reports, per build, the
best GB/s of every product shape and row count and exitlm's decode tokens/s per precision
(llama.cpp's figure from the same processes alongside), and the ratio of each to the
developer build. Prints one JSON object on stdout; progress on stderr.

    python benchmarks/native_builds.py                          # build, auto, avx2; 2 rounds
    python benchmarks/native_builds.py --modes build,auto --rounds 3 --precisions fp32,int8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _bench import note

HERE = Path(__file__).resolve().parent


def _run(script: str, args: list[str], mode: str) -> dict[str, Any]:
    env = {**os.environ, "EXITLM_NATIVE": mode, "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True,
                          text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{script} under EXITLM_NATIVE={mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def _gemv_best(report: dict[str, Any]) -> dict[str, float]:
    """``shape/M=m/kernel -> best GB/s`` of one gemv_kernels.py report (native kernels)."""
    out = {}
    for shape, rows in report["shapes"].items():
        for m, kernels in rows.items():
            if not m.startswith("M="):
                continue
            for kernel, fig in kernels.items():
                if kernel.startswith(("f32", "f16", "q8", "q4")) and "best_GBps" in fig:
                    out[f"{shape}/{m}/{kernel}"] = fig["best_GBps"]
    return out


def _decode(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``precision -> {exitlm, llama.cpp}`` decode tokens/s of one decode_vs_llamacpp report."""
    out = {}
    for precision, fig in report.get("results", {}).items():
        ex, ll = fig.get("exitlm", {}), fig.get("llamacpp", {})
        if "decode_tokens_per_s" in ex:
            out[precision] = {"exitlm": ex["decode_tokens_per_s"],
                              "llama.cpp": ll.get("decode_tokens_per_s")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="build,auto,avx2",
                    help="EXITLM_NATIVE values to compare; the first is the reference")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="qkv,gate_up,down")
    ap.add_argument("--precisions", default="fp32,fp16,int8,q4_0,q4_1")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    modes = args.modes.split(",")
    gemv: dict[str, dict[str, float]] = {m: {} for m in modes}
    decode: dict[str, dict[str, dict[str, float]]] = {m: {} for m in modes}
    kernels: dict[str, Any] = {}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else reversed(modes):
            note(f"round {r + 1}: gemv_kernels under EXITLM_NATIVE={mode}")
            rep = _run("gemv_kernels.py", ["--quick", "--repeats", "5", "--shapes", args.shapes],
                       mode)
            kernels[mode] = rep.get("kernels", rep.get("library"))
            for key, v in _gemv_best(rep).items():
                gemv[mode][key] = max(v, gemv[mode].get(key, 0.0))
            note(f"round {r + 1}: decode_vs_llamacpp under EXITLM_NATIVE={mode}")
            rep = _run("decode_vs_llamacpp.py", ["--precisions", args.precisions, "--repeats",
                                                 "1", "--new-tokens", str(args.new_tokens)],
                       mode)
            for p, fig in _decode(rep).items():
                best = decode[mode].setdefault(p, {"exitlm": 0.0, "llama.cpp": 0.0})
                best["exitlm"] = max(best["exitlm"], fig["exitlm"])
                best["llama.cpp"] = max(best["llama.cpp"], fig["llama.cpp"] or 0.0)
    ref = modes[0]
    summary: dict[str, Any] = {}
    for mode in modes[1:]:
        ratios = [gemv[mode][k] / gemv[ref][k] for k in gemv[ref] if gemv[ref][k] > 0
                  and k in gemv[mode]]
        ratios.sort()
        summary[mode] = {
            "gemv_best_GBps_ratio_median": round(ratios[len(ratios) // 2], 3) if ratios else None,
            "gemv_ratio_min": round(ratios[0], 3) if ratios else None,
            "decode_ratio": {p: round(fig["exitlm"] / decode[ref][p]["exitlm"], 3)
                             for p, fig in decode[mode].items() if p in decode[ref]},
        }
    print(json.dumps({"reference": ref, "rounds": args.rounds, "kernels": kernels,
                      "summary_vs_reference": summary, "gemv_best_GBps": gemv,
                      "decode_tokens_per_s": decode}, indent=1))


if __name__ == "__main__":
    main()
