"""Reductions in C++: per-lane accumulators updated in a vectorized ``r0`` loop.

A phase's ``r0`` loop runs in blocks of ``LANES``; lane ``rl`` of every block
updates element ``rl`` of each accumulator array, so the inner loop has no dependence
between iterations and the compiler vectorizes it whatever the reduction is (sum, NaN-
propagating max, first-index argmax, Welford). After the loop the lanes are combined in
order. With the r loop split across threads (mode "r"), each thread keeps its own lanes,
and the partials are combined in thread order, so results do not depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import CSEVariable, IndentedBuffer
from .kernel import CppKernel, Phase
from .overrides import compute_dtype, ctype, literal

LANES = 16  # lanes per vector block (a zmm of fp32, two ymm)

# How one value folds into an accumulator: {a} the accumulator, {b} the new value.
_COMBINE = {
    "sum": "{a} + {b}", "prod": "{a} * {b}", "xor_sum": "{a} ^ {b}",
    "max": "kiln_maximum<{T}>({a}, {b})", "min": "kiln_minimum<{T}>({a}, {b})",
    "any": "{a} | {b}", "all": "{a} & {b}",
}


@dataclass
class Accumulator:
    """One reduction's lane arrays (``name_<part>[LANES]``) and how to combine them."""

    name: str
    kind: str  # "plain", "argmax", "argmin" or "welford"
    parts: list[tuple[str, str, str]]  # (suffix, C++ type, identity)
    combine: str = ""  # plain only: _COMBINE template

    def array(self, suffix: str) -> str:
        return f"{self.name}_{suffix}"

    def declare(self, buf: IndentedBuffer, size: int = LANES) -> None:
        for suffix, ct, init in self.parts:
            buf.writeline(f"{ct} {self.array(suffix)}[{size}];")
            buf.writeline(f"for (int64_t l = 0; l < {size}; ++l) {self.array(suffix)}[l] = {init};")

    def merge(self, dst: list[str], src: list[str]) -> str:
        """A statement folding accumulator values ``src`` into lvalues ``dst``."""
        if self.kind == "plain":
            return f"{dst[0]} = {self.combine.format(a=dst[0], b=src[0])};"
        if self.kind == "welford":
            return f"kiln_welford_combine({', '.join(dst)}, {', '.join(src)});"
        better = f"kiln_{self.kind}_better({src[0]}, {src[1]}, {dst[0]}, {dst[1]})"
        return f"if ({better}) {{ {dst[0]} = {src[0]}; {dst[1]} = {src[1]}; }}"

    def refs(self, index: str) -> list[str]:
        return [f"{self.array(s)}[{index}]" for s, _, _ in self.parts]


def identity(reduction_type: str, dtype: torch.dtype) -> object:
    if reduction_type in ("sum", "any", "xor_sum"):
        return 0
    if reduction_type in ("prod", "all"):
        return 1
    if dtype == torch.bool:
        return reduction_type == "min"
    return float("-inf") if reduction_type == "max" else float("inf")


def emit_reduction(k: CppKernel, phase: Phase, reduction_type: str, value: CSEVariable
                   ) -> CSEVariable | tuple[CSEVariable, ...]:
    """Accumulate ``value`` over the phase's r loop; return the value(s) after it."""
    name = f"acc{len(phase.accumulators)}_{k.phase_count}"
    if reduction_type == "welford_reduce":
        return _welford(k, phase, name, value)
    if reduction_type in ("argmax", "argmin"):
        return _arg(k, phase, name, reduction_type, value)
    if reduction_type in ("any", "all"):
        value = k.emit(f"static_cast<uint8_t>({value} != 0)", torch.uint8)
    dtype = compute_dtype(value.dtype)
    init = literal(identity(reduction_type, dtype), dtype)
    acc = Accumulator(name, "plain", [("v", ctype(dtype), init)],
                      _COMBINE[reduction_type].replace("{T}", ctype(dtype)))
    phase.accumulators.append(acc)
    ref = acc.refs(k.lane)[0]
    phase.body.writeline(f"{ref} = {acc.combine.format(a=ref, b=value)};")
    out = _final(k, phase, acc, dtype)[0]
    if reduction_type in ("any", "all"):
        return k.emit_after(f"({out} != 0)", torch.bool)
    return out


def _final(k: CppKernel, phase: Phase, acc: Accumulator, *dtypes: torch.dtype
           ) -> list[CSEVariable]:
    """Combine the lanes in order into fresh x-level variables (with column lanes, each
    lane is its own column's result)."""
    outs = [k.newvar(dt) for dt in dtypes]
    for out, ref in zip(outs, acc.refs(k.lane if k.columns is not None else "0")):
        phase.post.writeline(f"{ctype(out.dtype)} {out} = {ref};")
    if k.columns is not None:
        return outs
    phase.post.writeline(f"for (int64_t l = 1; l < {LANES}; ++l) "
                         f"{acc.merge([o.name for o in outs], acc.refs('l'))}")
    return outs


def _arg(k: CppKernel, phase: Phase, name: str, reduction_type: str, value: CSEVariable
         ) -> CSEVariable:
    dtype = compute_dtype(value.dtype)
    init = literal(identity("max" if reduction_type == "argmax" else "min", dtype), dtype)
    acc = Accumulator(name, reduction_type, [("v", ctype(dtype), init), ("i", "int64_t", "-1")])
    phase.accumulators.append(acc)
    v, i = acc.refs(k.lane)
    op = ">" if reduction_type == "argmax" else "<"
    take = f"{name}_take"
    # Within a lane indices only grow: a tie keeps the earlier one, the first NaN wins.
    phase.body.writeline(f"const bool {take} = {i} < 0 || {value} {op} {v} || "
                         f"({value} != {value} && {v} == {v});")
    phase.body.writeline(f"{v} = {take} ? {value} : {v};")
    phase.body.writeline(f"{i} = {take} ? r0 : {i};")
    return _final(k, phase, acc, dtype, torch.int64)[1]


def _welford(k: CppKernel, phase: Phase, name: str, value: CSEVariable
             ) -> tuple[CSEVariable, ...]:
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    if k.reserve_row(dtype):
        return _two_pass_variance(k, phase, name, value, dtype)
    ct = ctype(dtype)
    zero = literal(0, dtype)
    acc = Accumulator(name, "welford", [("mean", ct, zero), ("m2", ct, zero), ("w", ct, zero)])
    phase.accumulators.append(acc)
    mean, m2, w = acc.refs(k.lane)
    x = value if value.dtype == dtype else f"static_cast<{ct}>({value})"
    # Every lane holds the same count at the start of a block: one reciprocal per block.
    phase.block_pre.writeline(f"const {ct} {name}_inv = ({ct})1 / ({acc.array('w')}[0] + "
                              f"({ct})1);")
    phase.body.writeline(f"const {ct} {name}_delta = {x} - {mean};")
    phase.body.writeline(f"{w} += ({ct})1;")
    phase.body.writeline(f"{mean} += {name}_delta * {name}_inv;")
    phase.body.writeline(f"{m2} += {name}_delta * ({x} - {mean});")
    return tuple(_final(k, phase, acc, dtype, dtype, dtype))


def _two_pass_variance(k: CppKernel, phase: Phase, name: str, value: CSEVariable,
                       dtype: torch.dtype) -> tuple[CSEVariable, ...]:
    """Mean, then the sum of squared deviations from it, over a row kept in a buffer: the
    result Welford's method gives (as accurate), at two cheap vector passes instead of
    one with a division-dependent chain per element."""
    ct = ctype(dtype)
    x = str(value) if value.dtype == dtype else f"static_cast<{ct}>({value})"
    row = f"row_{name}"
    phase.pre.writeline(f"{ct} {row}[{k.rnumel}];")
    phase.body.writeline(f"{row}[r0] = {x};")
    acc = Accumulator(name, "plain", [("v", ct, literal(0, dtype))], _COMBINE["sum"])
    phase.accumulators.append(acc)
    phase.body.writeline(f"{acc.refs(k.lane)[0]} += {row}[r0];")
    total = _final(k, phase, acc, dtype)[0]
    weight = literal(int(k.rnumel), dtype)
    mean, m2 = k.newvar(dtype), k.newvar(dtype)
    phase.post.writeline(f"const {ct} {mean} = {total} / {weight};")
    phase.post.writeline(f"{ct} {m2} = 0;")
    phase.post.writeline(f"#pragma omp simd reduction(+:{m2})")
    phase.post.writeline(f"for (int64_t r0 = 0; r0 < {k.rnumel}; ++r0) "
                         f"{m2} += ({row}[r0] - {mean}) * ({row}[r0] - {mean});")
    return mean, m2, k.emit_after(weight, dtype)


def render_phase(k: CppKernel, phase: Phase, code: IndentedBuffer) -> None:
    """Splice a finished phase into ``code``: its loops, then the code after them."""
    code.splice(phase.pre)
    if not phase.accumulators:
        _pointwise_loop(k, phase, code)
    else:
        for acc in phase.accumulators:
            acc.declare(code)
        if not k.rnumel.is_Integer:
            _dynamic_blocks(k, phase, code)
        else:
            rnumel = int(k.rnumel)
            main = rnumel - rnumel % LANES
            if main and k.mode == "r":
                _parallel_blocks(phase, main, code)
            elif main:
                _blocks(phase, main, code)
            if rnumel % LANES:
                _tail(phase, main, rnumel % LANES, code)
    code.splice(phase.post)


def _pointwise_loop(k: CppKernel, phase: Phase, code: IndentedBuffer) -> None:
    pragma = "#pragma omp parallel for simd schedule(static)" if k.mode == "r" else \
        "#pragma omp simd"
    code.writeline(pragma)
    code.writeline(f"for (int64_t r0 = 0; r0 < {k.rnumel_str}; ++r0)")
    _braced(code, phase.body)


def _dynamic_blocks(k: CppKernel, phase: Phase, code: IndentedBuffer) -> None:
    """Lane blocks over a reduction of run-time length: whole blocks, then the tail."""
    code.writeline("{")
    with code.indent():
        code.writeline(f"const int64_t kiln_rmain = {k.rnumel_str} - {k.rnumel_str} % {LANES};")
        if k.mode == "r":
            _parallel_blocks(phase, "kiln_rmain", code)
        else:
            _blocks(phase, "kiln_rmain", code)
        _block(phase, "kiln_rmain", f"{k.rnumel_str} - kiln_rmain", code)
    code.writeline("}")


def _blocks(phase: Phase, main: int | str, code: IndentedBuffer) -> None:
    code.writeline(f"for (int64_t rb = 0; rb < {main}; rb += {LANES})")
    code.writeline("{")
    with code.indent():
        _block(phase, "rb", str(LANES), code)
    code.writeline("}")


def _block(phase: Phase, start: str, count: str, code: IndentedBuffer) -> None:
    code.splice(phase.block_pre)
    code.writeline("#pragma omp simd")
    code.writeline(f"for (int64_t rl = 0; rl < {count}; ++rl)")
    code.writeline("{")
    with code.indent():
        code.writeline(f"const int64_t r0 = {start} + rl;")
        code.splice(phase.body)
    code.writeline("}")


def _tail(phase: Phase, main: int, tail: int, code: IndentedBuffer) -> None:
    code.writeline("{")
    with code.indent():
        _block(phase, str(main), str(tail), code)
    code.writeline("}")


def _parallel_blocks(phase: Phase, main: int | str, code: IndentedBuffer) -> None:
    """Blocks split across threads; each thread's lanes land in ``<array>_part``."""
    code.writeline("{")
    with code.indent():
        code.writeline("const int kiln_nt = omp_get_max_threads() < KILN_MAX_THREADS ? "
                       "omp_get_max_threads() : KILN_MAX_THREADS;")
        for acc in phase.accumulators:
            _declare_parts(acc, code)
        code.writeline("#pragma omp parallel num_threads(kiln_nt)")
        code.writeline("{")
        with code.indent():
            for acc in phase.accumulators:
                acc.declare(code)
            code.writeline("#pragma omp for schedule(static)")
            _blocks(phase, main, code)
            code.writeline("const int64_t kiln_tid = omp_get_thread_num();")
            for acc in phase.accumulators:
                for suffix, _, _ in acc.parts:
                    code.writeline(f"for (int64_t l = 0; l < {LANES}; ++l) "
                                   f"{acc.array(suffix)}_part[kiln_tid * {LANES} + l] = "
                                   f"{acc.array(suffix)}[l];")
        code.writeline("}")
        code.writeline("for (int64_t t = 0; t < kiln_nt; ++t)")
        code.writeline(f"for (int64_t l = 0; l < {LANES}; ++l)")
        code.writeline("{")
        with code.indent():
            for acc in phase.accumulators:
                src = [f"{acc.array(s)}_part[t * {LANES} + l]" for s, _, _ in acc.parts]
                code.writeline(acc.merge(acc.refs("l"), src))
        code.writeline("}")
    code.writeline("}")


def _declare_parts(acc: Accumulator, code: IndentedBuffer) -> None:
    for suffix, ct, init in acc.parts:
        arr = f"{acc.array(suffix)}_part"
        code.writeline(f"{ct} {arr}[KILN_MAX_THREADS * {LANES}];")
        code.writeline(f"for (int64_t l = 0; l < kiln_nt * {LANES}; ++l) {arr}[l] = {init};")


def _braced(code: IndentedBuffer, body: IndentedBuffer) -> None:
    code.writeline("{")
    with code.indent():
        code.splice(body)
    code.writeline("}")
