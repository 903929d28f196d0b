"""One rank of the tensor-parallel test (tests/cpu/test_ddp_ranks.py), run by torchrun:
an MLP split over the ranks with ``parallelize_module`` (the first layer by columns, the
second by rows, so the forward all-reduces its output and the backward its input's
gradient), compiled with Kiln, one training step against an eager copy split the same
way (outputs and the local shards' gradients). Its ATen graphs take the device mesh as an
input, which Kiln passes along (frontend/core/opaque.py). Writes ``<out>/rank<r>.json``:
the keys this rank computed, in order, and its client counters.

    torchrun --nproc_per_node 2 tests/tp_child.py OUT_DIR
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from kiln.frontend.core.fallback import KilnFallbackWarning  # noqa: E402
from tests.ddp_child import finish_rank  # noqa: E402  (records the client's keys)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))) + x


def main() -> None:
    warnings.simplefilter("error", KilnFallbackWarning)
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # the same full weights on every rank before the split
    net = Mlp()
    eager = copy.deepcopy(net)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(net, mesh, plan)
    parallelize_module(eager, mesh, plan)
    compiled = torch.compile(net, backend="kiln")
    torch.manual_seed(100)  # the same batch on every rank, as tensor parallelism has it
    x = torch.randn(8, 64)
    expected = eager(x)
    expected.square().mean().backward()
    got = compiled(x)
    got.square().mean().backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(net.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-4,
                                   atol=1e-5, msg=name)
    finish_rank(out, rank)


if __name__ == "__main__":
    main()
