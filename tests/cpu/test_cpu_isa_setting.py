"""KILN_CPU_ISA is checked like every setting: a level that does not exist is one warning
naming the variable and the levels, and kernels are built for this machine's level (no
compiler error dump, no graph run eagerly)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kiln.compiler.codegen.cpp.build import host_isa_level, isa_flags, isa_problem
from kiln.compiler.errors import KilnCompileError

PROGRAM = """
import warnings, torch
import kiln
from kiln.compiler.codegen.cpp.build import DEFAULT_ISA
warnings.simplefilter("error", kiln.KilnFallbackWarning)
def f(a, b):
    return torch.tanh(a) * b + a.sum(dim=-1, keepdim=True)
a, b = torch.randn(16, 33), torch.randn(16, 33)
torch.testing.assert_close(torch.compile(f, backend="kiln")(a, b), f(a, b))
print("isa", DEFAULT_ISA)
"""


@pytest.mark.skipif(host_isa_level() is None, reason="x86-64 levels only")
def test_a_bad_isa_is_one_warning_and_this_machines_level(tmp_path: object) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_CPU_ISA="x86-64-v9", KILN_FARM="inprocess", KILN_STATS_FILE="off",
               KILN_STORE=f"{tmp_path}/store", KILN_CACHE_DIR=os.environ["KILN_CACHE_DIR"])
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"isa {host_isa_level()}" in done.stdout
    warned = [line for line in done.stderr.splitlines() if "KILN_CPU_ISA" in line]
    assert len(warned) == 1 and "expected one of x86-64, x86-64-v2" in warned[0]
    assert "did you mean x86-64-v2?" in warned[0] or "x86-64-v4" in warned[0]
    assert "march" not in done.stderr and "error:" not in done.stderr


def test_isa_levels_are_named_and_others_refused() -> None:
    assert isa_problem("x86-64-v3") is None and isa_problem("x86-64") is None
    assert "expected one of x86-64, x86-64-v2, x86-64-v3, x86-64-v4" in str(
        isa_problem("x86-64-v9"))
    assert isa_flags("x86-64-v3") == ["-march=x86-64-v3", "-mtune=generic"]
    with pytest.raises(KilnCompileError, match="CPU target ISA 'x86-64-v9'"):
        isa_flags("x86-64-v9")  # a target naming one (a hostile request) never reaches g++
