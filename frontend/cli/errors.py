"""How ``kiln`` commands fail: one line on stderr and the exit status the CLI promises
(0 success, 1 the command could not do its work, 2 bad usage), never a traceback."""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """The command could not do its work; the message says what and why (exit 1)."""

    exit_code = EXIT_FAILED


class UsageError(CliError):
    """The command was called wrongly: an argument, a target, an option (exit 2)."""

    exit_code = EXIT_USAGE
