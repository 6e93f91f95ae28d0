"""The strategies ``exitlm bench`` compares, by name (no torch: the command's parser reads
them)."""

OURS = ("ar", "early-exit", "self-spec", "ppd")
"""exitlm's decoding strategies."""
THEIRS = ("hf", "hf-ee")
"""transformers' ``generate``: plain, and with LayerSkip's ``assistant_early_exit``."""
