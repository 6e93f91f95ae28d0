"""PPD with branch worker processes vs thread PPD vs plain greedy decoding (one JSON).

Predictive Pipelined Decoding (PPD Sec. 3) overlaps the next token's first ``d - d_bar``
layers with the current token's last ones. This measures, in one run and interleaved prompt
by prompt (so drift on a shared machine hits every strategy alike), the decode latency per
token of:

* ``ar``: plain greedy decoding (the baseline and the time unit: one layer = AR's time per
  token / d);
* ``ppd-thread``: PPD with its branch on a Python thread (serialised by the GIL on CPU);
* ``ppd-process``: PPD with its branch in a spawned worker process, KV in shared memory
  (:mod:`exitlm.infer.executors.ppd_worker`);

every process at one thread. It reports the measured ``p_correct``, PPD Theorem 4.1's
predicted latency for it, exact match with AR, and the per-token hand-off cost (round trip of
an empty message to the worker) and the time the main process spent waiting for the worker.

    python benchmarks/ppd_processes.py /work/main/runs/scratch-layerskip/model
    python benchmarks/ppd_processes.py default --ppd-layer 20 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from _bench import note, one_line_errors, percentile


def run_one(engine: Any, ids: list[int], new: int) -> tuple[list[int], float, int, Any]:
    """One request to completion: tokens, decode seconds (after the first token), decoded
    tokens, statistics."""
    from exitlm.infer.options import SamplingOptions

    req = engine.submit(ids, SamplingOptions(max_new_tokens=new, ignore_eos=True))
    w0, c0 = time.perf_counter(), time.thread_time()
    engine.run()
    CPU_SHARE[0] += time.thread_time() - c0
    CPU_SHARE[1] += time.perf_counter() - w0
    toks = req.token_ids
    return toks, req.t_end - req.t_first, max(0, len(toks) - 1), req.seq.stats


CPU_SHARE = [0.0, 0.0]
"""CPU seconds and wall seconds of the main process over the requests run so far."""


def _echo(kind: str, conn: Any, flags: torch.Tensor, port: int, n: int) -> None:
    """The other end of :func:`handoff_latencies`: answer ``n`` round trips of one kind."""
    torch.set_num_threads(1)
    if kind == "pipe":
        for _ in range(n):
            conn.send(conn.recv())
    elif kind == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1,
                                world_size=2)
        t = torch.zeros(4, dtype=torch.long)
        for _ in range(n):
            dist.recv(t, 0)
            dist.send(t, 0)
        dist.destroy_process_group()
    else:  # shared-memory flags, busy-waiting on both sides
        f = flags.numpy()
        for i in range(1, n + 1):
            while f[0] != i:
                pass
            f[1] = i


def handoff_latencies(n: int = 2000) -> dict[str, dict[str, float]]:
    """Round trip of a tiny message between two processes (the per-token hand-off of process
    PPD: one fork message and one answer), for a pipe (what exitlm uses), torch.distributed
    gloo over 127.0.0.1, and busy-waiting on shared-memory flags; median and p90, in us."""
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    out: dict[str, dict[str, float]] = {}
    for kind in ("pipe", "gloo", "shm-spin"):
        a, b = ctx.Pipe()
        flags = torch.zeros(2, dtype=torch.long).share_memory_()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = ctx.Process(target=_echo, args=(kind, b, flags, port, n), daemon=True)
        proc.start()
        times = []
        try:
            if kind == "gloo":
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=0, world_size=2)
                t = torch.zeros(4, dtype=torch.long)
            f = flags.numpy()
            for i in range(1, n + 1):
                t0 = time.perf_counter()
                if kind == "pipe":
                    a.send(("fork", i, [1]))
                    a.recv()
                elif kind == "gloo":
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    f[0] = i
                    while f[1] != i:
                        pass
                times.append(time.perf_counter() - t0)
            if kind == "gloo":
                dist.destroy_process_group()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        out[kind] = {"median_us": percentile(times, 0.5) * 1e6,
                     "p90_us": percentile(times, 0.9) * 1e6}
    return out


def _time_calls(obj: Any, attr: str, label: str, acc: dict[str, float]) -> None:
    """Shadow method ``attr`` of ``obj`` by one that adds its thread CPU time to
    ``acc[label]`` (``delattr`` restores the method)."""
    fn = getattr(obj, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[label] = acc.get(label, 0.0) + time.thread_time() - c0

    setattr(obj, attr, timed)


def profile_steps(engines: dict[str, Any], prompts: list[list[int]], new: int
                  ) -> dict[str, dict[str, float]]:
    """Main-process CPU time per decoded token, by part of the step, for ``ar`` and
    ``ppd-process``: layers, final head, fork hand-off (send / receive) and the whole step
    (the rest: draft head, top-k, bookkeeping). Thread CPU time, so contention shows less."""
    out: dict[str, dict[str, float]] = {}
    for name in ("ar", "ppd-process"):
        engine = engines[name]
        model, dec = engine.model, engine.decoder
        acc: dict[str, float] = {}
        targets = [(model, "run_layers", "layers"), (model, "final_logits", "final_head"),
                   (dec, "step", "step")]
        if name == "ppd-process":
            targets += [(dec.worker, "fork", "fork_send"), (dec.worker, "join", "join")]
        for obj, attr, label in targets:
            _time_calls(obj, attr, label, acc)
        try:
            tokens = sum(run_one(engine, ids, new)[2] for ids in prompts)
        finally:
            for obj, attr, _ in targets:
                delattr(obj, attr)  # the instance attribute shadowed the method
        row = {k: v / max(tokens, 1) * 1e3 for k, v in acc.items()}
        row["other"] = row["step"] - sum(v for k, v in row.items() if k != "step")
        out[name] = {f"{k}_cpu_ms_per_token": v for k, v in row.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="/work/main/runs/scratch-layerskip/model",
                    help="model name or checkpoint directory (skipped when absent)")
    ap.add_argument("--ppd-layer", type=int, default=None, help="d_bar (default: d/2)")
    ap.add_argument("--ppd-k", type=int, default=1)
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="guess among the first N token ids (a cheaper early projection)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="keep the last N tokens of each prompt (byte-level models)")
    ap.add_argument("--handoff", action="store_true",
                    help="also compare hand-off mechanisms (pipe, gloo, shared-memory spin)")
    ap.add_argument("--profile", action="store_true",
                    help="also split the main process's CPU time per token by part of the step")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "int8", "int4"),
                    help="weights (as exitlm generate --dtype)")
    ap.add_argument("--layerskip-exits", action="store_true",
                    help="give a model without exits LayerSkip exits at every layer")
    args = ap.parse_args(argv)

    from exitlm.bench.run import builtin_prompts
    from exitlm.config import ExitConfig
    from exitlm.infer.cli import DTYPES
    from exitlm.infer.engine import Engine
    from exitlm.infer.ppd import PPDOptions, PPDStats
    from exitlm.io.loader import load_model
    from exitlm.plan import ppd_theory

    if "/" in args.model and not Path(args.model).exists():
        print(json.dumps({"skipped": f"model {args.model} not found"}))
        return 0
    torch.set_num_threads(1)
    exits = ExitConfig(every_layer=True) if args.layerskip_exits else None
    loaded = load_model(args.model, exits=exits, dtype=DTYPES[args.dtype])
    model, tok = loaded.model, loaded.tokenizer
    d = model.num_layers
    d_bar = args.ppd_layer or (d + 1) // 2
    texts = builtin_prompts(args.num_prompts)
    room = model.config.max_seq_len - args.max_new_tokens - 2
    prompts = [(tok.encode(t) if tok is not None else list(t.encode()))[-min(
        args.prompt_tokens, room):] for t in texts]

    variants = {
        "ar": ("ar", None),
        "ppd-thread": ("ppd", PPDOptions(ppd_layer=d_bar, ppd_k=args.ppd_k,
                                         draft_vocab=args.draft_vocab)),
        "ppd-process": ("ppd", PPDOptions(ppd_layer=d_bar, ppd_k=args.ppd_k,
                                          draft_vocab=args.draft_vocab,
                                          ppd_workers="process")),
    }
    engines = {name: Engine(model, tok, strat, opts, max_batch=1, threads=1)
               for name, (strat, opts) in variants.items()}
    out: dict[str, Any] = {"model": args.model, "d": d, "d_bar": d_bar, "k": args.ppd_k,
                           "draft_vocab": args.draft_vocab, "dtype": args.dtype,
                           "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
                           "repeats": args.repeats, "threads_per_process": 1,
                           "note": "2-core machine shared with other jobs"}
    try:
        note("warm-up (spawns the branch worker)")
        t0 = time.perf_counter()  # warm-up: spawns the worker, first-call allocations
        for e in engines.values():
            run_one(e, prompts[0], 4)
        out["warmup_s"] = time.perf_counter() - t0
        worker = engines["ppd-process"].decoder.branches.worker  # type: ignore[attr-defined]
        out["handoff_round_trip_us"] = worker.ping(300) * 1e6
        worker.waited_s, worker.branch_s, worker.joins = 0.0, 0.0, 0
        out["load_average_before"] = os.getloadavg()[0]
        secs = {n: 0.0 for n in engines}
        toks = {n: 0 for n in engines}
        exact = {n: True for n in engines}
        stats: dict[str, list[PPDStats]] = {n: [] for n in engines}
        per_token: dict[str, list[float]] = {n: [] for n in engines}
        cpu = {n: 0.0 for n in engines}
        wall = {n: 0.0 for n in engines}
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                note(f"repeat {rep + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)}")
                ref: list[int] | None = None
                for name, e in engines.items():
                    CPU_SHARE[:] = [0.0, 0.0]
                    got, s, n, st = run_one(e, ids, args.max_new_tokens)
                    cpu[name] += CPU_SHARE[0]
                    wall[name] += CPU_SHARE[1]
                    ref = got if ref is None else ref
                    exact[name] &= got == ref
                    secs[name] += s
                    toks[name] += n
                    per_token[name].append(s / max(n, 1))
                    if isinstance(st, PPDStats):
                        stats[name].append(st)
        ar_tok = secs["ar"] / toks["ar"]
        out["layer_ms"] = ar_tok / d * 1e3
        for name in engines:
            row: dict[str, Any] = {
                "ms_per_token": secs[name] / toks[name] * 1e3,
                "median_ms_per_token": percentile(per_token[name], 0.5) * 1e3,
                "speedup_vs_ar": ar_tok / (secs[name] / toks[name]),
                "exact_match_with_ar": exact[name],
                "main_process_core_share": cpu[name] / wall[name],
                # CPU time is what each process would take with a core of its own (it
                # includes the prefills; contention shows in wall time, not here)
                "main_cpu_ms_per_token": cpu[name] / toks[name] * 1e3,
            }
            if stats[name]:
                p = PPDStats.total(stats[name]).p_correct
                ell = toks[name] // len(stats[name])
                theory = ppd_theory.predict(d, d_bar, args.ppd_k, ell, p)
                pred = ar_tok * theory["latency_per_token_normalized"]
                row.update({"p_correct": p,
                            "theorem_4_1_ms_per_token": pred * 1e3,
                            "theorem_4_1_speedup": theory["speedup"],
                            "measured_over_predicted_latency": secs[name] / toks[name] / pred})
            out[name] = row
        out["ppd-process"]["main_wait_on_worker_ms_per_fork"] = (
            worker.waited_s / max(worker.joins, 1) * 1e3)
        out["ppd-process"]["worker_ms_per_fork"] = worker.branch_s / max(worker.joins, 1) * 1e3
        out["ppd-process"]["worker_core_share"] = worker.branch_cpu_s / max(worker.branch_s, 1e-9)
        out["ppd-process"]["worker_cpu_ms_per_fork"] = (
            worker.branch_cpu_s / max(worker.joins, 1) * 1e3)
        ar_cpu = out["ar"]["main_cpu_ms_per_token"]
        # process mode only: a thread's CPU time leaves out the time it waited for the GIL
        out["ppd-process"]["cpu_speedup_vs_ar"] = (
            ar_cpu / out["ppd-process"]["main_cpu_ms_per_token"])
        out["load_average_after"] = os.getloadavg()[0]
        if args.profile:
            note("profile of the main process's step (CPU time)")
            out["profile"] = profile_steps(engines, prompts, args.max_new_tokens)
    finally:
        for e in engines.values():
            e.close()
    if args.handoff:
        note("hand-off round trips: pipe, gloo, shared-memory spin")
        out["handoff_round_trip"] = handoff_latencies()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    with one_line_errors("ppd_processes"):
        sys.exit(main())
