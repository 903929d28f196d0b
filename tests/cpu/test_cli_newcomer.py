"""A newcomer's first hour with the `kiln` command: every command, with good and bad
arguments, each in a fresh process as a user would type it. None may print a traceback;
each exits with the status the CLI's docstring promises (0 ok, 1 could not do its work,
2 bad usage), and an error is one line that names what went wrong."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kiln.frontend.cli.main as cli

MARKED = """
from pathlib import Path

import torch


def build_model():
    Path({marker!r}).write_text("built")
    return torch.nn.Linear(16, 8)
"""
MLP = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
"""
SCRIPT = """
import torch
from helper import SIZE  # a sibling module: the script's folder is on the path
model = torch.compile(torch.nn.Linear(SIZE, 4))
with torch.no_grad():
    print("script ran", tuple(model(torch.randn(2, SIZE)).shape))
"""


@dataclass
class World:
    root: Path
    env: dict[str, str]
    keys: list[str] = field(default_factory=list)
    key_json: str = ""

    def kiln(self, *argv: str, cwd: Path | None = None, timeout_s: float = 300, **env: str
             ) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *argv],
                              cwd=cwd or self.root / "proj", env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A folder holding a model, a script and its helper; a store filled by a precompile
    (with KILN_DEBUG, for a key.json)."""
    root = tmp_path_factory.mktemp("newcomer")
    proj = root / "proj"
    proj.mkdir()
    (proj / "mlp.py").write_text(MLP)
    (proj / "helper.py").write_text("SIZE = 16\n")
    (proj / "script.py").write_text(SCRIPT)
    # KILN_FARM=local, the default: no farm is up (the farm file would be under root)
    env = {**os.environ, "KILN_STORE": str(root / "store"), "KILN_FARM": "local",
           "KILN_LOCAL_CACHE": "off", "XDG_CACHE_HOME": str(root / "cache"),
           "KILN_CACHE_DIR": str(root / "kernels"), "PYTHONPATH": ""}
    env.pop("KILN_STATS_FILE", None)
    world = World(root, env)
    filled = world.kiln("precompile", "mlp:build_model", "--shapes", "4x16", "8x16",
                        KILN_DEBUG="1", KILN_DEBUG_DIR=str(root / "debug"))
    assert filled.returncode == 0, filled.stderr[-3000:]
    assert "published 2 artifacts" in filled.stdout
    # the two graphs' keys (kernels shared through the store have entries of their own),
    # each with its key.json, whatever order the folders are listed in
    by_key = {json.loads(p.read_text())["key"]: p for p in (root / "debug").rglob("key.json")}
    world.keys = sorted(by_key)
    stored = {p.name for p in (root / "store" / "ac").rglob("*") if p.is_file()}
    assert len(world.keys) == 2 and set(world.keys) <= stored
    # the first key's key.json, so that explain-miss against the second key differs
    world.key_json = str(by_key[world.keys[0]])
    yield world


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    code: int
    says: str = ""
    env: tuple[tuple[str, str], ...] = ()


def case(*argv: str, code: int, says: str = "", **env: str) -> Case:
    return Case(argv, code, says, tuple(env.items()))


BOGUS_STORE = "bogus://x/y"
# an s3:// store whose endpoint nothing answers
UNREACHABLE_S3 = {"KILN_STORE": "s3://kiln-none/x", "KILN_STORE_TIMEOUT": "2",
                  "KILN_STORE_OPTIONS": '{"endpoint_url": "http://127.0.0.1:1"}'}
CASES = [
    case("--version", code=0, says="kiln 0.1.0"),
    case("--help", code=0, says="precompile"),
    case(code=2, says="required: command"),
    case("bogus", code=2, says="invalid choice: 'bogus'"),
    # precompile
    case("precompile", "mlp.py:build_model", "--shapes", "4x16", code=0,
         says="1 already in the store"),
    case("precompile", "script.py", code=0, says="script ran (2, 4)"),
    case("precompile", "nofile.py", code=2, says="no such file: nofile.py"),
    case("precompile", "mlp.py:nope", "--shapes", "4x16", code=2,
         says="mlp.py has no function 'nope' (it defines: build_model)"),
    case("precompile", "nomodule:fn", "--shapes", "4x16", code=2, says="no module named"),
    case("precompile", "mlp:build_model", code=2, says="give --shapes"),
    case("precompile", "mlp:build_model", "--shapes", "4xq", code=2, says="expected shapes"),
    case("precompile", "mlp:build_model", "--shapes", "4x17", code=2,
         says="does not run on --shapes 4x17"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", "--dtype", "float99", code=2,
         says="'float99' is not a dtype"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", "--mode", "sideways", code=2,
         says="invalid choice: 'sideways'"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", "--option", "bogus=1", code=2,
         says="unknown option 'bogus'"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", "--option",
         "cpu_backend=fortran", code=2, says="expected one of cpp, triton-interpret"),
    case("precompile", "script.py", "--shapes", "4x16", code=2,
         says="--shapes apply to module:function targets"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", code=1,
         says="is read-only (KILN_STORE_READ_ONLY=1): nothing could be published",
         KILN_STORE_READ_ONLY="1"),
    case("precompile", "mlp:build_model", "--shapes", "4x16", code=1,
         says="cannot open the store", KILN_STORE=BOGUS_STORE),
    # stats
    case("stats", code=0, says="store lookups"),
    case("stats", code=0, says="stats are off (KILN_STATS_FILE=off)", KILN_STATS_FILE="off"),
    case("stats", code=0, says="KILN_FARM_TIMEOUT='abc': expected a number of seconds, such "
         "as 30 or 2.5; using the default 300", KILN_FARM_TIMEOUT="abc"),
    # inspect
    case("inspect", "{key}", "--no-wrapper", code=0, says="== kernels =="),
    case("inspect", "{prefix}", "--no-wrapper", code=0, says="== buffer lifetimes =="),
    case("inspect", "{key}", "--source", "nope", code=1, says="its kernels: cpp_"),
    case("inspect", "f" * 64, code=1, says="no artifact ffff"),
    case("inspect", "zz", code=2, says="is not a key"),
    case("inspect", "{key}", code=1, says="cannot open the store", KILN_STORE=BOGUS_STORE),
    case("inspect", "{key}", code=1, says="the folder does not exist",
         KILN_STORE="/nonexistent/kiln-store"),
    case("inspect", "{key}", code=1, says="/dev/null is a file, not a folder",
         KILN_STORE="/dev/null/x"),
    case("inspect", "{key}", code=1, says="cannot open the store", **UNREACHABLE_S3),
    case("inspect", "{prefix}", code=1, says="cannot open the store", **UNREACHABLE_S3),
    # explain-miss
    case("explain-miss", "{key}", "{other}", code=0, says="input 2: shape ("),
    case("explain-miss", "{key_json}", "{other}", code=0, says="differs"),
    case("explain-miss", "{key}", "nowhere/key.json", code=2, says="no such file"),
    case("explain-miss", "{key}", "f" * 64, code=1, says="no artifact"),
    # gc
    case("gc", "--dry-run", code=0, says='"dry_run": true'),
    case("gc", "--max-size", "10Q", code=2, says="expected a size"),
    case("gc", "--max-age", "soon", code=2, says="expected a duration"),
    case("gc", code=1, says="cannot open the store", KILN_STORE=BOGUS_STORE),
    case("gc", code=1, says="the folder does not exist", KILN_STORE="/nonexistent/store"),
    # farm
    case("farm", "sideways", code=2, says="invalid choice"),
    case("farm", "status", code=1, says="no farm is up"),
    case("farm", "status", code=1, says="does not answer", KILN_FARM="127.0.0.1:1"),
    # package
    case("package", "mlp:build_model", "--shapes", "4x16", "-o", "/nonexistent/x.kiln",
         code=2, says="the folder /nonexistent does not exist"),
    case("farm", "up", "--port", "99999", code=2, says="port from 1 to 65535"),
    case("farm", "up", "--port", "{busy_port}", code=1, says="is in use on this machine"),
    case("farm", "down", code=0, says="no farm is up"),
]


def _fill(arg: str, world: World, busy_port: int) -> str:
    return arg.format(key=world.keys[0], prefix=world.keys[0][:8], other=world.keys[1],
                      key_json=world.key_json, busy_port=busy_port)


def _error_lines(stderr: str) -> list[str]:
    """stderr less warnings (the CLI's, and the store's logged "Kiln..." ones, such as an
    unsigned shared store) and the progress display."""
    return [line for line in stderr.splitlines() if line.strip() and "\r" not in line
            and not line.startswith(("warning: ", "precompile:", "Kiln"))]


@pytest.mark.parametrize("c", CASES, ids=lambda c: " ".join(c.argv + tuple(
    f"{k}={v}" for k, v in c.env)) or "(nothing)")
def test_command(world: World, c: Case) -> None:
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        argv = [_fill(a, world, busy.getsockname()[1]) for a in c.argv]
        done = world.kiln(*argv, **dict(c.env))
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output[-3000:]
    assert done.returncode == c.code, output[-3000:]
    assert c.says in output, output[-3000:]
    if c.code != 0:  # one line saying why: an error on stderr, or a status on stdout
        (line,) = _error_lines(done.stderr) or done.stdout.splitlines()
        assert line.startswith(("kiln", "farm"))


def test_promised_exit_codes_are_documented() -> None:
    doc = cli.__doc__ or ""
    assert "0 on success; 1 when the command could not do its work" in doc
    assert "2 on bad usage" in doc


def test_farm_status_json_is_pure_json_with_every_counter(world: World) -> None:
    from kiln.workers import FARM_COUNTERS

    done = world.kiln("farm", "status", "--json", KILN_FARM="127.0.0.1:1")
    status = json.loads(done.stdout)  # nothing but the JSON on stdout
    assert done.returncode == 1 and status["up"] is False
    assert status["counters"] == dict.fromkeys(FARM_COUNTERS, 0)
    assert "127.0.0.1:1 does not answer" in status["reason"]


def test_farm_down_never_stops_a_process_it_cannot_prove_is_its_farm(world: World) -> None:
    """A stale farm.json naming this test's own process: removed, and nothing stopped."""
    farm_json = world.root / "cache" / "kiln" / "farm.json"
    farm_json.parent.mkdir(parents=True, exist_ok=True)
    farm_json.write_text(json.dumps({"address": "127.0.0.1:1", "pid": os.getpid(),
                                     "port": 1}))
    status = world.kiln("farm", "status")
    assert status.returncode == 1 and "does not answer" in status.stdout
    down = world.kiln("farm", "down")
    assert down.returncode == 0 and "stale" in down.stdout
    assert f"process {os.getpid()} is not a Ray head" in down.stdout
    assert not farm_json.exists()  # and this process is still here to check it


def test_stats_json_counts_every_graph_and_no_load_error(world: World) -> None:
    stats = json.loads(world.kiln("stats", "--json").stdout)
    assert stats["enabled"] is True and stats["load_errors"] == 0
    assert stats["compiles"] >= 2 and stats["publishes"] >= 2
    off = json.loads(world.kiln("stats", "--json", KILN_STATS_FILE="off").stdout)
    assert off["enabled"] is False and off["stats_file"] is None and off["graphs"] == 0


def test_a_file_as_the_store_is_one_message_naming_the_file(world: World) -> None:
    done = world.kiln("inspect", world.keys[0], KILN_STORE="/dev/null/x")
    assert done.returncode == 1
    assert "is shared" not in done.stderr  # no unsigned-shared-store warning first
    assert "does not exist" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "/dev/null is a file, not a folder" in line


def test_a_farm_address_where_no_ray_listens_fails_fast(world: World) -> None:
    """Something that is not Ray takes the connection (and says nothing): the farm is
    refused within the probe's few seconds, never Ray's long wait, and nothing blames
    RAY_AUTH_TOKEN."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        address = f"127.0.0.1:{other.getsockname()[1]}"
        done = world.kiln("farm", "status", KILN_FARM=address, timeout_s=20)
    assert done.returncode == 1
    assert "is not a Ray cluster" in done.stdout and "RAY_AUTH_TOKEN" not in done.stdout


def test_inspect_describes_every_entry_in_words(world: World) -> None:
    """Graphs, AOT cache entries, kernels shared by content key: none prints a graph's
    fields as null, None or '?'."""
    keys = sorted(p.name for p in (world.root / "store" / "ac").rglob("*") if p.is_file())
    assert len(keys) > len(world.keys)  # entries besides the two graphs
    for key in keys:
        done = world.kiln("inspect", key, "--no-wrapper")
        assert done.returncode == 0, done.stderr
        for bad in ("None", "null", "? (?)"):
            assert bad not in done.stdout, (key, done.stdout)


def test_inspect_names_a_local_compile_as_this_process(world: World) -> None:
    """The world compiled with the default farm (`local`) and no farm up, so in process:
    inspect says so, not "the farm of kiln farm up"."""
    shown = world.kiln("inspect", world.keys[0], "--no-wrapper").stdout
    assert "compiled     local (this process)" in shown
    assert "kiln farm up" not in shown


def test_package_checks_its_output_before_compiling(world: World) -> None:
    marker = world.root / "built.marker"
    (world.root / "proj" / "marked.py").write_text(MARKED.format(marker=str(marker)))
    done = world.kiln("package", "marked:build_model", "--shapes", "4x16", "-o",
                      "/nonexistent/x.kiln")
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert not marker.exists()  # the model was never built, nothing compiled


def test_json_into_a_closed_pipe_ends_quietly(world: World) -> None:
    """`kiln stats --json | head -c0`: the reader is gone before the first write."""
    proc = subprocess.Popen([sys.executable, "-m", "kiln.frontend.cli.main", "inspect",
                             world.keys[0], "--json"], cwd=world.root / "proj", env=world.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    stderr = proc.stderr.read()
    proc.wait(timeout=120)
    assert "BrokenPipe" not in stderr and "unexpected" not in stderr, stderr


def test_stats_reset_starts_the_counters_again_from_zero(world: World) -> None:
    """Last in this file: it empties the world's counters."""
    before = json.loads(world.kiln("stats", "--json").stdout)
    assert before["compiles"] >= 2
    reset = world.kiln("stats", "--reset")
    assert reset.returncode == 0 and "counters reset" in reset.stdout
    after = json.loads(world.kiln("stats", "--json").stdout)
    assert after["compiles"] == after["graphs"] == after["hits"]["total"] == 0
    again = world.kiln("stats", "--reset")
    assert again.returncode == 0 and "nothing to reset" in again.stdout
    off = world.kiln("stats", "--reset", KILN_STATS_FILE="off")
    assert off.returncode == 0 and "stats are off" in off.stdout
