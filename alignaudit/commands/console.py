"""What the commands print to: the two rich consoles, result paths, the terminal summary and the page a run ends
with."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader of our output went away (``| head``): rich exits 1 here, which is alignaudit's
        "alignment failure"; exit as a closed pipe instead (the files written so far are kept)."""
        try:
            super().on_broken_pipe()  # rich silences the stream and raises SystemExit(1)
        except SystemExit:
            raise SystemExit(EXIT_PIPE_CLOSED) from None


console = _Console()


err_console = _Console(stderr=True)


def shown(text) -> str:
    """``text`` (a message, a path: anything a user or a file may have put characters in) as a console line shows
    it literally: rich markup escaped (a directory named ``[bold]`` or ``[/]`` is a name, not a style, and never a
    MarkupError), control characters as Python escapes (an ANSI sequence in a file name is shown, not run by the
    terminal; a newline cannot split the one-line error)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return escape(text)


def results(*paths) -> None:
    """The result paths, never wrapped (they are copied and pasted)."""
    console.print("results: " + ", ".join(shown(p) for p in paths), highlight=False, soft_wrap=True)


def render_summary(out: Path, summary: Mapping[str, Any]) -> None:
    import pandas as pd

    from alignaudit.capture.rundir import SEQUENCES, TOKENS
    from alignaudit.reports.terminal import render_comparison

    render_comparison(console, summary, pd.read_parquet(out / TOKENS), pd.read_parquet(out / SEQUENCES))


def write_page(run_dir: Path) -> tuple[Path, ...]:
    """RUN_DIR/report.html at the end of a run: (its path,), or () and one warning line when it cannot be
    written (the run's results and exit code stand without it)."""
    from alignaudit.reports.html import write_report

    try:
        return (write_report(run_dir),)
    except Exception as e:  # noqa: BLE001 - the page is an extra; the run has already succeeded
        err_console.print(
            f"[yellow]warning:[/] report.html not written: {shown(e)} (retry with `alignaudit "
            f"report {shown(run_dir)}`)",
            highlight=False,
            soft_wrap=True,
        )
        return ()
