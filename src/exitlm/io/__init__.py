"""Checkpoint I/O: Hugging Face safetensors directories in and out, GGUF in, exitlm's own
format, and the embedded default model.

Everybody else calls :func:`load_model`; :func:`save_model` and :func:`export_hf` write.
"""

from exitlm.io.hf_map import CheckpointError
from exitlm.io.loader import LoadedModel, load_model
from exitlm.io.save import export_hf, save_model

__all__ = ["CheckpointError", "LoadedModel", "export_hf", "load_model", "save_model"]
