"""A PNG of the training loss of every exit (and the held-out loss when evaluated)."""

from __future__ import annotations

import json
from pathlib import Path

from exitlm.paths import atomic_file


def plot_log(log: Path, out: Path) -> Path | None:
    """Plot ``loss_<layer>`` (lines) and ``val_loss_<layer>`` (markers) from a JSONL log."""
    if not log.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError:  # a torn line (the run was killed while writing it)
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        for k, v in rec.items():
            if (k.startswith("loss_") or k.startswith("val_loss_")) and isinstance(v, float):
                xs, ys = series.setdefault(k, ([], []))
                xs.append(rec["step"])
                ys.append(v)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted(series, key=lambda s: (s.startswith("val"), int(s.rsplit("_", 1)[1]))):
        xs, ys = series[k]
        layer = k.rsplit("_", 1)[1]
        if k.startswith("val"):
            ax.plot(xs, ys, "o--", label=f"held-out, exit {layer}")
        else:
            ax.plot(xs, ys, label=f"train, exit {layer}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("loss per exit")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_file(out) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return out
