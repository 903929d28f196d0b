"""Models for the CLI tests (`kiln precompile cli_models:mlp`)."""

from __future__ import annotations

import torch


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
