"""The early-exit transformer, its exit heads and its KV cache."""
