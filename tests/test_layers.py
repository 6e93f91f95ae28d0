"""The layer map of docs/architecture.md, enforced: packages import only the layers below them
(and their siblings in the same layer not at all), no two modules import each other in a
circle, and an import inside a function says why it is there (``# lazy: <reason>``, for
start-up time) instead of dodging a cycle."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "exitlm"

LAYERS: list[list[str]] = [
    ["errors", "lazy", "paths"],
    ["args", "env", "schema", "progress", "table", "textfile"],
    ["config", "chat_template"],
    ["tokenizer"],
    ["model"],
    ["kernels"],
    ["runtime"],
    ["io", "comm"],
    ["plan"],
    ["infer"],
    ["train"],
    ["eval", "serve"],
    ["bench"],
    ["cli"],
    ["__main__", "exitlm"],
]
"""Bottom to top; the groups of one layer are independent of each other (docs/architecture.md
says what each owns)."""

LAZY = re.compile(r"#\s*lazy:\s*\S")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "exitlm"


def _imports() -> list[tuple[str, str, int, bool, Path]]:
    """(importer, imported module, line, inside a function, file) for every import of an
    exitlm module in src/exitlm."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        me = _module(path)
        tree = ast.parse(path.read_text())
        in_function = {id(n) for f in ast.walk(tree)
                       if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                       for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                if node.module == "exitlm":  # from exitlm import io -> exitlm.io
                    names = [f"exitlm.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "exitlm" or name.startswith("exitlm."):
                    out.append((me, name, node.lineno, id(node) in in_function, path))
    return out


def _rank() -> dict[str, int]:
    return {g: i for i, layer in enumerate(LAYERS) for g in layer}


def test_every_package_has_a_layer() -> None:
    rank = _rank()
    groups = {_group(_module(p)) for p in SRC.rglob("*.py")}
    assert groups <= set(rank), f"packages without a layer: {sorted(groups - set(rank))}"


def test_imports_follow_the_layer_map() -> None:
    rank = _rank()
    bad = []
    for me, name, line, _, path in _imports():
        a, b = _group(me), _group(name)
        if a == b or b not in rank or a not in rank:
            continue
        if rank[b] > rank[a]:
            bad.append(f"{path.relative_to(SRC)}:{line} imports {name} (layer of {b} is above "
                       f"{a})")
        elif rank[b] == rank[a]:
            bad.append(f"{path.relative_to(SRC)}:{line} imports {name} ({a} and {b} are "
                       "independent)")
    assert not bad, "\n".join(bad)


def test_no_module_circles() -> None:
    """No circle of imports between modules, function-level imports included (Tarjan's
    strongly connected components over the import graph)."""
    modules = {_module(p) for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for me, name, *_ in _imports():
        target = name
        while target not in modules and "." in target:  # exitlm.x.Name -> exitlm.x
            target = target.rsplit(".", 1)[0]
        if target in modules and target != me and not me.startswith(target + "."):
            graph[me].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # iterative depth would do; the graph is small
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    assert not circles, circles


def test_function_level_imports_say_why() -> None:
    """An exitlm import inside a function is there for start-up time (a command that must
    not import torch-heavy modules before it needs them), and says so on its line or the
    line above (``# lazy: ...``)."""
    bad = []
    for _me, name, line, inside, path in _imports():
        if not inside:
            continue
        lines = path.read_text().splitlines()
        here = lines[line - 1]
        above = lines[line - 2] if line > 1 else ""
        if not (LAZY.search(here) or LAZY.search(above)):
            bad.append(f"{path.relative_to(SRC)}:{line} {name}")
    assert not bad, f"{len(bad)} function-level imports without '# lazy: <reason>':\n" + \
        "\n".join(bad)
