"""exitlm.infer: decoding strategies as step machines, one engine with continuous batching,
and one result type.

``generate(model, tokenizer, prompts, strategy="ar", ...)`` returns a
:class:`GenerationResult` (:mod:`exitlm.infer.api`); :class:`Engine` serves requests that
join and leave a running batch (:mod:`exitlm.infer.engine`).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exitlm.infer.api import encode_prompts, generate
    from exitlm.infer.engine import Engine, EngineFull
    from exitlm.infer.options import SamplingOptions
    from exitlm.infer.request import Request, Update
    from exitlm.infer.result import (
        DecodeStats,
        ExitSummary,
        GenerationResult,
        SequenceResult,
        Timings,
    )
    from exitlm.infer.stopping import TextTracker
    from exitlm.infer.strategies import STRATEGIES, Strategy, get_strategy, register_strategy
    from exitlm.infer.strategy_options import (
        AROptions,
        EarlyExitOptions,
        PPDOptions,
        SelfSpecOptions,
    )

from exitlm.lazy import lazy_exports

# The public names, loaded on first use (PEP 562): the strategy registry and the
# command-line flags must load without torch.
_HOMES = {
    "encode_prompts": "exitlm.infer.api",
    "generate": "exitlm.infer.api",
    "AROptions": "exitlm.infer.strategy_options",
    "EarlyExitOptions": "exitlm.infer.strategy_options",
    "Engine": "exitlm.infer.engine",
    "EngineFull": "exitlm.infer.engine",
    "SamplingOptions": "exitlm.infer.options",
    "PPDOptions": "exitlm.infer.strategy_options",
    "Request": "exitlm.infer.request",
    "Update": "exitlm.infer.request",
    "DecodeStats": "exitlm.infer.result",
    "ExitSummary": "exitlm.infer.result",
    "GenerationResult": "exitlm.infer.result",
    "SequenceResult": "exitlm.infer.result",
    "Timings": "exitlm.infer.result",
    "SelfSpecOptions": "exitlm.infer.strategy_options",
    "TextTracker": "exitlm.infer.stopping",
    "STRATEGIES": "exitlm.infer.strategies",
    "Strategy": "exitlm.infer.strategies",
    "get_strategy": "exitlm.infer.strategies",
    "register_strategy": "exitlm.infer.strategies",
}


__getattr__ = lazy_exports(__name__, _HOMES, globals())


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
