"""The C++ backend for CPU graphs: OpenMP-parallel, vectorized loops from the same
scheduled IR as the Triton backend, compiled by the system compiler into shared objects."""
