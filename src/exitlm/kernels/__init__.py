"""CPU decoding backend: fast kernels and the modules that use them, applied to a built model."""
