"""Typed configuration of an early-exit transformer.

One :class:`ModelConfig` describes both families exitlm supports (one model class,
docs/architecture.md):

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
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from exitlm.errors import ConfigError
from exitlm.schema import (
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    UnitFloat,
    build,
    check,
)

NormType = Literal["rmsnorm", "layernorm"]
PosType = Literal["rope", "learned"]
MlpType = Literal["swiglu", "gelu"]
Activation = Literal["silu", "gelu", "gelu_tanh", "relu"]
ExitHead = Literal["linear", "mlp", "block"]
ExitNorm = Literal["none", "own", "final"]
ExitOutput = Literal["tied_embedding", "final_head", "own"]
TokenId = NonNegativeInt


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling.

    ``kind="llama3"`` is the wavelength-dependent scaling of Llama 3.1 (used by SmolLM2's
    long-context variants and Llama-3 checkpoints); ``kind="linear"`` divides all positions
    by ``factor``.
    """

    kind: Literal["linear", "llama3"] = "llama3"
    factor: PositiveFloat = 8.0
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192

    def __post_init__(self) -> None:
        check(self, "rope_scaling")


DraftWeights = Literal["model", "int8", "int4"]
"""What self-speculative drafts run on: the model's own layers, or a quantized copy of the
model (:mod:`exitlm.runtime.draft_copy`; ``--draft-weights``)."""


@dataclass(frozen=True)
class DraftHint:
    """The self-speculative round measured fastest for a model's weights on held-out text
    (LayerSkip Sec. 4.3: drafts from exit ``E``, ``d`` per round), recorded by whoever trained
    or tuned the exits (``exitlm bench --sweep speculation``). Self-speculation drafts at it
    when the exit is left open (:class:`~exitlm.infer.adaptive.SpecPlanner` prefers it and
    leaves it only for a round that promises clearly more, or for plain steps).

    Attributes:
        exit_layer: the draft exit ``E`` (one of the model's exits).
        num_speculations: drafts per round ``d``.
        weights: what the drafts ran on: ``model`` (the model's own layers) or ``int8`` /
            ``int4`` (a quantized copy of the model, :mod:`exitlm.runtime.draft_copy`;
            used where the copy can run, the model's own layers elsewhere).
    """

    exit_layer: PositiveInt
    num_speculations: Annotated[int, Range(ge=1, le=64)]
    weights: DraftWeights = "model"

    def __post_init__(self) -> None:
        check(self, "exits.draft")


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
        draft: the self-speculative round measured fastest with these exits' weights
            (:class:`DraftHint`), or ``None``. Replacing a checkpoint's exits drops it.
        threshold: the confidence threshold measured to keep plain decoding's output with
            these exits' weights on held-out text (``exitlm bench --sweep threshold``),
            early exit's default for the model (EE-LLM Sec. 5.2: an exit emits its token when
            its maximum probability reaches the threshold), or ``None`` (the strategy's
            default). Replacing a checkpoint's exits drops it.
    """

    layers: tuple[int, ...] = ()
    every_layer: bool = False
    head: ExitHead = "linear"
    norm: ExitNorm = "own"
    output: ExitOutput = "final_head"
    draft: DraftHint | None = None
    threshold: UnitFloat | None = None

    def __post_init__(self) -> None:
        check(self, "exits")
        object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))


LAYERSKIP_EXITS = ExitConfig(every_layer=True, norm="final")
"""LayerSkip's exits (Sec. 4.2): every layer through the model's shared final norm and LM head,
no parameters of their own. What a model without exits gets where exits are needed: a
decoding strategy other than plain decoding, a self-speculative round or an early-exit
threshold recorded in its config (``exitlm convert --draft`` / ``--threshold``)."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer with early exits."""

    vocab_size: PositiveInt = 256
    dim: PositiveInt = 64
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    hidden_dim: PositiveInt = 172
    max_seq_len: PositiveInt = 512
    norm: NormType = "rmsnorm"
    norm_eps: Annotated[float, Range(gt=0, lt=1)] = 1e-5
    pos: PosType = "rope"
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    mlp: MlpType = "swiglu"
    activation: Activation = "silu"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True
    bos_token_id: TokenId | None = None
    eos_token_ids: tuple[TokenId, ...] = ()
    pad_token_id: TokenId | None = None
    exits: ExitConfig = field(default_factory=ExitConfig)
    name: str = "custom"

    def __post_init__(self) -> None:
        check(self)
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
        for layer in self.exits.layers:
            if not 1 <= layer < self.num_layers:
                raise ConfigError(
                    f"exits.layers contains {layer}; exits are counted from 1 and must lie in "
                    f"[1, {self.num_layers - 1}] for a {self.num_layers}-layer model "
                    "(layer L is the final output, which always exists)"
                )
        hint = self.exits.draft
        if hint is not None and hint.exit_layer not in self.exit_layers:
            raise ConfigError(
                f"exits.draft.exit_layer is {hint.exit_layer}, which is not an exit of this "
                f"model; expected one of its exit layers ({_span(self.exit_layers)})"
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

    def with_draft(self, exit_layer: int, num_speculations: int, weights: str = "model"
                   ) -> ModelConfig:
        """This config with ``exits.draft`` set (:class:`DraftHint`; its exit is checked
        against this model's exits)."""
        hint = DraftHint(exit_layer, num_speculations, weights)  # type: ignore[arg-type]
        return self.replace(exits=dataclasses.replace(self.exits, draft=hint))

    def with_threshold(self, threshold: float) -> ModelConfig:
        """This config with ``exits.threshold`` set (checked: a probability in [0, 1])."""
        return self.replace(exits=dataclasses.replace(self.exits, threshold=threshold))

    # ----- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exits"]["layers"] = list(self.exits.layers)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> ModelConfig:
        """A config from plain data (``config.json``); every key and value is checked by
        type and range. ``where`` prefixes error messages (e.g. the file's path)."""
        try:
            return build(cls, d, label="model config")
        except ConfigError as err:
            if not where:
                raise
            raise ConfigError(f"{where}: {err}", hint=err.hint) from None

    def approx_num_parameters(self) -> int:
        """The parameter count implied by the config, computed without building a model
        (embeddings, attention and MLP weights; norms and biases left out)."""
        d, hd = self.dim, self.hdim
        attn = d * hd * (2 * self.num_heads + 2 * self.n_kv_heads)
        mlp = d * self.hidden_dim * (3 if self.mlp == "swiglu" else 2)
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embeddings + self.num_layers * (attn + mlp)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


def _span(layers: tuple[int, ...]) -> str:
    """``1-23`` for a contiguous run of layers, else the list; ``none`` when empty."""
    if not layers:
        return "none"
    if list(layers) == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


# Python objects per layer (modules, parameters) cost memory beyond the weights themselves.
_LAYER_OVERHEAD_BYTES = 32 * 1024


def check_fits_in_memory(cfg: ModelConfig, key: str = "model", bytes_per_parameter: int = 4
                         ) -> None:
    """Refuse, before anything is allocated, a configuration whose weights alone exceed this
    machine's physical memory (a typo such as ``num_layers: 10000000`` would otherwise grow
    memory until the process is killed)."""
    need = cfg.approx_num_parameters() * bytes_per_parameter + cfg.num_layers * \
        _LAYER_OVERHEAD_BYTES
    total = physical_memory()
    if total is not None and need > total:
        raise ConfigError(
            f"{key}: the configuration needs about {need / 2**30:,.1f} GiB for its weights "
            f"({cfg.num_layers} layers, dim {cfg.dim}, vocabulary {cfg.vocab_size}), more than "
            f"this machine's {total / 2**30:,.1f} GiB of memory",
            hint="reduce num_layers, dim, hidden_dim or vocab_size",
        )


_ROW_OVERHEAD_BYTES = 256
"""Python objects per batch row while a batch is built (its index, its window array)."""


def training_step_bytes(cfg: ModelConfig, batch_size: int, grad_accum: int, seq_len: int
                        ) -> int:
    """About the memory one training step takes beyond the weights and optimizer state: the
    inputs and labels (int64) of all ``grad_accum`` micro-batches, which are built before the
    step runs, and one micro-batch's fp32 activations kept for the backward pass (per layer
    and token: the normed input, the attention output and the MLP's hidden values; per exit
    and token: the logits). A lower bound (attention scores, gradients and temporaries come
    on top), for refusing absurd sizes, not for planning."""
    tokens = batch_size * seq_len
    buffers = grad_accum * tokens * 2 * 8 + batch_size * (_ROW_OVERHEAD_BYTES + 3 * 8 * seq_len)
    per_layer = 4 * cfg.dim + 2 * cfg.hidden_dim
    per_token = 4 * (cfg.num_layers * per_layer + (len(cfg.exit_layers) + 1) * cfg.vocab_size)
    return buffers + tokens * per_token


def check_batch_fits_in_memory(cfg: ModelConfig, batch_size: int, grad_accum: int,
                               seq_len: int) -> None:
    """Refuse, before any batch is built, a training step (``train.batch_size`` rows of
    ``data.seq_len`` tokens, ``train.grad_accum`` micro-batches) that needs more than this
    machine's physical memory (:func:`training_step_bytes`): a typo such as
    ``train.grad_accum=1000000000`` would otherwise grow memory until the process dies."""
    need = training_step_bytes(cfg, batch_size, grad_accum, seq_len)
    total = physical_memory()
    if total is not None and need > total:
        raise ConfigError(
            f"train.batch_size={batch_size} x train.grad_accum={grad_accum} micro-batches of "
            f"data.seq_len={seq_len} tokens: a training step needs about {need / 2**30:,.1f} GiB "
            f"for its batches and activations, more than this machine's "
            f"{total / 2**30:,.1f} GiB of memory",
            hint="reduce train.batch_size, train.grad_accum or data.seq_len",
        )


def physical_memory() -> int | None:
    """Bytes of physical memory, or ``None`` where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


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


def preset(name: str, /, **overrides: Any) -> ModelConfig:
    """Return a named preset configuration, optionally with fields replaced."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
