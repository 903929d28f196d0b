"""The AOT package: a model's graphs, compiled and signed, in one file that loads with no
Dynamo and no compile (``kiln package``, ``kiln.load_package``)."""

from kiln.frontend.package.archive import (
    PackageError,
    build_package,
    load_package,
    module_tensors,
    read_package,
)

__all__ = ["PackageError", "build_package", "load_package", "module_tensors", "read_package"]
