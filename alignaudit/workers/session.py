"""The parent's handle on one long-lived engine worker of the RL loop (the worker: alignaudit.workers.rl_session).

The parent writes one JSON command per line on the worker's stdin and reads one reply line, marked with
``REPLY_MARKER``, from its stdout; anything else the worker prints goes to the worker's log file. A library error
comes back as ``{"error": {"type", "message"}}`` and is re-raised here with its type; a worker that dies is an
EngineError carrying the last lines of its log.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import deque
from pathlib import Path

from alignaudit import errors
from alignaudit.workers import spawn
from alignaudit.workers.job import SessionJob

REPLY_MARKER = "ALIGNAUDIT-REPLY "


class Session:
    """The parent's handle on one worker.

    Args:
        job: the worker's engine (and a trainer's optimizer settings), written beside the log as
            ``LOG-STEM.request.json`` for the worker to read. log: the worker's log file.
    Raises:
        EngineError: the worker died (its last log lines in the message).
    """

    def __init__(self, job: SessionJob, log: Path):
        self.job, self.log = job, Path(log)
        path = self.log.with_suffix(".request.json")
        job.write(path)
        self._log = open(self.log, "w")  # noqa: SIM115 (the session's life; closed in close)
        self.proc = spawn.start_session([str(path)], {**os.environ, "PYTHONUNBUFFERED": "1"}, self._log)

    def call(self, command: str, **args) -> dict:
        """Send a command; return its reply. Raises the worker's own error type, or EngineError."""
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None, "start_session gives the worker both pipes"
        try:
            stdin.write(json.dumps({"command": command, **args}) + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        for line in stdout:
            if line.startswith(REPLY_MARKER):
                reply = json.loads(line[len(REPLY_MARKER) :])
                if "error" in reply:
                    raise getattr(errors, reply["error"]["type"], errors.EngineError)(reply["error"]["message"])
                return reply
            self._log.write(line)
            self._log.flush()
        raise self._died()

    def _died(self) -> errors.EngineError:
        code = self.proc.wait()
        self._log.flush()
        tail: deque[str] = deque(maxlen=8)
        with open(self.log, errors="replace") as f:
            for line in f:
                if line.strip():
                    tail.append(line.rstrip())
        last = "\n  ".join(tail)
        return errors.EngineError(
            f"{self.job.engine} {self.job.role} worker died (exit code {code}); "
            f"full log: {self.log}; last lines:\n  {last}"
        )

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("close")
                self.proc.wait(timeout=30)
            except (errors.AlignAuditError, OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
