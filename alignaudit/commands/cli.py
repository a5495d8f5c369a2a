"""The ``alignaudit`` command line: thin typer commands over the library, rendered with rich.

Exit codes (docs/cli.md): 0 success, 1 alignment failure (gate), 2 usage or input error, 3 engine
failure, 130 interrupted. Errors print one line; ``--debug`` (anywhere on the command line) shows the
traceback.
"""

from __future__ import annotations

import sys
import traceback
from typing import Annotated

import typer

from alignaudit import __version__, errors
from alignaudit.capture import outdir
from alignaudit.commands import capture_command, compare_commands, gate_command, interrupts, report_command, rl_command
from alignaudit.commands.console import console, err_console, shown
from alignaudit.commands.options import grouped

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP.",
)


def _version(value: bool) -> None:
    if value:
        console.print(f"alignaudit {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks on errors (also taken after the command's name).")
    ] = False,
) -> None:
    """Numerical alignment auditor for RL: training-engine vs rollout-engine logprobs, down to the ULP."""
    # main() reads --debug from the command line wherever it stands; this only lets it stand before the command


# in the order `alignaudit --help` lists them: compare and what digs into it, RL, the two halves of a compare, the
# verdict and the page
COMMANDS = (
    compare_commands.compare,
    compare_commands.bisect,
    compare_commands.ablate,
    compare_commands.rescore,
    rl_command.rl,
    capture_command.capture,
    compare_commands.diff,
    gate_command.gate,
    report_command.report,
)
for _command in COMMANDS:
    app.command()(grouped(_command))


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the typer app, turn library errors into one line and an exit code."""
    args = _optional_values(sys.argv[1:] if argv is None else list(argv), {"--strict": "all"})
    debug = "--debug" in args
    outdir.command_name = next((a for a in args if not a.startswith("-")), "?")
    try:
        code = _run(args, debug)
    except BaseException:  # SystemExit (a closed pipe): still release, then go
        _release_outputs(debug)
        raise
    return _release_outputs(debug) or code


def _release_outputs(debug: bool) -> int | None:
    """Release the command's output directories; say where the results --force replaced stay, and why
    (capture/outdir.py). Ctrl-C or SIGTERM here ends as an interrupt (130); another failure is a warning: the
    command's results and exit code stand. Returns 130 where interrupted, else None."""
    try:
        with interrupts.unwinding():
            for kept in outdir.release_all():
                if kept.beside_complete:
                    line = f"{shown(kept.path)} (the results --force replaced) stays: {shown(kept.reason)}"
                else:
                    line = f"{shown(kept.path)} keeps the last complete results: {shown(kept.reason)}"
                err_console.print(line, highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as e:  # noqa: BLE001
        if debug:
            traceback.print_exc()
        err_console.print(
            f"[yellow]warning:[/] releasing the output directory failed: {shown(e)}", highlight=False, soft_wrap=True
        )
    return None


def _run(args: list[str], debug: bool) -> int:
    try:
        with interrupts.unwinding():  # Ctrl-C and SIGTERM unwind, stopping engine workers (commands/interrupts.py)
            result = app(args=args, standalone_mode=False, prog_name="alignaudit")
        if interrupts.signalled:
            return _interrupted()
        return result if isinstance(result, int) else errors.EXIT_OK
    except errors.AlignAuditError as e:
        if debug:
            traceback.print_exc()
        err_console.print(f"[bold red]error:[/] {shown(e)}", highlight=False, soft_wrap=True)
        return e.exit_code
    except typer.Exit as e:
        return _interrupted() if interrupts.signalled else e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        return _interrupted()
    except Exception as e:
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click/typer usage errors
            if type(e).__name__ == "NoArgsIsHelpError":
                console.print(e.ctx.get_help(), highlight=False)  # type: ignore[attr-defined]  # that error's context
                return errors.EXIT_OK
            err_console.print(f"[bold red]error:[/] {shown(e.format_message())}", highlight=False, soft_wrap=True)
            return errors.EXIT_USAGE
        return _unexpected(e, debug)


def _interrupted() -> int:
    err_console.print("interrupted; the files written so far are kept", highlight=False, soft_wrap=True)
    return interrupts.EXIT_INTERRUPTED


def _optional_values(args: list[str], defaults: dict[str, str]) -> list[str]:
    """Let ``--strict`` stand alone: insert its default value when no value follows it."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg in defaults and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append(defaults[arg])
    return out


def _unexpected(e: Exception, debug: bool) -> int:
    """An unexpected bug: one line unless --debug."""
    if debug:
        traceback.print_exc()
    err_console.print(
        f"[bold red]error:[/] unexpected {type(e).__name__}: {shown(e)} (run with --debug for the traceback)",
        highlight=False,
        soft_wrap=True,
    )
    return errors.EXIT_ENGINE


def entrypoint() -> None:
    sys.exit(main())
