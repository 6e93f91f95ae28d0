"""exitlm.infer: text generation with one entry point and one result type.

``generate(model, tokenizer, prompts, strategy="ar", ...)`` returns a
:class:`GenerationResult`; see :mod:`exitlm.infer.api`.
"""

from exitlm.infer.api import STRATEGIES, Strategy, encode_prompts, generate, register_strategy
from exitlm.infer.autoregressive import AROptions, generate_ar
from exitlm.infer.options import SamplingOptions
from exitlm.infer.result import GenerationResult, SequenceResult, Timings
from exitlm.infer.stopping import TextTracker

__all__ = [
    "STRATEGIES",
    "AROptions",
    "GenerationResult",
    "SamplingOptions",
    "SequenceResult",
    "Strategy",
    "TextTracker",
    "Timings",
    "encode_prompts",
    "generate",
    "generate_ar",
    "register_strategy",
]
