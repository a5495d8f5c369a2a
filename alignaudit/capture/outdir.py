"""Output directories: claimed, locked, and only ever cleaned of what alignaudit itself wrote.

Every command that writes results (compare, bisect, capture, diff, gate, rl) goes through ``prepare``:
    - the directory is locked for the command's lifetime (``fcntl.flock`` on ``.alignaudit.lock``, released
      by the kernel however the process ends); a second run on the same directory is refused and told who
      holds it;
    - a marker file (``.alignaudit-outputs``, JSON) lists the top-level names alignaudit may write there. It
      is extended *before* anything is written, so after a crash it still covers every partial output;
    - ``--force`` removes only entries that the marker lists, and a listed directory only when every file in
      it has a name alignaudit writes (capture and op-store files) or it is one a library writes whole for
      alignaudit (rl --log-to: tensorboard/, wandb/); anything else is refused, naming the file, before anything
      is removed;
    - an entry the command is about to write that exists but was not written by alignaudit is refused.
Default names (``alignaudit-runs/<command>-<time>``) are created exclusively, with a numeric suffix when
two runs start in the same second.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import shutil
from datetime import datetime
from pathlib import Path

from alignaudit.capture.rundir import INNER_FILES, LIBRARY_DIRS, LOCK, MARKER
from alignaudit.errors import InputError

command_name = "?"  # set by the CLI; shown to a second run that finds the directory locked

_held: dict[Path, int] = {}


def default_out(command: str, root: Path = Path("alignaudit-runs")) -> Path:
    """A new, empty directory ``root/<command>-<YYYYmmdd-HHMMSS>[-N]``, created exclusively (never shared)."""
    stem = f"{command}-{datetime.now():%Y%m%d-%H%M%S}"
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        path = root / (stem if n == 0 else f"{stem}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise InputError(f"cannot find a free output name under {root}; pass --out")


def prepare(out: Path | str, force: bool, names: tuple[str, ...], inputs: tuple[Path, ...] = ()) -> Path:
    """Create (or reuse) ``out`` for a command that writes the top-level entries ``names``; lock it.

    Args:
        out: the directory. ``force``: reuse a non-empty directory, removing alignaudit's earlier outputs
            there (only those, see the module docstring). ``names``: what this command may write.
        inputs: directories the command reads (captures, run dirs); ``out`` may not be, contain, or lie in one.

    Raises:
        InputError: empty path, a file, an input overlap, unwritable, locked by another run, non-empty
            without ``force``, or holding entries alignaudit did not write where it must write.
    """
    if str(out).strip() == "":
        raise InputError("--out is empty; give a directory name")
    out = Path(out)
    check_overlap(out, inputs)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file; give a directory")
    if not force and out.is_dir() and any(p.name not in (MARKER, LOCK) for p in out.iterdir()):
        raise InputError(f"--out {out} is not empty; choose another directory or pass --force to overwrite")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create --out {out}: {e.strerror}") from e
    lock(out)
    existing = [p for p in out.iterdir() if p.name not in (MARKER, LOCK)]
    ours = set(read_marker(out))
    if existing and not force:  # filled by another run between the first look and the lock
        raise InputError(f"--out {out} is not empty; choose another directory or pass --force to overwrite")
    foreign = sorted(p.name for p in existing if p.name in names and p.name not in ours)
    if foreign:
        raise InputError(f"--out {out}: {foreign[0]} exists and was not written by alignaudit; move it or choose "
                         "another --out")
    stale = [out / name for name in sorted(ours) if (out / name).exists() or (out / name).is_symlink()]
    for path in stale:
        _check_removable(path)
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    claim(out, names)
    return out


def check_overlap(out: Path, inputs: tuple[Path, ...]) -> None:
    """Raise InputError when ``out`` is, contains, or lies inside one of ``inputs``."""
    resolved = Path(out).resolve()
    for src in inputs:
        src = Path(src).resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise InputError(f"--out {out} overlaps the input {src}; write the results to another directory")


def claim(out: Path, names: tuple[str, ...]) -> None:
    """Add ``names`` to the marker of ``out`` (before they are written).

    Raises:
        InputError: the directory is not writable.
    """
    marker = Path(out) / MARKER
    listed = sorted(set(read_marker(out)) | set(names))
    tmp = marker.with_name(MARKER + ".tmp")
    try:
        tmp.write_text(json.dumps({"written_by": "alignaudit", "entries": listed}, indent=1) + "\n")
        os.replace(tmp, marker)
    except OSError as e:
        raise InputError(f"cannot write to {out}: {e.strerror}; choose a writable directory") from e


def read_marker(out: Path) -> list[str]:
    """Top-level names alignaudit wrote (or may have written) in ``out``; [] without a marker."""
    try:
        record = json.loads((Path(out) / MARKER).read_text())
        entries = record.get("entries", [])
        return [e for e in entries if isinstance(e, str) and "/" not in e and e not in ("", ".", "..")]
    except (OSError, ValueError, AttributeError):
        return []


def _check_removable(path: Path) -> None:
    if not path.is_dir() or path.is_symlink() or path.name in LIBRARY_DIRS:
        return
    for root, _, files in os.walk(path):
        for name in files:
            if not any(fnmatch.fnmatch(name, pattern) for pattern in INNER_FILES):
                raise InputError(f"--force would remove {Path(root) / name}, which alignaudit did not write; "
                                 "move it first")


def lock(out: Path) -> None:
    """Hold an exclusive lock on ``out`` until ``release`` (or process exit); idempotent per process.

    Raises:
        InputError: another process holds it (the message names it), or the directory is not writable.
    """
    key = Path(out).resolve()
    if key in _held:
        return
    path = key / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise InputError(f"cannot write to {out}: {e.strerror}; choose a writable directory") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip()
        os.close(fd)
        try:
            info = json.loads(holder)
            who = f"pid {info['pid']}, `alignaudit {info['command']}`, started {info['started']}"
        except (json.JSONDecodeError, KeyError, TypeError):
            who = "another process"
        raise InputError(f"{out} is in use by another alignaudit run ({who}); "
                         "wait for it or choose another --out") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "command": command_name,
                             "started": datetime.now().isoformat(timespec="seconds")}).encode())
    _held[key] = fd


def release(out: Path) -> None:
    """Release the lock this process holds on ``out`` (a no-op without one): the Python API, which may run
    several commands in one process, releases each when it ends."""
    fd = _held.pop(Path(out).resolve(), None)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Release every lock this process holds (the CLI calls this when a command ends)."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)
