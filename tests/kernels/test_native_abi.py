"""The ctypes mirror (exitlm.kernels.abi) against the C header, read by a small parser: every
function's return and argument types, every struct's fields; the C sources define exactly
the header's exports; a library of another ABI version or struct layout is refused."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from exitlm.kernels import abi, loader

_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
            "double": ctypes.c_double}


def _clean(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def _ctype(decl: str) -> type | None:
    """The ctypes type of a C type (pointers are raw addresses; ``const char *`` a string)."""
    decl = " ".join(decl.replace("const ", "").split())
    if decl == "void":
        return None
    if decl == "char *":
        return ctypes.c_char_p
    if "*" in decl:
        return ctypes.c_void_p
    return _SCALARS[decl]


def _header() -> tuple[dict[str, list[tuple[str, type]]], dict[str, tuple[type | None, tuple]]]:
    text = _clean(abi.HEADER.read_text())
    structs: dict[str, list[tuple[str, type]]] = {}
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \w+;", text, flags=re.S):
        fields: list[tuple[str, type]] = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            first, *rest = (p.strip() for p in decl.split(","))
            base = re.match(r"((?:const )?(?:struct )?\w+)\s*(.*)", first)
            assert base is not None, decl
            for declarator in (base.group(2), *rest):
                fields.append((declarator.lstrip("* "),
                               ctypes.c_void_p if "*" in declarator
                               else _SCALARS[base.group(1)]))
        structs[name] = fields
    text = re.sub(r"typedef struct \w+ \{.*?\} \w+;|enum \{.*?\};|struct \w+;", " ", text,
                  flags=re.S)
    functions: dict[str, tuple[type | None, tuple]] = {}
    for ret, name, params in re.findall(r"([\w\s\*]+?)\s*\b(exitlm_\w+)\(([^)]*)\);", text):
        args = [] if params.strip() == "void" else [
            _ctype(re.sub(r"\w+$", "", p.strip())) if "*" not in p
            else ctypes.c_void_p for p in params.split(",")]
        functions[name] = (_ctype(ret.strip()), tuple(args))
    return structs, functions


def test_the_ctypes_signatures_are_the_headers() -> None:
    _, functions = _header()
    assert len(functions) >= 30
    assert set(functions) == set(abi.FUNCTIONS)
    for name, (ret, args) in functions.items():
        assert abi.FUNCTIONS[name] == (ret, args), name


def test_the_ctypes_structs_are_the_headers() -> None:
    structs, _ = _header()
    assert [name for name, _ in abi.STRUCTS] == list(structs)
    for name, struct in abi.STRUCTS:
        assert [(f, t) for f, t in struct._fields_] == structs[name], name


def test_the_sources_define_exactly_the_headers_exports() -> None:
    _, functions = _header()
    defined: set[str] = set()
    for src in loader.SOURCES:
        text = _clean(src.read_text())
        defined |= set(re.findall(r"^(?!static)[\w \*]*?\b(exitlm_\w+)\([^;{]*\)\s*\{", text,
                                  flags=re.M))
        assert "typedef struct exitlm" not in text, f"{src.name} redefines a header struct"
    assert defined == set(functions)


class _FakeFn:
    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self, *args: object) -> int:
        return self.value


class _FakeLib:
    """A stand-in for a loaded library with a chosen ABI version and struct sizes."""

    def __init__(self, version: int, sizes: dict[int, int]) -> None:
        for name in abi.FUNCTIONS:
            setattr(self, name, _FakeFn(0))
        self.exitlm_abi_version = _FakeFn(version)
        self.exitlm_struct_size = lambda i: sizes.get(i, ctypes.sizeof(abi.STRUCTS[i][1]))


def test_a_library_of_another_abi_is_refused() -> None:
    abi.declare(_FakeLib(abi.ABI_VERSION, {}), "good.so")  # the matching stand-in passes
    with pytest.raises(abi.NativeABIError, match=r"stale.so: native library ABI version 0"):
        abi.declare(_FakeLib(0, {}), "stale.so")
    with pytest.raises(abi.NativeABIError, match=r"exitlm_layer is 80 bytes"):
        abi.declare(_FakeLib(abi.ABI_VERSION, {2: 80}), "odd.so")
    lib = _FakeLib(abi.ABI_VERSION, {})
    del lib.exitlm_chan_send
    with pytest.raises(abi.NativeABIError, match="lacks exitlm_chan_send"):
        abi.declare(lib, "old.so")
    with pytest.raises(abi.NativeABIError, match="no exitlm_abi_version"):
        abi.declare(object(), Path("foreign.so"))  # type: ignore[arg-type]
