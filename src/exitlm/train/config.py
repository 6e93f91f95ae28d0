"""The training configuration: YAML files, ``key=value`` overrides and named presets.

A file mirrors :class:`TrainConfig`'s sections::

    model: {init: debug, overrides: {dim: 128}, exits: {layers: [2, 3]}}
    data: {seq_len: 128}
    loss: {kind: ee-llm, exit_weights: [0.25, 0.5]}
    dropout: {p_max: 0.1, curriculum: exp}
    optim: {lr: 3.0e-3}
    tune: {freeze_backbone: false}
    train: {steps: 300, batch_size: 8, out_dir: runs/ee}
    parallel: {pp: 2, schedule: 1f1b, token_slices: 4}

Overrides use dotted keys with YAML values: ``train.steps=50 model.exits.layers=[1,2]``.
Every unknown key or bad value raises :class:`~exitlm.config.ConfigError` naming the setting.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from exitlm.config import ConfigError, ExitConfig
from exitlm.parallel.dims import ParallelConfig
from exitlm.train.data import DataConfig
from exitlm.train.layer_dropout import LayerDropout
from exitlm.train.losses import LossConfig


@dataclass(frozen=True)
class ModelSpec:
    """Which model to train.

    ``init``: a preset name (random initialisation, from scratch), ``default`` (SmolLM2), or a
    checkpoint path - anything :func:`exitlm.io.load_model` accepts. ``overrides``: fields of
    :class:`~exitlm.config.ModelConfig` replaced for presets. ``exits``: the exit configuration
    (``ExitConfig`` fields); ``None`` keeps the preset's / checkpoint's.
    """

    init: str = "debug"
    overrides: dict[str, Any] = field(default_factory=dict)
    exits: dict[str, Any] | None = None

    def exit_config(self) -> ExitConfig | None:
        if self.exits is None:
            return None
        known = {f.name for f in dataclasses.fields(ExitConfig)}
        unknown = sorted(set(self.exits) - known)
        if unknown:
            raise ConfigError(f"unknown model.exits keys {unknown}; known keys: {sorted(known)}")
        return ExitConfig(**self.exits)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class TuneConfig:
    """Exit tuning (EE-LLM's EE-Tuning idea): train only the exit heads on a frozen backbone.

    ``init_new_heads``: heads the checkpoint lacks start as copies of the final norm / LM head
    (and the last layer's MLP or block when the head has one) instead of random weights.
    """

    freeze_backbone: bool = False
    init_new_heads: bool = True


@dataclass(frozen=True)
class RunConfig:
    """Steps, batch, logging, checkpoints, devices."""

    out_dir: str = "runs/exitlm"
    steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_samples: int = 64
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    device: str = "auto"
    amp: Literal["auto", "bf16", "fp16", "none"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    progress: bool = True
    tensorboard: bool = True

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "grad_accum"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.amp not in ("auto", "bf16", "fp16", "none"):
            raise ConfigError(f"train.amp must be auto, bf16, fp16 or none, got {self.amp!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"train.parallel must be ddp or fsdp, got {self.parallel!r}")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    dropout: LayerDropout = field(default_factory=LayerDropout)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    train: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"a training config must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SECTIONS))
        if unknown:
            raise ConfigError(f"unknown config sections {unknown}; known: {sorted(_SECTIONS)}")
        parts = {name: _section(kind, d.get(name) or {}, name) for name, kind in _SECTIONS.items()}
        return cls(**parts)


_SECTIONS: dict[str, type] = {
    "model": ModelSpec, "data": DataConfig, "loss": LossConfig, "dropout": LayerDropout,
    "optim": OptimConfig, "tune": TuneConfig, "train": RunConfig, "parallel": ParallelConfig,
}


def _section(kind: type, d: Any, name: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"config section {name!r} must be a mapping, got {d!r}")
    known = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown {name} keys {unknown}; known keys: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) and k != "overrides" else v for k, v in d.items()}
    try:
        return kind(**values)
    except TypeError as err:
        raise ConfigError(f"bad value in section {name!r}: {err}") from err


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` (YAML value) overrides to a nested dict (a copy)."""
    out = copy.deepcopy(d)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) < 2 or parts[0] not in _SECTIONS:
            raise ConfigError(f"override key {key!r} must start with one of {sorted(_SECTIONS)}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({err})") from err
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


# Named training setups (the YAML files in configs/ are copies to start from).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {"init": "debug", "exits": {"layers": [1, 2]}},
        "loss": {"kind": "ee-llm", "exit_weights": [0.25, 0.5]},
        "data": {"seq_len": 64},
        "train": {"steps": 20, "batch_size": 4},
    },
    "scratch-plain": {
        "model": {"init": "debug", "overrides": {"dim": 128, "num_layers": 8, "num_heads": 4,
                                                 "num_kv_heads": 4, "hidden_dim": 344,
                                                 "max_seq_len": 256},
                  "exits": {"layers": []}},
        "data": {"seq_len": 128},
        "loss": {"kind": "final"},
        "optim": {"lr": 2.0e-3, "warmup_steps": 30},
        "train": {"steps": 600, "batch_size": 16, "eval_every": 200, "eval_samples": 128,
                  "checkpoint_every": 200, "out_dir": "runs/scratch-plain"},
    },
}
PRESETS["scratch-ee"] = copy.deepcopy(PRESETS["scratch-plain"])
PRESETS["scratch-ee"]["model"]["exits"] = {"layers": [2, 4], "norm": "own",
                                           "output": "final_head"}
PRESETS["scratch-ee"]["loss"] = {"kind": "ee-llm", "exit_weights": [0.25, 0.5],
                                 "final_weight": 1.0}
PRESETS["scratch-ee"]["train"]["out_dir"] = "runs/scratch-ee"
PRESETS["scratch-layerskip"] = copy.deepcopy(PRESETS["scratch-plain"])
PRESETS["scratch-layerskip"]["model"]["exits"] = {"every_layer": True, "layers": [],
                                                  "norm": "final"}
PRESETS["scratch-layerskip"]["loss"] = {"kind": "layerskip", "e_scale": 1.0,
                                        "curriculum": "rotational", "rotation": 2}
PRESETS["scratch-layerskip"]["dropout"] = {"p_max": 0.1, "curriculum": "exp"}
PRESETS["scratch-layerskip"]["train"]["out_dir"] = "runs/scratch-layerskip"
PRESETS["default-ee"] = {
    "model": {"init": "default", "exits": {"layers": [12, 20], "head": "mlp", "norm": "own",
                                           "output": "final_head"}},
    "data": {"tokenizer": "default", "seq_len": 128},
    "loss": {"kind": "ee-llm", "exit_weights": [1.0, 1.0], "final_weight": 0.0},
    "tune": {"freeze_backbone": True, "init_new_heads": True},
    "optim": {"lr": 1.0e-3, "warmup_steps": 20, "weight_decay": 0.0},
    "train": {"steps": 160, "batch_size": 4, "log_every": 10, "checkpoint_every": 50,
              "out_dir": "runs/default-ee"},
}


def load_config(source: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from a YAML file or a preset name, plus overrides."""
    d: dict[str, Any] = {}
    if source:
        path = Path(source).expanduser()
        if path.is_file():
            try:
                d = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML ({err})") from err
            base = d.pop("preset", None) if isinstance(d, dict) else None
            if base is not None:
                if base not in PRESETS:
                    raise ConfigError(f"{path}: unknown preset {base!r}; "
                                      f"choose one of {sorted(PRESETS)}")
                d = _merge(copy.deepcopy(PRESETS[base]), d)
        elif source in PRESETS:
            d = copy.deepcopy(PRESETS[source])
        else:
            raise ConfigError(f"--config {source!r} is neither a file nor a preset "
                              f"({sorted(PRESETS)})")
    return TrainConfig.from_dict(apply_overrides(d, overrides or []))


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = _merge(base[k], v)
        else:
            base[k] = v
    return base
