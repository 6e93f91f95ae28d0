"""exitlm.eval."""
