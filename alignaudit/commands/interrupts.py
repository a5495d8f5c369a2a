"""Ctrl-C and SIGTERM during a command: unwind (so that engine workers are stopped and what was written is kept),
never print a traceback, and exit 130.

Typer turns a KeyboardInterrupt into a silent exit, so ``terminate`` records the signal in ``signalled`` before it
raises, and the CLI reads it to say why it stopped. An interrupt that lands where Python cannot raise it (an at-fork
callback while a worker starts) reaches ``sys.unraisablehook``; ``unraisable`` delivers it again once the hook has
returned rather than letting Python print "Exception ignored" and lose it.
"""

from __future__ import annotations

import contextlib
import signal
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for an interrupted command

signalled: list[int] = []
_in_unraisable_hook: list[bool] = [False]


@contextlib.contextmanager
def unwinding():
    """SIGTERM and SIGINT raise KeyboardInterrupt (recorded in ``signalled``) and ``unraisable`` is the unraisable
    hook inside the block; the previous handlers and hook are restored after it."""
    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    signalled.clear()
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def terminate(signum, frame):
    signalled.append(signum)
    if _in_unraisable_hook[0]:  # raised inside the hook it would be swallowed again, with a traceback
        _deliver_later(signum)
        return
    raise KeyboardInterrupt


def _deliver_later(signum: int) -> None:
    """Deliver ``signum`` to the main thread again from a short timer thread, once it has left the hook."""
    import _thread
    import threading

    timer = threading.Timer(0.01, _thread.interrupt_main, (signum,))
    timer.daemon = True
    timer.start()


def unraisable(info) -> None:
    """Our interrupt, raised where Python cannot propagate it (e.g. an at-fork callback while a worker
    starts), would be printed as "Exception ignored" with a traceback and lost. Deliver it again instead,
    after the hook has returned (a signal handled inside the hook is passed on the same way); report anything
    else as Python does."""
    _in_unraisable_hook[0] = True
    try:
        if issubclass(info.exc_type, KeyboardInterrupt) and signalled:
            _deliver_later(signalled[-1])
        else:
            sys.__unraisablehook__(info)
    finally:
        _in_unraisable_hook[0] = False
