"""What a run directory holds, judged from its files (and its run.json), read with one-line errors.

| kind | file that marks it | written by |
|---|---|---|
| compare | summary.json (+ tokens.parquet, sequences.parquet) | compare, gate, diff |
| bisect | ops-natural.parquet and/or ops-forced.parquet (ops.parquet: diff of two op captures) | bisect, diff |
| rl | steps.parquet | rl |
| ablate | ablate.parquet | ablate |
| gate | verdict.json, beside a compare, diff or rl run | gate |

A finished run's record and every file it lists are verified (alignaudit.comparison.integrity) before anything is read,
and a gate verdict is judged again from the checked run under the rule verdict.json records: a page never
shows a number the files' checksums do not cover.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from alignaudit.capture.rundir import (
    ABLATE_PARQUET,
    BISECT,
    MANIFEST,
    OPS_FILES,
    RUN,
    SEQUENCES,
    STEPS,
    SUMMARY,
    TOKEN_RUNS,
    TOKENS,
    VERDICT,
)
from alignaudit.comparison import integrity
from alignaudit.errors import InputError

MARKS = {"compare": SUMMARY, "rl": STEPS, "ablate": ABLATE_PARQUET}  # bisect: any of OPS_FILES
KNOWN = f"{SUMMARY}, {', '.join(OPS_FILES.values())}, {STEPS} or {ABLATE_PARQUET}"


@dataclass
class RunDir:
    """A run directory's kinds (in page order), its run.json (None without one) and gate verdict."""

    path: Path
    kinds: list[str]
    record: dict | None = None
    verdict: dict | None = None
    ops: dict[str, Path] = field(default_factory=dict)  # bisect mode -> ops table
    captures: dict = field(default_factory=dict)  # role -> Capture (checked), for a sealed compare/diff run

    @property
    def complete(self) -> bool:
        return self.record is None or self.record.get("status") == "complete"


def detect(run_dir: Path | str) -> RunDir:
    """Read ``run_dir`` far enough to know what it holds.

    Raises:
        InputError: no such directory, an unreadable run.json or verdict.json, no alignaudit results, or
            results missing a file their kind needs (the message names the file and the fix).
    """
    path = Path(run_dir)
    if not path.exists():
        raise InputError(
            f"{path} does not exist; give the run directory (--out) of alignaudit compare, bisect, gate, "
            "rl, ablate or diff"
        )
    if not path.is_dir():
        raise InputError(f"{path} is a file; give the run directory that holds it")
    record = read_json(path / RUN) if (path / RUN).is_file() else None
    ops = {mode: path / name for mode, name in OPS_FILES.items() if (path / name).is_file()}
    kinds = [
        kind
        for kind in ("compare", "bisect", "rl", "ablate")
        if (ops if kind == "bisect" else (path / MARKS[kind]).is_file())
    ]
    if record is None and kinds:
        raise InputError(
            f"{path} holds results but no {RUN}, so nothing vouches for them (written by an older "
            "alignaudit?); run the command again"
        )
    sealed = record is not None and (record.get("status") == "complete" or integrity.RECORD_SHA256 in record)
    captures = {}
    if (
        sealed and record is not None
    ):  # a sealed record whose status says otherwise was edited: its seal no longer matches
        captures = _check(path, record)
    command = (record or {}).get("command")
    if command in ("compare", "bisect", "rl", "ablate") and command not in kinds:
        status = (record or {}).get("status")
        fix = (
            "the run did not finish: run it again"
            if status != "complete"
            else "the directory was altered: run the command again"
        )
        wanted = " or ".join(OPS_FILES[m] for m in ("natural", "forced")) if command == "bisect" else MARKS[command]
        raise InputError(
            f"{path}: {RUN} records an `alignaudit {command}` run (status {status!r}) but {wanted} is missing; {fix}"
        )
    if not kinds:
        hint = (
            " (a capture: compare two with `alignaudit diff A B`, then report that)"
            if (path / MANIFEST).is_file()
            else ""
        )
        raise InputError(
            f"{path} holds no alignaudit results (none of {KNOWN}){hint}; give the run directory "
            "(--out) of alignaudit compare, bisect, gate, rl, ablate or diff"
        )
    if "compare" in kinds:
        missing = [name for name in (TOKENS, SEQUENCES) if not (path / name).is_file()]
        if missing:
            raise InputError(f"{path} holds {SUMMARY} but not {missing[0]}: the comparison is incomplete; run it again")
    if sealed and record is not None:  # the files this page reads: listed, checked
        integrity.check_outputs(path, record, tuple(name for kind in kinds for name in _read_by(kind, ops)))
    verdict = None
    if (path / VERDICT).is_file():  # shown as judged again here from the checked run, never as stored
        from alignaudit.comparison.gate import rejudge

        verdict = rejudge(path, read_json(path / VERDICT))
    return RunDir(path, kinds, record, verdict, ops, captures)


def _check(path: Path, record: dict) -> dict:
    """A finished run as the gate checks it (alignaudit.comparison.integrity): compare and diff runs against their
    captures, rl runs against their token rows, every run's seal and listed files. Returns the checked captures
    of a compare or diff run by role ({} for other runs)."""
    integrity.check_record(path / RUN, record)  # first: a sealed record edited to look unfinished is named as edited
    command = record.get("command")
    if command in TOKEN_RUNS:
        checked = integrity.load_run(path)
        return {"train": checked.train, "infer": checked.infer}
    elif command == "rl":
        integrity.load_rl_run(path)
    else:
        integrity.check_outputs(path, record)
    return {}


def _read_by(kind: str, ops: dict[str, Path]) -> tuple[str, ...]:
    """The files the page's section of ``kind`` reads."""
    if kind == "bisect":  # and bisect.json where the run wrote one (the ops table of a diff has none)
        return tuple(p.name for p in ops.values()) + tuple(
            BISECT for p in list(ops.values())[:1] if (p.parent / BISECT).is_file()
        )
    return {"compare": (SUMMARY, TOKENS, SEQUENCES), "rl": (STEPS,), "ablate": (ABLATE_PARQUET,)}[kind]


def read_json(path: Path) -> dict:
    """A JSON object from ``path``. Raises InputError when unreadable or not an object."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is unreadable ({e}); run the command that wrote it again") from e
    if not isinstance(record, dict):
        raise InputError(f"{path} is not a JSON object; run the command that wrote it again")
    return record


def read_table(path: Path, required: tuple[str, ...] = ()) -> pd.DataFrame:
    """A parquet table holding at least the ``required`` columns.

    Raises:
        InputError: unreadable, or a required column missing (named).
    """
    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged or truncated file
        raise InputError(
            f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "run the command that wrote it again"
        ) from e
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise InputError(
            f"{path} lacks the column(s) {', '.join(missing)}; it was written by another alignaudit "
            "version or altered: run the command again"
        )
    return frame
