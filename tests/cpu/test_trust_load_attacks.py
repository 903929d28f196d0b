"""Issue 33's attacks on the client's load path, each performed: a store others can
write (default settings), a restored build cache, a planted ``.pyc``, a rename race on
a loaded library, a world-writable folder inside the cache, and altered or unsigned
packages. A second user is modelled by the mode bits that would let them write."""

from __future__ import annotations

import importlib.util
import inspect
import logging
from pathlib import Path

import pytest
from test_trust_local import (  # noqa: F401  (env is a fixture)
    env,
    exported_kernels,
    fresh_process,
    plant,
    poison_library,
    run_checked,
    run_in_new_process,
)

from kiln.artifact_store import Artifact, open_store
from kiln.compiler.runtime import kernel_files, local_cache


def graph_artifacts(store: Path) -> list[Artifact]:
    reader = open_store(store, stats_file=False)
    found = [reader.get(p.name) for p in (store / "ac").rglob("*") if p.is_file()]
    return [a for a in found if a is not None and "wrapper.py" in a.blobs]


def test_row1_store_others_can_write_runs_no_code_by_default(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    team = tmp_path / "team-store"
    team.mkdir()
    team.chmod(0o775)  # a folder the team's group may write
    monkeypatch.setenv("KILN_STORE", str(team))
    monkeypatch.delenv("KILN_SIGNING_KEY")  # default settings
    run_checked()
    marker = tmp_path / "pwned"
    monkeypatch.setenv("KILN_TRUST_UNSIGNED", "1")  # the attacker reads what is there
    (graph,) = graph_artifacts(team)
    monkeypatch.delenv("KILN_TRUST_UNSIGNED")
    evil = f"open({str(marker)!r}, 'w').close()\n".encode() + graph.blobs["wrapper.py"]
    attacker = open_store(team, stats_file=False)
    assert attacker.publish(Artifact(graph.key, graph.manifest,
                                     dict(graph.blobs, **{"wrapper.py": evil})))
    fresh_process(monkeypatch)
    with caplog.at_level(logging.WARNING):
        run_checked()  # the victim: compiles locally, right results, no fallback
    assert not marker.exists(), "code from a store others can write ran"
    said = [r.getMessage() for r in caplog.records if r.name == "kiln.trust"]
    assert said and str(team) in said[0] and "writable by its group" in said[0]


def test_row5_restored_build_cache_is_neither_loaded_nor_published(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    run_checked()
    built = list((env / "cpp").glob("??/*.so"))
    assert built
    marker = tmp_path / "pwned"
    for so in built:  # this user's own file and mode, as a restored CI cache gives
        plant(so, poison_library(exported_kernels(so), marker, tmp_path), 0o600)
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "second-store"))  # a miss: build
    run_in_new_process()
    assert not marker.exists(), "the restored shared object ran"
    poison = (tmp_path / "poison.so").read_bytes()
    published = [p.read_bytes() for p in (tmp_path / "second-store" / "cas").rglob("*")
                 if p.is_file()]
    assert published and poison not in published, "the restored object was published"


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(root))
    monkeypatch.setattr(local_cache, "_roots", {})
    monkeypatch.setattr(local_cache, "_checked", set())
    return root


def test_row10_planted_pyc_never_runs(private_cache: Path) -> None:
    source = f"def f():\n    return 'honest'\n# {private_cache}\n"
    path = kernel_files.write_source(source)
    evil = compile("def f():\n    return 'pwned'\n", str(path), "exec")
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(mode=0o700)
    info = path.stat()  # a .pyc that claims the source's time and size
    pyc.write_bytes(importlib._bootstrap_external._code_to_timestamp_pyc(  # type: ignore[attr-defined]
        evil, info.st_mtime, info.st_size))
    module = kernel_files.import_source(source)
    assert module.f() == "honest"
    assert "honest" in inspect.getsource(module.f)


def test_row11_renamed_library_after_the_check_is_not_loaded(
        private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.compiler.codegen.cpp import build

    marker = tmp_path / "pwned"
    honest = poison_library(["kiln_honest"], tmp_path / "unused", tmp_path)
    (tmp_path / "evil").mkdir()
    evil = poison_library(["kiln_honest"], marker, tmp_path / "evil")
    check = build.verified_file

    def racing(path: Path, data: bytes) -> Path:  # the attacker's rename wins the race
        checked = check(path, data)
        plant(checked, evil)
        return checked

    monkeypatch.setattr(build, "verified_file", racing)
    with pytest.raises(OSError, match="changed after it was checked"):
        build.load_library(honest)
    assert not marker.exists()
    monkeypatch.setattr(build, "verified_file", check)
    build.load_library(honest).kiln_honest()
    assert not marker.exists()


def test_row11_world_writable_folder_inside_the_cache_is_not_used(
        private_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    kernels = local_cache.private_dir("kernels")
    assert (kernels.stat().st_mode & 0o777) == 0o700
    assert ((private_cache / "kernels").stat().st_mode & 0o777) == 0o700
    local_cache._checked.clear()  # a new process
    (private_cache / "kernels").chmod(0o777)  # another user could rename files in it
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        path = kernel_files.write_source("x = 1\n")
    assert private_cache not in path.parents
    assert any("writable by other users" in r.getMessage() for r in caplog.records)


class HostileFarm:
    """The attacker's gateway (issue 33 row 3): it answers every compile honestly,
    plus a payload in the wrapper, and publishes nothing."""

    description = "a farm the attacker answers for"

    def __init__(self, marker: Path) -> None:
        from kiln.frontend.transports.inprocess import InProcessFarm

        self.honest = InProcessFarm()
        self.marker = marker
        self.answers = 0

    def compile(self, key: str, request: object, *, timeout: float | None = None,
                delay: float = 0.0) -> object:
        compiled = self.honest.compile(key, request)  # type: ignore[arg-type]
        payload = f"open({str(self.marker)!r}, 'w').close()\n"
        compiled.wrapper_source = payload + compiled.wrapper_source
        self.answers += 1
        return compiled


def test_row3_farm_answer_is_not_run_by_a_client_that_checks_signatures(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from kiln.frontend.core import client as client_module
    from kiln.frontend.core.client import KilnFarmWarning

    marker = tmp_path / "pwned"
    hostile = HostileFarm(marker)
    monkeypatch.setattr(client_module, "farm_for", lambda mode: hostile)
    monkeypatch.setenv("KILN_FARM", "local")
    fresh_process(monkeypatch)
    caught = run_checked()  # right results: compiled here instead
    assert hostile.answers >= 1, "the farm was never asked"
    assert not marker.exists(), "code from the farm's answer ran"
    said = [str(w.message) for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert len(said) == 1 and "signature" in said[0] and hostile.description in said[0]


def test_row3_farm_answer_is_not_run_by_a_keyless_client_of_a_store_others_can_write(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """No key, default settings, a team store its group may write: the client refuses
    that store's unsigned artifacts, so it refuses the answer of the farm that publishes
    there too (its code could be anyone's who can write the store); it compiles here."""
    from kiln.frontend.core import client as client_module
    from kiln.frontend.core.client import KilnFarmWarning

    team = tmp_path / "team-store"
    team.mkdir()
    team.chmod(0o775)
    monkeypatch.setenv("KILN_STORE", str(team))
    monkeypatch.delenv("KILN_SIGNING_KEY")  # default settings: no key
    marker = tmp_path / "pwned"
    hostile = HostileFarm(marker)
    monkeypatch.setattr(client_module, "farm_for", lambda mode: hostile)
    monkeypatch.setenv("KILN_FARM", "local")
    fresh_process(monkeypatch)
    caught = run_checked()  # right results: compiled here instead
    assert hostile.answers >= 1, "the farm was never asked"
    assert not marker.exists(), "code from the farm's answer ran"
    said = [str(w.message) for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert len(said) == 1 and "signature" in said[0] and hostile.description in said[0]


def test_a_keyless_client_of_its_own_store_runs_its_farms_answer(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The default (no key, a store only this user can write): the farm's answer runs as
    its authenticated connection carried it, no second read of the store."""
    from kiln.frontend.core import client as client_module

    monkeypatch.delenv("KILN_SIGNING_KEY")
    marker = tmp_path / "ran"
    farm = HostileFarm(marker)  # (here: the user's own farm, whose code runs)
    monkeypatch.setattr(client_module, "farm_for", lambda mode: farm)
    monkeypatch.setenv("KILN_FARM", "local")
    fresh_process(monkeypatch)
    run_checked()
    assert farm.answers >= 1 and marker.exists()
