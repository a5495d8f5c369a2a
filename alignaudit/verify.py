"""What must hold before any verdict rests on captures: one validation for ``diff``, ``gate`` and ``rl``.

``load_pair`` (two capture directories, ``diff``): each capture complete and undamaged (capture.read_capture:
manifest status, required sha256 of the logprob table, row structure, token digest), both of the same
checkpoint (sha256 of config.json and weights) and of the same token ids.

``load_run`` (a run directory, ``gate``): all of the above for RUN/train and RUN/infer, plus the run's own
record (run.json): the run finished, each capture's manifest is byte for byte the one the run wrote (its
sha256 is in run.json), each capture's role and engine are the ones run.json names, and its settings
(dtype, device, strict ops, options) are the ones the run asked for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from alignaudit.capture import MANIFEST, Capture, read_capture
from alignaudit.errors import InputError

RUN = "run.json"
ROLES = ("train", "infer")
SETTINGS_CHECKED = ("dtype", "device", "strict", "options", "seed", "lm_head_dtype")


def load_pair(train_dir: Path, infer_dir: Path) -> tuple[Capture, Capture]:
    """Read two captures and check that they can be compared.

    Raises:
        InputError: a capture is missing, incomplete or damaged; the two are of different checkpoints
            or different token ids.
    """
    train, infer = read_capture(train_dir), read_capture(infer_dir)
    sha_t = train.manifest["model"].get("checkpoint_sha256")
    sha_i = infer.manifest["model"].get("checkpoint_sha256")
    if not sha_t or not sha_i:
        raise InputError(f"{train.path if not sha_t else infer.path} records no checkpoint sha256; capture it again")
    if sha_t != sha_i:
        raise InputError(
            f"the captures are of different checkpoints ({train.path}: {sha_t[:12]}, {infer.path}: {sha_i[:12]}); "
            "capture both from one --model"
        )
    if train.manifest["prompts"]["digest"] != infer.manifest["prompts"]["digest"]:
        raise InputError("the two captures were made on different token ids; capture both from the same prompts")
    return train, infer


@dataclass
class Run:
    """A finished run directory, checked: its record and both captures."""

    path: Path
    record: dict
    train: Capture
    infer: Capture


def manifest_sha256(capture_dir: Path) -> str:
    return hashlib.sha256((Path(capture_dir) / MANIFEST).read_bytes()).hexdigest()


def capture_record(capture: Capture) -> dict:
    """What run.json stores about a capture it made, to recognize it later."""
    return {"path": capture.path.name, "manifest_sha256": manifest_sha256(capture.path)}


def read_run_record(run_dir: Path, commands: tuple[str, ...] = ("compare",)) -> dict:
    """run.json of a finished run of one of ``commands``.

    Raises:
        InputError: no run.json, unreadable, another command's, or a run that did not finish.
    """
    run_dir = Path(run_dir)
    path = run_dir / RUN
    if not path.is_file():
        raise InputError(f"{run_dir} is not a run directory (no {RUN}); give the --out of `alignaudit "
                         f"{commands[0]}`")
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is unreadable ({e}); run the comparison again") from e
    if not isinstance(record, dict) or record.get("command") not in commands:
        raise InputError(f"{path} is not a record of `alignaudit {' or '.join(commands)}`")
    if record.get("status") != "complete":
        raise InputError(f"{run_dir}: the run did not finish (status {record.get('status')!r}); run it again")
    return record


def load_run(run_dir: Path) -> Run:
    """Read a finished compare run and check it end to end (see the module docstring).

    Raises:
        InputError: naming the first check that fails.
    """
    run_dir = Path(run_dir)
    record = read_run_record(run_dir)
    captures = record.get("captures")
    if not isinstance(captures, dict) or set(captures) != set(ROLES):
        raise InputError(f"{run_dir / RUN} lists no captures; the run was made by an older alignaudit, run it again")
    train, infer = load_pair(run_dir / "train", run_dir / "infer")
    for role, capture in (("train", train), ("infer", infer)):
        _check_capture(run_dir, record, role, capture)
    return Run(run_dir, record, train, infer)


STEP_COLUMNS = ("step", "tokens", "mismatches", "nan_tokens", "ulp_max", "max_abs_diff", "sync_bit_equal")


def load_rl_run(run_dir: Path):
    """steps.parquet of a finished rl run, checked against run.json: the sha256 recorded when the run
    finished, every step 1..N present once and in order, the columns the verdict reads.

    Raises:
        InputError: naming the first check that fails.
    """
    import pandas as pd

    run_dir = Path(run_dir)
    record = read_run_record(run_dir, commands=("rl",))
    path = run_dir / "steps.parquet"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != record.get("steps_sha256"):
        raise InputError(f"{path} is missing or is not the table this run wrote (sha256 differs from {RUN}); "
                         "run it again")
    steps = pd.read_parquet(path)
    missing = [c for c in STEP_COLUMNS if c not in steps]
    if missing:
        raise InputError(f"{path} lacks columns {missing}; the run was made by another alignaudit")
    expected = list(range(1, int((record.get("rl") or {}).get("steps", 0)) + 1))
    if steps["step"].tolist() != expected or not expected:
        raise InputError(f"{path} does not hold steps 1..{len(expected)} in order; the run directory was altered")
    return steps


def _check_capture(run_dir: Path, record: dict, role: str, capture: Capture) -> None:
    where = f"{run_dir}/{role}"
    expected = record["captures"][role]
    if not isinstance(expected, dict) or manifest_sha256(capture.path) != expected.get("manifest_sha256"):
        raise InputError(f"{where} is not the capture this run wrote (its manifest's sha256 differs from {RUN}); "
                         "run the comparison again")
    m = capture.manifest
    if m.get("role") != role:
        raise InputError(f"{where} holds a capture made as the {m.get('role')} side; the run directory was altered")
    side = record.get(role) or {}
    if m.get("engine") != side.get("engine"):
        raise InputError(f"{where} was made by {m.get('engine')}, but {RUN} says {side.get('engine')}; "
                         "the run directory was altered")
    settings = m.get("settings") or {}
    for key in SETTINGS_CHECKED:
        if settings.get(key) != side.get(key):
            raise InputError(f"{where}: {key} {settings.get(key)!r} differs from {RUN}'s {side.get(key)!r}; "
                             "the run directory was altered")
    if (m.get("model") or {}).get("path") != (record.get("model") or {}).get("path"):
        raise InputError(f"{where} is of another checkpoint than {RUN} names; the run directory was altered")
