"""Output directories: claimed, locked, and only ever cleaned of what alignaudit itself wrote.

Every command that writes results (compare, bisect, capture, diff, gate, rl) goes through ``prepare``:
    - the directory is locked for the command's lifetime (``fcntl.flock`` on ``.alignaudit.lock``, released
      by the kernel however the process ends); a second run on the same directory is refused and told who
      holds it;
    - a marker file (``.alignaudit-outputs``, JSON; capture/written.py) lists the top-level names alignaudit may
      write there. It is extended *before* anything is written, so after a crash it still covers every partial
      output, and when the command ends (``release``) it records the files the command wrote under them (modified
      since its claim, at names and places alignaudit writes), with size and modification time;
    - ``--force`` replaces only entries that the marker lists, and only where every file in them is one the
      marker records, unchanged (an entry whose command was killed before its record: the layout rule,
      rundir.alignaudit_wrote); anything else is refused, naming the file, before anything is moved;
    - the complete results ``--force`` replaces are moved aside into ``PREVIOUS`` (``.alignaudit-previous/``, with
      a marker of its own) and dropped only when the new outputs are complete (``release``). "Complete" is read
      from the directory, never from an exit code: run.json's ``status`` (capture: manifest.json's). A command that
      fails or is interrupted leaves its own outputs in place (their logs name them; ``gate`` refuses them) and
      the earlier results in ``PREVIOUS``; a later ``--force`` run deletes such incomplete outputs and keeps
      ``PREVIOUS`` until it completes itself, so ``PREVIOUS`` holds the last complete results. Moving aside goes
      through ``STAGING`` (renamed to ``PREVIOUS`` in one step; a leftover is moved back by the next run) and
      dropping through ``DROPPING`` (a leftover is deleted by the next run), so an interruption at any point
      keeps the last complete results;
    - an entry the command is about to write that exists but was not written by alignaudit is refused.
Default names (``alignaudit-runs/<command>-<time>``) are created exclusively, with a numeric suffix when
two runs start in the same second.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from alignaudit.capture import written
from alignaudit.capture.rundir import DROPPING, LOCK, MANIFEST, MARKER, PREVIOUS, RESERVED, RUN, STAGING
from alignaudit.errors import InputError

command_name = "?"  # set by the CLI; shown to a second run that finds the directory locked

_held: dict[Path, int] = {}
# per directory: when this process first claimed names there (ns since the epoch) and the names; recorded at release
_claimed: dict[Path, tuple[int, set[str]]] = {}
_replacing: set[Path] = set()  # directories whose PREVIOUS this process settles when its command ends
_ASIDE = (PREVIOUS, STAGING, DROPPING)


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
        out: the directory. ``force``: reuse a non-empty directory, replacing alignaudit's earlier outputs
            there (only those; complete ones are kept in ``PREVIOUS`` until the new outputs are, see the
            module docstring).
            ``names``: what this command may write.
        inputs: directories the command reads (captures, run dirs); ``out`` may not be, contain, or lie in one.

    Raises:
        InputError: empty path, one starting with "-", a file, an input overlap, unwritable, locked by another
            run, non-empty without ``force``, or holding entries alignaudit did not write where it must write (in
            ``PREVIOUS`` too, where it must be replaced).
    """
    if str(out).strip() == "":
        raise InputError("--out is empty; give a directory name")
    if str(out).startswith("-"):  # `--out --debug`: the option parser took the next flag as the value
        raise InputError(
            f"--out {out} looks like an option, not a directory; for a directory of that name give ./{out}"
        )
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
    try:
        _replace(out, force, names)
    except OSError as e:  # a rename or delete the file system refused (a read-only or immutable entry)
        release(out)
        raise InputError(f"cannot write to {out}: {e.strerror} ({e.filename}); choose a writable directory") from e
    except BaseException:
        release(out)  # the Python API's process goes on: leave the directory unlocked
        raise
    return out


def _replace(out: Path, force: bool, names: tuple[str, ...]) -> None:
    """``prepare``'s work on the locked ``out``: refuse what must not go, set alignaudit's earlier outputs aside,
    claim ``names``."""
    _recover(out)
    existing = [p for p in out.iterdir() if p.name not in RESERVED]
    ours = set(read_marker(out))
    if existing and not force:  # filled by another run between the first look and the lock
        raise InputError(f"--out {out} is not empty; choose another directory or pass --force to overwrite")
    foreign = sorted(p.name for p in existing if p.name in names and p.name not in ours)
    if foreign:
        raise InputError(
            f"--out {out}: {foreign[0]} exists and was not written by alignaudit; move it or choose another --out"
        )
    stale = [out / name for name in sorted(ours) if (out / name).exists() or (out / name).is_symlink()]
    marker = written.read(out)
    for path in stale:
        _check_removable(out, path.name, marker)
    _set_aside(out, stale)
    claim(out, names)


def _set_aside(out: Path, stale: list[Path]) -> None:
    """Replace alignaudit's earlier outputs ``stale``: complete ones (``is_complete``) become ``out/PREVIOUS``,
    dropping an older PREVIOUS; incomplete ones (a failed or interrupted run's) are deleted, and a PREVIOUS there
    stays. Raises InputError, before anything moves, where PREVIOUS must be dropped and holds what alignaudit did
    not write or another run has it locked."""
    previous = out / PREVIOUS
    has_previous = previous.is_dir()
    complete = is_complete(out)
    if has_previous or (stale and complete):
        _replacing.add(out.resolve())  # PREVIOUS may hold the only complete results: release settles it and says so
    if stale and not complete:
        for path in stale:
            _delete(path)
    elif stale:
        if has_previous:
            _check_droppable(previous)
            lock(previous)  # not while a gate or report of it runs
        staging, moved = out / STAGING, []
        try:
            staging.mkdir()
            written.write(staging, written.read(out).subset(path.name for path in stale))  # the records move too
            for path in stale:
                os.rename(path, staging / path.name)
                moved.append(path)
            if has_previous:
                os.rename(previous, out / DROPPING)
        except OSError:
            _undo_aside(out, moved)  # a move the file system refused: the results stay whole, where they were
            raise
        finally:
            release(previous)
        os.rename(staging, previous)
        _delete_marker_last(out / DROPPING)


def _undo_aside(out: Path, moved: list[Path]) -> None:
    """Put the entries ``moved`` into STAGING back where they were, and remove STAGING. Raises InputError naming
    STAGING where the file system refuses that too (the next run finishes it: ``_recover``)."""
    staging = out / STAGING
    try:
        for path in reversed(moved):
            os.rename(staging / path.name, path)
        _delete(staging)
    except OSError as e:
        left = sorted(p.name for p in staging.iterdir() if p.name not in (MARKER, LOCK)) if staging.is_dir() else []
        raise InputError(
            f"--out {out}: the file system refused to move the earlier results aside ({e.strerror}), and "
            f"to move them back: {', '.join(left) or 'they'} stay in {staging}; the next run puts them "
            "back, or move them back yourself"
        ) from None


def _recover(out: Path) -> None:
    """Finish what an interrupted run left half done: STAGING's entries go back to the top level (its move aside
    did not complete), DROPPING is deleted (its drop had begun). Raises InputError where one of alignaudit's
    folder names holds what alignaudit did not make, or an entry of STAGING cannot go back (its name is taken)."""
    for name in _ASIDE:
        _check_aside(out / name)
    staging = out / STAGING
    if staging.is_dir():
        bookkeeping = (MARKER, LOCK, MARKER + ".tmp")
        for path in staging.iterdir():
            if path.name not in bookkeeping and not (out / path.name).exists():
                os.rename(path, out / path.name)
        left = [path.name for path in staging.iterdir() if path.name not in bookkeeping]
        if left:
            raise InputError(
                f"--out {out}: {STAGING}/{left[0]} is left from an interrupted run and {left[0]} exists "
                "beside it; move one of them"
            )
        _delete(staging)
    _delete_marker_last(out / DROPPING, quiet=False)


def _check_aside(path: Path) -> None:
    """Raise InputError where ``path`` (PREVIOUS, STAGING or DROPPING) exists but is not a folder alignaudit made:
    a file, a link, a folder without alignaudit's marker (an empty STAGING, made just before its marker, is ours)."""
    if not path.exists() and not path.is_symlink():
        return
    ours = (
        path.is_dir()
        and not path.is_symlink()
        and ((path / MARKER).is_file() or (path.name == STAGING and _only_marker_tmp(path)))
    )
    if not ours:
        raise InputError(f"--out {path.parent}: {path.name} was not made by alignaudit; move it first")


def _only_marker_tmp(staging: Path) -> bool:
    """Whether ``staging`` holds nothing, or only the marker's temporary file (a run killed while it wrote STAGING's
    marker, the first thing written there)."""
    return all(p.name == MARKER + ".tmp" and p.is_file() and not p.is_symlink() for p in staging.iterdir())


def _check_droppable(previous: Path) -> None:
    """Raise InputError naming an entry of ``previous`` alignaudit did not write (the --force rule)."""
    foreign = _foreign_in_previous(previous)
    if foreign is not None:
        raise InputError(f"--force would remove {foreign.path}, {foreign.reason}; move it first")


def _foreign_in_previous(previous: Path) -> written.Foreign | None:
    """The first entry of ``previous`` (a PREVIOUS) that its marker does not list, or file inside a listed entry that
    its record does not say alignaudit wrote (written.foreign_file); None where there is none."""
    marker = written.read(previous)
    for path in sorted(previous.iterdir()):
        if path.name in (MARKER, LOCK):
            continue
        if path.name not in marker.entries:
            return written.Foreign(path, written.NOT_WRITTEN)
        if (foreign := written.foreign_file(previous, path.name, marker)) is not None:
            return foreign
    return None


def is_complete(out: Path) -> bool:
    """Whether the outputs in ``out`` are a finished command's: run.json's status is "complete" (a capture's
    manifest.json where there is no run.json); only a record the marker lists counts (a run.json of the user's
    does not)."""
    listed = set(read_marker(out))
    record = next(
        (Path(out) / name for name in (RUN, MANIFEST) if name in listed and (Path(out) / name).exists()), None
    )
    try:
        return record is not None and json.loads(record.read_text()).get("status") == "complete"
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _delete_marker_last(folder: Path, quiet: bool = True) -> None:
    """Delete ``folder`` (DROPPING), its marker last: an interruption or a file the system refuses to delete leaves a
    folder that still shows alignaudit made it, which the next run deletes (_recover) rather than refuses. ``quiet``:
    such a refusal is left for the next run (else its OSError is raised)."""
    try:
        if folder.is_dir() and not folder.is_symlink():
            for path in folder.iterdir():
                if path.name != MARKER:
                    _delete(path)
        _delete(folder)
    except OSError:
        if not quiet:
            raise


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def check_overlap(out: Path | str, inputs: tuple[Path, ...]) -> None:
    """Raise InputError when ``out`` is, contains, or lies inside one of ``inputs``."""
    resolved = Path(out).resolve()
    for src in inputs:
        src = Path(src).resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise InputError(f"--out {out} overlaps the input {src}; write the results to another directory")


def check_file_outputs(
    outputs: dict[str, Path | None],
    runs: tuple[Path, ...] = (),
    inputs: tuple[Path | None, ...] = (),
    own: dict[str, str] | None = None,
) -> None:
    """The rule for a command's file outputs (gate's --json, --junit, --markdown; report's --html): none may overwrite
    what it reports on. Checked before anything is read or written.

    Args:
        outputs: option name -> the file it writes (None: not written).
        runs: the run directories the command judges or reports; nothing of theirs may be written over.
        inputs: files the command reads (a baseline verdict).
        own: option name -> the one top-level name in a run that option writes by default (gate's verdict.json,
            report's report.html): the only place inside a run an output may go.
    Raises:
        InputError: two outputs naming one file, an output that is an input, an output inside a run other than
            its own name there (a record such as run.json, a capture's manifest, a parquet), or a reserved name.
    """
    own = own or {}
    seen: dict[Path, str] = {}
    read = {Path(p).resolve(): Path(p) for p in inputs if p is not None}
    for option, path in outputs.items():
        if path is None:
            continue
        target = Path(path).resolve()
        if target in seen:
            raise InputError(f"{seen[target]} and {option} name one file, {path}; give each its own")
        seen[target] = option
        if target.name in RESERVED:
            raise InputError(
                f"{option} {path}: {target.name} is a name alignaudit keeps for itself; write to another file name"
            )
        if target in read:
            raise InputError(f"{option} {path} is an input of this command ({read[target]}); write it elsewhere")
        for run in runs:
            root = Path(run).resolve()
            if root == target or root in target.parents:
                if target.parent == root and target.name == own.get(option):
                    continue
                where = f" (or {Path(run) / own[option]})" if option in own else ""
                raise InputError(
                    f"{option} {path} is inside the run {run}, whose files are the evidence it reports "
                    f"on; write it outside the run{where}"
                )


def claim(out: Path, names: tuple[str, ...]) -> None:
    """Add ``names`` to the marker of ``out`` (before they are written).

    Raises:
        InputError: the directory is not writable, or a name is one alignaudit keeps for itself (RESERVED).
    """
    reserved = [name for name in names if name in RESERVED]
    if reserved:
        raise InputError(f"{reserved[0]} is a name alignaudit keeps for itself in {out}; write to another file name")
    written.write(out, written.read(out).claiming(names))
    _claimed.setdefault(Path(out).resolve(), (time.time_ns(), set()))[1].update(names)


def read_marker(out: Path) -> list[str]:
    """Top-level names alignaudit wrote (or may have written) in ``out``, sorted; [] without a marker."""
    return sorted(written.read(out).entries)


def _check_removable(out: Path, name: str, marker: written.Marker) -> None:
    """Raise InputError naming the first file under ``out/name`` that ``marker`` does not say alignaudit wrote."""
    foreign = written.foreign_file(out, name, marker)
    if foreign is not None:
        raise InputError(f"--force would remove {foreign.path}, {foreign.reason}; move it first")


def check_replaceable(out: Path, names: tuple[str, ...], fix: str) -> None:
    """Raise InputError where one of ``names`` exists in ``out`` (a run a later command writes into: gate's verdict
    files, report's page) and is not a file alignaudit's record says it wrote there, unchanged since, or is a link
    (never written through). ``fix``: the clause that ends the message (how to write elsewhere)."""
    marker = written.read(out)
    for name in names:
        path = Path(out) / name
        if not path.exists() and not path.is_symlink():
            continue
        if name not in marker.entries or path.is_symlink() or not path.is_file():
            foreign: written.Foreign | None = written.Foreign(path, written.NOT_WRITTEN)
        else:  # a claimed name never recorded (a killed run): ours
            foreign = written.foreign_file(out, name, marker)
        if foreign is not None:
            raise InputError(f"{foreign.path} exists, {foreign.reason}; move it, {fix}")


def _record(out: Path) -> None:
    """Record in the marker of ``out`` the files this process wrote under the names it claimed there
    (written.inventory, from the first claim's time)."""
    since, names = _claimed.pop(Path(out).resolve(), (0, set()))
    if names and (Path(out) / MARKER).is_file():
        written.write(out, written.read(out).recording(written.inventory(out, names, since), names))


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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a planted link is refused
    except OSError as e:
        raise InputError(f"cannot write to {out}: {e.strerror}; choose a writable directory") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _holder(fd)
        os.close(fd)
        raise InputError(
            f"{out} is in use by another alignaudit run ({who}); wait for it or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.write(
        fd,
        json.dumps(
            {"pid": os.getpid(), "command": command_name, "started": datetime.now().isoformat(timespec="seconds")}
        ).encode(),
    )
    _held[key] = fd


@dataclass(frozen=True)
class Kept:
    """A PREVIOUS folder that stays when its command ends (``path``); why (``reason``, a clause); whether the outputs
    beside it are complete (``beside_complete``: then it holds older results, else the last complete ones)."""

    path: Path
    reason: str
    beside_complete: bool


def held_by(out: Path) -> str | None:
    """Who holds the lock on ``out`` ("pid N, `alignaudit COMMAND`, started TIME"), or None where no process does
    (this one's own lock included: it is not another run)."""
    if Path(out).resolve() in _held:
        return None
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """The holder a lock file (open as ``fd``) names."""
    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    try:
        info = json.loads(text)
        return f"pid {info['pid']}, `alignaudit {info['command']}`, started {info['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "another process"


def release(out: Path) -> Kept | None:
    """End this process's command in ``out``: settle the results ``--force`` set aside, then release the lock (a
    no-op without one). The Python API, which may run several commands in one process, releases each when it ends.

    Where the outputs in ``out`` are complete (``is_complete``), ``out/PREVIOUS`` is dropped, unless it holds an
    entry alignaudit did not write, another process has it locked (``gate`` or ``report`` of it), or it cannot be
    renamed: then it stays.

    Returns:
        The PREVIOUS that stays and why, else None.
    """
    key = Path(out).resolve()
    if key in _held:
        _record(key)  # before anything else: the outputs are final, and the lock still keeps other runs out
    kept, set_aside = None, key in _replacing
    _replacing.discard(key)
    if set_aside and (key / PREVIOUS).is_dir():  # a run can fail before the folder exists
        complete = is_complete(key)
        reason = _drop(key / PREVIOUS) if complete else "the outputs beside it are incomplete"
        if reason and (key / PREVIOUS).is_dir():
            kept = Kept(Path(out) / PREVIOUS, reason, complete)
    fd = _held.pop(key, None)
    if fd is not None:
        os.close(fd)
    return kept


def _drop(previous: Path) -> str | None:
    """Delete ``previous`` (a PREVIOUS) through DROPPING; None once it is gone, else why it stays."""
    foreign = _foreign_in_previous(previous)
    if foreign is not None:
        return f"it holds {foreign.path}, {foreign.reason}"
    holder = held_by(previous)
    if holder:
        return f"another alignaudit run holds it ({holder})"
    try:
        lock(previous)
    except InputError:
        return "it is not writable"
    dropping = previous.with_name(DROPPING)
    try:
        os.rename(previous, dropping)
    except OSError as e:
        return f"it could not be renamed ({e.strerror})"
    finally:
        release(previous)
    _delete_marker_last(dropping)
    return None


def release_all() -> list[Kept]:
    """``release`` every directory this process holds (the CLI calls this when a command ends); the ``PREVIOUS``
    folders that stay."""
    return [kept for key in sorted(_held.keys() | _replacing) if (kept := release(key))]
