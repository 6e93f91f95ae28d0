"""Named training setups, as plain data (no torch: ``exitlm train --help`` lists them at
once); :func:`exitlm.train.config.load_config` builds a config from one."""

from __future__ import annotations

import copy
from typing import Any

# Named training setups (the YAML files in configs/ are copies to start from).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {"init": "debug", "exits": {"layers": [1, 2]}},
        "loss": {"kind": "ee-llm", "exit_weights": [0.25, 0.5]},
        "data": {"seq_len": 64},
        "train": {"steps": 20, "batch_size": 4},
    },
    "scratch-plain": {
        "model": {"init": "debug", "overrides": {"dim": 128, "num_layers": 8, "num_heads": 4,
                                                 "num_kv_heads": 4, "hidden_dim": 344,
                                                 "max_seq_len": 256},
                  "exits": {"layers": []}},
        "data": {"seq_len": 128},
        "loss": {"kind": "final"},
        "optim": {"lr": 2.0e-3, "warmup_steps": 30},
        "train": {"steps": 600, "batch_size": 16, "eval_every": 200, "eval_samples": 128,
                  "checkpoint_every": 200, "out_dir": "runs/scratch-plain"},
    },
}
PRESETS["scratch-ee"] = copy.deepcopy(PRESETS["scratch-plain"])
PRESETS["scratch-ee"]["model"]["exits"] = {"layers": [2, 4], "norm": "own",
                                           "output": "final_head"}
PRESETS["scratch-ee"]["loss"] = {"kind": "ee-llm", "exit_weights": [0.25, 0.5],
                                 "final_weight": 1.0}
PRESETS["scratch-ee"]["train"]["out_dir"] = "runs/scratch-ee"
PRESETS["scratch-layerskip"] = copy.deepcopy(PRESETS["scratch-plain"])
PRESETS["scratch-layerskip"]["model"]["exits"] = {"every_layer": True, "layers": [],
                                                  "norm": "final"}
PRESETS["scratch-layerskip"]["loss"] = {"kind": "layerskip", "e_scale": 1.0,
                                        "curriculum": "rotational", "rotation": 2}
PRESETS["scratch-layerskip"]["dropout"] = {"p_max": 0.1, "curriculum": "exp"}
PRESETS["scratch-layerskip"]["train"]["out_dir"] = "runs/scratch-layerskip"
PRESETS["default-ee"] = {
    "model": {"init": "default", "exits": {"layers": [12, 20], "head": "mlp", "norm": "own",
                                           "output": "final_head"}},
    "data": {"tokenizer": "default", "seq_len": 128},
    "loss": {"kind": "ee-llm", "exit_weights": [1.0, 1.0], "final_weight": 0.0},
    "tune": {"freeze_backbone": True, "init_new_heads": True},
    "optim": {"lr": 1.0e-3, "warmup_steps": 20, "weight_decay": 0.0},
    "train": {"steps": 160, "batch_size": 4, "log_every": 10, "checkpoint_every": 50,
              "out_dir": "runs/default-ee"},
}
