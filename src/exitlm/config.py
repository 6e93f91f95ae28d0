"""Typed configuration of an early-exit transformer.

One :class:`ModelConfig` describes both families exitlm supports (DESIGN.md, "One model"):

* the Llama family (Llama, Mistral, Qwen2, SmolLM): RMSNorm, rotary positions, SwiGLU MLP,
  grouped-query attention, optional q/k/v biases (Qwen2);
* GPT-2: LayerNorm, learned positions, GELU MLP, multi-head attention with biases.

Exits are part of the configuration (EE-LLM Sec. 2 and App. D.1, LayerSkip Sec. 4.2), see
:class:`ExitConfig`.

**Layer numbering.** Layers are counted from 1 like the papers: an exit at layer ``l`` reads
the hidden state *after* the ``l``-th transformer layer. The final output is "layer L" (after
the last layer and the final norm). Internally, ``run_layers(start, end)`` uses Python's
half-open 0-based layer slots, so "exit after layer l" is the state produced by
``run_layers(0, l)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

NormType = Literal["rmsnorm", "layernorm"]
PosType = Literal["rope", "learned"]
MlpType = Literal["swiglu", "gelu"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
ExitHead = Literal["linear", "mlp", "block"]
ExitNorm = Literal["none", "own", "final"]
ExitOutput = Literal["tied_embedding", "final_head", "own"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the setting to change."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling.

    ``kind="llama3"`` is the wavelength-dependent scaling of Llama 3.1 (used by SmolLM2's
    long-context variants and Llama-3 checkpoints); ``kind="linear"`` divides all positions
    by ``factor``.
    """

    kind: Literal["linear", "llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ExitConfig:
    """Where a model may exit early and what an exit head looks like (EE-LLM App. D.1).

    Attributes:
        layers: 1-based layer indices ``l`` (``1 <= l < num_layers``): an exit reads the hidden
            state after layer ``l``. Each listed layer gets an exit head of the structure below.
        every_layer: LayerSkip (Sec. 4.2): every layer ``1..L-1`` without a head of its own may
            exit through the model's *final* norm and LM head (no extra parameters).
        head: what precedes the output embedding: ``linear`` (nothing), ``mlp`` (one MLP of
            the backbone's kind with a residual connection) or ``block`` (a full transformer
            layer, EE-LLM's "layer" exit).
        norm: the norm right before the output embedding: ``none``, ``own`` (a new norm per
            exit) or ``final`` (the backbone's final norm, shared).
        output: the output embedding: ``tied_embedding`` (the input embedding matrix),
            ``final_head`` (the backbone's LM head; equals the input embedding when the model
            ties them) or ``own`` (a new matrix per exit).
    """

    layers: tuple[int, ...] = ()
    every_layer: bool = False
    head: ExitHead = "linear"
    norm: ExitNorm = "own"
    output: ExitOutput = "final_head"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted({int(x) for x in self.layers})))
        _check_choice("exits.head", self.head, ("linear", "mlp", "block"))
        _check_choice("exits.norm", self.norm, ("none", "own", "final"))
        _check_choice("exits.output", self.output, ("tied_embedding", "final_head", "own"))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer with early exits."""

    vocab_size: int = 256
    dim: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_dim: int = 172
    max_seq_len: int = 512
    norm: NormType = "rmsnorm"
    norm_eps: float = 1e-5
    pos: PosType = "rope"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: MlpType = "swiglu"
    activation: Activation = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    exits: ExitConfig = field(default_factory=ExitConfig)
    name: str = "custom"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "num_layers", "num_heads", "hidden_dim", "max_seq_len"):
            if int(getattr(self, key)) <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        _check_choice("norm", self.norm, ("rmsnorm", "layernorm"))
        _check_choice("pos", self.pos, ("rope", "learned"))
        _check_choice("mlp", self.mlp, ("swiglu", "gelu"))
        _check_choice("activation", self.activation, ("silu", "gelu", "gelu_tanh", "relu"))
        kv = self.n_kv_heads
        if self.num_heads % kv != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kv})"
            )
        if self.head_dim is None and self.dim % self.num_heads != 0:
            raise ConfigError(
                f"dim ({self.dim}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        if self.pos == "rope" and self.hdim % 2 != 0:
            raise ConfigError(f"rotary positions need an even head_dim, got {self.hdim}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        for layer in self.exits.layers:
            if not 1 <= layer < self.num_layers:
                raise ConfigError(
                    f"exits.layers contains {layer}; exits are counted from 1 and must lie in "
                    f"[1, {self.num_layers - 1}] for a {self.num_layers}-layer model "
                    "(layer L is the final output, which always exists)"
                )

    @property
    def n_kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def hdim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    @property
    def exit_layers(self) -> tuple[int, ...]:
        """All 1-based layers at which the model can exit early, excluding the final layer."""
        if self.exits.every_layer:
            return tuple(range(1, self.num_layers))
        return self.exits.layers

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ----- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exits"]["layers"] = list(self.exits.layers)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = _build(RopeScaling, d["rope_scaling"], "rope_scaling")
        if isinstance(d.get("exits"), dict):
            d["exits"] = _build(ExitConfig, d["exits"], "exits")
        if "eos_token_ids" in d and d["eos_token_ids"] is not None:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


def _build(kind: type, d: dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {prefix} keys {unknown}; known keys: {sorted(known)}")
    return kind(**d)


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")


# ----- presets -------------------------------------------------------------------------------

def _debug() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, hidden_dim=128,
        max_seq_len=256, exits=ExitConfig(layers=(1, 2)), name="debug",
    )


def _debug_gpt2() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, dim=64, num_layers=4, num_heads=4, hidden_dim=256, max_seq_len=256,
        norm="layernorm", pos="learned", mlp="gelu", activation="gelu_tanh", qkv_bias=True,
        out_bias=True, mlp_bias=True, exits=ExitConfig(layers=(2,)), name="debug-gpt2",
    )


def _smollm2_135m() -> ModelConfig:
    return ModelConfig(
        vocab_size=49152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3, hidden_dim=1536,
        max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5, pos="rope", rope_theta=100000.0,
        mlp="swiglu", activation="silu", tie_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,), pad_token_id=2, name="smollm2-135m",
    )


def _gpt2_small() -> ModelConfig:
    return ModelConfig(
        vocab_size=50257, dim=768, num_layers=12, num_heads=12, hidden_dim=3072,
        max_seq_len=1024, norm="layernorm", pos="learned", mlp="gelu", activation="gelu_tanh",
        qkv_bias=True, out_bias=True, mlp_bias=True, norm_eps=1e-5, tie_embeddings=True,
        bos_token_id=50256, eos_token_ids=(50256,), name="gpt2",
    )


PRESETS = {
    "debug": _debug,
    "debug-gpt2": _debug_gpt2,
    "smollm2-135m": _smollm2_135m,
    "gpt2": _gpt2_small,
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Return a named preset configuration, optionally with fields replaced."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
