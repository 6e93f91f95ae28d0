"""Writing checkpoints: exitlm's own format and Hugging Face directories.

:func:`export_hf` writes a directory ``transformers.AutoModelForCausalLM.from_pretrained``
loads. Exit heads have no ``transformers`` equivalent, so they go to
``exitlm_exits.safetensors`` with their :class:`~exitlm.config.ExitConfig` in
``exitlm_exits.json``; ``transformers`` ignores both files, exitlm's HF loader reads them back.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from exitlm.io.hf_map import CheckpointError, config_to_hf, exitlm_to_hf, hf_mismatch
from exitlm.io.native import EXITS_CONFIG, EXITS_WEIGHTS, FORMAT_VERSION, save_native
from exitlm.io.st import EXPORT_KEY, FORMAT_KEY, atomic_dir, tensors_for_saving, write_safetensors
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from exitlm.io.loaded import LoadedModel


_DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16",
                "torch.bfloat16": "bfloat16"}


def _unpack(
    obj: LoadedModel | EarlyExitLM, tokenizer: Tokenizer | None
) -> tuple[EarlyExitLM, Tokenizer | None]:
    if isinstance(obj, EarlyExitLM):
        return obj, tokenizer
    model = getattr(obj, "model", None)
    if not isinstance(model, EarlyExitLM):
        raise TypeError(f"expected an EarlyExitLM or a LoadedModel, got {type(obj).__name__}")
    return model, tokenizer if tokenizer is not None else getattr(obj, "tokenizer", None)


def save_model(
    loaded_or_model: LoadedModel | EarlyExitLM,
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Save in exitlm's format (``config.json``, ``model.safetensors``, tokenizer files).

    A :class:`LoadedModel`'s own tokenizer is saved unless ``tokenizer`` is given. The write
    is atomic: the directory appears complete or not at all. An existing ``path`` is replaced
    only when it holds nothing but files exitlm writes, or with ``overwrite=True``.
    """
    model, tok = _unpack(loaded_or_model, tokenizer)
    return save_native(model, path, tok, overwrite=overwrite)


def export_hf(
    model: LoadedModel | EarlyExitLM, path: str | Path, tokenizer: Tokenizer | None = None,
    *, overwrite: bool = False,
) -> Path:
    """Export to a Hugging Face directory (``config.json`` + ``model.safetensors``).

    The backbone loads in ``transformers``; exit heads go to ``exitlm_exits.safetensors`` +
    ``exitlm_exits.json`` next to it. ``overwrite`` as in :func:`save_model`.
    """
    m, tok = _unpack(model, tokenizer)
    cfg = m.config
    problem = hf_mismatch(cfg)
    if problem is not None:
        raise CheckpointError(f"{cfg.name}: no Hugging Face architecture computes this model "
                              f"({problem})", hint="write exitlm's format instead (--to exitlm)")
    state = m.state_dict()
    backbone, _ = tensors_for_saving(dict(exitlm_to_hf(state.items(), cfg)))
    exits, aliases = tensors_for_saving({k: v for k, v in state.items() if k.startswith("exits.")})
    hf_cfg = config_to_hf(cfg)
    dtype = _DTYPE_NAMES.get(str(m.embed_tokens.weight.dtype), "float32")
    hf_cfg["torch_dtype"] = dtype
    hf_cfg["dtype"] = dtype
    hf_cfg[EXPORT_KEY] = FORMAT_VERSION  # marks the directory as exitlm's to replace
    target = Path(path)
    with atomic_dir(target, overwrite=overwrite) as tmp:
        write_safetensors(tmp / "model.safetensors", backbone, {})
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
        if exits or cfg.exits != type(cfg.exits)():
            write_safetensors(tmp / EXITS_WEIGHTS, exits, {"exitlm_aliases": json.dumps(aliases)})
            ex = dataclasses.asdict(cfg.exits)
            ex["layers"] = list(cfg.exits.layers)
            meta = {FORMAT_KEY: FORMAT_VERSION, "exits": ex}
            (tmp / EXITS_CONFIG).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if tok is not None:
            tok.save(tmp)
    return target
