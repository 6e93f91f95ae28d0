"""Where exitlm keeps what it computes once: one answer for every package that caches."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$EXITLM_CACHE`` (``~`` expanded) or ``~/.cache/exitlm``: converted models, token
    orders, tokenized corpora, benchmark files, the kernels' developer builds and runners'
    primitive timings (:mod:`exitlm.runtime.cost_store`)."""
    env = os.environ.get("EXITLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "exitlm"
