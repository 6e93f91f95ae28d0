"""exitlm.infer."""
