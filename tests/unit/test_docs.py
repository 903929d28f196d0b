"""The docs a newcomer reads agree with the code: README.md stays short and links only to
files a clone has; docs/cli.md covers every subcommand and every option `--help` lists;
docs/configuration.md's table has exactly the settings of frontend/config.py; the docs
and the demo say the same default farm; BENCHMARKS.md holds current figures only."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from kiln.frontend.cli.main import build_parser
from kiln.frontend.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_BYTES = 12 * 1024
BENCHMARKS_MAX_LINES = 400


def _subparsers(parser: argparse.ArgumentParser, prefix: str = "kiln"
                ) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its full name (`kiln trace summary`)."""
    found = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_subparsers(sub, f"{prefix} {name}"))
    return found


def _section(text: str, heading: str) -> str:
    """The text under `## heading` up to the next `## `."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/cli.md has no section '## {heading}'"
    return match.group(1)


def test_readme_is_short_and_has_room_for_more() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES - 1536, f"README.md is {size} bytes"


def test_readme_says_what_a_newcomer_needs() -> None:
    text = README.read_text()
    for needed in ("bash scripts/setup.sh", "bash scripts/test.sh", "## Quick start",
                   "kiln farm up", "FX graph cache", "AOTAutograd cache", "mega-cache",
                   "Redis", "kiln stats --reset", "## Two machines, one store",
                   "## Remote cache only", "docs/cli.md", "docs/configuration.md"):
        assert needed in text, needed
    for script in ("setup.sh", "test.sh", "demo.sh"):
        assert (ROOT / "scripts" / script).is_file()


@pytest.mark.parametrize("doc", ["README.md", "infra/README.md", "BENCHMARKS.md",
                                 *(f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")))])
def test_links_name_files_of_the_clone(doc: str) -> None:
    path = ROOT / doc
    text = path.read_text()
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc} links to {target}, not in a clone"


def test_cli_reference_covers_every_command_and_option() -> None:
    text = (DOCS / "cli.md").read_text()
    for name, parser in _subparsers(build_parser()).items():
        if name == "kiln":
            continue
        top = " ".join(name.split()[:2])
        section = _section(text, top)
        help_text = parser.format_help()  # what `kiln ... --help` prints
        for option in sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", help_text))):
            if option == "--help":
                continue
            assert option in section, f"docs/cli.md's {top} does not mention {option}"


def _table_variables(text: str) -> dict[str, str]:
    rows = {}
    for line in text.splitlines():
        match = re.match(r"^\| `(KILN_[A-Z_]+)`[^|]*\|(.*)\|\s*(.*?)\s*\|$", line)
        if match:
            rows[match.group(1)] = match.group(3)
    return rows


def test_configuration_table_is_the_settings_table() -> None:
    rows = _table_variables((DOCS / "configuration.md").read_text())
    assert set(rows) == {s.env for s in SETTINGS.values()}
    assert rows["KILN_FARM"].startswith(f"`{SETTINGS['farm'].default}`")
    assert rows["KILN_CPU_BACKEND"] == f"`{SETTINGS['cpu_backend'].default}`"


def test_triton_interpret_says_what_it_needs() -> None:
    text = (DOCS / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `KILN_CPU_BACKEND`"))
    assert "TRITON_INTERPRET=1" in row


def test_the_docs_and_the_demo_agree_on_the_default_farm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.frontend.cli import demo

    assert SETTINGS["farm"].default == "local"
    infra = (ROOT / "infra" / "README.md").read_text()
    assert "first miss starts an embedded Ray" not in infra
    assert "`KILN_FARM=local`" in infra and "`KILN_FARM=local`" in README.read_text()
    monkeypatch.delenv("KILN_FARM", raising=False)
    assert demo.demo_farm() == "local"  # the demo shows the default


def test_the_demos_hint_runs_without_an_active_environment() -> None:
    """The demo prints `<command> inspect KEY`: a command found without the venv on PATH."""
    from kiln.frontend.cli import demo

    command = demo.kiln_command()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    done = subprocess.run([*command.split(), "--version"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("kiln "), done.stderr


def test_benchmarks_hold_current_figures_only() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= BENCHMARKS_MAX_LINES
    # each measured table is introduced by its command, machine, commit and date
    for heading in re.findall(r"^## (.+)$", text, re.M):
        section = _bench_section(text, heading)
        if "|---" not in section.replace(" ", "").replace(":", ""):
            continue
        for field in (r"Commands?:", r"Machine:", r"Commit", r"(Date|Commit and date)"):
            assert re.search(rf"^- {field}", section, re.M), (heading, field)


def _bench_section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]
