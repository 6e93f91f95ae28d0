"""Command-line flags derived from the strategies' options dataclasses.

Every field of every registered strategy's options type becomes one flag (``exit_layer`` ->
``--exit-layer``; the type from the annotation, the help from the field's metadata, see
:func:`~exitlm.infer.options.option`). A name shared by several strategies is one flag whose
help lists each meaning. ``exitlm generate``, ``bench`` and ``serve`` add the same flags; the
dataclasses are the only table. ``--head-dtype`` (:func:`add_head_dtype_flag`), a loading flag
those commands and ``eval`` share, is defined here once too.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from exitlm.args import int_list
from exitlm.config import ConfigError
from exitlm.infer.strategies import STRATEGIES
from exitlm.schema import convert, field_hints


def _fields() -> dict[str, list[tuple[str, dataclasses.Field[Any], Any]]]:
    """Option name -> [(strategy, field, annotation)] over the registered strategies."""
    out: dict[str, list[tuple[str, dataclasses.Field[Any], Any]]] = {}
    for name, strat in STRATEGIES.items():
        hints = typing.get_type_hints(strat.options_type)
        for f in dataclasses.fields(strat.options_type):
            out.setdefault(f.name, []).append((name, f, hints[f.name]))
    return out


def flag(name: str) -> str:
    """The command-line flag of option ``name``."""
    return "--" + name.replace("_", "-")


def strategies_taking(name: str) -> tuple[str, ...]:
    """The strategies that have an option ``name``."""
    return tuple(s for s, _, _ in _fields().get(name, []))


def _int_tuple(text: str) -> tuple[int, ...]:
    """:func:`exitlm.args.int_list` as the tuple a strategy option holds."""
    return tuple(int_list(text))


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field annotated ``annotation`` (``X | None`` means X)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0]
        args = list(typing.get_args(annotation))
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        return {"choices": list(args)}
    if typing.get_origin(annotation) is tuple:
        return {"type": _int_tuple, "metavar": "L1,L2,..."}
    if annotation in (int, float, str):
        return {"type": annotation}
    raise TypeError(f"no command-line form for options of type {annotation!r}")


def add_strategy_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per strategy option (default: each strategy's own default)."""
    g = parser.add_argument_group("strategy options (default: each strategy's own defaults)")
    for name, uses in _fields().items():
        helps = "; ".join(f"{s}: {f.metadata.get('help', '')}" for s, f, _ in uses)
        g.add_argument(flag(name), dest=name, default=None, help=helps.replace("%", "%%"),
                       **_argument(uses[0][2]))


HEAD_DTYPES = ("int8",)
"""``--head-dtype`` choices: the precision of the output embeddings alone."""


def add_head_dtype_flag(parser: argparse.ArgumentParser | Any) -> None:
    """``--head-dtype``: quantize only the output embeddings of a float model (the one
    definition ``generate``, ``serve``, ``bench`` and ``eval`` share)."""
    parser.add_argument(
        "--head-dtype", choices=HEAD_DTYPES, default=None,
        help="int8: quantize only the LM head and the exits' own output matrices of a float "
             "model (groups of 32; a tied embedding keeps its lookups and gets an int8 "
             "copy, +28%% of its fp32 memory); every strategy stays token-identical to plain "
             "decoding with that head (default: the heads in --dtype)")


def strategy_overrides(args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    """The strategy options given on the command line, checked against ``strategy``."""
    options_type = STRATEGIES[strategy].options_type
    own = {f.name for f in dataclasses.fields(options_type)}
    out: dict[str, Any] = {}
    for name in _fields():
        value = getattr(args, name, None)
        if value is None:
            continue
        if name not in own:
            takes = sorted(flag(f) for f in own)
            raise ConfigError(f"{flag(name)} does not apply to --strategy {strategy} (it "
                              f"takes: {', '.join(takes) or 'no options'})")
        # checked here so that a bad value is named by its flag (--stages 0), not its field
        out[name] = convert(value, field_hints(options_type)[name], flag(name))
    return out
