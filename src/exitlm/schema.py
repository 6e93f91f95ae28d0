"""Typed conversion of plain data (YAML, JSON, command-line values) into config dataclasses.

Every config dataclass states its settings as type hints; limits ride along as
``typing.Annotated`` metadata (:class:`Range`, or the aliases below). One converter reads
those hints, so a bad value anywhere - a training YAML file, a ``key=value`` override, a
checkpoint's ``config.json`` - is reported the same way::

    train.batch_size: expected an integer >= 1, got 2.5

:func:`build` makes a dataclass from a mapping (unknown keys are errors); :func:`check`
validates and normalises an instance made in Python (each config's ``__post_init__`` calls
it); :func:`convert` converts one value. Conversion is strict: ``"false"`` is not a bool,
``4.5`` is not an integer, ``nan`` and ``inf`` are not numbers. Two conveniences: a single
value where a list is expected is a one-element list, and a string spelling a finite number
is accepted where a float is expected (YAML reads ``1e-3`` as a string).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union

from exitlm.errors import ConfigError, short_repr

T = TypeVar("T")


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric setting (``ge``: >=, ``gt``: >, ``le``: <=, ``lt``: <)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, v: float) -> bool:
        """Whether ``v`` lies within the bounds."""
        return not ((self.ge is not None and v < self.ge) or (self.gt is not None and v <= self.gt)
                    or (self.le is not None and v > self.le)
                    or (self.lt is not None and v >= self.lt))

    def describe(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1]``, ``in (0, 1)``..."""
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if low is not None and high is not None:
            left = "[" if self.ge is not None else "("
            right = "]" if self.le is not None else ")"
            return f"in {left}{_num(low)}, {_num(high)}{right}"
        if low is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low)}"
        if high is not None:
            return f"{'<=' if self.le is not None else '<'} {_num(high)}"
        return ""


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
UnitFloat = Annotated[float, Range(ge=0, le=1)]
Seed = Annotated[int, Range(ge=0, le=2**32 - 1)]
"""A random seed: what every generator exitlm seeds accepts (``torch``, ``numpy``)."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unwrap(hint: Any) -> tuple[Any, Range | None]:
    if typing.get_origin(hint) is Annotated:
        base, *meta = typing.get_args(hint)
        return base, next((m for m in meta if isinstance(m, Range)), None)
    return hint, None


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


_NOUNS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
          str: ("a string", "strings"), bool: ("true or false", "true/false values")}


def describe(hint: Any, plural: bool = False) -> str:
    """What a value of type ``hint`` must be, in words (``an integer >= 1``)."""
    base, rng = _unwrap(hint)
    origin = typing.get_origin(base)
    if base is Any:
        return "any value"
    if base is type(None):
        return "null"
    if _is_union(origin):
        return " or ".join(describe(a, plural) for a in typing.get_args(base))
    if origin is Literal:
        choices = list(typing.get_args(base))
        return f"{'values' if plural else 'one'} of {choices}"
    if origin is tuple:
        return f"{'lists' if plural else 'a list'} of {describe(typing.get_args(base)[0], True)}"
    if base is dict or origin is dict:
        return "mappings" if plural else "a mapping"
    if dataclasses.is_dataclass(base):
        return f"{'mappings' if plural else 'a mapping'} of {base.__name__} settings"
    noun = _NOUNS.get(base, (f"a {getattr(base, '__name__', base)}",) * 2)[int(plural)]
    limits = rng.describe() if rng is not None else ""
    return f"{noun} {limits}".strip()


def _fail(key: str, hint: Any, value: Any) -> ConfigError:
    where = f"{key}: " if key else ""
    return ConfigError(f"{where}expected {describe(hint)}, got {short_repr(value)}")


def convert(value: Any, hint: Any, key: str = "") -> Any:
    """``value`` checked against (and converted to) the type ``hint``; a
    :class:`~exitlm.errors.ConfigError` naming ``key`` when it does not fit."""
    base, rng = _unwrap(hint)
    origin = typing.get_origin(base)
    if base is Any:
        return value
    if _is_union(origin):
        arms = typing.get_args(base)
        if value is None and type(None) in arms:
            return None
        for arm in arms:
            if arm is type(None):
                continue
            try:
                return convert(value, arm, key)
            except ConfigError:
                if _same_shape(arm, value):
                    raise  # the value meant this arm: its own, more precise message
        raise _fail(key, hint, value)
    if origin is Literal:
        if any(type(value) is type(c) and value == c for c in typing.get_args(base)):
            return value
        raise _fail(key, hint, value)
    if origin is tuple:
        return _convert_tuple(value, hint, key)
    if base is dict or origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise _fail(key, hint, value)
    if dataclasses.is_dataclass(base) and isinstance(base, type):
        if isinstance(value, base):
            return value
        if isinstance(value, Mapping):
            return build(base, value, key)
        raise _fail(key, hint, value)
    if base is bool:
        if isinstance(value, bool):
            return value
        raise _fail(key, hint, value)
    if base is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(key, hint, value)
        out: Any = value
    elif base is float:
        out = _to_float(value)
        if out is None:
            raise _fail(key, hint, value)
    elif isinstance(base, type):
        if isinstance(value, base):
            return value
        raise _fail(key, hint, value)
    else:  # pragma: no cover - a hint this converter does not know is a programming error
        raise TypeError(f"{key}: unsupported type hint {hint!r}")
    if rng is not None and not rng.holds(out):
        raise _fail(key, hint, value)
    return out


def _same_shape(hint: Any, value: Any) -> bool:
    """Whether ``value`` has the structure of ``hint`` (a mapping for a dataclass, a list
    for a list type), so that an error inside it is the one to report."""
    base, _ = _unwrap(hint)
    if dataclasses.is_dataclass(base):
        return isinstance(value, Mapping)
    return typing.get_origin(base) is tuple and isinstance(value, (list, tuple))


def _to_float(value: Any) -> float | None:
    """A finite float from an int, a float or a string spelling a number; else ``None``."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        if len(value) > 64:
            return None
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, int):
        try:
            value = float(value)
        except OverflowError:
            return None
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _convert_tuple(value: Any, hint: Any, key: str) -> tuple[Any, ...]:
    base, _ = _unwrap(hint)
    args = typing.get_args(base)
    if len(args) != 2 or args[1] is not Ellipsis:  # pragma: no cover - fixed-size tuples
        raise TypeError(f"{key}: unsupported type hint {hint!r}")
    item = args[0]
    if isinstance(value, (list, tuple)):
        return tuple(convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if isinstance(value, (Mapping, set, frozenset)):
        raise _fail(key, hint, value)
    try:  # one value where a list is expected: a one-element list
        return (convert(value, item, key),)
    except ConfigError:
        raise _fail(key, hint, value) from None


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """The resolved type hints of a dataclass's fields (``Annotated`` metadata kept)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def convert_fields(cls: type, data: Any, prefix: str = "", label: str | None = None
                   ) -> dict[str, Any]:
    """The entries of mapping ``data`` converted by the hints of dataclass ``cls``'s fields
    (a subset of the fields is fine); unknown keys are an error."""
    what = label or prefix or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping of {what} settings, "
                          f"got {short_repr(data)}")
    hints = field_hints(cls)
    unknown = sorted(str(k) for k in data if k not in hints)
    if unknown:
        raise ConfigError(f"unknown {what} keys {unknown}; known keys: {sorted(hints)}")
    return {k: convert(v, hints[k], _join(prefix, k)) for k, v in data.items()}


def build(cls: type[T], data: Any, prefix: str = "", label: str | None = None) -> T:
    """An instance of dataclass ``cls`` from mapping ``data`` (missing keys take defaults).

    Args:
        prefix: the dotted key of ``data`` in error messages (``train`` -> ``train.steps``).
        label: how unknown keys are introduced (``unknown <label> keys [...]``).
    """
    if isinstance(data, cls):
        return data
    values = convert_fields(cls, data, prefix, label)
    missing = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
               if f.init and f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix or cls.__name__}: missing {_plural(missing)} "
                          f"{', '.join(repr(m) for m in missing)}")
    return cls(**values)


def _plural(names: list[str]) -> str:
    return "key" if len(names) == 1 else "keys"


def check(obj: Any, prefix: str = "") -> None:
    """Validate every field of dataclass instance ``obj`` by its hint and store the
    normalised value (lists become tuples, ints become floats where floats are expected)."""
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        new = convert(value, hint, _join(prefix, name))
        if new is not value:
            object.__setattr__(obj, name, new)
