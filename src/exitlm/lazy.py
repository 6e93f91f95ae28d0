"""Public names of a package that load on first use (PEP 562), so that importing the package -
``exitlm --help`` and argument errors import ``exitlm``, ``exitlm.infer`` and ``exitlm.io`` -
does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each public name to the module
    defining it, imported when the name is first read; the value is then kept in
    ``namespace`` (the package's ``globals()``), so later reads are plain lookups."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    return __getattr__
