"""What alignaudit wrote in an output directory: its marker file (``.alignaudit-outputs``) and the rule that
``--force`` removes only the files the marker records.

The marker is JSON::

    {"written_by": "alignaudit",
     "entries": ["run.json", "train", ...],           # top-level names a command claimed, before writing them
     "recorded": ["run.json", "train", ...],          # entries whose files were recorded when the command ended
     "files": {"train/manifest.json": [1234, 1733616000123456789], ...}}   # path -> [bytes, mtime in ns]

A command claims its names before it writes (so a crash still leaves them listed) and, when it ends
(``capture.outdir.release``: normal end, failure or interrupt), records the files it wrote under them: those modified
since its claim whose names and places are ones alignaudit writes (``inventory``). A file under a recorded entry is
alignaudit's when the record lists its path with the same size and modification time: a file put there by anyone
else, before, during or after the run, or one changed since, is not, and ``--force`` refuses to remove it. An entry
that was claimed but never recorded (its command was killed, or the directory was written by a version before
records) falls back to the layout rule, ``rundir.alignaudit_wrote``: names alignaudit writes, at the places it
writes them. A folder inside an entry that has a marker of its own, where the entry's record lists that marker (a
row of ablate's configs/, which gate or report may write into later), is judged by that marker for the entries it
records. Limits: a file changed with its size and time restored passes as unchanged; a copy that does not keep times
is refused as changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from alignaudit.capture.rundir import LIBRARY_DIRS, LOCK, MARKER, RESERVED, alignaudit_wrote
from alignaudit.errors import InputError


@dataclass(frozen=True)
class Marker:
    """One directory's marker.

    Attributes:
        entries: the top-level names alignaudit claimed there.
        recorded: the entries whose files were recorded when the command that claimed them ended.
        files: each recorded file's path from the directory ("/"-separated) -> (size in bytes, st_mtime_ns).
    """

    entries: frozenset[str] = frozenset()
    recorded: frozenset[str] = frozenset()
    files: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def claiming(self, names: Iterable[str]) -> Marker:
        """This marker with ``names`` claimed anew: listed, and their earlier records dropped (the command about to
        write them records them again when it ends)."""
        names = set(names)
        return Marker(self.entries | names, self.recorded - names, self._files_outside(names))

    def recording(self, files: Mapping[str, tuple[int, int]], names: Iterable[str]) -> Marker:
        """This marker with the entries ``names`` recorded as holding exactly ``files``."""
        names = set(names)
        return Marker(self.entries | names, self.recorded | names, self._files_outside(names) | dict(files))

    def _files_outside(self, names: set[str]) -> dict[str, tuple[int, int]]:
        return {path: stat for path, stat in self.files.items() if _entry(path) not in names}

    def subset(self, names: Iterable[str]) -> Marker:
        """The part of this marker about the entries ``names`` (what moves with them into another directory)."""
        names = set(names) & self.entries
        return Marker(
            frozenset(names),
            self.recorded & names,
            {path: stat for path, stat in self.files.items() if _entry(path) in names},
        )


def read(directory: Path) -> Marker:
    """The marker of ``directory``; an empty Marker where there is none or it cannot be read. Entries that could
    name something outside the directory ("", ".", "..", a path) are dropped."""
    try:
        record = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python parses
        return Marker()
    if not isinstance(record, dict):
        return Marker()
    entries = frozenset(e for e in _strings(record.get("entries")) if _is_name(e))
    recorded = frozenset(e for e in _strings(record.get("recorded")) if e in entries)
    raw = record.get("files")
    files = {}
    for path, stat in raw.items() if isinstance(raw, dict) else ():
        if _entry(path) in recorded and _is_stat(stat):
            files[path] = (stat[0], stat[1])
    return Marker(entries, recorded, files)


def write(directory: Path, marker: Marker) -> None:
    """Replace the marker of ``directory`` with ``marker`` in one step (a temporary file renamed over it).

    Raises:
        InputError: the directory is not writable.
    """
    path = Path(directory) / MARKER
    tmp = path.with_name(MARKER + ".tmp")
    record = {
        "written_by": "alignaudit",
        "entries": sorted(marker.entries),
        "recorded": sorted(marker.recorded),
        "files": {name: list(stat) for name, stat in sorted(marker.files.items())},
    }
    try:
        tmp.unlink(missing_ok=True)  # a link planted under this name is removed, never written through
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"cannot write to {directory}: {e.strerror}; choose a writable directory") from e


def inventory(directory: Path, names: Iterable[str], since_ns: int) -> dict[str, tuple[int, int]]:
    """The files under the entries ``names`` of ``directory`` that the command which claimed them wrote, with size
    and modification time: path from ``directory`` -> (st_size, st_mtime_ns). A file counts where it was modified at
    ``since_ns`` (the claim, in ns since the epoch) or later, less MTIME_SLACK_NS for file systems with coarse
    times, and where its name and place are ones alignaudit writes (rundir.alignaudit_wrote; an entry that is a
    file: itself; in a folder a library writes whole, LIBRARY_DIRS: any name). So a file a user moves in during the
    run (an older time) or adds there under a name of their own is never recorded. Links are recorded as links
    (lstat), never followed; a link to a folder counts as a file."""
    directory = Path(directory)
    files = {}
    for name in names:
        top = directory / name
        if not top.is_dir() or top.is_symlink():
            if (top.exists() or top.is_symlink()) and _stat(top)[1] >= since_ns - MTIME_SLACK_NS:
                files[name] = _stat(top)
            continue
        for path in _walk(top):
            relative = path.relative_to(directory)
            stat = _stat(path)
            if stat[1] >= since_ns - MTIME_SLACK_NS and (name in LIBRARY_DIRS or alignaudit_wrote(relative.parts)):
                files[relative.as_posix()] = stat
    return files


def _walk(top: Path) -> Iterator[Path]:
    """Every file under the folder ``top``, links included (a link to a folder as a file), never following one."""
    for root, dirs, leaves in os.walk(top):
        for leaf in sorted(leaves + [d for d in dirs if (Path(root) / d).is_symlink()]):
            yield Path(root) / leaf


@dataclass(frozen=True)
class Foreign:
    """A file ``--force`` must not remove (``path``), and why, as a clause (``reason``)."""

    path: Path
    reason: str


NOT_WRITTEN, CHANGED = "which alignaudit did not write", "which changed after alignaudit wrote it"


def foreign_file(directory: Path, name: str, marker: Marker) -> Foreign | None:
    """The first file under the entry ``name`` of ``directory`` that alignaudit did not write by ``marker`` (module
    docstring), or None where every file there is alignaudit's. An entry that is a file is judged only where it is
    recorded (a claimed name is alignaudit's); a folder a library writes whole (LIBRARY_DIRS) only where recorded."""
    directory = Path(directory)
    top = directory / name
    if not top.is_dir() or top.is_symlink():
        recorded = name in marker.recorded and (top.exists() or top.is_symlink())
        return _judge(top, marker.files.get(name)) if recorded else None
    if name not in marker.recorded and name in LIBRARY_DIRS:
        return None
    nested: dict[Path, Marker] = {}
    for path in _walk(top):
        if (foreign := _foreign(directory, path, marker, nested)) is not None:
            return foreign
    return None


def _foreign(directory: Path, path: Path, marker: Marker, nested: dict[Path, Marker]) -> Foreign | None:
    """``path`` (under ``directory``) as a Foreign unless ``marker`` says alignaudit wrote it, or the marker of a
    folder between them does where ``marker`` lists that folder's marker (a comparison alignaudit made there, which
    gate or report may have written into later; ``nested`` caches those markers)."""
    relative = path.relative_to(directory)
    if path.name in (MARKER, LOCK):  # rewritten (a lock: made) by each later command there: not judged by its stat
        ours = _listed(relative, marker) or _listed(relative.parent / MARKER, marker)  # a folder alignaudit made
        return None if ours else Foreign(path, NOT_WRITTEN)
    for depth in range(len(relative.parts) - 1, 1, -1):  # the nearest folder below the entry with a marker of its own
        inner = directory.joinpath(*relative.parts[:depth])
        if (inner / MARKER).is_file() and _listed(Path(*relative.parts[:depth], MARKER), marker):
            if inner not in nested:
                nested[inner] = read(inner)
            below = Path(*relative.parts[depth:])
            if below.parts[0] in nested[inner].recorded:
                return _judge(path, nested[inner].files.get(below.as_posix()))
            break
    if relative.parts[0] in marker.recorded:
        return _judge(path, marker.files.get(relative.as_posix()))
    return None if alignaudit_wrote(relative.parts) else Foreign(path, NOT_WRITTEN)


def _listed(relative: Path, marker: Marker) -> bool:
    """Whether the file at ``relative`` is alignaudit's by ``marker``'s record, or where its entry was never recorded,
    by the layout rule."""
    if relative.parts[0] in marker.recorded:
        return relative.as_posix() in marker.files
    return alignaudit_wrote(relative.parts)


def _judge(path: Path, recorded: tuple[int, int] | None) -> Foreign | None:
    """``path`` against its record: None where it matches, else why not."""
    if recorded is None:
        return Foreign(path, NOT_WRITTEN)
    return None if recorded == _stat(path) else Foreign(path, CHANGED)


# a file written just after its command's claim can carry an earlier time on a file system that stores coarse times
# (FAT: 2 s; ext3, HFS+: 1 s)
MTIME_SLACK_NS = 2_000_000_000


def _stat(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_size, info.st_mtime_ns


def _entry(path: str) -> str:
    return path.split("/", 1)[0]


def _strings(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _is_name(entry: str) -> bool:
    return "/" not in entry and entry not in ("", ".", "..", *RESERVED)


def _is_stat(stat: object) -> bool:
    return (
        isinstance(stat, list)
        and len(stat) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in stat)
    )
