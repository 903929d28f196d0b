"""Triton code generation: overrides of the ops protocol, kernels, heuristics."""
