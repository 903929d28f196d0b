"""The AOT cache's entry on the wire (frontend/core/aot/entry.py): what a served entry of a
graph with symbolic sizes says comes back as written, and every malformed field is
refused with EntryError before anything runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kiln.frontend.core.aot.entry import (
    AotEntry,
    EntryError,
    entry_from_artifact,
    to_artifact,
)

KEY, GRAPH = "a" * 64, "b" * 64


def _symbolic() -> AotEntry:
    return AotEntry(True, GRAPH, 3, symbolic=True,
                    dynamic=((0, frozenset({0})), (1, frozenset({0, 2}))))


def test_a_symbolic_entry_comes_back_as_written() -> None:
    entry = _symbolic()
    artifact = to_artifact(KEY, entry)
    assert artifact.manifest["symbolic"] is True
    assert artifact.manifest["dynamic"] == [[0, [0]], [1, [0, 2]]]
    assert entry_from_artifact(artifact) == entry
    static = AotEntry(True, GRAPH, 2)
    assert entry_from_artifact(to_artifact(KEY, static)) == static


@pytest.mark.parametrize("field, value", [
    ("symbolic", 1),  # not a bool
    ("symbolic", None),
    ("dynamic", [[0, []]]),  # an output with no dimensions
    ("dynamic", [[0, [0]], [0, [1]]]),  # an output twice
    ("dynamic", [[0, [64]]]),  # a dimension out of range
    ("dynamic", [["0", [0]]]),
    ("dynamic", {"0": [0]}),
])
def test_a_malformed_symbolic_field_is_refused(field: str, value: Any) -> None:
    artifact = to_artifact(KEY, _symbolic())
    manifest = copy.deepcopy(artifact.manifest)
    manifest[field] = value
    with pytest.raises(EntryError):
        entry_from_artifact(type(artifact)(KEY, manifest, artifact.blobs))


def test_dynamic_outputs_need_a_symbolic_graph() -> None:
    artifact = to_artifact(KEY, _symbolic())
    manifest = dict(artifact.manifest, symbolic=False)
    with pytest.raises(EntryError, match="symbolic"):
        entry_from_artifact(type(artifact)(KEY, manifest, artifact.blobs))
