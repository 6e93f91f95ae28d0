"""Cutting an early-exit model into pipeline stages (EE-LLM Sec. 3.1, App. A.2).

Stage ``s`` runs layers ``[start, end)`` (0-based slots; paper layers ``start+1 .. end``).
It owns every exit it computes. An exit after the last layer of a stage either runs at the
*beginning* of the next stage (``placement="next"``, EE-LLM's Optimization 2, the default:
it balances the load because the earlier stage already holds more in-flight activations) or
at the end of its own stage (``placement="end"``). The final output belongs to the last stage.

Parameters used by several stages - the input embedding when the LM head or an exit is tied
to it, the final norm or head when exits share them - are *replicated*: every stage that uses
one holds a copy, and their gradients are summed across those stages after each backward
(EE-LLM Sec. 3.1.2: compute as if untied, then all-reduce), so the copies stay equal.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from exitlm.config import ConfigError, ModelConfig
from exitlm.model.transformer import EarlyExitLM


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its layer range and the exits it computes."""

    index: int
    num_stages: int
    start: int
    end: int
    exits: tuple[int, ...]
    """1-based early-exit layers computed on this stage (the final output excluded)."""
    num_layers: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def loss_layers(self) -> tuple[int, ...]:
        """Every 1-based layer whose loss this stage computes (the final one on the last)."""
        return (*self.exits, self.num_layers) if self.last else self.exits


def split_layers(num_layers: int, stages: int,
                 boundaries: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """Layer ranges ``[(start, end), ...]`` of ``stages`` stages: an even split (earlier
    stages take the remainder) or explicit ``boundaries`` (1-based last layer of each stage
    but the last)."""
    if stages < 1:
        raise ConfigError(f"parallel.pp must be >= 1, got {stages}")
    if stages > num_layers:
        raise ConfigError(f"parallel.pp={stages} exceeds the model's {num_layers} layers; "
                          "every stage needs at least one layer")
    if boundaries:
        b = list(boundaries)
        if len(b) != stages - 1:
            raise ConfigError(f"parallel.boundaries needs pp - 1 = {stages - 1} values, got {b}")
        edges = [0, *b, num_layers]
        if any(lo >= hi for lo, hi in itertools.pairwise(edges)):
            raise ConfigError(f"parallel.boundaries {b} must increase strictly within "
                              f"[1, {num_layers - 1}] so every stage has a layer")
        return list(itertools.pairwise(edges))
    base, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def build_stages(model_or_cfg: EarlyExitLM | ModelConfig, stages: int,
                 boundaries: tuple[int, ...] = (),
                 placement: str = "next") -> list[StageSpec]:
    """Stage specs for a model (or its :class:`~exitlm.config.ModelConfig`)."""
    cfg = model_or_cfg.config if isinstance(model_or_cfg, EarlyExitLM) else model_or_cfg
    L = cfg.num_layers
    exits = tuple(cfg.exit_layers)
    if placement not in ("next", "end"):
        raise ConfigError(f"parallel.exit_placement must be next or end, got {placement!r}")
    ranges = split_layers(L, stages, boundaries)
    specs = []
    for i, (start, end) in enumerate(ranges):
        owned = []
        for layer in exits:
            inside = start < layer < end
            at_end = layer == end and (placement == "end" or i == stages - 1)
            at_start = layer == start and placement == "next" and layer > 0
            if inside or at_end or at_start:
                owned.append(layer)
        specs.append(StageSpec(i, stages, start, end, tuple(sorted(owned)), L))
    return specs


def stage_parameter_names(model: EarlyExitLM, spec: StageSpec) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters stage ``spec`` uses."""
    cfg = model.config
    names: set[str] = set()
    params = dict(model.named_parameters())

    def add_module(prefix: str) -> None:
        names.update(n for n in params if n.startswith(prefix + "."))

    def add_output_embedding() -> None:
        names.add("embed_tokens.weight" if model.lm_head is None else "lm_head.weight")

    if spec.first:
        add_module("embed_tokens")
        if model.embed_positions is not None:
            add_module("embed_positions")
    for i in range(spec.start, spec.end):
        add_module(f"layers.{i}")
    if spec.last:
        add_module("norm")
        add_output_embedding()
    ex = cfg.exits
    for layer in spec.exits:
        if str(layer) in model.exits:
            add_module(f"exits.{layer}")
            if ex.norm == "final":
                add_module("norm")
            if ex.output == "tied_embedding":
                names.add("embed_tokens.weight")
            elif ex.output == "final_head":
                add_output_embedding()
        else:  # LayerSkip: exit through the shared final norm + LM head
            add_module("norm")
            add_output_embedding()
    return names


def prune_to_stage(model: EarlyExitLM, spec: StageSpec) -> set[str]:
    """Drop the transformer layers and exit heads another stage owns and empty the shared
    tensors (embedding, final norm / head) this stage does not use, so a stage holds only its
    own parameters. Returns the stage's parameter names. Names are unchanged, so the state
    dicts of all stages together are the whole model's."""
    owned = stage_parameter_names(model, spec)
    for i in range(model.num_layers):
        if not spec.start <= i < spec.end:
            model.layers[i] = nn.Module()  # placeholder: keeps slot indices, holds nothing
    for key in list(model.exits.keys()):
        if int(key) not in spec.exits:
            del model.exits[key]
    for name, p in model.named_parameters():
        if name not in owned:  # shared modules another stage uses: keep dtype/device only
            p.requires_grad_(False)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return owned


def shared_parameter_users(model: EarlyExitLM, specs: list[StageSpec]) -> dict[str, list[int]]:
    """Parameters used by more than one stage -> the stages using them (sorted)."""
    users: dict[str, list[int]] = {}
    for spec in specs:
        for name in stage_parameter_names(model, spec):
            users.setdefault(name, []).append(spec.index)
    return {n: sorted(s) for n, s in sorted(users.items()) if len(s) > 1}


class StageModule(nn.Module):
    """One stage as a plain module without exits: token ids (first stage) or hidden states
    in, hidden states or final logits (last stage) out. For interoperating with
    ``torch.distributed.pipelining.PipelineStage`` (the no-exit gradient oracle and the
    benchmark baseline); exitlm's own executor does not need it."""

    def __init__(self, model: EarlyExitLM, spec: StageSpec) -> None:
        super().__init__()
        self.model = model
        self.spec = spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed(x) if self.spec.first else x
        h = self.model.run_layers(h, self.spec.start, self.spec.end)
        return self.model.final_logits(h) if self.spec.last else h
