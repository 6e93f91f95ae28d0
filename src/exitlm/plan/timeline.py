"""Timeline pictures of simulated schedules, in the style of EE-LLM Fig. 3-5 and TeraPipe
Fig. 2: one row per stage, one block per operation labelled with its microbatch / slice /
token, colours by segment (backbone / exit / input, forward / backward), idle time blank.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from exitlm.plan.cost_model import PlanError
from exitlm.plan.simulate import SimResult

_COLORS = {
    ("F", "backbone"): "#9ecae1", ("B", "backbone"): "#3182bd",
    ("F", "exit"): "#fdae6b", ("B", "exit"): "#e6550d",
    ("F", "input"): "#a1d99b", ("B", "input"): "#31a354",
}
_NAMES = {
    ("F", "backbone"): "backbone forward", ("B", "backbone"): "backbone backward",
    ("F", "exit"): "exit forward", ("B", "exit"): "exit backward",
    ("F", "input"): "input forward", ("B", "input"): "input backward",
}


def draw_timeline(result: SimResult, path: str, title: str = "",
                  time_unit: str = "time") -> str:
    """Draw ``result`` to ``path`` (``.png`` or ``.svg``); returns the path written."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".svg"):
        raise PlanError(f"--plot file must end in .png or .svg, got {path!r}")
    p = result.num_stages
    width = min(24.0, 4.0 + 0.35 * len(result.ops) / max(p, 1))
    fig, ax = plt.subplots(figsize=(width, 0.6 * p + 1.6))
    used = set()
    span = result.makespan or 1.0
    for op in result.ops:
        t = op.start
        y = p - 1 - op.stage
        for cat, dur in op.segments:
            kind = "F" if cat.endswith("@F") else op.kind  # e.g. a deferred exit forward
            key = (kind, cat.removesuffix("@F"))
            color = _COLORS.get(key, "#bdbdbd")
            used.add(key)
            hatch = "//" if not op.label.replace(".", "").isdigit() else None
            ax.broken_barh([(t, dur)], (y + 0.1, 0.8), facecolors=color, edgecolor="black",
                           linewidth=0.4, hatch=hatch)
            t += dur
        if op.duration > 0.02 * span:
            ax.text(op.start + op.duration / 2, y + 0.5, op.label, ha="center", va="center",
                    fontsize=7)
    ax.set_yticks([p - 1 - s + 0.5 for s in range(p)])
    ax.set_yticklabels([f"stage {s + 1}" for s in range(p)])
    ax.set_xlim(0, span)
    ax.set_ylim(0, p)
    ax.set_xlabel(time_unit)
    ax.set_title(title or f"time per iteration = {result.makespan:.4g}")
    handles = [Patch(facecolor=_COLORS[k], edgecolor="black", label=_NAMES[k])
               for k in _COLORS if k in used]
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 if p < 3
                  else -0.12), ncol=min(6, len(handles)), fontsize=7, frameon=False)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
