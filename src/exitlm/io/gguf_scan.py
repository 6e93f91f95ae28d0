"""A bounded pre-scan of a GGUF header, run before ``gguf.GGUFReader`` sees the file.

``GGUFReader`` builds Python objects for every item a metadata array *claims* to hold, so a
4 KB file whose header claims an array of 2**60 items makes it loop (and allocate) without
end, and a real array of millions of empty strings costs gigabytes. :func:`scan_gguf_header`
walks the header (magic, version, counts, each key/value, each tensor description) without
materializing any value: fixed-size arrays are skipped by ``count * size`` once that is
known to fit in the file, string arrays are walked length by length, and an array claiming
more items than the remaining bytes could hold, or more than :data:`MAX_ARRAY_ITEMS` items in
all, is refused with one line naming the key. Time and memory are bounded by the file's size
and the item cap, whatever the header claims.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from exitlm.io.hf_map import CheckpointError

MAX_ARRAY_ITEMS = 2_000_000
"""Most metadata array items (all arrays of a file together) exitlm reads. Llama-3's
tokenizer holds about 660K, Gemma-3's about 790K."""
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DEPTH = 4  # nested arrays

_STRING = 8
_ARRAY = 9
# GGUFValueType -> size in bytes of the fixed-size scalar types.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_VERSIONS = (2, 3)


def _show(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 120 else text[:120] + "...")


class _Scanner:
    def __init__(self, path: Path, buf: bytes | mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.items = 0

    def fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise self.fail(f"{what} needs {n:,} bytes but only {self.left():,} remain in the "
                            "file (truncated or corrupt GGUF)")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw

    def skip_string(self, what: str) -> None:
        n = self.u64(what)
        self.need(n, what)
        self.pos += n

    def value(self, vtype: int, key: str, depth: int = 0) -> None:
        if vtype in _FIXED:
            self.need(_FIXED[vtype], f"GGUF metadata {key}")
            self.pos += _FIXED[vtype]
        elif vtype == _STRING:
            self.skip_string(f"GGUF metadata {key} (a string)")
        elif vtype == _ARRAY:
            self.array(key, depth)
        else:
            raise self.fail(f"GGUF metadata {key}: unknown value type {vtype} (expected "
                            f"0..12, as the GGUF spec defines)")

    def array(self, key: str, depth: int) -> None:
        if depth >= _MAX_DEPTH:
            raise self.fail(f"GGUF metadata {key}: arrays nested deeper than {_MAX_DEPTH}")
        etype = self.u32(f"GGUF metadata {key} (array element type)")
        count = self.u64(f"GGUF metadata {key} (array length)")
        if etype in _FIXED:
            least = _FIXED[etype]
        elif etype == _STRING:
            least = 8
        elif etype == _ARRAY:
            least = 12
        else:
            raise self.fail(f"GGUF metadata {key}: unknown array element type {etype} "
                            "(expected 0..12, as the GGUF spec defines)")
        if count * least > self.left():
            raise self.fail(
                f"GGUF metadata {key}: array claims {count:,} items but only {self.left():,} "
                f"bytes remain in the file (at least {least} per item expected)")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise self.fail(
                f"GGUF metadata {key}: array of {count:,} items brings the file's metadata "
                f"arrays to {self.items:,} items; exitlm reads at most {MAX_ARRAY_ITEMS:,}")
        if etype in _FIXED:
            self.pos += count * least
        elif etype == _STRING:
            buf, pos, size = self.buf, self.pos, self.size
            unpack = struct.Struct("<Q").unpack_from
            for i in range(count):
                if pos + 8 > size:
                    self.pos = pos
                    self.need(8, f"GGUF metadata {key} (string {i})")
                (n,) = unpack(buf, pos)
                pos += 8 + n
                if pos > size:
                    raise self.fail(f"GGUF metadata {key}: string {i} claims {n:,} bytes, past "
                                    "the end of the file (truncated or corrupt GGUF)")
            self.pos = pos
        else:
            for _ in range(count):
                self.array(key, depth + 1)


def scan_gguf_header(path: Path) -> None:
    """Check that ``path``'s GGUF header is well-formed and bounded; raise
    :class:`CheckpointError` (one line naming the file and the key or tensor) if not."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise CheckpointError(f"{path}: not a GGUF file (only {size} bytes; a GGUF header "
                                  "needs at least 24)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _scan(_Scanner(path, buf))


def _scan(s: _Scanner) -> None:
    magic = bytes(s.buf[:4])
    if magic != b"GGUF":
        raise s.fail(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    s.pos = 4
    version = s.u32("GGUF version")
    if version not in _VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in _VERSIONS:
            raise s.fail("big-endian GGUF files are not supported (exitlm reads little-endian "
                         "GGUF v2/v3)")
        raise s.fail(f"GGUF version {version} is not supported (exitlm reads versions 2 and 3)")
    n_tensors = s.u64("GGUF tensor count")
    n_kv = s.u64("GGUF key/value count")
    if n_kv * 13 > s.left():  # key length 8 + >= 1 byte + type 4
        raise s.fail(f"GGUF header claims {n_kv:,} metadata entries but only {s.left():,} bytes "
                     "remain in the file")
    for i in range(n_kv):
        raw = s.string(f"GGUF metadata entry {i} (key)")
        key = _show(raw)
        vtype = s.u32(f"GGUF metadata {key} (value type)")
        s.value(vtype, key)
    if n_tensors * 24 > s.left():  # name length 8 + n_dims 4 + type 4 + offset 8
        raise s.fail(f"GGUF header claims {n_tensors:,} tensors but only {s.left():,} bytes "
                     "remain in the file")
    for i in range(n_tensors):
        name = _show(s.string(f"GGUF tensor {i} (name)"))
        n_dims = s.u32(f"GGUF tensor {name} (dimension count)")
        if n_dims > MAX_DIMS:
            raise s.fail(f"GGUF tensor {name}: {n_dims:,} dimensions (GGUF allows at most "
                         f"{MAX_DIMS})")
        s.need(8 * n_dims + 12, f"GGUF tensor {name} (shape, type, offset)")
        s.pos += 8 * n_dims + 12
