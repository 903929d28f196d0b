"""Session-wide isolation: every test run gets its own store, local cache and kernel
cache, and compiles in-process unless a test (tests/farm) asks for a farm."""

from __future__ import annotations

import os
import tempfile

_ROOT = tempfile.mkdtemp(prefix="kiln_tests_")
os.environ.setdefault("KILN_STORE", "file://" + os.path.join(_ROOT, "store"))
os.environ.setdefault("KILN_LOCAL_CACHE", os.path.join(_ROOT, "local_cache"))
os.environ.setdefault("KILN_CACHE_DIR", os.path.join(_ROOT, "cache"))
os.environ.setdefault("KILN_FARM", "inprocess")
