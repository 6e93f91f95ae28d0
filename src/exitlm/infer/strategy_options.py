"""The options of the built-in decoding strategies: typed dataclasses that the registry
(:mod:`exitlm.infer.strategies`), the command-line flags (:mod:`exitlm.infer.flags`) and the
server read. They import no torch, so ``exitlm <command> --help`` and argument errors answer
at once; the decoders that take them import these names from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from exitlm.config import ConfigError, DraftWeights, ModelConfig
from exitlm.infer.options import option
from exitlm.schema import PositiveInt, Range, UnitFloat, check

MAX_SPECULATIONS = 64
"""The most draft tokens a round may hold (bounds the cache slots a round writes)."""
Speculations = Annotated[int, Range(ge=1, le=MAX_SPECULATIONS)]


@dataclass(frozen=True)
class AROptions:
    """Options of plain autoregressive decoding (none beyond :class:`SamplingOptions`)."""


DEFAULT_THRESHOLD = 0.9
"""Early exit's confidence threshold for a model that records none (``exits.threshold``)."""


@dataclass(frozen=True)
class EarlyExitOptions:
    """Options of the ``early-exit`` strategy (see :mod:`exitlm.infer.early_exit`)."""

    threshold: UnitFloat | None = option(
        None, "confidence threshold on an exit's maximum probability (EE-LLM); 1.0 never "
        "exits early (exactly greedy decoding); default: the model's recorded exits.threshold "
        f"(measured to keep plain decoding's output), else {DEFAULT_THRESHOLD}",
        per_request=True)
    exit_layers: tuple[PositiveInt, ...] | None = option(
        None, "the exits checked, in order (default: the model's exit heads; for a LayerSkip "
        "model with only every-layer exits, the layers at 1/4, 1/2 and 3/4 depth - each "
        "check costs an LM-head projection)")
    max_pending: PositiveInt = option(
        8, "force a full-depth pass once this many tokens await KV recomputation (EE-LLM "
        "App. D.3)", per_request=True)
    kv: Literal["recompute", "copy", "pipeline"] = option(
        "recompute", "KV recomputation (exact keys/values, EE-LLM), CALM state copying "
        "(lossy), or pipeline-based inference across --stages processes (EE-LLM Sec. 4; "
        "no recomputation, same tokens as recompute)")
    stages: PositiveInt | None = option(
        None, "with --kv pipeline: pipeline stages, one process each (default 2)")
    exit_layer: PositiveInt | None = option(
        None, "fixed-layer exit at E for every token (LayerSkip Sec. 4.2, lossy); overrides "
        "the confidence rule")

    def threshold_for(self, config: ModelConfig) -> float:
        """The threshold in force on a model of ``config``: this option, else the model's
        recorded ``exits.threshold``, else :data:`DEFAULT_THRESHOLD`."""
        if self.threshold is not None:
            return self.threshold
        recorded = config.exits.threshold
        return DEFAULT_THRESHOLD if recorded is None else recorded

    def __post_init__(self) -> None:
        check(self)
        if self.stages is not None and self.kv != "pipeline":
            raise ConfigError(f"--stages {self.stages} applies only to --kv pipeline "
                              f"(got --kv {self.kv})")
        if self.kv == "pipeline" and self.exit_layer is not None:
            raise ConfigError("--exit-layer (a fixed exit) does not run as a pipeline; use "
                              "--kv pipeline with confidence exits (--threshold)")
        if self.exit_layers is not None:
            layers = tuple(sorted(set(self.exit_layers)))
            object.__setattr__(self, "exit_layers", layers)


@dataclass(frozen=True)
class SelfSpecOptions:
    """Options of the ``self-spec`` strategy."""

    exit_layer: PositiveInt | None = option(
        None, "the draft exit E (default: chosen per step from measured agreement and costs; "
        "on a tensor-parallel shard the deepest exit head, or L // 2 for LayerSkip "
        "every-layer exits)")
    num_speculations: Speculations | None = option(
        None, "d, draft tokens per round (LayerSkip Sec. 4.3.1; default: chosen per step, "
        "plain steps when no round pays; 4 on a tensor-parallel shard)", per_request=True)
    draft_vocab: PositiveInt | None = option(
        None, "draft only among the first N token ids (BPE ids roughly follow merge "
        "frequency): a cheaper exit projection; output unchanged")
    draft_threshold: UnitFloat | None = option(
        None, "stop a round's drafting once the exit's probability of its own draft falls "
        "below this (transformers' assistant_confidence_threshold); output unchanged",
        per_request=True)
    draft_weights: DraftWeights | None = option(
        None, "what the drafts run on: 'model' (the model's own first E layers; verification "
        "reuses their keys, values and exit query - LayerSkip), 'int8' / 'int4' (a quantized "
        "copy of the model, about +28% / +19% of its float32 memory: cheaper draft steps; "
        "verification then runs all L layers; a float32 model on the CPU kernels; one "
        "sequence at a time - batches draft through the model); output unchanged either way "
        "(default: the model's recorded round's, else 'model')")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class PPDOptions:
    """Options of the ``ppd`` strategy."""

    ppd_layer: PositiveInt | None = option(
        None, "d_bar, the exit whose top-k predictions start the next token (d/2 <= d_bar < d; "
        "default: the deepest exit head >= d/2, else d/2)")
    ppd_k: PositiveInt = option(1, "k, the number of candidate branches")
    parallel: bool = option(
        True, "run branches concurrently with the main thread (threads / CUDA streams); "
        "--no-parallel runs them one after the other (same tokens)")
    ppd_workers: Literal["thread", "process"] = option(
        "thread", "where the branches run: 'thread' (worker threads; CUDA streams on a GPU) or "
        "'process' (CPU: one spawned worker process, KV cache in shared memory, one thread "
        "per process; overlaps where threads are serialised by the GIL)")
    draft_vocab: PositiveInt | None = option(
        None, "take the top-k among the first N token ids only (a cheaper early projection "
        "on the critical path); output unchanged")

    def __post_init__(self) -> None:
        check(self)
        if self.draft_vocab is not None and self.draft_vocab < self.ppd_k:
            raise ConfigError(f"draft_vocab must be >= ppd_k, got {self.draft_vocab}")
        if self.ppd_workers == "process" and not self.parallel:
            raise ConfigError("ppd_workers='process' runs the branches in parallel; drop "
                              "--no-parallel (or use --ppd-workers thread)")
