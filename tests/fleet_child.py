"""One process of a fleet test (tests/cpu/test_fleet_claims.py): compile a model of
tests/fleet_models with Kiln, check its outputs (and gradients, for ``train``) against
eager on fresh random inputs, and print one JSON line: this process's client counters and
the seconds from its start to its first output.

    python tests/fleet_child.py infer|train [seed]

The store, farm mode and claim settings come from the environment (KILN_*);
``FLEET_TRACE_DIR`` gives each process its own KILN_TRACE file there. ``FLEET_SYNC_DIR``
lines the processes up for a test that kills one of them: each writes ``ready-<pid>``
there once it has imported everything and built its model and inputs, waits for ``go``
before it compiles, and writes ``waiting-<pid>`` (naming the holder) when it starts to
wait on another process's claim."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

STARTED = time.time()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("FLEET_TRACE_DIR"):  # one KILN_TRACE file per process
    os.environ["KILN_TRACE"] = f"{os.environ['FLEET_TRACE_DIR']}/trace-{os.getpid()}.json"

import torch  # noqa: E402

from kiln.frontend.core.client import process_counters, reset_clients  # noqa: E402
from kiln.frontend.core.fallback import KilnFallbackWarning  # noqa: E402
from tests import fleet_models  # noqa: E402


def _write(path: Path, text: str) -> None:
    """Written whole, then renamed: the test never reads half a file."""
    path.with_suffix(".tmp").write_text(text)
    path.with_suffix(".tmp").rename(path)


def _report_claim_waits(sync: Path) -> None:
    """``waiting-<pid>`` names the holder once this process waits on its claim."""
    from kiln.artifact_store.claims import Claims, describe_owner

    acquire_or_wait = Claims.acquire_or_wait

    def reported(self: Claims, key: str, ready: Any, owner: Any = None,
                 on_wait: Any = None) -> Any:
        def heard(holder: dict[str, Any]) -> None:
            _write(sync / f"waiting-{os.getpid()}", describe_owner(holder))
            if on_wait is not None:
                on_wait(holder)
        return acquire_or_wait(self, key, ready, owner, heard)

    Claims.acquire_or_wait = reported  # type: ignore[method-assign]


def _line_up(sync: Path, timeout: float = 300.0) -> None:
    """Ready; then wait for the test's ``go``, so the processes reach their claims
    together however unevenly a loaded machine started them."""
    _report_claim_waits(sync)
    _write(sync / f"ready-{os.getpid()}", "")
    ends = time.monotonic() + timeout
    while not (sync / "go").exists():
        if time.monotonic() > ends:
            sys.exit("fleet_child: no go from the test")
        time.sleep(0.01)


def main() -> None:
    warnings.simplefilter("error", KilnFallbackWarning)
    mode = sys.argv[1]
    torch.manual_seed(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    model = fleet_models.Block(dim=32, heads=2)
    x = torch.randn(2, 8, 32)
    compiled = torch.compile(model, backend="kiln")
    if os.environ.get("FLEET_SYNC_DIR"):
        _line_up(Path(os.environ["FLEET_SYNC_DIR"]))
    if mode == "train":
        model.train()
        expected = model(x)
        expected.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        model.zero_grad()
        out = compiled(x)
        first = time.time() - STARTED
        out.square().mean().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5)
    else:
        model.eval()
        with torch.no_grad():
            expected = model(x)
            out = compiled(x)
        first = time.time() - STARTED
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    counters = process_counters()
    reset_clients()  # flush the counters to the stats file
    print(json.dumps({"pid": os.getpid(), "first_output_s": first,
                      "first_output_at": STARTED + first, "counters": counters}))


if __name__ == "__main__":
    main()
