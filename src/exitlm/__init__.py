"""exitlm: train and serve early-exit language models.

Implements EE-LLM, LayerSkip, TeraPipe and Predictive Pipelined Decoding in one framework;
see the README and docs/architecture.md.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exitlm.config import (
        ConfigError,
        DraftHint,
        ExitConfig,
        ModelConfig,
        RopeScaling,
        preset,
    )
    from exitlm.model.kv_cache import KVCache
    from exitlm.model.transformer import EarlyExitLM, ModelOutput

from exitlm.lazy import lazy_exports

# The public names, loaded on first use (PEP 562): ``import exitlm.cli`` - the command's
# help and argument errors - must not import torch.
_HOMES = {
    "ConfigError": "exitlm.config", "DraftHint": "exitlm.config", "ExitConfig": "exitlm.config",
    "ModelConfig": "exitlm.config", "RopeScaling": "exitlm.config", "preset": "exitlm.config",
    "KVCache": "exitlm.model.kv_cache",
    "EarlyExitLM": "exitlm.model.transformer", "ModelOutput": "exitlm.model.transformer",
}


__getattr__ = lazy_exports(__name__, _HOMES, globals())


__all__ = [
    "ConfigError",
    "DraftHint",
    "EarlyExitLM",
    "ExitConfig",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "RopeScaling",
    "preset",
]
__version__ = "0.1.0"
