"""Cache keys: the client's name for ``kiln.compiler.keys`` (where the farm hashes too)."""

from kiln.compiler.keys import (
    INPUT_FIELDS,
    PART_DESCRIPTIONS,
    PART_NAMES,
    SOURCE_SUFFIXES,
    KeyInfo,
    compute_key,
    describe_differences,
    diff_requests,
    explain_miss,
    hash_source_tree,
    key_from_parts,
    key_parts,
    kiln_version,
    recorded_parts,
    schema,
    versions,
)

__all__ = [
    "INPUT_FIELDS", "PART_DESCRIPTIONS", "PART_NAMES", "SOURCE_SUFFIXES", "KeyInfo",
    "compute_key", "describe_differences", "diff_requests", "explain_miss",
    "hash_source_tree", "key_from_parts", "key_parts", "kiln_version", "recorded_parts",
    "schema", "versions",
]
