"""exitlm.plan."""
