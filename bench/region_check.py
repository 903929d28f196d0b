"""Which region of a graph compiled as regions goes wrong (a diagnostic, not a test).

Runs one model's step of bench/coldstart_models.py through Kiln with regions on, and
checks every region as it runs: its compiled outputs against its own ATen graph run
eagerly on copies of the same inputs (NaN and inf counts in each, and the largest
difference over the reference's largest magnitude). Then the step's outputs against
eager's, named. ``--defer`` makes the client defer as with a farm up (regions compiled on
threads of this process, each graph waiting at its first call; a training backward
compiled right after its forward), so that the farm's path runs without Ray.

For a region with a wrong output it then says (lines starting ``  ``): where the wrong
values lie (count, flat index span, coordinates of the first few, the output's address
beside the region's other outputs); whether a second call of the same loaded region on
the same inputs is wrong again; whether the region's artifact as the store holds it,
loaded afresh, is right on those inputs; and which fields of the compiled graph differ
between the one the client loaded and the stored one.

Seen on the H200 (2026-12-04, main 7a853a0, ``--defer``): forward region 0's output 4,
the contiguous copy of the max-pool output saved for the backward (fp16 [32, 64, 56, 56]),
had ~8000 wrong values (some NaN) on every run, also with CUDA_LAUNCH_BLOCKING=1, with
KILN_AUTOTUNE=0 and with KILN_STATIC_LAUNCHER=0, and again on a second call; the step's
layer1.0.conv1 gradient then had 128-704 NaN. At 18:42 this check found the same without
``--defer`` and in the stored artifact loaded afresh (the loaded and stored graphs equal):
the kernel itself was wrong on the GPU. Its contiguous copy loaded back the channels-last
values it had just stored, in another thread layout, with nothing ordering the two (fixed
in 24916a3, tests/unit/test_store_load_order.py); at 18:54 every region and the step were
right (without ``--defer``; the farm sweep at 19:03 passed its check).

    python3 bench/region_check.py --model resnet50_train --device cuda --defer
    python3 bench/region_check.py --model resnet50_train --device cpu --smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def describe(t: Any) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    f = t.detach().float()
    return (f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} nan {int(f.isnan().sum())} "
            f"inf {int(f.isinf().sum())}")


def difference(out: Any, ref: Any) -> str:
    """NaN and inf counts of both, and max |out - ref| over max |ref| (finite values)."""
    import torch

    if not (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)):
        return f"{type(out).__name__} / {type(ref).__name__}"
    o, r = out.detach().float(), ref.detach().float()
    if o.shape != r.shape:
        return f"shape {list(o.shape)} against {list(r.shape)}"
    both = torch.isfinite(o) & torch.isfinite(r)
    scale = float(r[both].abs().max()) if bool(both.any()) else 0.0
    diff = float((o - r)[both].abs().max()) if bool(both.any()) else 0.0
    strides = "" if out.stride() == ref.stride() else f" strides {out.stride()}/{ref.stride()}"
    return (f"{describe(out)} (eager {int((~torch.isfinite(r)).sum())} non-finite), "
            f"max diff {diff:.3g} of max {scale:.3g}{strides}")


def bad(out: Any, ref: Any, rel: float) -> bool:
    import torch

    if not (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)):
        return False
    o, r = out.detach().float(), ref.detach().float()
    if o.shape != r.shape or bool((~torch.isfinite(o) & torch.isfinite(r)).any()):
        return True
    both = torch.isfinite(o) & torch.isfinite(r)
    if not bool(both.any()):
        return False
    return float((o - r)[both].abs().max()) > rel * max(float(r[both].abs().max()), 1e-6)


def where_wrong(out: Any, ref: Any, rel: float, others: Sequence[Any]) -> str:
    """Where ``out`` differs from ``ref``: how many values, their flat index span, the
    coordinates of the first few, and which of ``others`` (the region's outputs) sit
    right before and after it in memory."""
    import torch

    o, r = out.detach().float(), ref.detach().float()
    both = torch.isfinite(r)
    scale = max(float(r[both].abs().max()) if bool(both.any()) else 0.0, 1e-6)
    wrong = (~torch.isfinite(o) & both) | ((o - r).abs() > rel * scale)
    flat = wrong.flatten().nonzero().flatten()
    if not flat.numel():
        return "no wrong value"
    coords = [tuple(int(v) for v in torch.unravel_index(i, o.shape)) for i in flat[:6]]
    start, end = out.data_ptr(), out.data_ptr() + out.untyped_storage().nbytes()
    before = [t.data_ptr() + t.untyped_storage().nbytes() - start for t in others
              if isinstance(t, torch.Tensor) and t.is_cuda == out.is_cuda
              and t.data_ptr() < start] if out.is_cuda else []
    after = [t.data_ptr() - end for t in others if isinstance(t, torch.Tensor)
             and t.is_cuda == out.is_cuda and t.data_ptr() >= end] if out.is_cuda else []
    return (f"{flat.numel()} wrong of {o.numel()}, flat {int(flat[0])}..{int(flat[-1])}, "
            f"first at {coords}; nearest output ends {max(before, default=None)} B "
            f"before it, next starts {min(after, default=None)} B after it")


def install_checks(rel: float, log: list[str]) -> None:
    """Wrap each region's call (``frontend.core.regions._step``) with the check, and keep each
    loaded region's compile result (``_load_region``) for the follow-up checks."""
    import torch

    from kiln.frontend.core import regions

    graphs: dict[str, Any] = {}
    loaded: dict[int, tuple[Any, ...]] = {}
    region_plan, step, load_region = regions._region_plan, regions._step, regions._load_region

    def recording_plan(region: Any, key: str) -> Any:
        plan = region_plan(region, key)
        graphs[plan.label] = region.gm
        return plan

    def recording_load(client: Any, result: Any, *rest: Any) -> Any:
        fn = load_region(client, result, *rest)
        loaded[id(fn)] = (client, result, rest)
        return fn

    def checked_step(call: Any, plan: Any) -> Any:
        gm = graphs.get(plan.label)

        def checked(args: list[Any]) -> Any:
            copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            bad_in = [i for i, a in enumerate(copies) if isinstance(a, torch.Tensor)
                      and a.is_floating_point() and not bool(torch.isfinite(a).all())]
            outs = call(args)
            if gm is None:
                return outs
            with torch.no_grad():
                refs = gm(*copies)
            refs = refs if isinstance(refs, (list, tuple)) else (refs,)
            wrong = [i for i, (o, r) in enumerate(zip(outs, refs)) if bad(o, r, rel)]
            say(log, f"{plan.label}: {len(outs)} outputs, {len(wrong)} wrong"
                     f"{', non-finite inputs ' + str(bad_in) if bad_in else ''}")
            for i in wrong[:4]:
                say(log, f"  output {i}: {difference(outs[i], refs[i])}")
                say(log, f"  output {i}: {where_wrong(outs[i], refs[i], rel, outs)}")
            if wrong:
                follow_up(call, loaded.get(id(call)), copies, refs, wrong, rel, log)
            return outs

        return step(checked, plan)

    regions._region_plan = recording_plan  # type: ignore[assignment]
    regions._step = checked_step  # type: ignore[assignment]
    regions._load_region = recording_load  # type: ignore[assignment]
    regions._check_loader = load_region  # type: ignore[attr-defined]


def say(log: list[str], line: str) -> None:
    log.append(line)
    print(line, flush=True)


def follow_up(call: Any, loaded: tuple[Any, ...] | None, copies: list[Any], refs: Any,
              wrong: list[int], rel: float, log: list[str]) -> None:
    """The same loaded region called again; the stored artifact loaded afresh and called;
    and the fields in which the client's compiled graph differs from the stored one."""
    import torch

    from kiln.frontend.core import regions

    def fresh() -> list[Any]:
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in copies]

    again = call(fresh())
    say(log, "  called again: " + "; ".join(
        f"output {i} {'WRONG' if bad(again[i], refs[i], rel) else 'right'}" for i in wrong))
    if loaded is None:
        return
    client, result, rest = loaded
    stored = client.lookup(result.key.key)
    if stored is None:
        say(log, "  the store has no artifact under the region's key")
        return
    outs = regions._check_loader(client, stored, *rest)(fresh())  # type: ignore[attr-defined]
    say(log, f"  the stored artifact ({stored.source}), loaded afresh: " + "; ".join(
        f"output {i} {'WRONG' if bad(outs[i], refs[i], rel) else 'right'}" for i in wrong))
    mine, theirs = result.compiled.to_dict(), stored.compiled.to_dict()
    fields = [k for k in mine if mine[k] != theirs.get(k)]
    kernels = [a["name"] for a, b in zip(mine["kernels"], theirs["kernels"]) if a != b]
    binaries = [k for k in mine["binaries"] if mine["binaries"][k] != theirs["binaries"].get(k)]
    say(log, f"  loaded vs stored compiled graph: fields differing {fields}, kernels "
             f"{kernels[:8]}, binaries {binaries[:8]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50_train")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--defer", action="store_true", help="defer as with a farm up")
    parser.add_argument("--rel", type=float, default=0.05,
                        help="a region output is wrong past this max diff / max |ref|")
    parser.add_argument("--store", default="", help="Kiln store folder (default: a new one)")
    args = parser.parse_args(argv)
    store = args.store or tempfile.mkdtemp(prefix="kiln-region-check-")
    os.environ.setdefault("KILN_FARM", "inprocess")
    os.environ.setdefault("KILN_REGIONS", "on")
    os.environ.setdefault("KILN_STORE", f"file://{store}")
    os.environ.setdefault("KILN_LOCAL_CACHE", "off")
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from coldstart_models import MODELS

    import kiln
    from kiln.frontend.core.fallback import KilnFallbackWarning

    # A graph run eagerly must never pass as Kiln's: its check would compare eager with eager.
    warnings.simplefilter("error", KilnFallbackWarning)
    log: list[str] = []
    install_checks(args.rel, log)
    if args.defer:
        from kiln.frontend.core import regions

        regions.compiles_here = lambda client: False  # type: ignore[assignment]
    torch.manual_seed(0)
    case = MODELS[args.model](args.device, args.smoke)
    ref = [t.detach().clone() for t in case.step(case.module)]
    torch._dynamo.reset()
    out = case.step(torch.compile(case.module, backend=kiln.backend))
    names = getattr(case, "outputs", ())
    failed = 0
    print("== summary\n" + "\n".join(log))
    for i, (o, r) in enumerate(zip(out, ref)):
        name = names[i] if i < len(names) else f"output {i}"
        wrong = bad(o, r, args.rel)
        failed += wrong
        print(f"step {name}: {'WRONG' if wrong else 'ok'} {difference(o, r)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
