"""A checkpoint's configuration against its tensor index, before anything is built.

Building a model - even on the ``meta`` device - costs time and memory in proportion to what
the configuration claims (``num_layers: 10000000`` creates ten million layer objects). The
tensors' names and shapes (safetensors headers, a sharded index, GGUF tensor infos) are known
before any weight is read, so the claims that size a model are checked against them first:
the number of layers and the embedding's ``(vocab_size, dim)``. What remains is bounded by
the checkpoint's own size; the full per-tensor check follows when the model is built.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from exitlm.config import ModelConfig
from exitlm.io.hf_map import CheckpointError

# "layers.3." (exitlm), "model.layers.3." (Llama family), "h.3." / "transformer.h.3." (GPT-2),
# "blk.3." (GGUF); exit heads ("exits.3.") are not backbone layers.
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")
EMBEDDINGS = ("embed_tokens.weight", "model.embed_tokens.weight", "wte.weight",
              "transformer.wte.weight", "token_embd.weight")


def deepest_layer(names: Iterable[str]) -> tuple[int, str | None]:
    """``(1 + the highest backbone layer index, the tensor naming it)`` among tensor names;
    ``(0, None)`` when none names a layer."""
    top, which = -1, None
    for name in names:
        if name.startswith("exits."):
            continue
        m = _LAYER.search(name)
        if m is not None and int(m.group(1)) > top:
            top, which = int(m.group(1)), name
    return top + 1, which


def check_config_against_tensors(
    cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]], source: str,
    config_name: str = "config.json", files: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`CheckpointError` when ``cfg``'s layer count or embedding shape disagrees
    with the checkpoint's tensors (``shapes``: tensor name -> shape, from headers only;
    ``files``: tensor name -> the file holding it, for messages)."""

    def where(name: str) -> str:
        return (files or {}).get(name, source)

    found, top = deepest_layer(shapes)
    if found > cfg.num_layers and top is not None:
        raise CheckpointError(
            f"{where(top)}: tensor {top!r} belongs to layer {found}, but {config_name} says "
            f"num_layers={cfg.num_layers}; the configuration does not match the weights"
        )
    if found < cfg.num_layers:
        raise CheckpointError(
            f"{source}: {config_name} says num_layers={cfg.num_layers} but the weights hold "
            f"{found} layer(s); the configuration does not match the weights"
        )
    for name in EMBEDDINGS:
        shape = shapes.get(name)
        if shape is not None and tuple(shape) != (cfg.vocab_size, cfg.dim):
            raise CheckpointError(
                f"{where(name)}: tensor {name!r} has shape {tuple(shape)} but {config_name} "
                f"implies (vocab_size, dim) = ({cfg.vocab_size}, {cfg.dim})"
            )
