"""Code generation: backend scheduling rules, kernels and the Python wrapper."""
