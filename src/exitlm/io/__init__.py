"""exitlm.io."""
