"""Reductions in Triton: persistent (the whole row in one block) or looped (accumulate
per lane over ``for roffset`` iterations, then combine lanes)."""

from __future__ import annotations

from typing import Any

import torch

from ..common import CSEVariable
from .overrides import literal, triton_type


def identity(reduction_type: str, dtype: torch.dtype) -> Any:
    if reduction_type in ("sum", "any", "xor_sum", "welford_reduce"):
        return 0
    if reduction_type == "prod":
        return 1
    if reduction_type in ("max", "argmax"):
        return float("-inf")
    if reduction_type in ("min", "argmin", "all"):
        return float("inf") if reduction_type != "all" else 1
    raise NotImplementedError(reduction_type)


_FINAL = {"sum": "tl.sum({a}, {axis})", "prod": "th.prod({a}, {axis})",
          "max": "th.max2({a}, {axis})", "min": "th.min2({a}, {axis})",
          "xor_sum": "th.xor_sum({a}, {axis})", "any": "tl.max({a}, {axis})",
          "all": "tl.min({a}, {axis})"}
_STEP = {"sum": "{acc} + {v}", "prod": "{acc} * {v}", "max": "th.maximum({acc}, {v})",
         "min": "th.minimum({acc}, {v})", "xor_sum": "{acc} ^ {v}",
         "any": "tl.maximum({acc}, {v})", "all": "tl.minimum({acc}, {v})"}


def emit_reduction(k: Any, reduction_type: str, value: CSEVariable, dtype: torch.dtype) -> Any:
    """Emit a reduction of ``value`` over the kernel's r dimension; return the result."""
    if reduction_type in ("any", "all"):
        value = k.emit(f"({value} != 0).to(tl.int8)", torch.int8)
    acc_dtype = value.dtype
    step, final = _step_final(reduction_type, acc_dtype, 1)
    mask = "rmask & xmask" if not k.mask_stack else "rmask & xmask & " + " & ".join(
        k.mask_stack)
    if reduction_type == "welford_reduce":
        return _welford(k, value, mask)
    if reduction_type in ("argmax", "argmin"):
        return _arg(k, reduction_type, value, mask)
    init = literal(identity(reduction_type, acc_dtype), acc_dtype)
    vb = k.emit(f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])", acc_dtype)
    if not k.looped:
        masked = k.emit(f"tl.where({mask}, {vb}, {init})", acc_dtype)
        out = k.emit(f"{final.format(a=masked)}[:, None]", acc_dtype)
        return _finish(k, reduction_type, out)
    acc = f"_{k.loop_cse.newvar(acc_dtype).name}"
    k.loop_pre.writeline(f"{acc} = tl.full([XBLOCK, RBLOCK], {init}, {triton_type(acc_dtype)})")
    updated = k.emit(step.format(acc=acc, v=vb), acc_dtype)
    k.loop_body.writeline(f"{acc} = tl.where({mask}, {updated}, {acc})")
    out = k.loop_cse.newvar(acc_dtype)
    k.loop_post.writeline(f"{out} = {final.format(a=acc)}[:, None]")
    return _finish(k, reduction_type, out)


def _step_final(reduction_type: str, acc_dtype: torch.dtype, axis: int) -> tuple[str, str]:
    """The accumulate step and the final combine (over ``axis``) of a reduction."""
    if not acc_dtype.is_floating_point and reduction_type in ("max", "min"):
        step = {"max": "tl.maximum({acc}, {v})", "min": "tl.minimum({acc}, {v})"}
        return step[reduction_type], f"tl.{reduction_type}({{a}}, {axis})"
    final = _FINAL.get(reduction_type, "").replace("{axis}", str(axis))
    return _STEP.get(reduction_type, ""), final


def emit_column_reduction(k: Any, reduction_type: str, value: CSEVariable,
                          dtype: torch.dtype) -> CSEVariable:
    """A column stage's reduction in a row-column kernel: accumulated per lane across
    the row loop, combined over the rows of the tile (axis 0) after it."""
    acc_dtype = value.dtype
    step, final = _step_final(reduction_type, acc_dtype, 0)
    mask = " & ".join(["xmask", "rmask", *k.mask_stack])
    init = literal(identity(reduction_type, acc_dtype), acc_dtype)
    vb = k.emit(f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])", acc_dtype)
    acc = f"_{k.cse.newvar(acc_dtype).name}"
    k.column_pre.writeline(f"{acc} = tl.full([XBLOCK, RBLOCK], {init}, "
                           f"{triton_type(acc_dtype)})")
    updated = k.emit(step.format(acc=acc, v=vb), acc_dtype)
    k.body.writeline(f"{acc} = tl.where({mask}, {updated}, {acc})")
    out = k.cse.newvar(acc_dtype)
    k.column_post.writeline(f"{out} = {final.format(a=acc)}[None, :]")
    return out


def _finish(k: Any, reduction_type: str, out: CSEVariable) -> CSEVariable:
    if reduction_type in ("any", "all"):
        return _post_emit(k, f"({out} != 0)", torch.bool)
    return out


def _post_emit(k: Any, expr: str, dtype: torch.dtype) -> CSEVariable:
    if not k.looped:
        return k.emit(expr, dtype)
    var = k.loop_cse.newvar(dtype)
    k.loop_post.writeline(f"{var} = {expr}")
    return var


def _welford(k: Any, value: CSEVariable, mask: str) -> tuple[CSEVariable, ...]:
    f32 = torch.float32
    vb = k.emit(f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])", f32)
    if not k.looped:
        masked = k.emit(f"tl.where({mask}, {vb}, 0.0)", f32)
        n = "rnumel.to(tl.float32)" if k.dynamic else float(k.rnumel)
        mean = k.emit(f"tl.sum({masked}, 1)[:, None] / {n}", f32)
        delta = k.emit(f"tl.where({mask}, {vb} - {mean}, 0.0)", f32)
        m2 = k.emit(f"tl.sum({delta} * {delta}, 1)[:, None]", f32)
        weight = k.emit(f"tl.zeros([XBLOCK, 1], tl.float32) + {n}", f32)
        return (mean, m2, weight)
    names = [f"_{k.loop_cse.newvar(f32).name}" for _ in range(3)]
    for n in names:
        k.loop_pre.writeline(f"{n} = tl.zeros([XBLOCK, RBLOCK], tl.float32)")
    step = [k.loop_cse.newvar(f32).name for _ in range(3)]
    k.loop_body.writeline(f"{', '.join(step)} = th.welford_step({vb}, {', '.join(names)}, "
                          f"roffset == 0)")
    for n, s in zip(names, step):
        k.loop_body.writeline(f"{n} = tl.where({mask}, {s}, {n})")
    outs = [k.loop_cse.newvar(f32) for _ in range(3)]
    tmp = [f"{o}_" for o in outs]
    k.loop_post.writeline(f"{', '.join(tmp)} = th.welford({', '.join(names)}, 1)")
    for o, t in zip(outs, tmp):
        k.loop_post.writeline(f"{o} = {t}[:, None]")
    return tuple(outs)


def _arg(k: Any, reduction_type: str, value: CSEVariable, mask: str) -> CSEVariable:
    helper = "th.max_with_index" if reduction_type == "argmax" else "th.min_with_index"
    step_fn = "th.argmax_step" if reduction_type == "argmax" else "th.argmin_step"
    vdt = value.dtype
    init = literal(identity(reduction_type, vdt), vdt)
    vb = k.emit(f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])", vdt)
    ib = k.emit("tl.broadcast_to(rindex, [XBLOCK, RBLOCK]).to(tl.int64)", torch.int64)
    if not k.looped:
        masked = k.emit(f"tl.where({mask}, {vb}, {init})", vdt)
        pair = k.loop_cse.newvar(vdt).name if k.loop_cse else k.cse.newvar(vdt).name
        out = k.cse.newvar(torch.int64)
        k.compute().writeline(f"{pair}, {out}_ = {helper}({masked}, {ib}, 1)")
        k.compute().writeline(f"{out} = {out}_[:, None]")
        return out
    acc_v = f"_{k.loop_cse.newvar(vdt).name}"
    acc_i = f"_{k.loop_cse.newvar(torch.int64).name}"
    k.loop_pre.writeline(f"{acc_v} = tl.full([XBLOCK, RBLOCK], {init}, {triton_type(vdt)})")
    k.loop_pre.writeline(f"{acc_i} = tl.zeros([XBLOCK, RBLOCK], tl.int64)")
    nv, ni = k.loop_cse.newvar(vdt), k.loop_cse.newvar(torch.int64)
    k.loop_body.writeline(f"{nv}, {ni} = {step_fn}({acc_v}, {acc_i}, {vb}, {ib})")
    k.loop_body.writeline(f"{acc_v} = tl.where({mask}, {nv}, {acc_v})")
    k.loop_body.writeline(f"{acc_i} = tl.where({mask}, {ni}, {acc_i})")
    out = k.loop_cse.newvar(torch.int64)
    k.loop_post.writeline(f"_{out}, {out}_ = {helper}({acc_v}, {acc_i}, 1)")
    k.loop_post.writeline(f"{out} = {out}_[:, None]")
    return out
