"""One rank of the DDP test (tests/cpu/test_ddp_ranks.py), run by torchrun: a model
wrapped in DistributedDataParallel with small buckets (Dynamo's DDPOptimizer splits its
graph at bucket boundaries), compiled with Kiln, one training step against an eager DDP
copy (outputs and all-reduced gradients), on gloo. Writes ``<out>/rank<r>.json``: the
keys this rank computed, in order, and its client counters.

    torchrun --nproc_per_node 4 tests/ddp_child.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import kiln.frontend.core.client as client_module  # noqa: E402
from kiln.frontend.core.client import process_counters, reset_clients  # noqa: E402
from kiln.frontend.core.fallback import KilnFallbackWarning  # noqa: E402

keys: list[str] = []
_compute_key = client_module.compute_key


def recording_compute_key(request):  # type: ignore[no-untyped-def]
    """The client's own key function; the keys it returns are kept for the test."""
    info = _compute_key(request)
    keys.append(info.key)
    return info


client_module.compute_key = recording_compute_key


WIDTH = 512


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 1 MiB of weights per layer: DDP's smallest bucket (its first) holds one
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)
        self.c = torch.nn.Linear(WIDTH, WIDTH // 2)
        self.d = torch.nn.Linear(WIDTH // 2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.a(x))
        x = torch.tanh(self.b(x)) + x
        x = torch.relu(self.c(x))
        return self.d(x).log_softmax(-1)


def finish_rank(out: Path, rank: int) -> None:
    """Write ``<out>/rank<rank>.json`` (the keys this rank computed and its client
    counters), then leave the process group with the other ranks."""
    counters = process_counters()
    reset_clients()
    (out / f"rank{rank}.json").write_text(json.dumps({"keys": keys, "counters": counters}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    warnings.simplefilter("error", KilnFallbackWarning)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank, as DDP requires
    net = Net()
    # About one layer per bucket (1 MiB, the least DDPOptimizer takes): it splits the
    # graph into several.
    eager = DDP(copy.deepcopy(net), bucket_cap_mb=1)
    kiln = DDP(net, bucket_cap_mb=1)
    compiled = torch.compile(kiln, backend="kiln")
    torch.manual_seed(100 + rank)  # each rank its own batch
    x = torch.randn(16, WIDTH)
    expected = eager(x)
    expected.square().mean().backward()
    got = compiled(x)
    got.square().mean().backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(kiln.module.named_parameters(), eager.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    finish_rank(out, rank)


if __name__ == "__main__":
    main()
