"""What must hold before any verdict rests on captures: one validation for ``diff``, ``gate`` and ``rl``.

``load_pair`` (two capture directories, ``diff``): each capture complete and undamaged (capture.read_capture:
manifest status, required sha256 of the logprob table, row structure, token digest), both of the same
checkpoint (sha256 of config.json and weights) and of the same token ids.

``load_run`` (a run directory, ``gate``): all of the above for RUN/train and RUN/infer, plus the run's own
record (run.json): the run finished, each capture's manifest is byte for byte the one the run wrote (its
sha256 is in run.json), each capture's role and engine are the ones run.json names, and its settings
(dtype, device, strict ops, options), model and mode (rollout settings included) are the ones the run
asked for. A ``diff`` directory's record names its two captures by path and manifest sha256.

Every finished run record is sealed (``seal``): it lists the sha256 of every file the command wrote
(``outputs``: summary.json, tokens.parquet, steps.parquet, tokens/step-*.parquet, ops tables, ...) and
carries the sha256 of its own content (``record_sha256``). ``read_run_record`` verifies the seal and
``check_outputs`` the files, so no field of run.json and no output file a verdict or a page reads can be
changed afterwards unnoticed. What no check can catch: a directory rewritten with every checksum
recomputed (the checksums detect damage and edits, they are not signatures).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from alignaudit.capture import outdir
from alignaudit.capture.digest import file_sha256
from alignaudit.capture.directory import Capture, read_capture
from alignaudit.capture.rundir import (
    EVAL,
    EVAL_DIR,
    EVAL_ROWS,
    MANIFEST,
    PREVIOUS,
    RESULTS,
    RUN,
    SIDES,
    STEP_TOKENS,
    STEPS,
    SUMMARY,
    TOKEN_RUNS,
    TOKENS,
    TOKENS_DIR,
)
from alignaudit.errors import InputError

RECORD_SHA256 = "record_sha256"
OUTPUTS = "outputs"
SETTINGS_CHECKED = ("dtype", "device", "strict", "options", "seed", "lm_head_dtype")


def load_pair(train_dir: Path, infer_dir: Path) -> tuple[Capture, Capture]:
    """Read two captures and check that they can be compared.

    Raises:
        InputError: a capture is missing, incomplete or damaged; the same directory or capture (a copy) twice; the
            two are of different checkpoints or different token ids.
    """
    train, infer = read_capture(train_dir), read_capture(infer_dir)
    if os.path.samefile(train.path, infer.path):
        raise InputError(
            f"both captures are {train_dir}: a capture compared with itself is identical whatever the "
            "engine computed; give the training engine's capture and the inference engine's"
        )
    ids = train.manifest.get("capture_id"), infer.manifest.get("capture_id")
    # captures written before capture_id existed: a copy is the same manifest, byte for byte
    if ids[0] == ids[1] if all(ids) else manifest_sha256(train.path) == manifest_sha256(infer.path):
        raise InputError(
            f"{train_dir} and {infer_dir} hold one capture (one is a copy of the other), identical "
            "whatever the engine computed; give the training engine's capture and the inference engine's"
        )
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


def record_digest(record: dict) -> str:
    """sha256 of a record's content as JSON stores it (``record_sha256`` itself left out)."""
    body = {k: v for k, v in json.loads(json.dumps(record, default=str)).items() if k != RECORD_SHA256}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(record: dict, out: Path, outputs: tuple[str, ...]) -> dict:
    """The finished form of a run record: ``"status": "complete"``, the sha256 of every file among
    ``outputs`` (names relative to ``out``; a directory stands for every file in it; a name not written is
    left out) and the record's own sha256."""
    out = Path(out)
    digests = {}
    for name in outputs:
        path = out / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
        digests.update({f.relative_to(out).as_posix(): file_sha256(f) for f in files})
    sealed = {**record, "status": "complete", OUTPUTS: digests}
    sealed[RECORD_SHA256] = record_digest(sealed)
    return sealed


def marks_failure(run):
    """Decorate a command's run function (compare, rescore, bisect, ablate, rl: its argument ``out`` the run
    directory): if it raises after writing run.json with ``"status": "running"``, run.json says ``"failed"`` (or
    ``"interrupted"`` for Ctrl-C) with the error's first line, and the error goes on. A run is never left
    looking as if it were still running; readers refuse any status but complete."""
    import functools
    import inspect

    signature = inspect.signature(run)

    @functools.wraps(run)
    def wrapper(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except BaseException as error:
            out = signature.bind_partial(*args, **kwargs).arguments.get("out")
            if out is not None:
                record_failure(Path(out) / RUN, error)
            raise

    return wrapper


def record_failure(path: Path, error: BaseException) -> None:
    """Mark a run record still ``running`` as ``failed`` / ``interrupted`` (``marks_failure``); any other
    record, or none, is left as it is."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(record, dict) or record.get("status") != "running":
        return
    status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    text = (str(error).strip().splitlines() or [""])[0]
    record.update(status=status, error=f"{type(error).__name__}: {text}"[:500])
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def check_record(path: Path, record: dict) -> None:
    """A finished record's seal. Raises InputError when run.json changed after the run finished."""
    if record.get(RECORD_SHA256) != record_digest(record):
        raise InputError(
            f"{path} was changed after the run finished (its content no longer matches its "
            f"{RECORD_SHA256}), or was written by an older alignaudit; run it again"
        )


def check_outputs(run_dir: Path, record: dict, names: tuple[str, ...] | None = None) -> None:
    """Every output file the sealed record lists (or those of ``names``, files or directories) exists and is
    byte for byte the one the run wrote.

    Raises:
        InputError: naming the first file missing, changed, or not listed.
    """
    listed = record.get(OUTPUTS) or {}
    for name in names or ():
        if name not in listed and not any(k.startswith(name.rstrip("/") + "/") for k in listed):
            raise InputError(f"{Path(run_dir) / name} is not among the files {RUN} lists; the run wrote no such file")
    for name, sha in listed.items():
        if names is not None and not any(name == n or name.startswith(n.rstrip("/") + "/") for n in names):
            continue
        path = Path(run_dir) / name
        if not path.is_file() or file_sha256(path) != sha:
            raise InputError(
                f"{path} is missing or is not the file this run wrote (its sha256 differs from {RUN}); run it again"
            )


def read_run_record(run_dir: Path, commands: tuple[str, ...] = ("compare",)) -> dict:
    """run.json of a finished run of one of ``commands``, its seal verified (``check_record``).

    Raises:
        InputError: no run.json, unreadable, another command's, a run that did not finish, or a record
            changed afterwards.
    """
    run_dir = Path(run_dir)
    path = run_dir / RUN
    kept = f"; the last complete results there are in {run_dir / PREVIOUS}" if (run_dir / PREVIOUS).is_dir() else ""
    if not path.is_file():
        raise InputError(
            f"{run_dir} is not a run directory (no {RUN}); give the --out of `alignaudit {commands[0]}`{kept}"
        )
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 text
        raise InputError(f"{path} is unreadable ({e}); run the comparison again") from e
    if not isinstance(record, dict) or record.get("command") not in commands:
        raise InputError(f"{path} is not a record of `alignaudit {' or '.join(commands)}`")
    if record.get("status") == "running" and (holder := outdir.held_by(run_dir)):
        raise InputError(f"{run_dir}: the run is still going ({holder}); wait for it to finish")
    if record.get("status") != "complete":
        raise InputError(f"{run_dir}: the run did not finish (status {record.get('status')!r}); run it again{kept}")
    check_record(path, record)
    return record


def load_run(run_dir: Path) -> Run:
    """Read a finished compare run and check it end to end (see the module docstring).

    Raises:
        InputError: naming the first check that fails.
    """
    run_dir = Path(run_dir)
    record = read_run_record(run_dir, commands=TOKEN_RUNS)
    captures = record.get("captures")
    if not isinstance(captures, dict) or set(captures) != set(SIDES):
        raise InputError(f"{run_dir / RUN} lists no captures; the run was made by an older alignaudit, run it again")
    check_outputs(run_dir, record, RESULTS[record["command"]])
    check_outputs(run_dir, record)
    if record["command"] == "diff":  # the captures live where they were made
        train, infer = load_pair(Path(captures["train"]["path"]), Path(captures["infer"]["path"]))
        for role, capture in (("train", train), ("infer", infer)):
            _check_manifest(run_dir / RUN, f"the {role} capture {capture.path}", captures[role], capture, "compared")
        _check_results(run_dir, train, infer)
        return Run(run_dir, record, train, infer)
    train, infer = load_pair(run_dir / "train", run_dir / "infer")
    for role, capture in (("train", train), ("infer", infer)):
        _check_capture(run_dir, record, role, capture)
    _check_request(run_dir, record, infer)
    _check_results(run_dir, train, infer)
    return Run(run_dir, record, train, infer)


def _check_results(run_dir: Path, train: Capture, infer: Capture) -> None:
    """The result files agree with the captures they were computed from: tokens.parquet's rows and both
    logprob columns bit for bit, and summary.json's counts, ULP and |d| (what a page shows), recomputed."""
    import json as json_

    import numpy as np
    import pandas as pd

    from alignaudit.comparison.token_diff import align_tokens, compare_tokens, summarize_tokens

    fresh = compare_tokens(align_tokens(train.logprobs, infer.logprobs))
    stored = pd.read_parquet(run_dir / TOKENS)
    same = len(stored) == len(fresh) and all(
        np.array_equal(stored[c].to_numpy(), fresh[c].to_numpy()) for c in ("seq", "pos", "token_id", "bitwise_equal")
    )
    same = same and all(
        np.array_equal(stored[c].to_numpy(np.float32).view(np.int32), fresh[c].to_numpy(np.float32).view(np.int32))
        for c in ("lp_train", "lp_infer")
    )
    if not same:
        raise InputError(
            f"{run_dir / 'tokens.parquet'} does not hold the comparison of the run's captures; run it again"
        )
    try:
        summary = json_.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{run_dir / SUMMARY} is unreadable ({type(e).__name__}); run the comparison again") from e
    if not isinstance(summary, dict):
        raise InputError(f"{run_dir / SUMMARY} is not the summary the run wrote; run the comparison again")
    expected = summarize_tokens(fresh, 0.2)
    for key in ("tokens_compared", "mismatches", "ulp_max", "max_abs_diff"):
        if summary.get(key) != expected[key]:
            raise InputError(
                f"{run_dir / 'summary.json'} says {key} {summary.get(key)!r}, its captures give "
                f"{expected[key]!r}; run it again"
            )
    _check_vocab(run_dir, summary, stored, fresh, train, infer)


VOCAB_CHECKED = (
    "positions",
    "k",
    "nonfinite_positions",
    "infinite_kl",
    "row_token_mismatches",
    "kl_train_infer",
    "kl_infer_train",
    "tv",
    "top1_agreement",
    "topk_overlap_mean",
    "topk_overlap_min",
)


def _check_vocab(run_dir: Path, summary: dict, stored, fresh, train: Capture, infer: Capture) -> None:
    """With full-vocabulary rows (compare --full-vocab): the rows pass their checks (sha256 in the manifest, dtype,
    shape; capture.vocab_rows.read_rows), and tokens.parquet's vocab columns and summary.json's "vocab" record are
    those recomputed from them. Counts and flags must be equal; the float64 measures equal to a relative 1e-9, since
    another machine's float64 reductions (vector width) may round the last bits otherwise. A summary with a vocab
    record whose captures hold no rows, or the reverse, is refused."""
    import math

    import numpy as np

    from alignaudit.comparison.vocab import COLUMNS, summarize_vocab, vocab_columns

    has_rows = train.has_vocab_rows and infer.has_vocab_rows
    if not has_rows:
        if "vocab" in summary or any(c in stored for c in COLUMNS):
            raise InputError(
                f"{run_dir / SUMMARY} holds full-vocabulary results, but its captures hold no rows to "
                "check them against; run it again"
            )
        return
    recomputed = vocab_columns(fresh, train.vocab_rows, infer.vocab_rows)

    def close(a, b) -> bool:
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, float) and isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300) or (math.isnan(a) and math.isnan(b))
        return a == b

    for column in COLUMNS:
        want = recomputed[column].to_numpy()
        have = stored[column].to_numpy() if column in stored else None
        same = (
            have is not None
            and len(have) == len(want)
            and (
                np.array_equal(have, want)
                if want.dtype == bool
                else np.allclose(have, want, rtol=1e-9, atol=1e-300, equal_nan=True)
            )
        )
        if not same:
            raise InputError(
                f"{run_dir / TOKENS}: column {column} is not the comparison of the captures' "
                "full-vocabulary rows; run it again"
            )
    expected = summarize_vocab(recomputed)
    for key in VOCAB_CHECKED:
        if not close((summary.get("vocab") or {}).get(key), expected[key]):
            raise InputError(
                f"{run_dir / SUMMARY} says vocab {key} {(summary.get('vocab') or {}).get(key)!r}, its "
                f"captures' rows give {expected[key]!r}; run it again"
            )


STEP_COLUMNS = (
    "step",
    "tokens",
    "mismatches",
    "nan_tokens",
    "positive_tokens",
    "ulp_max",
    "max_abs_diff",
    "sync_bit_equal",
    "sync_tensors_differing",
    "sync_stale_packed",
    "sync_replicas_diverged",
    "train_forward_equal",
)


@dataclass
class RLRun:
    """A finished rl run, checked: its record, steps.parquet, and whether per-token rows backed the steps."""

    path: Path
    record: dict
    steps: object  # pandas.DataFrame
    token_rows: bool


def load_rl_run(run_dir: Path) -> RLRun:
    """A finished rl run, checked against its sealed run.json: steps.parquet and every tokens/step-N.parquet
    are the files the run wrote, steps 1..N are present once and in order, and (with token rows) each step's
    counts equal those recomputed from its token rows (both engines' logprobs, compared again here).

    Raises:
        InputError: naming the first check that fails.
    """
    import pandas as pd

    from alignaudit.comparison.token_diff import compare_tokens, summarize_tokens

    run_dir = Path(run_dir)
    record = read_run_record(run_dir, commands=("rl",))
    check_outputs(run_dir, record, RESULTS["rl"])
    check_outputs(run_dir, record)
    path = run_dir / STEPS
    steps = pd.read_parquet(path)
    missing = [c for c in STEP_COLUMNS if c not in steps]
    if missing:
        raise InputError(f"{path} lacks columns {missing}; the run was made by another alignaudit")
    asked = int((record.get("rl") or {}).get("steps", 0))
    stopped = record.get("stopped")  # rl --max-seconds: a finished run of fewer steps than asked
    ran = int(stopped["after_step"]) if stopped else asked
    if not 1 <= ran <= asked or record.get("steps_run", ran) != ran:
        raise InputError(
            f"{run_dir / RUN}: steps asked {asked}, run {record.get('steps_run')}, stopped {stopped}: "
            "they disagree; the run directory was altered"
        )
    expected = list(range(1, ran + 1))
    if steps["step"].tolist() != expected:
        raise InputError(f"{path} does not hold steps 1..{len(expected)} in order; the run directory was altered")
    for role, side in (("train", "train"), ("rollout", "infer")):  # what run.json asked vs what each engine reported
        reported = (record.get("engines") or {}).get(side) or {}
        for key in ("engine", "strict"):
            if reported.get(key) != (record.get(side) or {}).get(key):
                in_record = (record.get(side) or {}).get(key)
                raise InputError(
                    f"{run_dir / RUN}: the {role} engine's {key} {in_record!r} in {RUN} differs from the "
                    f"{reported.get(key)!r} it reported; the run directory was altered"
                )
    token_rows = bool((record.get("rl") or {}).get("token_rows"))
    for row in steps.to_dict("records") if token_rows else ():
        name = f"{TOKENS_DIR}/{STEP_TOKENS.format(step=int(row['step']))}"
        check_outputs(run_dir, record, (name,))
        table = pd.read_parquet(run_dir / name)
        if set(table["step"]) != {row["step"]}:
            raise InputError(f"{run_dir / name} holds rows of another step; the run directory was altered")
        s = summarize_tokens(
            compare_tokens(table[["seq", "pos", "token_id", "generated", "lp_train", "lp_infer"]]),
            record.get("clip_eps", 0.2),
        )
        seen = {
            "tokens": s["tokens_compared"],
            "mismatches": s["mismatches"],
            "ulp_max": s["ulp_max"],
            "nan_tokens": s["nan_tokens"]["train"] + s["nan_tokens"]["infer"],
            "positive_tokens": s["positive_tokens"]["train"] + s["positive_tokens"]["infer"],
        }
        for key, value in seen.items():
            recorded = None if pd.isna(row[key]) else int(row[key])
            if recorded != value:
                raise InputError(
                    f"step {row['step']}: {key} {recorded} in steps.parquet, {value} from the step's "
                    f"token rows ({name}); the run directory was altered"
                )
        if (record.get("rl") or {}).get("full_vocab"):
            _check_step_vocab(run_dir / name, row, table)
    if record.get("eval"):
        _check_evals(run_dir, record, ran)
    return RLRun(run_dir, record, steps, token_rows)


def _check_evals(run_dir: Path, record: dict, ran: int) -> None:
    """rl's held-out evaluations: eval.parquet and each eval/step-N.parquet listed in the seal (their bytes were
    checked with every listed file), and eval.parquet's numbers those its rows give (comparison.held_out.check_table).
    Raises InputError."""
    import pandas as pd

    from alignaudit.comparison.held_out import check_table

    def rows_of(step: int):
        name = f"{EVAL_DIR}/{EVAL_ROWS.format(step=step)}"
        check_outputs(run_dir, record, (name,))
        return pd.read_parquet(run_dir / name)

    check_outputs(run_dir, record, (EVAL,))
    check_table(pd.read_parquet(run_dir / EVAL), rows_of, record, ran, run_dir / EVAL)


def _check_step_vocab(path: Path, row: dict, table) -> None:
    """rl --full-vocab: the step's vocab columns of steps.parquet are those its token rows' per-token vocab columns
    give (comparison.vocab.summarize_vocab, step_columns): counts equal, measures equal to a relative 1e-9 (another
    machine's float64 sums may round the last bits otherwise), NaN where NaN. Raises InputError naming the column."""
    import math

    from alignaudit.comparison.vocab import COLUMNS, step_columns, summarize_vocab

    if any(c not in table for c in COLUMNS):
        raise InputError(
            f"{path} lacks the per-token vocab columns of an rl --full-vocab run; the run directory was altered"
        )
    for key, value in step_columns(summarize_vocab(table)).items():
        recorded = float(row.get(key, float("nan")))
        same = (math.isnan(recorded) and math.isnan(value)) or math.isclose(recorded, value, rel_tol=1e-9, abs_tol=0.0)
        if not same:
            raise InputError(
                f"step {row['step']}: {key} {recorded} in steps.parquet, {value} from the step's token "
                f"rows ({path.name}); the run directory was altered"
            )


def _check_manifest(record_path: Path, where: str, expected, capture: Capture, made: str = "wrote") -> None:
    if not isinstance(expected, dict) or manifest_sha256(capture.path) != expected.get("manifest_sha256"):
        raise InputError(
            f"{where} is not the capture this run {made} (its manifest's sha256 differs from "
            f"{record_path}); run it again"
        )


def _check_request(run_dir: Path, record: dict, infer: Capture) -> None:
    """What run.json says was compared against what the captures recorded: the model's name, the mode and,
    in rollout mode, how the inference engine sampled."""
    m = infer.manifest
    if (m.get("model") or {}).get("name") != (record.get("model") or {}).get("name"):
        raise InputError(
            f"{run_dir / RUN} names the model {(record.get('model') or {}).get('name')!r}, its captures "
            f"{(m.get('model') or {}).get('name')!r}; the run directory was altered"
        )
    if m.get("mode") != record.get("mode"):
        raise InputError(
            f"{run_dir / RUN} says mode {record.get('mode')!r}, the inference capture was made in "
            f"{m.get('mode')!r} mode; the run directory was altered"
        )
    asked, done = record.get("rollout"), m.get("rollout")
    if (asked is None) != (done is None) or (
        asked and done is not None and any(done.get(k) != v for k, v in asked.items())
    ):
        raise InputError(
            f"{run_dir / RUN}'s rollout settings {asked} differ from what the inference capture "
            "sampled with; the run directory was altered"
        )


def _check_capture(run_dir: Path, record: dict, role: str, capture: Capture) -> None:
    where = f"{run_dir}/{role}"
    _check_manifest(run_dir / RUN, where, record["captures"][role], capture)
    m = capture.manifest
    if m.get("role") != role:
        raise InputError(f"{where} holds a capture made as the {m.get('role')} side; the run directory was altered")
    side = record.get(role) or {}
    if m.get("engine") != side.get("engine"):
        raise InputError(
            f"{where} was made by {m.get('engine')}, but {RUN} says {side.get('engine')}; the run directory was altered"
        )
    settings = m.get("settings") or {}
    for key in SETTINGS_CHECKED:
        if settings.get(key) != side.get(key):
            raise InputError(
                f"{where}: {key} {settings.get(key)!r} differs from {RUN}'s {side.get(key)!r}; "
                "the run directory was altered"
            )
    if (m.get("model") or {}).get("path") != (record.get("model") or {}).get("path"):
        raise InputError(f"{where} is of another checkpoint than {RUN} names; the run directory was altered")
