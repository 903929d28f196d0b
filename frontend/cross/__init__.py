"""Tracing for a GPU this host does not have: fake CUDA tensors (``fake_device``), the
CUDA guard shim a CPU-only torch lacks (``cuda_guard_shim``), and the SDPA backend
choice of the target (``sdpa_model``). ``kiln precompile --gpu`` and packages use them."""
