"""Rendering chat templates, which come with checkpoints and are untrusted input.

Templates run in Jinja's immutable sandbox (no attribute escapes, no mutation of the
messages) with limits on what the sandbox itself leaves unbounded (:class:`TemplateLimits`):

* **size**: the rendered text, and every string, list or number that an operator (``*``,
  ``+``, ``%``, ``**``, ``~``), a filter, a method call or a block (``{% set %}``, a macro)
  makes, stays within ``max_chars`` (plus room for the messages themselves). Where a
  result's size is known from the arguments (``'x' * 10**10``, ``a ~ b``,
  ``'x'|center(10**10)``, ``sep.join(items)``, ``s.replace(a, b)``) the call is refused
  *before* anything is allocated; the values a filter's iterator (``map``, ``select``...)
  yields are counted as they come, and nothing is computed at compile time (constant
  folding would run filters before any limit applies). ``lipsum`` is not offered;
* **time**: rendering stops after ``timeout_s``. A trace hook on the template's own frames
  checks the clock on every line, so loops stop even when their body produces nothing
  (nested ``range`` loops);
* **recursion** (a macro calling itself) and template syntax errors.

Every failure is a :class:`ChatTemplateError`, a one-line :class:`~exitlm.errors.ExitlmError`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MappingView
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateSyntaxError, nodes, pass_context
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from exitlm.errors import ExitlmError

MAX_TEMPLATE_BYTES = 2**20
"""The largest chat template file (``--chat-template``, a checkpoint's ``chat_template.jinja``)
read."""


class ChatTemplateError(ExitlmError, ValueError):
    """A chat template failed to render: syntax, a blocked operation, or a limit."""


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on rendering one chat template.

    ``max_chars``: the most characters the output - and any value made while rendering -
    may hold beyond four times the messages' own length; ``timeout_s``: wall-clock seconds;
    ``max_source_chars``: the longest template accepted.
    """

    max_chars: int = 1_000_000
    timeout_s: float = 5.0
    max_source_chars: int = 1_000_000


MADE_FACTOR = 64
"""The strings operations make in one rendering may add up to this many times the size
limit (each of them is within the limit itself)."""


class _Budget:
    """The clock and size limit of one rendering."""

    def __init__(self, limits: TemplateLimits, room: int) -> None:
        self.max_chars = limits.max_chars + room
        self.max_made = MADE_FACTOR * self.max_chars
        self.made = 0
        self.timeout_s = limits.timeout_s
        self.deadline = time.monotonic() + limits.timeout_s

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template: rendering took longer than "
                                    f"{self.timeout_s:g} s (an endless or very long loop?)")

    def fits(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise ChatTemplateError(f"chat template: {what} would make about {chars:,} "
                                    f"characters, more than the limit of {self.max_chars:,}")

    def value(self, value: Any, what: str) -> None:
        self.fits(size_of(value, self.max_chars), what)
        if isinstance(value, str):
            self.made_string(len(value))

    def made_string(self, chars: int) -> None:
        """Count a string an operation made: each is within ``max_chars``, but a template of
        many such expressions (``[A, A, A, ...]``) would hold them all at once."""
        self.made += chars
        if self.made > self.max_made:
            raise ChatTemplateError(
                f"chat template: the strings made while rendering reach {self.made:,} "
                f"characters in all, more than {MADE_FACTOR} x the limit of "
                f"{self.max_chars:,} (many large values at once?)")

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], what: str) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise ChatTemplateError(f"chat template: {what} got the number {a}, larger than "
                                        f"the limit of {self.max_chars:,}")

    def checked(self, value: Any, what: str) -> Any:
        """``value`` once its size is within the limit; an iterator comes back counting
        the size of what it yields."""
        self.value(value, what)
        if isinstance(value, Iterator) and not isinstance(value, (str, bytes)):
            return self._counted(value, what)
        return value

    def _counted(self, items: Iterator[Any], what: str) -> Iterator[Any]:
        total = 0
        for item in items:
            total += size_of(item, self.max_chars)
            self.fits(total, what)
            if isinstance(item, str):
                self.made_string(len(item))
            yield item


def size_of(value: Any, limit: int) -> int:
    """About how many characters ``value`` holds, counted through nested containers; stops
    counting once past ``limit``."""
    total, stack, seen = 0, [value], 0
    while stack and total <= limit:
        v = stack.pop()
        seen += 1
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, bool) or v is None:
            total += 1
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, Mapping):
            total += 2 + len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset, MappingView)):
            total += 2 + len(v)
            stack.extend(v)
        else:
            total += 1
    return total


_PRINTF_NUMBER = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")


def _check_widths(budget: _Budget, fmt: str, what: str) -> None:
    """Refuse a printf-style (``'%10000000000s'``) or ``str.format`` width beyond the limit."""
    widths = [w for m in _PRINTF_NUMBER.finditer(fmt) for w in m.groups() if w]
    with contextlib.suppress(ValueError):  # not a valid format string: Python reports it
        for _, _, spec, _ in string.Formatter().parse(fmt):
            widths += re.findall(r"\d+", spec or "")
    for w in widths:
        if len(w) > 12 or int(w) > budget.max_chars:
            raise ChatTemplateError(f"chat template: {what} asks for a field width of {w}, "
                                    f"more than the limit of {budget.max_chars:,}")


def _estimate_call(budget: _Budget, name: str, args: tuple[Any, ...],
                   kwargs: Mapping[str, Any]) -> None:
    """The size of results that arguments determine, checked before the call is made.
    ``args`` start with the string / sequence the filter or method works on."""
    limit = budget.max_chars
    if not args:
        return
    first = args[0]
    if name == "join" and len(args) > 1:  # str.join(sep, items) / |join(items, sep)
        sep, items = (first, args[1]) if isinstance(first, str) else (args[1], first)
        if isinstance(sep, str) and hasattr(items, "__len__"):
            budget.fits(size_of(items, limit) + len(sep) * len(items), "join")
    elif name == "replace" and isinstance(first, str) and len(args) >= 3:
        old, new = args[1], args[2]
        if isinstance(old, str) and isinstance(new, str):
            hits = len(first) + 1 if not old else first.count(old)
            budget.fits(len(first) + hits * len(new), "replace")
    elif name == "expandtabs" and isinstance(first, str):
        tab = args[1] if len(args) > 1 else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            budget.fits(len(first) + first.count("\t") * tab, "expandtabs")
    elif name == "indent" and isinstance(first, str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width
        if isinstance(per_line, int):
            budget.fits(len(first) + (first.count("\n") + 1) * per_line, "indent")
    elif name == "wordwrap" and isinstance(first, str):
        wrap = kwargs.get("wrapstring") or (args[3] if len(args) > 3 else None) or "\n"
        if isinstance(wrap, str):
            budget.fits(len(first) * (1 + len(wrap)), "wordwrap")
    elif name == "translate" and isinstance(first, str) and len(args) > 1:
        table = args[1]
        if isinstance(table, Mapping):
            longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1)
            budget.fits(len(first) * max(longest, 1), "translate")
    elif name in ("format", "__mod__") and isinstance(first, str):
        _check_widths(budget, first, name)
    elif name == "sum":
        start = kwargs.get("start", args[2] if len(args) > 2 else 0)
        if not isinstance(start, (int, float)):
            raise ChatTemplateError("chat template: sum() only adds numbers here")


class _CheckedConcat(CodeGenerator):
    """Jinja's code generator, except that ``a ~ b`` compiles to
    :meth:`_Sandbox.concat_values` (which checks the size first) instead of Jinja's plain
    join, and is never folded at compile time."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:  # the choice of Jinja's own visit_Concat
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.concat_values({join}, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class _Namespace(Namespace):
    """``namespace()`` whose text is short: Jinja's prints every attribute, and namespaces
    stored in each other and filled afterwards would print exponentially long text that no
    size check saw being made."""

    def __repr__(self) -> str:
        return "<namespace>"


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the size and time checks of :class:`_Budget`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CheckedConcat

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.globals.pop("lipsum", None)  # lorem ipsum of any length; no chat needs it
        self.globals["namespace"] = _Namespace
        self.filters["tojson"] = _tojson
        for name, fn in list(self.filters.items()):
            self.filters[name] = _guard(fn, name, budget)

    def concat_values(self, join: Callable[[Iterable[Any]], str], parts: tuple[Any, ...]
                      ) -> str:
        """``a ~ b ~ ...``, refused before joining when the parts hold too much."""
        b = self.budget
        b.tick()
        b.fits(sum(size_of(p, b.max_chars) for p in parts), "'~'")
        out = join(parts)
        b.value(out, "'~'")
        return out

    def concat(self, chunks: Iterable[str]) -> str:  # type: ignore[override]
        """The text of a block (``{% set x %}...{% endset %}``, a macro, a filter block),
        checked as it grows."""
        parts, total = [], 0
        for chunk in chunks:
            total += len(chunk)
            self.budget.fits(total, "a block")
            parts.append(chunk)
        return "".join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = self.budget
        b.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
                    b.fits(size_of(seq, b.max_chars) * max(n, 0), "'*'")
        elif operator == "+" and not (isinstance(left, (int, float))
                                      and isinstance(right, (int, float))):
            b.fits(size_of(left, b.max_chars) + size_of(right, b.max_chars), "'+'")
        elif operator == "%" and isinstance(left, str):
            _check_widths(b, left, "'%'")
            b.arguments(right if isinstance(right, tuple) else (right,), {}, "'%'")
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and abs(left) > 1 and right > 0):
            b.fits(left.bit_length() * right // 3, "'**'")
        out = super().call_binop(context, operator, left, right)
        b.value(out, f"'{operator}'")
        return out

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """An unsafe attribute (``__class__``, ``append``...) is an error at once, not an
        empty value that renders silently: a template reaching for one is hostile."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map`` with the field widths and arguments checked."""
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text, budget = value.__self__, self.budget

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_widths(budget, text, "format()")
            budget.arguments(args, kwargs, "format()")
            return fmt(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        b = __self.budget
        b.tick()
        name = getattr(__obj, "__name__", type(__obj).__name__)
        b.arguments(args, kwargs, f"{name}()")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _estimate_call(b, name, (owner, *args), kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        return b.checked(out, f"{name}()")


_PASSED: dict[str, Callable[[Context], Any]] = {
    "context": lambda c: c,
    "eval_context": lambda c: c.eval_ctx,
    "environment": lambda c: c.environment,
}
"""What a ``pass_context`` / ``pass_eval_context`` / ``pass_environment`` filter gets first."""


def _guard(fn: Callable[..., Any], name: str, budget: _Budget) -> Callable[..., Any]:
    """A filter that checks the clock, its arguments, the size it will make and the size it
    made. It takes the context (``pass_context``), which also keeps Jinja from running it
    at compile time (constant folding), before any limit applies."""
    passed = _PASSED.get(getattr(getattr(fn, "jinja_pass_arg", None), "name", ""))

    @pass_context
    @functools.wraps(fn)
    def guarded(context: Context, *args: Any, **kwargs: Any) -> Any:
        budget.tick()
        budget.arguments(args, kwargs, f"filter {name}")
        _estimate_call(budget, name, args, kwargs)
        lead = () if passed is None else (passed(context),)
        return budget.checked(fn(*lead, *args, **kwargs), f"filter {name}")

    return guarded


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """``tojson`` as Hugging Face chat templates use it (no HTML escaping)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@contextlib.contextmanager
def _clock_on_template_lines(budget: _Budget) -> Iterator[None]:
    """Check the clock on every line the compiled template runs (and every call made while
    rendering), so that loops without output stop at the deadline too."""
    previous = sys.gettrace()

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            budget.tick()
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        budget.tick()
        return local if frame.f_code.co_filename == "<template>" else None

    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_chat_template(source: str, limits: TemplateLimits | None = None,
                         **variables: Any) -> str:
    """Render ``source`` with ``variables`` (``messages``, ``add_generation_prompt``,
    ``bos_token``...) inside the limits; any failure is a :class:`ChatTemplateError`."""
    limits = limits or TemplateLimits()
    if not isinstance(source, str):
        raise ChatTemplateError(f"chat template: expected text, got {type(source).__name__}")
    if len(source) > limits.max_source_chars:
        raise ChatTemplateError(f"chat template: {len(source):,} characters, more than the "
                                f"limit of {limits.max_source_chars:,}")
    budget = _Budget(limits, 4 * size_of(variables, 10**12))
    env = _Sandbox(budget)

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template error: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat template line {err.lineno}: syntax error: "
                                f"{err.message}") from None
    except RecursionError:
        raise ChatTemplateError("chat template: nested too deeply to compile") from None
    parts: list[str] = []
    total = 0
    try:
        with _clock_on_template_lines(budget):
            for chunk in template.generate(**variables):
                total += len(chunk)
                budget.fits(total, "the rendered text")
                parts.append(chunk)
    except ChatTemplateError:
        raise
    except SecurityError as err:
        raise ChatTemplateError(f"chat template: blocked unsafe operation: {err}") from None
    except RecursionError:
        raise ChatTemplateError("chat template: recursion too deep (a macro calling "
                                "itself?)") from None
    except MemoryError:
        raise ChatTemplateError("chat template: out of memory while rendering") from None
    except Exception as err:  # the template's own errors: undefined names, bad types, ...
        raise ChatTemplateError(f"chat template failed: {type(err).__name__}: {err}") from None
    return "".join(parts)
