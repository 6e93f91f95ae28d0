"""Early-exit training: EE-LLM's multi-exit loss, the LayerSkip recipe (layer dropout + early-exit
loss curricula), exit tuning, data, the trainer, checkpoints and the ``train`` / ``eval``
commands."""
