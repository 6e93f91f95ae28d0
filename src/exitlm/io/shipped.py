"""Models shipped inside the package: whole exitlm checkpoints under ``exitlm/data``.

A shipped model is an exitlm directory (:mod:`exitlm.io.native`, sharded to stay under the
package index's file limits), or a low-rank delta over a base the user installs
(:mod:`exitlm.io.delta`), with a model card (``README.md``) beside its weights. A name is
known only when its directory is installed: a source checkout without the weights does not
pretend to have the model. ``layerskip-code`` is the byte-level code model trained with the
LayerSkip recipe (layer dropout + early-exit loss at every layer through the shared final norm
and head, LayerSkip Sec. 4.1-4.2) by ``device/layerskip_code.py``.
"""

from __future__ import annotations

from pathlib import Path

from exitlm.io.bundle import DATA_DIR, SHIPPED_MODELS
from exitlm.io.delta import is_delta_dir
from exitlm.io.native import is_native_dir


def shipped_dir(name: str, data_dir: Path | None = None) -> Path | None:
    """The installed directory of the shipped model ``name``, else ``None`` (not a shipped
    name, or its weights are not installed)."""
    folder = SHIPPED_MODELS.get(name)
    if folder is None:
        return None
    path = (data_dir or DATA_DIR) / folder
    return path if is_native_dir(path) or is_delta_dir(path) else None


def shipped_names(data_dir: Path | None = None) -> list[str]:
    """The shipped models installed here, sorted."""
    return sorted(n for n in SHIPPED_MODELS if shipped_dir(n, data_dir) is not None)
