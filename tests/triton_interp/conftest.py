"""These tests run Kiln's Triton kernels on CPU tensors under Triton's interpreter.

The interpreter is chosen when Triton is first imported, so this folder runs in its own
pytest process with TRITON_INTERPRET=1 (scripts/test.sh does this); collected in a
process where Triton was already imported without it, the tests skip.
"""

from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from kiln.compiler.runtime.kernel_files import interpreter_active

    if interpreter_active():
        return
    skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 before triton is imported: "
                                   "run this folder in its own pytest process")
    for item in items:
        if "triton_interp" in str(item.fspath):
            item.add_marker(skip)
