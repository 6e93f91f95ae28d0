"""exitlm: train and serve early-exit language models.

Implements EE-LLM, LayerSkip, TeraPipe and Predictive Pipelined Decoding in one framework;
see the README and docs/architecture.md.
"""

from exitlm.config import ConfigError, ExitConfig, ModelConfig, RopeScaling, preset
from exitlm.model.kv_cache import KVCache
from exitlm.model.transformer import EarlyExitLM, ModelOutput

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
