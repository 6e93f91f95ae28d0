"""Training throughput (tokens/s) without exits, with EE-LLM exits, and with the LayerSkip recipe.

One process, one model size, the same random batches for every variant; each step is a full
optimizer step (forward, backward, AdamW). Variants, timed in interleaved rounds (shared
machines are noisy; the median round is reported):

* ``plain``       - final-exit loss only;
* ``ee-llm``      - EE-LLM Eq. 1 with minimalistic exits (own norm, shared LM head) at 1/4 and
  1/2 depth, weights 0.25 / 0.5 / 1;
* ``layerskip``   - LayerSkip: layer dropout ``p_max`` (S(t)=1, Eq. 2-3) + early-exit loss
  through the shared head with the rotational curriculum (R=2, Eq. 5-6);
* ``dropout-only`` - LayerSkip's layer dropout alone (the part that saves compute).

EE-LLM's claim is a small overhead for a few exits; LayerSkip's is that layer dropout makes
training faster. The ratios to ``plain`` are printed as JSON on stdout.

    python benchmarks/train_throughput.py                  # dim 256, 8 layers, vocab 8192
    python benchmarks/train_throughput.py --vocab 512      # backbone-dominated compute
    python benchmarks/train_throughput.py --quick

The LM head's share of the compute decides the exit overhead: with a large vocabulary
relative to the backbone each extra exit costs a visible fraction of a step. On a machine
shared with other jobs pass ``--threads 1``: oversubscribed OpenMP threads can slow every
variant down by an order of magnitude.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from exitlm.config import ExitConfig, preset
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.layer_dropout import LayerDropout
from exitlm.train.losses import LossConfig, multi_exit_loss


def variants(layers: int, p_max: float) -> dict[str, tuple[ExitConfig, LossConfig, LayerDropout]]:
    q, h = max(1, layers // 4), max(1, layers // 2)
    return {
        "plain": (ExitConfig(), LossConfig(kind="final"), LayerDropout()),
        "ee-llm": (ExitConfig(layers=(q, h), norm="own"),
                   LossConfig(kind="ee-llm", exit_weights=(0.25, 0.5)), LayerDropout()),
        "layerskip": (ExitConfig(every_layer=True, norm="final"),
                      LossConfig(kind="layerskip", curriculum="rotational", rotation=2),
                      LayerDropout(p_max=p_max)),
        "dropout-only": (ExitConfig(), LossConfig(kind="final"), LayerDropout(p_max=p_max)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--p-max", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round")
    a = ap.parse_args()
    if a.quick:
        a.dim, a.layers, a.vocab, a.batch, a.seq, a.steps, a.rounds = 64, 4, 512, 4, 64, 2, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    base = preset("debug", dim=a.dim, num_layers=a.layers, num_heads=max(1, a.dim // 64),
                  num_kv_heads=max(1, a.dim // 64), hidden_dim=int(a.dim * 8 / 3),
                  vocab_size=a.vocab, max_seq_len=a.seq)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(4)]
    setups: dict[str, Any] = {}
    for name, (ex, loss, drop) in variants(a.layers, a.p_max).items():
        torch.manual_seed(0)
        model = EarlyExitLM(base.replace(exits=ex)).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        setups[name] = (model, opt, loss, drop)

    total_steps = 1000

    def run(name: str, steps: int, start: int) -> float:
        model, opt, loss, drop = setups[name]
        t0 = time.perf_counter()
        for i in range(steps):
            t = start + i
            x = batches[t % len(batches)]
            w = loss.weights_at(t, model.config, total_steps)
            active = drop.sample(a.batch, a.layers, t, total_steps)
            res = multi_exit_loss(model, x[:, :-1], x[:, 1:], w, active=active)
            res.total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return steps * a.batch * a.seq / (time.perf_counter() - t0)

    for name in setups:  # warm-up
        run(name, 1, 0)
    rates: dict[str, list[float]] = {n: [] for n in setups}
    for r in range(a.rounds):
        for name in setups:
            rates[name].append(run(name, a.steps, 1 + r * a.steps))
        print(f"round {r + 1}/{a.rounds}: " +
              ", ".join(f"{n} {v[-1]:.0f} tok/s" for n, v in rates.items()), file=sys.stderr)
    med = {n: statistics.median(v) for n, v in rates.items()}
    out = {
        "config": {"dim": a.dim, "layers": a.layers, "vocab": a.vocab, "batch": a.batch,
                   "seq": a.seq, "p_max": a.p_max, "threads": torch.get_num_threads(),
                   "steps_per_round": a.steps, "rounds": a.rounds},
        "machine": platform.platform(),
        "tokens_per_s": {n: round(v, 1) for n, v in med.items()},
        "ratio_to_plain": {n: round(v / med["plain"], 3) for n, v in med.items()},
        "expected_compute_fraction_layerskip_dropout": round(
            1 - sum(LayerDropout(p_max=a.p_max).rates(a.layers, 0, total_steps)) / a.layers, 3),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
