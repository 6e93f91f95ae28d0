"""Training data: text files, directories and JSONL -> tokenized, packed, memory-mapped token
files with a held-out split, and a deterministic, resumable, rank-sharded batch stream.

Preprocessing (:func:`prepare`) writes ``train.bin`` / ``val.bin`` (flat token ids, documents
joined by a separator token) and ``meta.json`` into a directory named by a fingerprint of the
inputs. Files are written under temporary names and renamed; ``meta.json`` comes last and marks
the directory complete, so an interrupted run is simply redone when run again.

The corpus itself - which documents, which are held out - is :mod:`exitlm.io.corpus`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from exitlm.config import ConfigError
from exitlm.errors import ExitlmError
from exitlm.io import load_model
from exitlm.io.corpus import DataConfig, is_held_out, iter_documents, list_sources, stdlib_root
from exitlm.io.default_model import cache_root
from exitlm.io.dirs import ensure_dir
from exitlm.paths import pid_alive, write_text_atomic
from exitlm.tokenizer import Tokenizer

DATA_FORMAT = 1


class TextTokenizer(Protocol):
    """What preprocessing needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_id(self) -> int: ...

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256); byte 0 separates documents."""

    vocab_size = 256
    max_id = 255
    eos_token_ids = (0,)
    bos_token_id = None
    pad_token_id = None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(spec: str, setting: str = "data.tokenizer") -> Any:
    """``bytes``, a directory with ``tokenizer.json``, or any name/path ``load_model`` takes;
    errors name ``setting`` (the option that gave ``spec``)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.load(path)
    given = f"{setting} {spec!r}" if setting.startswith("--") else f"{setting}={spec!r}"
    try:
        tok = load_model(spec).tokenizer
    except ExitlmError as err:
        raise ConfigError(f"{given}: {err}", hint=err.hint) from None
    if tok is None:
        raise ConfigError(f"{given} has no tokenizer; use 'bytes', 'default' or a checkpoint "
                          "directory with tokenizer.json")
    return tok


# ----- preprocessing ----------------------------------------------------------------------------

def data_dir_for(cfg: DataConfig) -> Path:
    """The cache directory of this corpus + tokenizer + split."""
    h = hashlib.sha256()
    for key, path in list_sources(cfg):
        st = path.stat()
        h.update(f"{key}|{path}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(f"{cfg.tokenizer}|{cfg.val_fraction}|{cfg.seed}|{cfg.text_field}|{DATA_FORMAT}"
             .encode())
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root() / "data"
    return root / h.hexdigest()[:20]


def prepare(cfg: DataConfig, *, progress: bool = True, tokenizer: Any = None) -> Path:
    """Tokenize and pack the corpus once; return the directory (``train.bin``, ``val.bin``,
    ``meta.json``). A complete directory is reused; an interrupted one is redone."""
    out = data_dir_for(cfg)
    if out.is_dir():
        _remove_dead_temps(out)
    if (out / "meta.json").is_file():
        return out
    tok = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    eos = getattr(tok, "eos_token_ids", ()) or ()
    sep = int(eos[0]) if eos else 0
    dtype = np.uint16 if max(tok.vocab_size - 1, tok.max_id) < 2**16 else np.uint32
    ensure_dir(out, "data.cache_dir" if cfg.cache_dir else "")
    tag = f".tmp-{os.getpid()}"
    counts = {"train": 0, "val": 0}
    docs = {"train": 0, "val": 0}
    sources = list_sources(cfg)
    files = {s: open(out / f"{s}.bin{tag}", "wb") for s in counts}  # noqa: SIM115
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), desc="tokenizing", unit="file", disable=not progress,
                   leave=False)
        last_file = None
        val_keys: list[str] = []
        for key, text in iter_documents(cfg):
            split = "val" if is_held_out(key, cfg.val_fraction, cfg.seed) else "train"
            if isinstance(tok, ByteTokenizer):
                ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(dtype)
            else:
                ids = np.asarray(tok.encode(text, add_bos=False), dtype=dtype)
            if not ids.size:
                continue
            np.append(ids, np.asarray([sep], dtype=dtype)).tofile(files[split])
            counts[split] += int(ids.size) + 1
            docs[split] += 1
            if split == "val":
                val_keys.append(key)
            file_key = key.split(":", 1)[0]
            if file_key != last_file:
                bar.update(1)
                last_file = file_key
        bar.close()
    finally:
        for f in files.values():
            f.close()
    if counts["val"] == 0 or counts["train"] == 0:
        for s in counts:
            (out / f"{s}.bin{tag}").unlink(missing_ok=True)
        raise ConfigError(
            f"the corpus splits into {docs['train']} training and {docs['val']} held-out "
            "documents; both must be non-empty (add files or change data.val_fraction)"
        )
    for s in counts:
        os.replace(out / f"{s}.bin{tag}", out / f"{s}.bin")
    meta = {
        "format": DATA_FORMAT, "tokenizer": cfg.tokenizer, "vocab_size": int(tok.vocab_size),
        "dtype": np.dtype(dtype).name, "separator": sep, "tokens": counts, "documents": docs,
        "val_documents": val_keys[:1000],
        "sources": [str(p) for p in cfg.paths] or [str(stdlib_root())],
    }
    write_text_atomic(out / "meta.json", json.dumps(meta, indent=1) + "\n")
    return out


def _remove_dead_temps(out: Path) -> None:
    """Delete ``*.tmp-PID`` files that preprocessing runs killed mid-way left in ``out``."""

    for f in out.glob("*.tmp-*"):
        pid = f.name.rsplit(".tmp-", 1)[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            f.unlink(missing_ok=True)


# ----- reading ----------------------------------------------------------------------------------

class TokenFile:
    """A memory-mapped token file cut into windows of ``seq_len + 1`` tokens (inputs + the
    next-token labels), stride ``seq_len``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "data",
                 seq_len_setting: str = "data.seq_len") -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(f"{name} holds {len(self.tokens)} tokens, fewer than one sample of "
                              f"{seq_len_setting}={seq_len} + 1; use more data or a shorter "
                              f"{seq_len_setting}")

    @classmethod
    def open(cls, path: Path, dtype: str, seq_len: int) -> TokenFile:
        """Memory-map a token file written by :func:`prepare`."""
        return cls(np.memmap(path, dtype=np.dtype(dtype), mode="r"), seq_len, str(path))

    def window(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))  # (B, T+1)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def open_split(directory: Path, split: str, seq_len: int) -> TokenFile:
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    return TokenFile.open(directory / f"{split}.bin", meta["dtype"], seq_len)


class BatchStream:
    """An endless, deterministically shuffled stream of training batches.

    The stream is a global sequence of sample indices: epoch ``e`` is a permutation seeded by
    ``(seed, e)``. Each step consumes ``batch_size * world_size`` consecutive entries; rank
    ``r`` takes the ``r``-th block of ``batch_size``, so ``world_size`` ranks together see
    exactly what one process with the combined batch sees. ``position`` (entries consumed) is
    all a checkpoint needs to resume.
    """

    def __init__(
        self, data: TokenFile, batch_size: int, *, seed: int = 0, rank: int = 0,
        world_size: int = 1, position: int = 0,
    ) -> None:
        self.data = data
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = position
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _index(self, p: int) -> int:
        n = self.data.num_samples
        epoch = p // n
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[p % n])

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.position + self.rank * self.batch_size
        idx = [self._index(p) for p in range(start, start + self.batch_size)]
        self.position += self.batch_size * self.world_size
        return self.data.batch(idx)


def eval_batches(
    data: TokenFile, batch_size: int, max_samples: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out windows in order, ``batch_size`` at a time; with ``max_samples``, that many
    windows evenly spread over the split."""
    n = data.num_samples
    if max_samples is None or max_samples >= n:
        idx = list(range(n))
    else:
        idx = [i * n // max_samples for i in range(max_samples)]
    for s in range(0, len(idx), batch_size):
        yield data.batch(idx[s : s + batch_size])
