"""Checkpoint I/O: Hugging Face safetensors directories in and out, GGUF in, exitlm's own
format, and the embedded default model.

Everybody else calls :func:`load_model`; :func:`save_model` and :func:`export_hf` write.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exitlm.io.hf_map import CheckpointError
    from exitlm.io.loader import LoadedModel, load_model
    from exitlm.io.save import export_hf, save_model

from exitlm.lazy import lazy_exports

# Loaded on first use (PEP 562): ``exitlm convert --help`` imports no torch.
_HOMES = {"CheckpointError": "exitlm.io.hf_map", "LoadedModel": "exitlm.io.loader",
          "load_model": "exitlm.io.loader", "export_hf": "exitlm.io.save",
          "save_model": "exitlm.io.save"}


__getattr__ = lazy_exports(__name__, _HOMES, globals())


__all__ = ["CheckpointError", "LoadedModel", "export_hf", "load_model", "save_model"]
