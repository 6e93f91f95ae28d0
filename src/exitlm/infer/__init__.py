"""exitlm.infer: decoding strategies as step machines, one engine with continuous batching,
and one result type.

``generate(model, tokenizer, prompts, strategy="ar", ...)`` returns a
:class:`GenerationResult` (:mod:`exitlm.infer.api`); :class:`Engine` serves requests that
join and leave a running batch (:mod:`exitlm.infer.engine`).
"""

from exitlm.infer.api import encode_prompts, generate
from exitlm.infer.autoregressive import AROptions
from exitlm.infer.early_exit import EarlyExitOptions
from exitlm.infer.engine import Engine, EngineFull
from exitlm.infer.options import SamplingOptions
from exitlm.infer.ppd import PPDOptions
from exitlm.infer.request import Request, Update
from exitlm.infer.result import (
    DecodeStats,
    ExitSummary,
    GenerationResult,
    SequenceResult,
    Timings,
)
from exitlm.infer.self_speculative import SelfSpecOptions
from exitlm.infer.stopping import TextTracker
from exitlm.infer.strategies import STRATEGIES, Strategy, get_strategy, register_strategy

__all__ = [
    "STRATEGIES",
    "AROptions",
    "DecodeStats",
    "EarlyExitOptions",
    "Engine",
    "EngineFull",
    "ExitSummary",
    "GenerationResult",
    "PPDOptions",
    "Request",
    "SamplingOptions",
    "SelfSpecOptions",
    "SequenceResult",
    "Strategy",
    "TextTracker",
    "Timings",
    "Update",
    "encode_prompts",
    "generate",
    "get_strategy",
    "register_strategy",
]
