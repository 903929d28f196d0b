"""One line per test file as it finishes, for runs whose tests are spread over processes
(pytest-xdist) or that run beside another pytest (scripts/test.sh).

pytest's own progress prints a file's name when the file starts and a letter per test; with
xdist it prints letters only, and two pytest processes writing to one terminal mix their
letters on one line. With ``--file-progress`` the letters go, and each file gets one
whole line when its last test is reported (on xdist's controller, which sees every
worker's reports): its name, its counts, its failing tests, the seconds its tests took and
how far the run is. ``--file-progress=FD`` writes the lines to that file descriptor
instead of the terminal, for a run whose output goes to a log.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--file-progress", nargs="?", const="terminal", default=None,
                     metavar="FD", help="one line per test file as it finishes (kiln's "
                     "scripts/test.sh); FD: write the lines to that file descriptor")


class FileProgress:
    """Counts each file's reports; prints the file's line when its last test finished."""

    def __init__(self, config: pytest.Config, where: str) -> None:
        self.config = config
        self.fd = None if where == "terminal" else int(where)
        self.expected: Counter[str] = Counter()  # tests per file
        self.finished: Counter[str] = Counter()
        self.outcomes: dict[str, Counter[str]] = {}
        self.failed: dict[str, list[str]] = {}
        self.seconds: dict[str, float] = {}
        self.total = 0
        self.done = 0

    def _expect(self, nodeids: Sequence[str]) -> None:
        if self.total:  # every xdist worker collects the same tests: count them once
            return
        for nodeid in nodeids:
            self.expected[nodeid.split("::", 1)[0]] += 1
        self.total = len(nodeids)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not hasattr(self.config, "workerinput"):
            self._expect([item.nodeid for item in session.items])

    def pytest_xdist_node_collection_finished(self, node: Any, ids: Sequence[str]) -> None:
        self._expect(ids)

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport
                                 ) -> tuple[str, str, str] | None:
        """No letter per test (the file's line counts them); categories as pytest's."""
        if report.when == "call" or report.outcome != "passed":
            category: str = report.outcome
            if hasattr(report, "wasxfail"):
                category = "xfailed" if report.skipped else "xpassed"
            elif report.when != "call" and report.failed:
                category = "error"
            return category, "", category.upper()
        return None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        outcomes = self.outcomes.setdefault(path, Counter())
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration
        if report.failed:
            name = report.nodeid.split("::", 1)[-1]
            kind = "failed" if report.when == "call" else f"error in {report.when}"
            self.failed.setdefault(path, []).append(f"{name} ({kind})")
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcomes["skipped" if report.skipped else
                     "failed" if report.failed else "passed"] += 1
        if report.when != "teardown":
            return
        self.finished[path] += 1
        self.done += 1
        if self.finished[path] == self.expected.get(path, 0):
            self._write(path)

    def _write(self, path: str) -> None:
        outcomes = self.outcomes.pop(path, Counter())
        counts = ", ".join(f"{n} {what}" for what, n in sorted(outcomes.items())) or "no tests"
        share = 100 * self.done // max(1, self.total)
        line = f"[{share:3d}%] {path}: {counts} ({self.seconds.get(path, 0.0):.1f} s)"
        for failure in self.failed.pop(path, []):
            line += f"\n        FAILED {failure}"
        if self.fd is not None:
            os.write(self.fd, (line + "\n").encode())
            return
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(line)


def configure(config: pytest.Config) -> None:
    """Install the reporter when ``--file-progress`` asks for it (not in xdist's workers:
    their reports reach the controller, which prints)."""
    where = config.getoption("--file-progress", None)
    if where is None or hasattr(config, "workerinput"):
        return
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.showfspath = False  # the file's line comes when it ends
    config.pluginmanager.register(FileProgress(config, where), "kiln-file-progress")
