"""Training checkpoints: model, optimizer, LR schedule, data position, RNG and step.

Layout of ``OUT/checkpoints/step-00000100/``:

* ``model.safetensors`` - the model's state dict (only the trained tensors when the backbone
  is frozen: the rest is rebuilt from ``model.init`` on resume);
* ``optimizer.safetensors`` - every optimizer state tensor, named ``state.<param>.<key>``;
* ``state.json`` - step, data position, scheduler state, optimizer hyper-parameters, the
  training config, and the RNG states (stored as lists of bytes).

Nothing is pickled. The directory is assembled under a temporary name and renamed in one
``os.replace``; ``OUT/checkpoints/latest`` (a one-line text file, also replaced atomically)
names the newest complete checkpoint. A crash at any point leaves the previous checkpoint
usable.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from exitlm.io.st import atomic_dir, write_text_atomic
from exitlm.model.transformer import EarlyExitLM

STATE_VERSION = 1


@dataclass
class TrainState:
    """What a resumed run needs besides the model weights."""

    step: int
    data_position: int
    scheduler: dict[str, Any]
    extra: dict[str, Any]


def optimizer_to_tensors(
    opt: torch.optim.Optimizer | dict[str, Any],
) -> tuple[dict[str, torch.Tensor], Any]:
    """Split an optimizer state dict (or ``opt.state_dict()``) into tensors (for safetensors)
    and a JSON-able remainder. Parameter keys are ids, or names under FSDP."""
    sd = opt if isinstance(opt, dict) else opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_state_from_tensors(tensors: dict[str, torch.Tensor], meta: Any) -> dict[str, Any]:
    """Inverse of :func:`optimizer_to_tensors`: the optimizer state dict."""

    def pid(key: str) -> int | str:
        return int(key) if key.isdigit() else key

    state: dict[int | str, dict[str, Any]] = {}
    for name, t in tensors.items():
        param, key = name.removeprefix("state.").rsplit(".", 1)  # names may contain dots
        state.setdefault(pid(param), {})[key] = t
    for param, values in meta["scalars"].items():
        state.setdefault(pid(param), {}).update(values)
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def optimizer_state_by_name(opt: torch.optim.Optimizer,
                            names: dict[int, str]) -> dict[str, Any]:
    """``opt.state_dict()`` keyed by parameter *name* instead of position (``names`` maps
    ``id(param)`` to its name), so the state loads into an optimizer over any subset or
    ordering of the parameters: a pipeline stage, another pipeline layout, one process."""
    sd = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    state = {order[i]: v for i, v in sd["state"].items()}
    groups = []
    for g in sd["param_groups"]:
        groups.append({**g, "params": [order[i] for i in g["params"]]})
    return {"state": state, "param_groups": groups}


def load_optimizer_state(opt: torch.optim.Optimizer, sd: dict[str, Any],
                         names: dict[int, str]) -> None:
    """Load a state dict keyed by name (:func:`optimizer_state_by_name`, FSDP) or, from older
    checkpoints, by position. Named state of parameters ``opt`` does not hold is ignored; the
    optimizer's own parameter groups (hyper-parameters come from the config) are kept."""
    state = sd.get("state", {})
    if state and all(isinstance(k, int) for k in state):
        opt.load_state_dict(sd)
        return
    own = opt.state_dict()
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    own["state"] = {i: state[n] for i, n in enumerate(order) if n in state}
    opt.load_state_dict(own)


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save_checkpoint(
    out_dir: Path,
    *,
    model: EarlyExitLM | dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | dict[str, Any],
    state: TrainState,
    names: set[str] | None = None,
    keep: int = 2,
) -> Path:
    """Write ``out_dir/checkpoints/step-XXXXXXXX`` atomically and point ``latest`` at it.

    ``model`` / ``optimizer`` may be full state dicts already gathered (FSDP)."""
    root = Path(out_dir) / "checkpoints"
    target = root / f"step-{state.step:08d}"
    tensors, opt_meta = optimizer_to_tensors(optimizer)
    model_sd = model if isinstance(model, dict) else model.state_dict()
    meta = {
        "version": STATE_VERSION, "step": state.step, "data_position": state.data_position,
        "scheduler": state.scheduler, "optimizer": opt_meta, "rng": _rng_state(),
        "extra": state.extra,
    }
    with atomic_dir(target) as tmp:
        weights = {k: v.detach().to("cpu").contiguous() for k, v in model_sd.items()
                   if names is None or k in names}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        save_file(tensors, str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
        (tmp / "state.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")
    write_text_atomic(root / "latest", target.name + "\n")
    _prune(root, keep)
    return target


def _prune(root: Path, keep: int) -> None:
    if keep < 1:
        return
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.json").is_file())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir``, or ``None``."""
    root = Path(out_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text(encoding="utf-8").strip()
        if (cand / "state.json").is_file():
            return cand
    done = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def read_checkpoint(
    path: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], TrainState]:
    """Model tensors, optimizer state dict and train state of a checkpoint; restores RNG."""
    meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if meta.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: checkpoint state version {meta.get('version')} is not "
                         f"{STATE_VERSION}")
    weights = load_file(str(path / "model.safetensors"))
    optim = optimizer_state_from_tensors(load_file(str(path / "optimizer.safetensors")),
                                         meta["optimizer"])
    _set_rng_state(meta["rng"])
    return weights, optim, TrainState(meta["step"], meta["data_position"], meta["scheduler"],
                                      meta["extra"])
