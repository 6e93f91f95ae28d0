"""exitlm: train and serve early-exit language models.

Implements EE-LLM, LayerSkip, TeraPipe and Predictive Pipelined Decoding in one framework;
see the README and docs/architecture.md.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exitlm.config import ConfigError, ExitConfig, ModelConfig, RopeScaling, preset
    from exitlm.model.kv_cache import KVCache
    from exitlm.model.transformer import EarlyExitLM, ModelOutput

# The public names, loaded on first use (PEP 562): ``import exitlm.cli`` - the command's
# help and argument errors - must not import torch.
_HOMES = {
    "ConfigError": "exitlm.config", "ExitConfig": "exitlm.config",
    "ModelConfig": "exitlm.config", "RopeScaling": "exitlm.config", "preset": "exitlm.config",
    "KVCache": "exitlm.model.kv_cache",
    "EarlyExitLM": "exitlm.model.transformer", "ModelOutput": "exitlm.model.transformer",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'exitlm' has no attribute {name!r}")
    import importlib  # lazy: the public names load on first use

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


__all__ = [
    "ConfigError",
    "EarlyExitLM",
    "ExitConfig",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "RopeScaling",
    "preset",
]
__version__ = "0.1.0"
