"""What a loader returns (:class:`LoadedModel`) and the steps every loader shares: keeping the
checkpoint's exit heads that still match (:func:`keep_matching_exits`), special-token ids,
casting, and rebuilding the same weights with another dtype or exit configuration."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from exitlm.config import ExitConfig, ModelConfig
from exitlm.io.materialize import model_from_tensors
from exitlm.model.layers import rope_inv_freq
from exitlm.model.transformer import EarlyExitLM
from exitlm.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready for use, its tokenizer (``None`` for presets), config and origin."""

    model: EarlyExitLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    source: str


def rebuild(
    loaded: LoadedModel, *, dtype: torch.dtype, exits: ExitConfig | None
) -> LoadedModel:
    """The same weights in another dtype and/or with another exit configuration."""
    ckpt = loaded.config
    cfg = ckpt if exits is None else ckpt.replace(exits=exits)
    state = loaded.model.state_dict()
    model = model_from_tensors(
        cfg, keep_matching_exits(state.items(), ckpt, cfg), source=loaded.source, dtype=dtype,
        allow_missing_exits=exits is not None,
    )
    return LoadedModel(model, loaded.tokenizer, cfg, loaded.source)


def settled(loaded: LoadedModel, source: str, *, dtype: torch.dtype,
            exits: ExitConfig | None) -> LoadedModel:
    """``loaded`` (fp32, weights put on top of a base) named ``source``, rebuilt in ``dtype``
    and/or with ``exits`` when asked, in eval mode."""
    loaded.source = source
    if dtype != torch.float32 or exits is not None:
        loaded = rebuild(loaded, dtype=dtype, exits=exits)
        loaded.source = source
    loaded.model.eval()
    return loaded


def keep_matching_exits(
    tensors: Iterable[tuple[str, torch.Tensor]], ckpt: ModelConfig, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop checkpoint exit tensors that the requested exit configuration does not use.

    A checkpoint head is kept when its layer is still requested and the head structure
    (``head``, ``norm``, ``output``) is unchanged; anything else is re-initialised.
    """
    same = (ckpt.exits.head, ckpt.exits.norm, ckpt.exits.output) == (
        cfg.exits.head, cfg.exits.norm, cfg.exits.output)
    wanted = {str(x) for x in cfg.exits.layers} if same else set()
    for name, t in tensors:
        if name.startswith("exits.") and name.split(".", 2)[1] not in wanted:
            continue
        yield name, t


def cast_parameters(model: EarlyExitLM, dtype: torch.dtype) -> None:
    """Cast parameters to ``dtype`` keeping the rotary frequencies in fp32."""
    model.to(dtype)
    if model.rope_inv_freq is not None:
        c = model.config
        model.rope_inv_freq = rope_inv_freq(c.hdim, c.rope_theta, c.rope_scaling)


def fill_special(tok: Tokenizer | None, cfg: ModelConfig) -> Tokenizer | None:
    """Take special-token ids the tokenizer files do not state from the model config."""
    if tok is None:
        return None
    if not tok.eos_token_ids and cfg.eos_token_ids:
        tok.eos_token_ids = tuple(cfg.eos_token_ids)
    if tok.bos_token_id is None:
        tok.bos_token_id = cfg.bos_token_id
    if tok.pad_token_id is None:
        tok.pad_token_id = cfg.pad_token_id
    return tok
