"""The artifact layout, as the client names it: ``kiln.workers.artifact`` (builders on the
farm publish with it too)."""

from kiln.workers.artifact import (
    LAYOUT_VERSION,
    WRAPPER_BLOB,
    ArtifactFormatError,
    compile_seconds,
    cubin_records,
    from_artifact,
    superseding,
    to_artifact,
)

__all__ = ["LAYOUT_VERSION", "WRAPPER_BLOB", "ArtifactFormatError", "compile_seconds",
           "cubin_records", "from_artifact", "superseding", "to_artifact"]
