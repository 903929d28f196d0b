"""Cache keys: the client's name for ``kiln.compiler.keys`` (where the farm hashes too)."""

from kiln.compiler.keys import (
    PART_DESCRIPTIONS,
    PART_NAMES,
    SOURCE_SUFFIXES,
    KeyInfo,
    compute_key,
    diff_requests,
    explain_miss,
    hash_source_tree,
    key_parts,
    kiln_version,
    schema,
    versions,
)

__all__ = [
    "PART_DESCRIPTIONS", "PART_NAMES", "SOURCE_SUFFIXES", "KeyInfo", "compute_key",
    "diff_requests", "explain_miss", "hash_source_tree", "key_parts", "kiln_version",
    "schema", "versions",
]
