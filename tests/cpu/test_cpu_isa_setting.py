"""KILN_CPU_ISA is checked like every setting: a level that does not exist is one warning
naming the variable and the levels, and kernels are built for this machine's level (no
compiler error dump, no graph run eagerly)."""

from __future__ import annotations

import pytest

from kiln.compiler.codegen.cpp.build import (
    default_isa,
    host_isa_level,
    isa_flags,
    isa_problem,
)
from kiln.compiler.errors import KilnCompileError


@pytest.mark.skipif(host_isa_level() is None, reason="x86-64 levels only")
def test_a_bad_isa_is_one_warning_and_this_machines_level(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.frontend.config import KilnConfig

    monkeypatch.setenv("KILN_CPU_ISA", "x86-64-v9")
    assert default_isa() == host_isa_level()  # what targets get: kernels still build
    config = KilnConfig.resolve(env={"KILN_CPU_ISA": "x86-64-v9"}, warn=False)
    (problem,) = [p for p in config.problems if "KILN_CPU_ISA" in p]
    assert problem.startswith("KILN_CPU_ISA='x86-64-v9': expected one of x86-64, x86-64-v2, "
                              "x86-64-v3, x86-64-v4")
    assert problem.endswith("this machine's level is used")
    fine = KilnConfig.resolve(env={"KILN_CPU_ISA": "x86-64-v3"}, warn=False)
    assert not [p for p in fine.problems if "KILN_CPU_ISA" in p]


def test_isa_levels_are_named_and_others_refused() -> None:
    assert isa_problem("x86-64-v3") is None and isa_problem("x86-64") is None
    assert "expected one of x86-64, x86-64-v2, x86-64-v3, x86-64-v4" in str(
        isa_problem("x86-64-v9"))
    assert isa_flags("x86-64-v3") == ["-march=x86-64-v3", "-mtune=generic"]
    with pytest.raises(KilnCompileError, match="CPU target ISA 'x86-64-v9'"):
        isa_flags("x86-64-v9")  # a target naming one (a hostile request) never reaches g++
