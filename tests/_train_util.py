"""Tiny corpora and configs for trainer tests (seconds on 2 CPU cores)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from exitlm.train.config import TrainConfig

WORDS = ("def", "return", "class", "self", "import", "for", "in", "if", "else", "None",
         "value", "items", "result", "(", ")", ":", "=", "+", "\n", "    ")


def tiny_corpus(root: Path, files: int = 24, words: int = 400) -> Path:
    rng = random.Random(0)
    src = root / "corpus"
    src.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        path = src / f"mod_{i:03d}.py"
        # Never rewrite an existing file: several processes build the same config, and a
        # rewrite changes the mtime (the data cache key) or races a reader.
        if not path.is_file():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
    return src


def tiny_config(root: Path, out: str = "run", **sections: dict[str, Any]) -> TrainConfig:
    d: dict[str, Any] = {
        "model": {"init": "debug", "overrides": {"dim": 32, "num_heads": 2, "num_kv_heads": 2,
                                                 "hidden_dim": 64},
                  "exits": {"layers": [1, 2]}},
        "data": {"paths": [str(tiny_corpus(root))], "seq_len": 32, "val_fraction": 0.2,
                 "cache_dir": str(root / "cache")},
        "loss": {"kind": "ee-llm", "exit_weights": [0.3, 0.5], "weight_schedule": "warmup",
                 "weight_steps": 4, "exit_weights_initial": 0.1},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"steps": 6, "batch_size": 4, "log_every": 1, "progress": False,
                  "tensorboard": False, "out_dir": str(root / out)},
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return TrainConfig.from_dict(d)
