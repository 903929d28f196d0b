"""Graph inputs that are not tensors or sizes: objects the graph only passes along.

A tensor-parallel model's ATen graphs (DTensor, ``parallelize_module``) take the device
mesh and its process group as inputs, script objects that no kernel reads: the
collectives name their group by a string (``_c10d_functional.all_reduce(t, "sum",
"0")``), and the forward returns the object for its backward. Such an input cannot be
part of a request (it has no shape, and its identity is this process's), so it is taken
out of the graph before the request is made and put back around the compiled graph:

- the compiled graph takes the other inputs, in order;
- each output that was the object is the object the call was given.

An object that an op reads (not only the output) stays a reason to run the graph
eagerly, named in the warning.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def is_opaque(value: Any) -> bool:
    """An input the compiler has no type for: not a tensor, size or plain scalar."""
    return not isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool,
                                  int, float, bool, type(None)))


@dataclass(frozen=True)
class OpaqueInputs:
    """Where the objects were: their input slots, and the outputs that return them
    (output position -> input slot)."""

    slots: tuple[int, ...]
    outputs: dict[int, int]

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        """A boxed callable taking the full inputs around ``compiled`` (boxed, taking the
        inputs without the objects)."""
        slots, outputs = frozenset(self.slots), sorted(self.outputs.items())

        def call(args: list[Any]) -> Any:
            objects = {i: args[i] for i in slots}
            kept = [a for i, a in enumerate(args) if i not in slots]
            args.clear()  # the boxed convention: the callee owns (and frees) the inputs
            result = list(compiled(kept))
            for position, slot in outputs:
                result.insert(position, objects[slot])
            return result

        call._boxed_call = True  # type: ignore[attr-defined]
        return call


def without_opaque_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                          ) -> tuple[torch.fx.GraphModule, list[Any], OpaqueInputs] | None:
    """``gm`` without its object inputs (a copy), the other example inputs, and where the
    objects were; None where every input is a tensor or size. Raises ``ValueError``
    naming the op where an op reads an object."""
    slots = [i for i, x in enumerate(example_inputs) if is_opaque(x)]
    if not slots:
        return None
    new = copy.deepcopy(gm)
    placeholders = list(new.graph.find_nodes(op="placeholder"))
    output = next(iter(new.graph.find_nodes(op="output")))
    dropped = {placeholders[i]: i for i in slots}
    for node, slot in dropped.items():
        readers = [u for u in node.users if u is not output]
        if readers:
            raise ValueError(f"input {slot} (a {type(example_inputs[slot]).__name__}) is "
                             f"read by {readers[0].target}, not only returned")
    values = output.args[0]
    flat = list(values) if isinstance(values, (list, tuple)) else [values]
    returned = {p: dropped[v] for p, v in enumerate(flat) if v in dropped}
    output.args = (type(values)(v for v in flat if v not in dropped)
                   if isinstance(values, (list, tuple)) else values,)
    for node in dropped:
        new.graph.erase_node(node)
    new.recompile()
    taken = set(slots)
    kept = [x for i, x in enumerate(example_inputs) if i not in taken]
    return new, kept, OpaqueInputs(tuple(slots), returned)
