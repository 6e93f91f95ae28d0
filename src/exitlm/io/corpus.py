"""Where text comes from: the corpus readers every part of exitlm shares.

Text files, directories and JSONL files (:class:`DataConfig`), split into training and
held-out documents by a hash of their path (:func:`is_held_out`), so the split never changes.
The default corpus is the Python standard library's source (every machine has it), split by
file. Training tokenizes the training documents (:mod:`exitlm.train.data`); the benchmarks and
evaluation tasks draw prompts from the held-out ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from exitlm.config import ConfigError
from exitlm.schema import PositiveInt, Range, Seed, check

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it is cut.

    ``paths``: text files, directories (``*.py``, ``*.txt``, ``*.md``, ``*.rst`` inside,
    recursively) and ``.jsonl`` files (one document per line, field ``text_field``). Empty: the
    Python standard library's source. ``val_fraction`` of the files (of the lines for JSONL)
    go to the held-out split, chosen by a hash of their path, so the split never changes.
    ``suffixes``: the file kinds read inside directories (empty: the ones above; e.g.
    ``[".py"]`` for a corpus of Python code only).
    """

    paths: tuple[str, ...] = ()
    tokenizer: str = "bytes"
    seq_len: Annotated[int, Range(ge=2)] = 128
    val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.02
    seed: Seed = 0
    max_files: PositiveInt | None = None
    text_field: str = "text"
    cache_dir: str | None = None
    suffixes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(self, "data")
        known = (*TEXT_SUFFIXES, ".jsonl")
        bad = [x for x in self.suffixes if x not in known]
        if bad:
            raise ConfigError(f"data.suffixes: {bad[0]!r} is not a file kind exitlm reads; "
                              f"choose from {list(known)}")


# ----- documents --------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(cfg: DataConfig, setting: str = "data.paths") -> list[tuple[str, Path]]:
    """``(key, path)`` for every input file; ``key`` (path relative to its root) decides the
    split. Sorted, so the order is the same on every machine with the same files. Errors name
    ``setting`` (the option that gave the paths)."""
    roots = [Path(p).expanduser() for p in cfg.paths] or [stdlib_root()]
    out: list[tuple[str, Path]] = []
    for root in roots:
        if root.is_file():
            out.append((root.name, root))
        elif root.is_dir():
            stdlib = not cfg.paths  # the default corpus: the standard library's *.py only
            suffixes = cfg.suffixes or ((".py",) if stdlib else (*TEXT_SUFFIXES, ".jsonl"))
            # the installed packages inside the standard library's folder are not part of it
            # (also when the folder is named in data.paths)
            skip_packages = stdlib or root.resolve() == stdlib_root().resolve()
            out.extend(_walk(root, suffixes, skip_packages))
        elif root.exists():  # a device, a pipe, a socket: reading it may never end
            raise ConfigError(f"{setting}: {root} is not a regular file or directory")
        else:
            raise ConfigError(f"{setting}: {root} does not exist")
    if cfg.max_files is not None:
        out = out[: cfg.max_files]
    if not out:
        raise ConfigError(f"{setting} {list(cfg.paths)} contain no text files "
                          f"({', '.join(TEXT_SUFFIXES)}, .jsonl)")
    return out


def _walk(root: Path, suffixes: tuple[str, ...], skip_packages: bool) -> list[tuple[str, Path]]:
    """The files under ``root`` with one of ``suffixes``, sorted by their path's parts;
    folders named ``site-packages`` / ``dist-packages`` are not entered with
    ``skip_packages`` (symlinked folders never: the walk stays bounded)."""
    found: list[tuple[tuple[str, ...], Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if skip_packages:
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        base = Path(dirpath)
        rel_dir = base.relative_to(root).parts
        for name in filenames:
            if os.path.splitext(name)[1] in suffixes and (base / name).is_file():
                found.append(((*rel_dir, name), base / name))
    found.sort(key=lambda item: item[0])
    return [("/".join(parts), path) for parts, path in found]


def is_held_out(key: str, fraction: float, seed: int) -> bool:
    """Whether the document ``key`` belongs to the held-out ``fraction`` (a hash of the key
    and ``seed``: the same split on every machine, whatever else the corpus holds)."""
    h = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def held_out_samples(cfg: DataConfig, n: int, nbytes: int) -> list[bytes]:
    """The first ``nbytes`` bytes of the first ``n`` held-out files of ``cfg``'s corpus that
    are longer than that (in the corpus' order): the same samples on every machine with the
    same files, never trained on by a run over this corpus."""
    out: list[bytes] = []
    for key, path in list_sources(cfg):
        if len(out) == n:
            break
        if path.suffix != ".jsonl" and is_held_out(key, cfg.val_fraction, cfg.seed):
            data = path.read_bytes()
            if len(data) > nbytes:
                out.append(data[:nbytes])
    return out


def iter_jsonl(path: Path, errors: str = "strict") -> Iterator[tuple[int, Any]]:
    """``(0-based line number, decoded JSON value)`` per non-blank line of a JSONL file;
    a line that is not JSON raises :class:`ConfigError` naming the file and line. ``errors``:
    how undecodable UTF-8 is handled (``open``'s argument)."""
    try:
        f = Path(path).open(encoding="utf-8", errors=errors)  # noqa: SIM115
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror or err})") from None
    with f:
        yield from parse_jsonl(path, f)


def parse_jsonl(path: str | Path, lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """``(0-based line number, decoded JSON value)`` per non-blank line of ``lines``, the
    text of the JSONL file ``path``; a line that is not JSON raises :class:`ConfigError`
    naming the file and line."""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except (ValueError, RecursionError) as err:
            raise ConfigError(f"{path}:{i + 1}: not valid JSON ({err})") from err


def iter_documents(cfg: DataConfig, setting: str = "data.paths") -> Iterator[tuple[str, str]]:
    """``(key, text)`` per document: a whole file, or one JSONL line (key ``file:line``);
    errors name ``setting`` (the option that gave the paths)."""
    for key, path in list_sources(cfg, setting):
        if path.suffix == ".jsonl":
            for i, rec in iter_jsonl(path, errors="replace"):
                text = rec.get(cfg.text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(f"{path}:{i + 1}: no string field "
                                      f"{cfg.text_field!r} (set data.text_field)")
                yield f"{key}:{i}", text
        else:
            try:
                data = path.read_bytes()
            except OSError as err:
                raise ConfigError(f"{setting}: cannot read {path} ({err.strerror or err})"
                                  ) from None
            yield key, data.decode("utf-8", errors="replace")
