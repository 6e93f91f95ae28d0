"""TeraPipe DP planning time for L = 2048 tokens and K = 48 stages (TeraPipe Sec. 3.3).

The per-stage cost follows TeraPipe Eq. 9 with a GPU-like shape (TeraPipe Fig. 3): t(i, 0)
is flat until the device saturates, then linear in i; the context overhead is the fitted
bilinear t_ctx. Prints JSON: the DP's wall time (exact branch-and-bound, and the paper's
enumeration with an epsilon), its latency and the best uniform slicing's latency.

    python benchmarks/plan_terapipe_dp.py [--seq-len 2048] [--stages 48]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from exitlm.plan.terapipe import PerfModel, best_uniform, plan_slices


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--stages", type=int, default=48)
    ap.add_argument("--epsilon", type=float, default=0.002,
                    help="epsilon of the enumerate run (time units: ms)")
    args = ap.parse_args()
    n = args.seq_len
    i = np.arange(1, n + 1)
    # ms per stage: ~0.25 ms floor up to 128 tokens, then ~2 us / token
    t0 = np.maximum(0.25, 0.002 * i) + 0.05
    pm = PerfModel(tuple(float(x) for x in t0), (0.01, 1e-4, 2e-5, 2.5e-6))
    t = time.perf_counter()
    cost = pm.matrix()
    t_matrix = time.perf_counter() - t
    out: dict[str, object] = {"seq_len": n, "stages": args.stages, "matrix_seconds": t_matrix}
    for method, eps in (("bisect", 0.0), ("enumerate", args.epsilon)):
        t = time.perf_counter()
        res = plan_slices(cost, args.stages, epsilon=eps, method=method)
        out[method] = {"seconds": time.perf_counter() - t, "epsilon": eps,
                       "latency": res["latency"], "num_slices": res["num_slices"],
                       "dp_evaluations": res["dp_evaluations"]}
    t = time.perf_counter()
    uni = best_uniform(cost, args.stages)
    out["best_uniform"] = {"seconds": time.perf_counter() - t, "latency": uni["latency"],
                           "num_slices": uni["num_slices"]}
    out["uniform_over_dp"] = uni["latency"] / out["bisect"]["latency"]  # type: ignore[index]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
