"""Canonical serialization of ATen FX graphs and compile requests (the frontend's view).

The format itself lives in :mod:`compiler.request` so that compile workers can decode
requests without importing the frontend; this module re-exports it and adds
:func:`make_request`, which stamps the client's versions on a request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kiln.compiler.request import (
    GRAPH_FORMAT_VERSION,
    NON_OUTPUT_OPTIONS,
    REQUEST_FORMAT_VERSION,
    CompileRequest,
    InputMeta,
    SerializationError,
    SymIntMeta,
    TensorMeta,
    canonical,
    deserialize_graph,
    dtype_from_name,
    example_inputs_from_metas,
    fake_tensor_from_meta,
    output_options,
    placeholder_metas,
    serialize_graph,
    symint_meta,
)
from kiln.compiler.symwire import SymbolTable

__all__ = [
    "GRAPH_FORMAT_VERSION",
    "NON_OUTPUT_OPTIONS",
    "REQUEST_FORMAT_VERSION",
    "CompileRequest",
    "SerializationError",
    "SymIntMeta",
    "TensorMeta",
    "canonical",
    "deserialize_graph",
    "dtype_from_name",
    "example_inputs_from_metas",
    "fake_tensor_from_meta",
    "make_request",
    "output_options",
    "placeholder_metas",
    "serialize_graph",
]


def make_request(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[torch.Tensor | TensorMeta],
    *,
    options: Mapping[str, Any],
    target: Mapping[str, Any],
    versions: Mapping[str, Any] | None = None,
) -> CompileRequest:
    """Build the request for ``gm``; drops options that cannot change the output.

    Symbolic sizes (SymInt inputs, tensors with SymInt sizes) are named ``s0, s1, ...``
    by first appearance among the inputs; their values never enter the request."""
    symbols = SymbolTable()
    metas: list[InputMeta] = []
    for i, x in enumerate(example_inputs):
        if isinstance(x, TensorMeta):
            metas.append(x)
        elif isinstance(x, torch.Tensor):
            metas.append(TensorMeta.from_tensor(x, symbols))
        elif isinstance(x, torch.SymInt):
            metas.append(symint_meta(x, symbols))
        else:
            raise SerializationError(f"input {i} is a {type(x).__name__}, not a tensor")
    if versions is None:
        from kiln.compiler.versions import versions as current_versions

        versions = current_versions()
    return CompileRequest(
        graph=serialize_graph(gm, symbols),
        inputs=tuple(metas),
        symbols=tuple(symbols.ranges),
        options=output_options(options),
        target=dict(target),
        versions=dict(versions),
    )
