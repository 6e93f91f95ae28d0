"""The registry of decoding strategies: a name, a typed options dataclass and a
:class:`~exitlm.infer.decoder.Decoder` factory each.

The engine, :func:`~exitlm.infer.api.generate`, the command-line flags
(:mod:`exitlm.infer.flags`) and the server all look strategies up here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exitlm.config import ConfigError
from exitlm.infer.options import per_request_fields
from exitlm.infer.strategy_options import AROptions, EarlyExitOptions, PPDOptions, SelfSpecOptions

if TYPE_CHECKING:
    from exitlm.infer.decoder import Decoder
    from exitlm.runtime.runner import Runner


@dataclass(frozen=True)
class Strategy:
    """A decoding strategy: its options type and how to build its decoder on a runner."""

    name: str
    options_type: type
    decoder: Callable[[Runner, Any], Decoder]
    description: str = ""

    @property
    def per_request(self) -> frozenset[str]:
        """Options each request may set for itself (the rest shape the decoder)."""
        return per_request_fields(self.options_type)

    def options(self, base: Any = None, **changes: Any) -> Any:
        """``base`` (default: the defaults) with ``changes`` applied, type-checked."""
        opts = self.options_type() if base is None else base
        if not isinstance(opts, self.options_type):
            raise ConfigError(f"strategy {self.name!r} takes options of type "
                              f"{self.options_type.__name__}, got {type(opts).__name__}")
        fields = {f.name for f in dataclasses.fields(opts)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise ConfigError(f"unknown {self.name!r} options {unknown}; it takes: "
                              f"{sorted(fields) or 'none'}")
        return dataclasses.replace(opts, **changes) if changes else opts


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> None:
    """Make ``strategy`` available under ``strategy.name``."""
    STRATEGIES[strategy.name] = strategy


def get_strategy(name: str) -> Strategy:
    if name not in STRATEGIES:
        raise ConfigError(f"unknown decoding strategy {name!r}; available: {sorted(STRATEGIES)}")
    return STRATEGIES[name]


# The decoders are imported when one is built: the registry (names, options, flags) loads
# without torch.
def _ar(runner: Runner, opts: Any) -> Decoder:
    from exitlm.infer.autoregressive import DepthDecoder  # lazy: torch-free registry

    return DepthDecoder(runner, opts)


def _early_exit(runner: Runner, opts: Any) -> Decoder:
    from exitlm.infer.early_exit import early_exit_decoder  # lazy: torch-free registry

    return early_exit_decoder(runner, opts)


def _self_spec(runner: Runner, opts: Any) -> Decoder:
    from exitlm.infer.self_speculative import SelfSpecDecoder  # lazy: torch-free registry

    return SelfSpecDecoder(runner, opts)


def _ppd(runner: Runner, opts: Any) -> Decoder:
    from exitlm.infer.ppd import PPDDecoder  # lazy: torch-free registry

    return PPDDecoder(runner, opts)


register_strategy(Strategy(
    "ar", AROptions, _ar,
    "plain autoregressive decoding (the baseline)"))
register_strategy(Strategy(
    "early-exit", EarlyExitOptions, _early_exit,
    "confidence exits with KV recomputation (EE-LLM); fixed-layer exit (LayerSkip)"))
register_strategy(Strategy(
    "self-spec", SelfSpecOptions, _self_spec,
    "self-speculative decoding: draft with exit E, verify with layers E..L (LayerSkip)"))
register_strategy(Strategy(
    "ppd", PPDOptions, _ppd,
    "Predictive Pipelined Decoding: top-k early guesses start the next token in parallel"))
