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
usable. ``state.json`` (written last) records the size and CRC-32 of the two weight files, so
a checkpoint damaged later is recognised (:func:`verify_checkpoint`) and ``--resume`` falls
back to the previous one. Old checkpoints are pruned by renaming them to a temporary name
first, so a prune cut short leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from exitlm.io.hf_map import CheckpointError
from exitlm.io.st import all_finite, atomic_dir
from exitlm.model.transformer import EarlyExitLM
from exitlm.paths import write_text_atomic
from exitlm.train.run_dir import STEP_DIR, dir_step

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
        meta["files"] = {f: _fingerprint(tmp / f) for f in WEIGHT_FILES}
        (tmp / "state.json").write_text(json.dumps(meta) + "\n", encoding="utf-8")
    write_text_atomic(root / "latest", target.name + "\n")
    _prune(root, keep)
    return target


WEIGHT_FILES = ("model.safetensors", "optimizer.safetensors")


def _fingerprint(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file (read in 16 MiB blocks)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(16 * 2**20):
            crc = zlib.crc32(block, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints; each is first renamed to a temporary
    name, so an interrupted prune leaves only recognisable leftovers."""
    if keep < 1:
        return
    for old in checkpoints(root.parent)[keep:]:
        aside = root / f".{old.name}.old-{os.getpid()}-prune"
        try:
            os.replace(old, aside)
        except OSError:
            continue
        shutil.rmtree(aside, ignore_errors=True)


def checkpoints(out_dir: Path) -> list[Path]:
    """The complete checkpoints under ``out_dir`` (those with ``state.json``), newest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()
             and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``out_dir``, or ``None``."""
    found = checkpoints(out_dir)
    return found[0] if found else None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint whose weight files match their recorded size and
    CRC-32; a :class:`CheckpointError` names what is damaged."""
    file = path / "state.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{file}: unreadable ({err})") from None
    if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{file}: checkpoint state version {version!r} is not "
                              f"{STATE_VERSION}")
    missing = [k for k in ("step", "data_position", "optimizer", "rng", "extra") if k not in meta]
    if missing:
        raise CheckpointError(f"{file}: lacks {missing}")
    for name in WEIGHT_FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name}: missing")
    for name, want in (meta.get("files") or {}).items():
        if name in WEIGHT_FILES and _fingerprint(path / name) != want:
            raise CheckpointError(f"{path / name}: size or checksum differs from the one "
                                  "recorded when it was written (the file is damaged)")
    return meta


def read_checkpoint(
    path: Path,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], TrainState]:
    """Model tensors, optimizer state dict and train state of a checkpoint; restores RNG.

    Everything is read and checked (checksums, readable safetensors, finite weights) before
    the RNG is touched; any damage is a :class:`CheckpointError`."""
    meta = verify_checkpoint(path)
    weights = _load(path / "model.safetensors")
    bad = [k for k, t in weights.items() if not all_finite(t)]
    if bad:
        raise CheckpointError(f"{path / 'model.safetensors'}: tensor(s) {bad[:4]} hold NaN or "
                              "infinite values")
    try:
        optim = optimizer_state_from_tensors(_load(path / "optimizer.safetensors"),
                                             meta["optimizer"])
        state = TrainState(_count(meta, "step", path), _count(meta, "data_position", path),
                           meta["scheduler"], meta["extra"])
        _set_rng_state(meta["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path / 'state.json'}: invalid state ({err})") from None
    return weights, optim, state


def _count(meta: dict[str, Any], key: str, path: Path) -> int:
    """``meta[key]``, an integer >= 0 (``step`` also the number in the directory's name):
    a hand-edited or foreign ``state.json`` must not resume at step -5 or read batches from
    a negative position."""
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    if key == "step" and STEP_DIR.fullmatch(path.name) and dir_step(path.name) != value:
        raise ValueError(f"step {value} differs from the step of the directory name")
    return value


def _load(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{file}: unreadable safetensors ({err})") from None
