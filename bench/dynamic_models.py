"""Real models at many sizes, every way of compiling them (issue 32): graphs, eager
fallbacks and ms per call at each size, as one JSON object.

    python3 bench/dynamic_models.py --models llama --json llama.json
    python3 bench/dynamic_models.py --models bert,resnet --json others.json

Models (built from configs, random weights, nothing downloaded):

- ``llama``: HF ``LlamaModel``, 8 layers, hidden 1024, GQA 16/4 heads, bf16, batch 4, at
  200, 384, 700, 1000, 1500 and 333 tokens (the issue's model and order);
- ``bert``: HF ``BertModel`` (4 layers, hidden 768, fp16, batch 8) with a padding mask
  (one row half padded), at the same lengths;
- ``resnet``: transformers' ResNet in ResNet-18's layout (fp16, 224x224), at batch
  sizes 2, 3, 8, 16, 24, 5.

Settings, each in this process after ``torch._dynamo.reset()``: ``eager``,
``inductor`` (default: automatic dynamic), ``inductor_dynamic`` (``dynamic=True``),
``kiln`` (default), ``kiln_dynamic`` (``dynamic=True``) and ``kiln_static``
(``dynamic=False``: one compile per size). Per row: Dynamo graphs compiled, Kiln's eager
fallbacks (``KilnFallbackWarning``), first-call seconds and median ms per call at each
size (CUDA events), and the difference from eager's output (relative L2 error, and the
largest absolute difference). A Kiln row with a
fallback, or any row whose output differs from eager beyond the dtype's tolerance,
fails; the process then exits 1. Kiln compiles in this process (``KILN_FARM=inprocess``)
into a fresh store unless ``KILN_STORE`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KILN_FARM", "inprocess")
if "KILN_STORE" not in os.environ:
    os.environ["KILN_STORE"] = "file://" + tempfile.mkdtemp(prefix="kiln_dynamic_bench_")
    os.environ.setdefault("KILN_LOCAL_CACHE", "off")

import torch  # noqa: E402

LENGTHS = (200, 384, 700, 1000, 1500, 333)
BATCHES = (2, 3, 8, 16, 24, 5)
# --cpu-smoke: the same code path on this machine's CPU with tiny models and sizes (a
# check that the script runs, not a measurement).
SMOKE = {"lengths": (20, 33, 7), "batches": (2, 3, 5)}
DEVICE = "cuda"
SETTINGS = ("eager", "inductor", "inductor_dynamic", "kiln", "kiln_dynamic", "kiln_static")
# Largest relative L2 error from eager's output (a whole model's rounding in the dtype).
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@dataclass
class Model:
    """A model, its sizes, and the inputs of one size."""

    name: str
    module: torch.nn.Module
    sizes: tuple[int, ...]
    inputs: Callable[[int, torch.Generator], list[Any]]
    dtype: torch.dtype


class LastHidden(torch.nn.Module):
    """An HF model returning its last hidden state (a tensor, not an output class)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> torch.Tensor:
        if len(args) == 2:
            return self.model(args[0], attention_mask=args[1]).last_hidden_state
        return self.model(args[0]).last_hidden_state


def llama(smoke: bool) -> Model:
    from transformers import LlamaConfig, LlamaModel

    hidden, layers = (64, 1) if smoke else (1024, 8)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=4096, use_cache=False)
    config._attn_implementation = "sdpa"
    dtype = torch.float32 if smoke else torch.bfloat16
    module = LastHidden(LlamaModel(config)).to(DEVICE, dtype).eval()

    def inputs(n: int, g: torch.Generator) -> list[Any]:
        return [torch.randint(0, 32000, (4, n), device=DEVICE, generator=g)]

    return Model("llama", module, SMOKE["lengths"] if smoke else LENGTHS, inputs, dtype)


def bert(smoke: bool) -> Model:
    from transformers import BertConfig, BertModel

    hidden, layers = (64, 1) if smoke else (768, 4)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4
                        if smoke else 12, intermediate_size=4 * hidden, vocab_size=30522,
                        max_position_embeddings=2048)
    config._attn_implementation = "sdpa"
    dtype = torch.float32 if smoke else torch.float16
    module = LastHidden(BertModel(config)).to(DEVICE, dtype).eval()

    def inputs(n: int, g: torch.Generator) -> list[Any]:
        mask = torch.ones(8, n, dtype=torch.long, device=DEVICE)
        mask[1, n // 2:] = 0  # a padded row
        return [torch.randint(0, 30522, (8, n), device=DEVICE, generator=g), mask]

    return Model("bert", module, SMOKE["lengths"] if smoke else LENGTHS, inputs, dtype)


def resnet(smoke: bool) -> Model:
    from transformers import ResNetConfig, ResNetModel

    # ResNet-18's layout (basic blocks, 2-2-2-2), transformers' own ResNet.
    config = ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512],
                          depths=[2, 2, 2, 2], layer_type="basic")
    dtype = torch.float32 if smoke else torch.float16
    module = LastHidden(ResNetModel(config)).to(DEVICE, dtype).eval()
    side = 32 if smoke else 224

    def inputs(n: int, g: torch.Generator) -> list[Any]:
        return [torch.randn(n, 3, side, side, device=DEVICE, generator=g).to(dtype)]

    return Model("resnet", module, SMOKE["batches"] if smoke else BATCHES, inputs, dtype)


MODELS: dict[str, Callable[[bool], Model]] = {"llama": llama, "bert": bert, "resnet": resnet}


def compiled_fn(model: Model, setting: str) -> Callable[..., Any]:
    if setting == "eager":
        return model.module
    backend = "kiln" if setting.startswith("kiln") else "inductor"
    dynamic = {"dynamic": True, "static": False}.get(setting.rpartition("_")[2])
    return torch.compile(model.module, backend=backend, dynamic=dynamic)


def median_ms(fn: Callable[..., Any], args: list[Any], reps: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        if DEVICE == "cpu":
            t = time.perf_counter()
            fn(*args)
            times.append(1e3 * (time.perf_counter() - t))
            continue
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_setting(model: Model, setting: str, reps: int, inputs: dict[int, list[Any]],
                reference: dict[int, torch.Tensor]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch._dynamo.reset()
    counters.clear()
    fn = compiled_fn(model, setting)
    row: dict[str, Any] = {"model": model.name, "setting": setting, "sizes": {},
                           "fallbacks": [], "failures": []}
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KilnFallbackWarning)
        for n in model.sizes:
            t = time.perf_counter()
            out = fn(*inputs[n])
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t
            ref = reference[n]
            diff = (out.float() - ref).abs().max().item()
            rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-6)).item()
            if not rel <= TOLERANCE[model.dtype]:
                row["failures"].append(f"size {n}: relative error {rel:.3g} from eager")
            row["sizes"][str(n)] = {"ms": round(median_ms(fn, inputs[n], reps), 4),
                                    "first_call_s": round(first_s, 3),
                                    "max_abs_diff": diff, "rel_l2_error": rel}
    row["fallbacks"] = [str(w.message) for w in caught
                        if issubclass(w.category, KilnFallbackWarning)]
    row["graphs"] = int(counters["stats"]["unique_graphs"]) if setting != "eager" else None
    if setting.startswith("kiln") and row["fallbacks"]:
        row["failures"].append(f"{len(row['fallbacks'])} eager fallback(s)")
    row["ok"] = not row["failures"]
    return row


def run_model(name: str, settings: list[str], reps: int, smoke: bool = False
              ) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = MODELS[name](smoke)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    inputs = {n: model.inputs(n, g) for n in model.sizes}
    with torch.no_grad():
        reference = {n: model.module(*inputs[n]).float() for n in model.sizes}
    rows = []
    for setting in settings:
        try:
            rows.append(run_setting(model, setting, reps, inputs, reference))
        except Exception as e:  # a setting that raises is a failed row, the rest run on
            rows.append({"model": name, "setting": setting, "ok": False,
                         "failures": [f"{type(e).__name__}: {e}"]})
        print_row(rows[-1])
    return rows


def print_row(row: dict[str, Any]) -> None:
    sizes = row.get("sizes", {})
    ms = ", ".join(f"{n}: {v['ms']:.3f}" for n, v in sizes.items())
    print(f"{row['model']:7s} {row['setting']:17s} graphs {row.get('graphs')} "
          f"fallbacks {len(row.get('fallbacks', []))} {'ok' if row['ok'] else 'FAILED'} "
          f"ms [{ms}] {'; '.join(row['failures'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,bert,resnet")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="write the rows here too")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU: "
                        "a check that the script runs, not a measurement")
    args = parser.parse_args(argv)
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench/dynamic_models.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for name in args.models.split(","):
        rows.extend(run_model(name, args.settings.split(","), args.reps, args.cpu_smoke))
    device = "cpu" if DEVICE == "cpu" else torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__,
              "rows": rows, "ok": all(r["ok"] for r in rows)}
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
