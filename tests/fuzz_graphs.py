"""A differential fuzzer: seeded random graphs of pointwise ops, reductions, views,
broadcasts, indexing and matmuls, compiled by Kiln and compared with eager.

A graph is a small program (``Program``): inputs, then nodes that each apply one op
template to earlier values. It renders to Python source, which is both what runs (the
source is ``exec``'d into a function) and the reproduction a failure prints. A failing
program is shrunk (outputs dropped, nodes cut out and replaced by fresh inputs or by one
of their arguments) while it still fails the same way.

``tests/cpu/test_fuzz.py`` runs a fixed budget; ``KILN_FUZZ_GRAPHS=2000`` (and
``KILN_FUZZ_SEED``) ask for more.
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

# (rtol, atol): fp32 math in another order than eager's (fused, reductions reassociated).
TOLERANCE = (1e-4, 1e-4)


@dataclass(frozen=True)
class Input:
    """A graph input: random normal floats, or int64 indices in ``[0, high)``."""

    shape: tuple[int, ...]
    index_high: int = 0  # > 0: an index tensor

    def make(self, gen: torch.Generator) -> torch.Tensor:
        if self.index_high:
            return torch.randint(0, self.index_high, self.shape, generator=gen)
        return torch.randn(self.shape, generator=gen)


@dataclass(frozen=True)
class Node:
    """``template`` formatted with the names of ``args`` ({0}, {1}, ...) and ``params``."""

    template: str
    args: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()

    def render(self, names: list[str]) -> str:
        return self.template.format(*[names[a] for a in self.args], **dict(self.params))


@dataclass(frozen=True)
class Program:
    """Inputs are values ``0..len(inputs)-1``; node ``k`` is value ``len(inputs) + k``."""

    inputs: tuple[Input, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]

    def names(self) -> list[str]:
        return [f"x{i}" for i in range(len(self.inputs))] + \
            [f"v{k}" for k in range(len(self.nodes))]

    def source(self) -> str:
        names = self.names()
        lines = [f"def fn({', '.join(names[:len(self.inputs)])}):"]
        for k, node in enumerate(self.nodes):
            lines.append(f"    {names[len(self.inputs) + k]} = {node.render(names)}")
        lines.append(f"    return ({''.join(names[o] + ', ' for o in self.outputs)})")
        return "\n".join(lines)

    def function(self) -> Callable[..., Any]:
        namespace: dict[str, Any] = {"torch": torch, "F": F}
        exec(compile(self.source(), "<fuzz graph>", "exec"), namespace)  # noqa: S102
        return namespace["fn"]

    def make_inputs(self, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [i.make(gen) for i in self.inputs]

    def describe(self, seed: int) -> str:
        shapes = ", ".join(f"x{i}: {'index<' + str(s.index_high) + '>' if s.index_high else ''}"
                           f"{list(s.shape)}" for i, s in enumerate(self.inputs))
        return f"{self.source()}\n# inputs (seed {seed}): {shapes}"


# -- op templates ---------------------------------------------------------------------

UNARY = (
    "torch.sin({0})", "torch.cos({0})", "torch.tanh({0})", "torch.sigmoid({0})",
    "torch.relu({0})", "torch.abs({0})", "torch.neg({0})", "torch.exp(torch.tanh({0}))",
    "torch.log(torch.abs({0}) + 1.0)", "torch.sqrt(torch.abs({0}))",
    "torch.rsqrt(torch.abs({0}) + 0.5)", "torch.erf({0})", "F.gelu({0})", "F.silu({0})",
    "({0} * {0})", "torch.clamp({0}, min=-0.5, max=0.7)", "torch.floor({0} * 3.0)",
    "torch.sign({0})", "({0} * 0.5 + 1.0)", "torch.nan_to_num(1.0 / {0}, 0.0, 9.0, -9.0)",
)
BINARY = (
    "({0} + {1})", "({0} - {1})", "({0} * {1})", "({0} / (torch.abs({1}) + 0.5))",
    "torch.maximum({0}, {1})", "torch.minimum({0}, {1})", "torch.where({0} > {1}, {0}, {1})",
    "torch.atan2({0}, {1})", "torch.where({0} < 0.0, {1}, torch.sigmoid({0}))",
    "(({0} > {1}).float() * {0})",
)
REDUCTIONS = (
    "{0}.sum({dim}, keepdim={keep})", "{0}.amax({dim}, keepdim={keep})",
    "{0}.amin({dim}, keepdim={keep})", "{0}.mean({dim}, keepdim={keep})",
    "torch.softmax({0}, {dim})", "torch.log_softmax({0}, {dim})",
    "torch.logsumexp({0}, {dim}, keepdim={keep})", "{0}.max({dim}, keepdim={keep})[0]",
    "{0}.argmax({dim}, keepdim={keep})", "({0} * {0}).sum({dim}, keepdim={keep}).sqrt()",
    "{0}.var({dim}, keepdim={keep}, correction=0)",
)


class _Builder:
    """Grows one random program, tracking each value's example tensor."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.inputs: list[Input] = []
        self.nodes: list[Node] = []
        self.values: list[torch.Tensor] = []  # example values, inputs then nodes
        self.gen = torch.Generator().manual_seed(rng.randrange(2**31))

    def shape(self) -> tuple[int, ...]:
        rank = self.rng.choice((1, 2, 2, 3, 3, 4))
        return tuple(self.rng.choice((1, 2, 3, 4, 5, 7, 8)) for _ in range(rank))

    def add_input(self, spec: Input) -> None:
        # Example values only steer the shapes; the checked run draws fresh ones.
        self.inputs.append(spec)
        self.values.append(spec.make(self.gen))

    def pick(self, floats: bool = True) -> int:
        """A value, preferring recent ones (deeper graphs)."""
        candidates = [i for i, v in enumerate(self.values)
                      if not floats or v.dtype == torch.float32]
        weights = [1 + i for i in range(len(candidates))]
        return self.rng.choices(candidates, weights)[0]


def random_program(seed: int, max_nodes: int = 10) -> Program:
    """A random program of up to ``max_nodes`` ops over a few inputs, from ``seed``."""
    rng = random.Random(seed)
    b = _Builder(rng)
    base = b.shape()
    b.add_input(Input(base))
    for _ in range(rng.randint(0, 2)):
        b.add_input(Input(_broadcastable(rng, base)))
    pending: list[tuple[str, tuple[int, ...], dict[str, Any], list[Input]]] = []
    target = rng.randint(2, max_nodes)
    attempts = 0
    while len(pending) < target and attempts < 20 * max_nodes:
        attempts += 1
        made = _random_node(b, rng)
        if made is None:
            continue
        template, args, params, new_inputs = made
        example = _try_eager(template, args, params, b, new_inputs)
        if example is None or example.numel() == 0 or example.numel() > 4096:
            continue
        pending.append((template, args, params, new_inputs))
        b.values.append(example)
    return _assemble(b, pending, rng)


def _assemble(b: _Builder, pending: list[tuple[str, tuple[int, ...], dict[str, Any],
                                                list[Input]]], rng: random.Random) -> Program:
    """Place the inputs nodes asked for after the initial ones and renumber references:
    during generation a reference ``a >= n0`` is node ``a - n0``, and ``-(j + 1)`` is the
    node's own ``j``-th new input."""
    n0 = len(b.inputs)
    all_inputs = list(b.inputs) + [i for _, _, _, new in pending for i in new]
    n_in = len(all_inputs)
    nodes, next_new = [], n0
    for template, args, params, new in pending:
        fixed = tuple(next_new - a - 1 if a < 0 else (a if a < n0 else a - n0 + n_in)
                      for a in args)
        next_new += len(new)
        nodes.append(Node(template, fixed, tuple(sorted(params.items()))))
    # Every value no node reads is an output (nothing is dead), plus maybe one more.
    used = {a for node in nodes for a in node.args}
    outputs = {n_in + k for k in range(len(nodes)) if n_in + k not in used}
    if nodes and rng.random() < 0.3:
        outputs.add(n_in + rng.randrange(len(nodes)))
    return Program(tuple(all_inputs), tuple(nodes), tuple(sorted(outputs)))


def _broadcastable(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with some dimensions set to 1 and maybe leading ones dropped."""
    out = tuple(1 if rng.random() < 0.3 else s for s in shape)
    return out[rng.randint(0, len(out) - 1):] if out and rng.random() < 0.3 else out


def _try_eager(template: str, args: tuple[int, ...], params: dict[str, Any], b: _Builder,
               new_inputs: list[Input]) -> torch.Tensor | None:
    fresh = [i.make(b.gen) for i in new_inputs]
    values = [fresh[-a - 1] if a < 0 else b.values[a] for a in args]
    names = [f"a{i}" for i in range(len(values))]
    expr = template.format(*names, **params)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = eval(expr, {"torch": torch, "F": F}, dict(zip(names, values)))  # noqa: S307
    except Exception:  # noqa: BLE001 - an invalid combination: draw another
        return None
    return out if isinstance(out, torch.Tensor) else None


NewNode = tuple[str, tuple[int, ...], dict[str, Any], list[Input]]


def _random_node(b: _Builder, rng: random.Random) -> NewNode | None:
    kind = rng.choices(("unary", "binary", "reduction", "view", "index", "matmul", "cat"),
                       (5, 5, 3, 4, 2, 1, 1))[0]
    x = b.pick()
    shape = tuple(b.values[x].shape)
    if kind == "unary":
        return rng.choice(UNARY), (x,), {}, []
    if kind == "binary":
        y = b.pick()
        if rng.random() < 0.3:  # a fresh input broadcast against x
            return rng.choice(BINARY), (x, -1), {}, [Input(_broadcastable(rng, shape))]
        return rng.choice(BINARY), (x, y) if rng.random() < 0.5 else (y, x), {}, []
    if not shape:
        return None
    dim = rng.randrange(len(shape))
    if kind == "reduction":
        return rng.choice(REDUCTIONS), (x,), {"dim": dim, "keep": rng.random() < 0.5}, []
    if kind == "view":
        return _random_view(rng, x, shape)
    if kind == "index":
        return _random_index(rng, x, shape, dim)
    if kind == "matmul":
        return "torch.matmul({0}, {1})", (x, -1), {}, [Input((shape[-1], rng.randint(1, 9)))]
    return f"torch.cat([{{0}}, {{1}}], {dim})", (x, -1), {}, [Input(shape)]


def _random_view(rng: random.Random, x: int, shape: tuple[int, ...]
                 ) -> tuple[str, tuple[int, ...], dict[str, Any], list[Input]]:
    rank = len(shape)
    choice = rng.choice(("permute", "reshape", "slice", "select", "unsqueeze", "expand",
                         "flip", "diagonal", "transpose_contiguous", "squeeze"))
    dim = rng.randrange(rank)
    if choice == "permute":
        perm = list(range(rank))
        rng.shuffle(perm)
        return "{0}.permute(" + str(perm) + ")", (x,), {}, []
    if choice == "reshape":
        if rank >= 2 and rng.random() < 0.6:
            merged = list(shape[:dim]) + [-1] + list(shape[dim + 2:]) if dim < rank - 1 \
                else [-1]
            return "{0}.reshape(" + str(merged) + ")", (x,), {}, []
        return "{0}.reshape(-1)", (x,), {}, []
    if choice == "slice":
        start, step = rng.randint(0, max(0, shape[dim] - 1)), rng.choice((1, 1, 2, 3))
        index = ", ".join([":"] * dim + [f"{start}::{step}"])
        return "{0}[" + index + "]", (x,), {}, []
    if choice == "select":
        return f"{{0}}.select({dim}, {rng.randrange(shape[dim]) - shape[dim]})", (x,), {}, []
    if choice == "unsqueeze":
        return f"{{0}}.unsqueeze({rng.randint(0, rank)})", (x,), {}, []
    if choice == "expand":
        new = [rng.choice((2, 3, 4)) if s == 1 else -1 for s in shape]
        return "{0}.expand(" + str([rng.randint(2, 3)] + new) + ")", (x,), {}, []
    if choice == "flip":
        dims = sorted(rng.sample(range(rank), rng.randint(1, rank)))
        return "{0}.flip(" + str(dims) + ")", (x,), {}, []
    if choice == "diagonal" and rank >= 2:
        d0, d1 = rng.sample(range(rank), 2)
        return f"{{0}}.diagonal({rng.randint(-1, 1)}, {d0}, {d1})", (x,), {}, []
    if choice == "squeeze":
        return f"{{0}}.squeeze({dim})", (x,), {}, []
    return f"{{0}}.transpose(0, {dim}).contiguous()", (x,), {}, []


def _random_index(rng: random.Random, x: int, shape: tuple[int, ...], dim: int
                  ) -> tuple[str, tuple[int, ...], dict[str, Any], list[Input]]:
    n = shape[dim]
    choice = rng.choice(("index_select", "gather", "getitem"))
    if choice == "index_select":
        idx = Input((rng.randint(1, 6),), index_high=n)
        return f"torch.index_select({{0}}, {dim}, {{1}})", (x, -1), {}, [idx]
    if choice == "gather":
        idx_shape = tuple(rng.randint(1, n) if d == dim else s for d, s in enumerate(shape))
        return f"torch.gather({{0}}, {dim}, {{1}})", (x, -1), {}, [Input(idx_shape, n)]
    idx = Input((rng.randint(1, 4), rng.randint(1, 3)), index_high=shape[0])
    return "{0}[{1}]", (x, -1), {}, [idx]


# -- running and shrinking ----------------------------------------------------------------


@dataclass
class Failure:
    """How a program failed: ``kind`` (compile, run, mismatch) and the message."""

    kind: str
    message: str
    program: Program
    seed: int
    shrunk_from: int = 0
    notes: list[str] = field(default_factory=list)

    def report(self) -> str:
        return (f"fuzz graph (seed {self.seed}) {self.kind}: {self.message[:800]}\n"
                f"minimal reproduction ({len(self.program.nodes)} nodes, shrunk from "
                f"{self.shrunk_from}):\n{self.program.describe(self.seed)}")


def check_program(program: Program, seed: int, device: str = "cpu") -> Failure | None:
    """Compile ``program`` with Kiln (C++ kernels on CPU, Triton on CUDA), run it,
    compare with eager."""
    from kiln.compiler.compiled_graph import load
    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.driver import compile_graph
    from kiln.frontend.core.graphs import graph_constants

    fn = program.function()
    inputs = [t.to(device) for t in program.make_inputs(seed)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = fn(*[t.clone() for t in inputs])
        except Exception:  # noqa: BLE001 - not a valid program (a shrinking step broke it)
            return None
        try:
            gm = trace_aten(fn, [t.clone() for t in inputs])
            options = {"cpu_backend": "cpp"} if device == "cpu" else {"autotune": "0"}
            compiled = compile_graph(gm, inputs, options, name="fuzz")
        except Exception as e:  # noqa: BLE001 - a failure to report
            return Failure("compile", f"{type(e).__name__}: {e}", program, seed)
        try:
            actual = load(compiled, graph_constants(gm), torch.device(device))(
                [t.clone() for t in inputs])
        except Exception as e:  # noqa: BLE001
            return Failure("run", f"{type(e).__name__}: {e}", program, seed)
    for i, (got, want) in enumerate(zip(actual, expected)):
        try:
            torch.testing.assert_close(got, want, rtol=TOLERANCE[0], atol=TOLERANCE[1],
                                       equal_nan=True, check_stride=False)
        except AssertionError as err:
            return Failure("mismatch", f"output {i}: {err}", program, seed)
    return None


def shrink(failure: Failure, check: Callable[[Program, int], Failure | None] = check_program
           ) -> Failure:
    """The smallest program found that still fails the same way (same ``kind`` and, for
    an exception, the same exception type)."""
    best = failure
    start = len(failure.program.nodes)
    improved = True
    while improved:
        improved = False
        for candidate in _smaller(best.program):
            found = check(candidate, best.seed)
            if found is not None and _same_failure(found, best):
                best, improved = found, True
                break
    best.shrunk_from = start
    return best


def _same_failure(a: Failure, b: Failure) -> bool:
    if a.kind != b.kind:
        return False
    return a.kind == "mismatch" or a.message.split(":")[0] == b.message.split(":")[0]


def _smaller(p: Program) -> list[Program]:
    """Candidate programs one step smaller than ``p``, most reducing first."""
    out: list[Program] = []
    if len(p.outputs) > 1:
        out += [replace(p, outputs=(o,)) for o in p.outputs]
    for k in reversed(range(len(p.nodes))):
        for a in p.nodes[k].args:  # the node replaced by one of its arguments
            out.append(_substitute(p, k, a))
        cut = _cut(p, k)  # the node replaced by a fresh input
        if cut is not None:
            out.append(cut)
    return [prune(c) for c in out]


def _substitute(p: Program, k: int, replacement: int) -> Program:
    """Drop node ``k``; its users read ``replacement`` instead."""
    n_in = len(p.inputs)
    value = n_in + k

    def remap(a: int) -> int:
        if a == value:
            return replacement
        return a - 1 if a > value else a

    nodes = tuple(replace(nd, args=tuple(remap(a) for a in nd.args))
                  for i, nd in enumerate(p.nodes) if i != k)
    return Program(p.inputs, nodes, tuple(sorted({remap(o) for o in p.outputs})))


def _cut(p: Program, k: int) -> Program | None:
    """Node ``k`` becomes a new graph input of its shape (float values)."""
    shape = _value_shape(p, k)
    if shape is None:
        return None
    n_in = len(p.inputs)
    shifted = Program(p.inputs + (Input(shape),),
                      tuple(replace(nd, args=tuple(a + 1 if a >= n_in else a for a in nd.args))
                            for nd in p.nodes),
                      tuple(o + 1 if o >= n_in else o for o in p.outputs))
    return _substitute(shifted, k, n_in)


def _value_shape(p: Program, k: int) -> tuple[int, ...] | None:
    """The shape of node ``k``'s value, if it is a float tensor."""
    probe = Program(p.inputs, p.nodes[:k + 1], (len(p.inputs) + k,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (value,) = probe.function()(*probe.make_inputs(0))
    return tuple(value.shape) if value.dtype == torch.float32 else None


def prune(p: Program) -> Program:
    """Drop nodes and inputs nothing reaches from the outputs; renumber."""
    live = set(p.outputs)
    n_in = len(p.inputs)
    for k in reversed(range(len(p.nodes))):
        if n_in + k in live:
            live |= set(p.nodes[k].args)
    keep_in = [i for i in range(n_in) if i in live] or [0]
    keep_nodes = [k for k in range(len(p.nodes)) if n_in + k in live]
    new_index = {old: new for new, old in enumerate(keep_in)}
    new_index |= {n_in + k: len(keep_in) + j for j, k in enumerate(keep_nodes)}
    nodes = tuple(replace(p.nodes[k], args=tuple(new_index[a] for a in p.nodes[k].args))
                  for k in keep_nodes)
    return Program(tuple(p.inputs[i] for i in keep_in), nodes,
                   tuple(new_index[o] for o in p.outputs))


def fuzz(seeds: range, check: Callable[[Program, int], Failure | None] = check_program
         ) -> list[Failure]:
    """Check one random program per seed; every failure comes back shrunk. With
    ``KILN_FUZZ_LOG`` set, each seed's outcome is appended to that file as it comes (a
    long run shows its progress, and a run cut short what it covered)."""
    failures = []
    log = os.environ.get("KILN_FUZZ_LOG")
    for seed in seeds:
        program = random_program(seed)
        found = check(program, seed)
        if found is not None:
            failures.append(shrink(found, check))
        if log:
            with open(log, "a") as f:
                f.write(f"seed {seed}: {'FAIL ' + found.kind if found else 'ok'}\n")
    return failures
