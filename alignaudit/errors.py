"""Exception types raised by the library, each mapped to a CLI exit code.

The CLI prints ``str(error)`` as one line and exits with ``error.exit_code``; ``--debug`` shows the
traceback. Messages name the problem and the fix.

Exit codes (shared by every command, documented in docs/cli.md):
    0  success / gate pass
    1  alignment failure (the gate's verdict, not an error)
    2  usage or input error (bad option, unreadable model or prompts, corrupt capture)
    3  engine failure (engine not installed, worker crashed)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3


class AlignAuditError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = EXIT_USAGE


class InputError(AlignAuditError):
    """Bad user input: model, prompts, options, capture directories."""

    exit_code = EXIT_USAGE


class EngineError(AlignAuditError):
    """An engine is missing, failed to start, or crashed while running."""

    exit_code = EXIT_ENGINE
