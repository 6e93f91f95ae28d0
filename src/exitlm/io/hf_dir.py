"""Load a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``).

Sharded directories are read through ``model.safetensors.index.json``. Every file's header
is checked first (names and shapes against the configuration, without reading data), so a
wrong or missing tensor is reported by file and Hugging Face name before any weight is
loaded; then tensors stream one at a time through :func:`~exitlm.io.hf_map.hf_to_exitlm`
into :func:`~exitlm.io.materialize.model_from_tensors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from exitlm.config import ConfigError, ExitConfig, ModelConfig
from exitlm.io.header_check import check_config_against_tensors
from exitlm.io.hf_map import (
    CheckpointError,
    architecture_of,
    check_float_weight,
    check_token_ids_in_vocab,
    config_from_hf,
    exitlm_to_hf,
    hf_names,
    hf_to_exitlm,
)
from exitlm.io.loaded import LoadedModel, fill_special, keep_matching_exits
from exitlm.io.materialize import model_from_tensors
from exitlm.io.native import (
    EXITS_CONFIG,
    EXITS_WEIGHTS,
    load_tokenizer_dir,
    native_tensors_of,
)
from exitlm.io.st import (
    FORMAT_KEY,
    PICKLE_SUFFIXES,
    read_json,
    read_json_object,
    refuse_pickle,
    stream_file,
    tensor_shapes,
)
from exitlm.model.transformer import EarlyExitLM
from exitlm.schema import build

INDEX = "model.safetensors.index.json"


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """HF tensors that carry nothing exitlm needs (buffers, or a tied head's copy)."""
    if name.endswith("rotary_emb.inv_freq") or name.endswith((".attn.bias", ".attn.masked_bias")):
        return True
    return cfg.tie_embeddings and name == "lm_head.weight"


def _canonical(name: str, cfg: ModelConfig) -> str:
    """GPT-2 checkpoints exist with and without the ``transformer.`` prefix."""
    if cfg.pos == "learned" and name != "lm_head.weight" and not name.startswith("transformer."):
        return "transformer." + name
    return name


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a backbone with configuration ``cfg``."""
    with torch.device("meta"):
        model = EarlyExitLM(cfg.replace(exits=ExitConfig()))
    return {n: tuple(t.shape) for n, t in exitlm_to_hf(model.state_dict().items(), cfg)}


def weight_files(path: Path) -> dict[Path, list[str] | None]:
    """The safetensors files of ``path`` and, for sharded checkpoints, each file's tensors."""
    index = path / INDEX
    if index.is_file():
        data = read_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: has no 'weight_map' object of tensor -> file")
        files: dict[Path, list[str] | None] = {}
        for tensor, file in wm.items():
            if not isinstance(file, str) or Path(file).name != file:
                raise CheckpointError(f"{index}: tensor {tensor!r} maps to bad file {file!r}")
            if Path(file).suffix in PICKLE_SUFFIXES:  # named by the index: still a pickle
                raise refuse_pickle(path / file)
            names = files.setdefault(path / file, [])
            assert names is not None
            names.append(tensor)
        return files
    found = sorted(p for p in path.glob("*.safetensors") if p.name != EXITS_WEIGHTS)
    if found:
        return dict.fromkeys(found)
    pickled = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise refuse_pickle(pickled[0])
    raise CheckpointError(
        f"{path}: no weights found (expected model.safetensors, sharded *.safetensors with "
        f"{INDEX}, or a .gguf file)"
    )


def hf_dir_config(path: Path) -> ModelConfig:
    """The configuration of an HF directory, with the exits stored beside it (if any)."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    hf = read_json_object(file)
    try:
        architecture_of(hf)
        cfg = check_token_ids_in_vocab(config_from_hf(hf, name=path.name))
    except CheckpointError as err:
        raise CheckpointError(f"{file}: {err}") from err
    except (ConfigError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: invalid configuration: {err}") from None
    exits_file = path / EXITS_CONFIG
    if exits_file.is_file():
        meta = read_json(exits_file)
        try:
            if not isinstance(meta, dict) or meta.get(FORMAT_KEY) is None:
                raise ConfigError(f"missing {FORMAT_KEY!r}")
            if "exits" not in meta:
                raise ConfigError("missing 'exits'")
            cfg = cfg.replace(exits=build(ExitConfig, meta["exits"], "exits"))
        except ConfigError as err:
            raise CheckpointError(f"{exits_file}: invalid exit configuration: {err}") from None
    return cfg


def _check_headers(
    path: Path, files: dict[Path, list[str] | None], cfg: ModelConfig
) -> dict[Path, list[str]]:
    """Validate names and shapes of every file's tensors; returns the names to read.

    The layer count and embedding shape are checked against the headers first, so a
    configuration that does not match its weights fails before a model is built."""
    headers = {file: tensor_shapes(file) for file in files}
    union = {n: s for shapes in headers.values() for n, s in shapes.items()}
    holder = {n: str(f) for f, shapes in headers.items() for n in shapes}
    check_config_against_tensors(cfg, union, str(path), files=holder)
    expected = expected_hf_shapes(cfg)
    seen: set[str] = set()
    plan: dict[Path, list[str]] = {}
    for file, listed in files.items():
        shapes = headers[file]
        names = list(shapes) if listed is None else listed
        for name in names:
            if name not in shapes:
                raise CheckpointError(
                    f"{file}: lacks tensor {name!r} that {INDEX} says it holds"
                )
            if _ignored(name, cfg):
                continue
            key = _canonical(name, cfg)
            if key not in expected:
                raise CheckpointError(
                    f"{file}: unexpected tensor {name!r} for a {cfg.num_layers}-layer "
                    f"{'GPT-2' if cfg.pos == 'learned' else 'Llama-family'} model "
                    "(config.json and the weights disagree)"
                )
            if shapes[name] != expected[key]:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {shapes[name]}, config.json implies "
                    f"{expected[key]}"
                )
            if key in seen:
                raise CheckpointError(f"{file}: tensor {name!r} is also stored in another "
                                      "weight file; each tensor must be stored once")
            seen.add(key)
        plan[file] = [n for n in names if not _ignored(n, cfg)]
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        where = ", ".join(f.name for f in files)
        raise CheckpointError(
            f"{path}: missing tensors {shown} ({len(missing)} in all; searched {where})"
        )
    return plan


def load_hf_dir(
    path: Path, *, dtype: torch.dtype = torch.float32, exits: ExitConfig | None = None
) -> LoadedModel:
    """Load a Hugging Face directory; exit heads come from ``exitlm_exits.*`` when present."""
    files = weight_files(path)  # first: a pickle-only directory is refused before all else
    ckpt = hf_dir_config(path)
    cfg = ckpt if exits is None else ckpt.replace(exits=exits)
    plan = _check_headers(path, files, ckpt)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in plan.items():
            for name, t in stream_file(file, names):
                check_float_weight(t, name, str(file))  # before q/k/v or gate/up are fused
                yield name, t

    def exit_stream() -> Iterator[tuple[str, torch.Tensor]]:
        file = path / EXITS_WEIGHTS
        if file.is_file() and ckpt.exits.layers:
            for name, t in native_tensors_of(file):
                if not name.startswith("exits."):
                    raise CheckpointError(
                        f"{file}: holds tensor {name!r}, which is not an exit-head tensor; "
                        f"{EXITS_WEIGHTS} may only hold exits.* tensors (the backbone's "
                        "come from the Hugging Face weight files)")
                yield name, t

    def all_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from hf_to_exitlm(stream(), ckpt, source=str(path))
        yield from keep_matching_exits(exit_stream(), ckpt, cfg)

    # canonical Hugging Face name -> (its file, its name there: GPT-2's may lack "transformer.")
    stored = {_canonical(n, ckpt): (str(f), n) for f, names in plan.items() for n in names}

    def origin(name: str) -> tuple[str, list[str]]:
        """The file and the Hugging Face names of exitlm's tensor ``name`` (for messages)."""
        if name.startswith("exits."):
            return str(path / EXITS_WEIGHTS), [name]
        held = [stored.get(n, (str(path), n)) for n in hf_names(name, ckpt)]
        return ", ".join(sorted({f for f, _ in held})), [n for _, n in held]

    model = model_from_tensors(
        cfg, all_tensors(), source=str(path), dtype=dtype,
        allow_missing_exits=exits is not None, origin=origin,
    )
    return LoadedModel(model, fill_special(load_tokenizer_dir(path), cfg), cfg, str(path))
