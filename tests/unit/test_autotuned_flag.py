"""An in-process artifact says ``autotuned: true`` only when every kernel with several
candidate configs was actually timed (here the GPU timing is replaced by a record of
what would have been measured: no GPU on this machine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.compiler import autotune
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import KernelBinary


def _fake_cuda_graph() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = [torch.empty(512, 1024, device="cuda") for _ in range(2)]
    fn = lambda a, b: (a.exp() + b).relu().sum(-1)  # noqa: E731
    return compile_graph(trace_aten(fn, args), args, {}, compile_kernels=False)


def _binaries(specs: list[Any], target: dict[str, Any]) -> dict[str, list[KernelBinary]]:
    return {s.name: [KernelBinary(s.name, target, dict(c), b"", {}) for c in s.configs[:3]]
            for s in specs}


@pytest.mark.parametrize("timed", [True, False])
def test_autotuned_only_when_configs_were_timed(monkeypatch: pytest.MonkeyPatch,
                                                timed: bool) -> None:
    compiled = _fake_cuda_graph()
    assert all(len(s.configs) > 1 for s in compiled.kernels)
    monkeypatch.setattr(autotune, "compile_candidates", _binaries)

    def tune(spec: Any, target: Any, device: Any, binaries: list[KernelBinary]) -> Any:
        return binaries[0], ([(binaries[0].config, 0.01)] if timed else [])

    monkeypatch.setattr(autotune, "autotune_kernel", tune)
    autotune.autotune_graph(compiled, {"kind": "cuda", "arch": 90}, torch.device("cpu"))
    assert compiled.autotuned is timed
