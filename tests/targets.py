"""GPU targets the tests cross-compile for with no GPU (Triton's ``GPUTarget`` fields)."""

SM90 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32}
