"""Parent side of the engine workers: launch one worker process per capture and read what it wrote."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

from alignaudit import errors
from alignaudit.capture.directory import Capture, read_capture
from alignaudit.capture.rundir import LOGPROBS, MANIFEST, OPS_DIR, REQUEST, VOCAB_DIR, WORKER_LOG
from alignaudit.engines import check_installed
from alignaudit.inputs.checkpoint import ModelSpec
from alignaudit.workers.capture_worker import ERROR_MARKER, PROGRESS_MARKER
from alignaudit.workers.job import CaptureJob


def run_capture(job: CaptureJob, *, stream_log: bool = False, on_progress=None) -> Capture:
    """Run ``job`` (alignaudit.workers.job.CaptureJob) in a fresh worker process and return the capture it wrote to
    ``job.out``.

    The job (``request.json``) and the worker's combined stdout/stderr (``worker.log``) stay in ``job.out`` for
    reproduction. ``on_progress(done, total)`` receives the worker's progress lines (sequences done), which are kept
    out of the log; ``stream_log`` copies the worker's output to stderr as it comes.

    Raises:
        EngineError: the engine is not installed, or the worker crashed (message: its last log lines).
        InputError: the worker refused the input (same message as it would give in-process).
    """
    engine, out = job.engine, job.out
    check_installed(engine)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (MANIFEST, LOGPROBS):  # a failed run must never leave an earlier capture looking valid
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / OPS_DIR, ignore_errors=True)
    shutil.rmtree(out / VOCAB_DIR, ignore_errors=True)
    job.write(out / REQUEST)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    tail: deque[str] = deque(maxlen=20)
    with open(out / WORKER_LOG, "w") as log:
        proc = start_worker([str(out / REQUEST)], env)
        assert proc.stdout is not None, "start_worker pipes the worker's output"
        try:
            for line in proc.stdout:
                if line.startswith(PROGRESS_MARKER):
                    if on_progress is not None:
                        done, total = line[len(PROGRESS_MARKER) :].split()
                        on_progress(int(done), int(total))
                    continue
                log.write(line)
                tail.append(line.rstrip("\n"))
                if stream_log:
                    sys.stderr.write(line)
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: do not leave an engine holding memory
                proc.kill()
                proc.wait()
    if code != 0:
        raise _worker_error(engine, code, list(tail), out / WORKER_LOG)
    return read_capture(out)


def check_options(runs: list, spec: ModelSpec, mode: str = "prompt") -> None:
    """Validate the settings of every engine run (alignaudit.inputs.request.EngineRun) in one short worker that
    imports only the engines' config classes (seconds): option names and types, and the engine's own
    configuration built from ``spec`` and the settings (e.g. Megatron's TransformerConfig), so a problem
    with the second engine is reported before the first one runs. Runs without options cost nothing.

    Raises:
        InputError: an option an engine does not understand or cannot take (the engine's own message).
        EngineError: the check itself crashed.
    """
    checks = [
        {"engine": run.engine, "settings": run.settings.to_dict(), "spec": spec.to_dict(), "role": role, "mode": mode}
        for role, run in zip(("train", "infer")[: len(runs)], runs, strict=True)
        if run.settings.options
    ]  # one run (capture) or the pair
    if not checks:
        return
    proc = start_worker(["--check-options", json.dumps(checks)], {**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None, "start_worker pipes the worker's output"
    try:
        output = proc.stdout.read()
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 0:
        engines = " and ".join(dict.fromkeys(c["engine"] for c in checks))
        raise _worker_error(engines, code, output.splitlines()[-20:], None)


def python_module(module: str) -> list[str]:
    """The command that runs ``python -m module`` in a fresh interpreter, without the working directory on its
    sys.path (``-P``, Python >= 3.11) where the worker then imports the same alignaudit as this process.

    Why: the worker must run the code this process runs. ``python -m`` puts the working directory first on sys.path,
    so started inside another checkout of alignaudit (this one installed, the command run from another's root) the
    worker would import that checkout's alignaudit/. Where alignaudit comes only from the working directory, or -P
    would give the worker another alignaudit than this process's (run in one checkout, installed from another), the
    worker keeps the working directory.
    """
    if _same_alignaudit_without_working_directory():
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-m", module]


def _same_alignaudit_without_working_directory() -> bool:
    """Whether Python's import system, with sys.path less the working directory, finds this process's alignaudit
    (an editable install's finder, or site-packages)."""
    import importlib.machinery

    import alignaudit

    cwd = os.path.abspath(os.getcwd())
    path = [p for p in sys.path if os.path.abspath(p or ".") != cwd]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec("alignaudit", path)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec("alignaudit", None)
        else:
            continue
        if spec is not None:
            return spec.origin is not None and Path(spec.origin).resolve() == Path(alignaudit.__file__).resolve()
    return False


def start_worker(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``python -m alignaudit.workers.capture_worker ARGS`` in a fresh process with ``env``: its stdout and stderr
    together on one text pipe (``proc.stdout``), killed when this process dies. The test session replaces it
    with alignaudit.workers.preloaded (the same worker, forked from an interpreter that has imported the engine)."""
    return subprocess.Popen(
        [*python_module("alignaudit.workers.capture_worker"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


def start_session(args: list[str], env: dict[str, str], stderr) -> subprocess.Popen:
    """``python -m alignaudit.workers.rl_session ARGS`` in a fresh process with ``env``: text pipes on its stdin
    (commands) and stdout (replies), its stderr into the open file ``stderr``, killed when this process dies. The
    test session replaces it too (alignaudit.workers.preloaded.Preloaded.start_session)."""
    return subprocess.Popen(
        [*python_module("alignaudit.workers.rl_session"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        preexec_fn=_die_with_parent,
    )


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL when the parent dies, however it dies (prctl PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker_error(engine: str, code: int, tail: list[str], log: Path | None) -> errors.AlignAuditError:
    for line in reversed(tail):
        if line.startswith(ERROR_MARKER):
            record = json.loads(line[len(ERROR_MARKER) :])
            kind = getattr(errors, record["type"], errors.EngineError)
            where = f" (worker log: {log})" if log and issubclass(kind, errors.EngineError) else ""
            return kind(record["message"] + where)
    last = "\n  ".join(line for line in tail[-8:] if line.strip())
    where = f"; full log: {log}" if log else ""
    return errors.EngineError(f"{engine} worker crashed (exit code {code}){where}; last lines:\n  {last}")
