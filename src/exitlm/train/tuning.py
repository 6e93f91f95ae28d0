"""Exit tuning (EE-LLM's EE-Tuning idea): add exit heads to a trained model and train only them.

* :func:`init_heads_from_final` starts new heads as copies of what the final exit uses: the
  final norm for an own norm, the LM head for an own output matrix, the last layer's MLP (and
  its pre-MLP norm) for an MLP head, the last layer for a block head. An exit at layer ``l``
  then begins as "the last layer's computation applied early", which is where LayerSkip-style
  shared exits start too (LayerSkip Sec. 4.2).
* :func:`freeze_backbone` leaves only ``exits.*`` trainable. With a frozen backbone the
  multi-exit loss (``final_weight=0``) stops the forward after the deepest exit, so tuning
  never runs the layers after it (:func:`exitlm.train.losses.multi_exit_loss`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from exitlm.model.transformer import EarlyExitLM


@torch.no_grad()
def init_heads_from_final(model: EarlyExitLM, layers: Iterable[int]) -> list[int]:
    """Initialise the heads of ``layers`` from the final norm / LM head / last layer.

    Returns the layers whose heads were initialised.
    """
    last = model.layers[model.num_layers - 1]
    done = []
    for layer in layers:
        key = str(layer)
        if key not in model.exits:
            continue
        head = model.exits[key]
        if head.norm is not None:
            head.norm.load_state_dict(model.norm.state_dict())
        if head.proj is not None:
            head.proj.weight.copy_(model.output_embedding())
        if head.mlp is not None and head.mlp_norm is not None:
            head.mlp.load_state_dict(last.mlp.state_dict())
            head.mlp_norm.load_state_dict(last.norm_mlp.state_dict())
        if head.block is not None:
            head.block.load_state_dict(last.state_dict())
        done.append(layer)
    return done


def freeze_backbone(model: EarlyExitLM) -> list[str]:
    """Make only the exit heads' own parameters trainable; return their names."""
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("exits."))
        if p.requires_grad:
            names.append(name)
    if not names:
        raise ValueError(
            "tune.freeze_backbone leaves nothing to train: the exits own no parameters "
            "(set model.exits.norm=own, exits.head=mlp/block or exits.output=own)"
        )
    return names


def new_exit_layers(
    before: tuple[int, ...], after: tuple[int, ...], same_structure: bool
) -> list[int]:
    """Exit layers whose heads a checkpoint could not supply."""
    return [k for k in after if not same_structure or k not in before]
