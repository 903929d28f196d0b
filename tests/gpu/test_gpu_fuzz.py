"""The differential fuzzer (``tests/fuzz_graphs.py``) on the GPU: random graphs compiled
to Triton kernels for this device and compared with eager on CUDA tensors. 500 graphs by
default (the issue's target); ``KILN_FUZZ_GRAPHS`` and ``KILN_FUZZ_SEED`` change that."""

from __future__ import annotations

import functools
import os

from tests.fuzz_graphs import check_program, fuzz


def test_random_graphs_match_eager_on_cuda() -> None:
    count = int(os.environ.get("KILN_FUZZ_GRAPHS", 500))
    first = int(os.environ.get("KILN_FUZZ_SEED", 0))
    failures = fuzz(range(first, first + count),
                    functools.partial(check_program, device="cuda"))
    assert not failures, f"{len(failures)} of {count} graphs failed:\n\n" + "\n\n".join(
        f.report() for f in failures)
