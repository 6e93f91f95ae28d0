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
from typing import Annotated, Any, Literal

import yaml

from exitlm.config import PRESETS as MODEL_PRESETS
from exitlm.config import ConfigError, ExitConfig, ModelConfig, preset
from exitlm.io.corpus import DataConfig
from exitlm.schema import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
    UnitFloat,
    build,
    check,
    convert_fields,
)
from exitlm.train.layer_dropout import LayerDropout
from exitlm.train.losses import LossConfig
from exitlm.train.parallel.dims import ParallelConfig
from exitlm.train.presets import PRESETS


@dataclass(frozen=True)
class ModelSpec:
    """Which model to train.

    ``init``: a preset name (random initialisation, from scratch), ``default`` (SmolLM2), or a
    checkpoint path - anything :func:`exitlm.io.load_model` accepts. ``overrides``: fields of
    :class:`~exitlm.config.ModelConfig` replaced for presets. ``exits``: the exit configuration
    (``ExitConfig`` fields); ``None`` keeps the preset's / checkpoint's.

    Keys and values of ``overrides`` and ``exits`` are checked when the spec is made, and so is
    the resulting model configuration of a preset.
    """

    init: str = "debug"
    overrides: dict[str, Any] = field(default_factory=dict)
    exits: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check(self, "model")
        object.__setattr__(self, "overrides", convert_fields(
            ModelConfig, self.overrides, "model.overrides", "model.overrides"))
        self.exit_config()
        if self.init in MODEL_PRESETS:
            self.preset_config()
        elif self.overrides:
            raise ConfigError("model.overrides apply to presets (training from scratch) only; "
                              f"model.init={self.init!r} is a checkpoint")

    def exit_config(self) -> ExitConfig | None:
        """The requested :class:`ExitConfig` (``None``: keep the model's own)."""
        if self.exits is None:
            return None
        return build(ExitConfig, self.exits, "model.exits")

    def preset_config(self) -> ModelConfig:
        """The :class:`ModelConfig` of a preset ``init`` with the overrides and exits."""
        try:
            exits = self.exit_config()
            # one replace: the preset's own exits are not checked against overridden layers
            return preset(self.init, **{**self.overrides,
                                        **({} if exits is None else {"exits": exits})})
        except ConfigError as err:
            raise ConfigError(f"model (preset {self.init!r} with model.overrides / "
                              f"model.exits): {err}", hint=err.hint) from None


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio * lr``.

    ``fused``: torch's fused AdamW (one kernel for all parameters instead of several per
    parameter: on a GPU, a small model's optimizer step is otherwise mostly kernel launches);
    results differ from the per-parameter loop in the last bits."""

    lr: PositiveFloat = 3e-3
    min_lr_ratio: UnitFloat = 0.1
    warmup_steps: NonNegativeInt = 20
    weight_decay: NonNegativeFloat = 0.1
    beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Range(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0
    fused: bool = False

    def __post_init__(self) -> None:
        check(self, "optim")


@dataclass(frozen=True)
class TuneConfig:
    """Exit tuning (EE-LLM's EE-Tuning idea): train only the exit heads on a frozen backbone.

    ``init_new_heads``: heads the checkpoint lacks start as copies of the final norm / LM head
    (and the last layer's MLP or block when the head has one) instead of random weights.
    """

    freeze_backbone: bool = False
    init_new_heads: bool = True

    def __post_init__(self) -> None:
        check(self, "tune")


@dataclass(frozen=True)
class RunConfig:
    """Steps, batch, logging, checkpoints, devices.

    ``on_nonfinite``: what a step whose loss or gradients are NaN/inf does: ``error`` stops
    the run (nothing non-finite is ever saved), ``skip`` drops the step's update and goes on
    (the run still stops after 100 such steps in a row).
    """

    out_dir: str = "runs/exitlm"
    steps: PositiveInt = 100
    batch_size: PositiveInt = 8
    grad_accum: PositiveInt = 1
    seed: Seed = 0
    log_every: NonNegativeInt = 10
    eval_every: NonNegativeInt = 0
    eval_samples: PositiveInt = 64
    checkpoint_every: NonNegativeInt = 0
    keep_checkpoints: NonNegativeInt = 2
    device: str = "auto"
    amp: Literal["auto", "bf16", "fp16", "none"] = "auto"
    parallel: Literal["ddp", "fsdp"] = "ddp"
    progress: bool = True
    tensorboard: bool = True
    on_nonfinite: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        check(self, "train")
        if not self.out_dir.strip():
            raise ConfigError("train.out_dir: expected a directory path, got ''")
        if self.device != "auto":
            import torch

            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ConfigError(f"train.device: expected auto, cpu, cuda or cuda:N, got "
                                  f"{self.device!r}") from None


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

    def __post_init__(self) -> None:
        if self.loss.distill > 0 and (self.parallel.pipelined or self.parallel.tp > 1):
            raise ConfigError(
                f"loss.distill={self.loss.distill} needs the final output beside every exit in "
                "one process's loss, and pipeline or tensor parallelism splits them: set "
                "loss.distill=0, or parallel.pp=1, parallel.token_slices=1 and parallel.tp=1")

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """A config from plain data (YAML); every key and value is checked."""
        if not isinstance(d, dict):
            raise ConfigError(f"a training config must be a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _SECTIONS)
        if unknown:
            raise ConfigError(f"unknown config sections {unknown}; known: {sorted(_SECTIONS)}")
        parts = {name: build(kind, {} if d.get(name) is None else d[name], name)
                 for name, kind in _SECTIONS.items()}
        return cls(**parts)


_SECTIONS: dict[str, type] = {
    "model": ModelSpec, "data": DataConfig, "loss": LossConfig, "dropout": LayerDropout,
    "optim": OptimConfig, "tune": TuneConfig, "train": RunConfig, "parallel": ParallelConfig,
}


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
            value = load_yaml(raw)
        except DuplicateKey as err:
            raise ConfigError(f"override {item!r}: {err}") from None
        except (yaml.YAMLError, RecursionError) as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({_first_line(err)})"
                              ) from None
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


def load_config(source: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from a YAML file or a preset name, plus overrides."""
    d: Any = {}
    if source:
        path = Path(source).expanduser()
        if path.is_file():
            d = read_yaml(path)
            if d is None or d == {}:  # an empty file, only comments, or {}
                raise ConfigError(f"{path}: the config is empty; expected a mapping of "
                                  "sections (model, data, train, ...) or a 'preset' key")
            base = d.pop("preset", None) if isinstance(d, dict) else None
            if base is not None:
                if not isinstance(base, str) or base not in PRESETS:
                    raise ConfigError(f"{path}: unknown preset {base!r}; "
                                      f"choose one of {sorted(PRESETS)}")
                d = _merge(copy.deepcopy(PRESETS[base]), d)
        elif source in PRESETS:  # (also beside a folder of that name)
            d = copy.deepcopy(PRESETS[source])
        elif path.exists():
            raise ConfigError(f"--config {source!r} is not a file")
        else:
            raise ConfigError(f"--config {source!r} is neither a file nor a preset "
                              f"({sorted(PRESETS)})")
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: a training config must be a mapping of sections, got "
                          f"{type(d).__name__}")
    try:
        return TrainConfig.from_dict(apply_overrides(d, overrides or []))
    except ConfigError as err:
        raise ConfigError(f"{_blame(d, source, overrides, err)}{err}", hint=err.hint) from None


def _blame(d: dict[str, Any], source: str | None, overrides: list[str] | None,
           err: ConfigError) -> str:
    """Where a bad value came from: the config file, or the command-line overrides."""
    if overrides:
        try:
            TrainConfig.from_dict(d)
        except ConfigError as alone:
            if str(alone) != str(err):
                return "override: "
        else:
            return "override: "
    is_file = bool(source) and Path(str(source)).expanduser().is_file()
    return f"{source}: " if is_file else ""


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (``None`` for an empty one); a :class:`ConfigError`
    naming the file for anything that is not readable UTF-8 YAML text."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file (expected a YAML config)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror or err})") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: contains NUL bytes; expected a YAML text file")
    try:
        return load_yaml(text)
    except DuplicateKey as err:
        raise ConfigError(f"{path}:{err.line}: {err}") from None
    except (yaml.YAMLError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid YAML ({_first_line(err)})") from None


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one YAML mapping (1-based ``line`` and ``first`` of the two)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"the key {key!r} is given twice in one mapping (also on line "
                         f"{first}); keep one")
        self.key, self.line, self.first = key, line, first


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the
    last silently: ``train: {steps: 3}`` then ``train: {steps: 5}`` would drop the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}  # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' merges, by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first:
                    raise DuplicateKey(key, line, first[key])
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                break
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The YAML document in ``text`` (safe types only; a key given twice in one mapping is a
    :class:`yaml.YAMLError`)."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: safe types only


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())[:200]


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = _merge(base[k], v)
        else:
            base[k] = v
    return base
