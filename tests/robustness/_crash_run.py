"""Run a tiny training and ``kill -9`` this process at a chosen point of checkpointing.

    python _crash_run.py CONFIG.json POINT N

``CONFIG.json`` is a :meth:`TrainConfig.to_dict`; the process sends itself SIGKILL the N-th
time it reaches ``POINT``:

* ``after-step``: a training step finished (between checkpoints);
* ``before-model.safetensors`` / ``before-optimizer.safetensors``: a checkpoint's temporary
  directory exists, that file is not written yet;
* ``before-rename``: the temporary checkpoint is complete but not yet renamed into place;
* ``latest-tmp-created``: the ``latest`` pointer's temporary file exists and is empty;
* ``mid-prune``: an old checkpoint was renamed aside and one of its files deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any


def main() -> None:
    cfg_file, point, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import torch

    torch.set_num_threads(1)
    import exitlm.train.checkpoint as ck
    from exitlm.train.config import TrainConfig
    from exitlm.train.trainer import Trainer

    seen: dict[str, int] = {}

    def reached(name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        if name == point and seen[name] == nth:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    real_save_file = ck.save_file

    def save_file(tensors: Any, path: str, metadata: Any = None) -> None:
        reached(f"before-{Path(path).name}")
        real_save_file(tensors, path, metadata=metadata)

    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if ck.STEP_DIR.fullmatch(Path(dst).name) and ".tmp-" in Path(src).name:
            reached("before-rename")
        real_replace(src, dst)

    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> Any:
        out = real_mkstemp(*args, **kwargs)
        if str(kwargs.get("prefix", "")).startswith(".latest."):
            reached("latest-tmp-created")
        return out

    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        p = Path(path)
        if ".old-" in p.name and p.name.endswith("-prune"):
            files = sorted(f for f in p.rglob("*") if f.is_file())
            if files:
                files[0].unlink()
            reached("mid-prune")
        real_rmtree(path, *args, **kwargs)

    real_step = Trainer.train_step

    def train_step(self: Trainer) -> dict[str, Any]:
        rec = real_step(self)
        reached("after-step")
        return rec

    ck.save_file = save_file
    os.replace = replace
    tempfile.mkstemp = mkstemp
    shutil.rmtree = rmtree
    Trainer.train_step = train_step  # type: ignore[method-assign]
    cfg = TrainConfig.from_dict(json.loads(Path(cfg_file).read_text()))
    Trainer(cfg).train()
    print("finished without reaching", point, file=sys.stderr)


if __name__ == "__main__":
    main()
