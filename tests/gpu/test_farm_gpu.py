"""The farm on a GPU host: a local Ray cluster whose Autotuner actor (num_gpus=1) times
every kernel's candidate configs on the real GPU, after the first answer (heuristic
configs), and the tuned artifact that supersedes it in the store records the winners."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from kiln.compiler.decompositions import trace_aten  # noqa: E402
from kiln.frontend.config import KilnConfig  # noqa: E402
from kiln.frontend.core.client import client_for  # noqa: E402
from kiln.frontend.core.compile import build_request, compile_request  # noqa: E402
from kiln.workers.artifact import from_artifact  # noqa: E402


@pytest.mark.gpu
def test_farm_autotunes_on_the_gpu(tmp_path: Path) -> None:
    import ray

    config = KilnConfig.resolve({"farm": "embedded",
                                 "store": f"file://{tmp_path / 'store'}", "autotune": True})
    x, w = torch.randn(4096, 1024, device="cuda"), torch.randn(1024, device="cuda")
    fn = lambda x, w: (torch.nn.functional.layer_norm(x, (1024,), w) * 2).relu()  # noqa: E731
    request = build_request(trace_aten(fn, [x, w]), [x, w], config)
    try:
        result = compile_request(request, config, "ln")
        assert result.source == "farm", result.source
        assert not result.compiled.autotuned  # the first output: heuristic configs
        assert result.compiled.stats.get("autotune_pending") is True
        client = client_for(config)
        assert client.tuner.wait(600)
        artifact = client.store.get(result.key.key)
        assert artifact is not None
        compiled = from_artifact(artifact)
        assert compiled.autotuned
        record = compiled.stats.get("autotune") or {}
        assert record, compiled.stats
        for spec in compiled.kernels:
            assert compiled.binaries[spec.name].config == compiled.configs[spec.name]
        print("autotune record:", record)
    finally:
        if ray.is_initialized():
            ray.shutdown()
