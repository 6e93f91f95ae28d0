"""The files of a Megatron-LM / EE-LLM checkpoint and how tensor parallelism split its tensors.

A checkpoint directory as Megatron's ``checkpointing.py`` writes it::

    latest_checkpointed_iteration.txt          "1000" or "release"
    iter_0001000/ (or release/)
        mp_rank_{t:02d}/model_optim_rng.pt          pipeline size 1
        mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt  pipeline size > 1

Each file is one (tensor rank ``t``, pipeline stage ``p``) shard: ``{"args": Namespace,
"checkpoint_version": 3.0, "model": {...}, ...}``. Its model dict nests
``language_model.{embedding, encoder, output_layer, exit_output_layer}``; encoder layers are
numbered within their stage. Tensor parallelism splits (Megatron ``core/tensor_parallel``):

* column-parallel weights and biases (fused QKV, ``dense_h_to_4h``, vocabulary-parallel
  embeddings and output layers) along dim 0; the QKV shards hold whole query groups, so
  concatenating them keeps the group-interleaved order;
* SwiGLU's ``dense_h_to_4h``: each shard is ``[gate_t; up_t]`` (the forward chunks its local
  output in two), so the merge is ``[gate_0..gate_T; up_0..up_T]``, not a plain concatenation;
* row-parallel weights (attention ``dense``, ``dense_4h_to_h``) along dim 1; their biases and
  every norm and position embedding are replicated.

Shards are read through :func:`exitlm.io.torch_load.load_pt` (no arbitrary unpickling,
memory-mapped tensors).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exitlm.io.hf_map import CheckpointError
from exitlm.io.torch_load import load_pt

TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?")
_ALIASES = (  # older Megatron names -> current ones
    (".input_layernorm.", ".input_norm."),
    (".post_attention_layernorm.", ".post_attention_norm."),
    ("final_layernorm.", "final_norm."),
    (".attention.", ".self_attention."),
)


def _rank_dirs(path: Path) -> list[Path]:
    try:
        return sorted(c for c in path.iterdir() if c.is_dir() and _RANK_DIR.fullmatch(c.name))
    except OSError:
        return []


def is_megatron_dir(path: Path) -> bool:
    """Whether ``path`` looks like a Megatron checkpoint (its root or one iteration)."""
    return path.is_dir() and ((path / TRACKER).is_file() or bool(_rank_dirs(path))
                              or bool(_rank_dirs(path / "release")))


def iteration_dir(path: Path) -> Path:
    """The iteration directory holding the shards: ``path`` itself when it holds
    ``mp_rank_*`` directories, else the one ``latest_checkpointed_iteration.txt`` names."""
    if _rank_dirs(path):
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
        if text == "release":
            target = path / "release"
        elif text.isdigit() and int(text) > 0:
            target = path / f"iter_{int(text):07d}"
        else:
            raise CheckpointError(
                f"{tracker}: expected a positive iteration number or 'release', got {text!r}")
        if not _rank_dirs(target):
            raise CheckpointError(f"{tracker}: names {target.name}, but {target} holds no "
                                  "mp_rank_* shard directories")
        return target
    if _rank_dirs(path / "release"):
        return path / "release"
    raise CheckpointError(f"{path}: not a Megatron checkpoint (no {TRACKER}, release/ or "
                          "mp_rank_* directories)")


@dataclass(frozen=True)
class Shards:
    """The shard files of one iteration: ``tp`` tensor ranks x ``pp`` pipeline stages."""

    root: Path
    tp: int
    pp: int
    pipelined: bool

    def file(self, t: int, p: int) -> Path:
        name = f"mp_rank_{t:02d}_{p:03d}" if self.pipelined else f"mp_rank_{t:02d}"
        return self.root / name / SHARD_FILE


def find_shards(path: Path) -> Shards:
    """The tensor x pipeline grid of shard files under ``path`` (every one must exist)."""
    root = iteration_dir(path)
    ranks: set[tuple[int, int]] = set()
    styles: set[bool] = set()
    for d in _rank_dirs(root):
        m = _RANK_DIR.fullmatch(d.name)
        assert m is not None
        if m.group(3):
            raise CheckpointError(f"{d}: expert-parallel shards (mixture of experts) are not "
                                  "supported")
        styles.add(m.group(2) is not None)
        ranks.add((int(m.group(1)), int(m.group(2) or 0)))
    if len(styles) > 1:
        raise CheckpointError(f"{root}: mixes mp_rank_TT and mp_rank_TT_PPP directories")
    tp = max(t for t, _ in ranks) + 1
    pp = max(p for _, p in ranks) + 1
    shards = Shards(root, tp, pp, styles.pop())
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in ranks or not shards.file(t, p).is_file():
                raise CheckpointError(f"{shards.file(t, p)}: missing (a {tp}x{pp} tensor x "
                                      "pipeline checkpoint needs every shard)")
    return shards


@dataclass
class Shard:
    """One file's arguments, checkpoint version and model tensors (canonical flat names)."""

    file: Path
    args: argparse.Namespace | None
    version: float | None
    tensors: dict[str, torch.Tensor]


def read_shard(file: Path) -> Shard:
    """Read one shard safely; names are flattened (``language_model.`` dropped, old
    Megatron names renamed to current ones)."""
    obj = load_pt(file)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file}: expected a dict with 'model' and 'args', got "
                              f"{type(obj).__name__}")
    if "model0" in obj:
        raise CheckpointError(f"{file}: virtual pipeline stages (model0, model1, ...) are not "
                              "supported; convert with --num-layers-per-virtual-pipeline-stage "
                              "unset first")
    model = obj.get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{file}: has no 'model' dict of tensors")
    args = obj.get("args")
    version = obj.get("checkpoint_version")
    tensors = dict(_flatten(model, ""))
    return Shard(file, args if isinstance(args, argparse.Namespace) else None,
                 float(version) if isinstance(version, (int, float)) else None, tensors)


def _flatten(tree: dict[Any, Any], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, name + ".")
        elif isinstance(value, torch.Tensor):
            yield canonical_name(name), value


def canonical_name(name: str) -> str:
    """``language_model.encoder.layers.0.input_layernorm.weight`` ->
    ``encoder.layers.0.input_norm.weight`` (and the other renames of :data:`_ALIASES`)."""
    name = name.removeprefix("language_model.")
    if name.startswith("transformer."):
        name = "encoder." + name.removeprefix("transformer.")
    for old, new in _ALIASES:
        name = name.replace(old, new)
    return name


# ----- tensor-parallel split kinds ------------------------------------------------------------

COLUMN, ROW, REPLICATED, GLU = "column", "row", "replicated", "glu"


def split_kind(name: str, swiglu: bool) -> str:
    """How tensor parallelism splits the tensor ``name`` (canonical)."""
    leaf = name.rsplit(".", 2)
    module, param = leaf[-2], leaf[-1]
    if module == "dense_h_to_4h":
        return GLU if swiglu else COLUMN
    if module in ("query_key_value", "word_embeddings", "output_layer",
                  "word_embeddings_for_head") or (
            name.startswith("exit_output_layer.")):
        return COLUMN
    if module in ("dense", "dense_4h_to_h") and param == "weight":
        return ROW
    return REPLICATED


def merge(kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from its tensor-parallel parts (see the module docstring)."""
    if len(parts) == 1:
        return parts[0]
    if kind == COLUMN:
        return torch.cat(parts, dim=0)
    if kind == ROW:
        return torch.cat(parts, dim=1)
    if kind == GLU:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return parts[0]


def split(kind: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The inverse of :func:`merge`: the ``tp`` parts Megatron holds of ``full``."""
    if tp == 1 or kind == REPLICATED:
        return [full] * tp
    if kind == COLUMN:
        return list(full.chunk(tp, dim=0))
    if kind == ROW:
        return list(full.chunk(tp, dim=1))
    gate, up = full.chunk(2, dim=0)
    return [torch.cat((g, u), dim=0) for g, u in zip(gate.chunk(tp), up.chunk(tp), strict=True)]
