"""--force at the level of the library (alignaudit.capture.outdir, no command run): complete results are set aside as
.alignaudit-previous/ and dropped only once the new outputs are complete; a name or place alignaudit keeps for
itself, a file of the user's or a folder in use is never removed; a rename the file system refuses or Ctrl-C cuts
leaves the results whole; ablate's and rl's folders are claimed as they write them. The --force runs of commands
on real captures are in test_outputs.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from alignaudit.capture import outdir
from alignaudit.capture.rundir import PREVIOUS
from alignaudit.errors import InputError


def _complete_capture(out: Path, text: str) -> None:
    (out / "manifest.json").write_text(json.dumps({"status": "complete", "text": text}))


def test_what_force_sets_aside_is_settled_from_the_directory_not_from_how_the_command_ended(tmp_path):
    """The library form (the Python API): release() drops PREVIOUS where the outputs beside it are complete (however
    the command ended: a closed pipe or Ctrl-C after the results were written), keeps it where they are not; a
    --force over incomplete outputs deletes them and keeps PREVIOUS; over complete ones it makes them PREVIOUS."""
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "first")
    assert outdir.release(out) is None
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    assert not (out / "manifest.json").exists()
    (out / "logprobs.parquet").write_text("partial")  # a run that failed before its manifest
    assert outdir.release(out) == outdir.Kept(out / PREVIOUS, "the outputs beside it are incomplete", False)
    outdir.prepare(out, True, CAPTURE_OUTPUTS)  # the failed outputs go, the complete ones stay aside
    assert not (out / "logprobs.parquet").exists() and "first" in (out / PREVIOUS / "manifest.json").read_text()
    _complete_capture(out, "second")
    assert outdir.release(out) is None and not (out / PREVIOUS).exists()
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    _complete_capture(out, "third")
    outdir.release(out)
    outdir.prepare(out, True, CAPTURE_OUTPUTS)  # complete outputs replace an older PREVIOUS
    assert "third" in (out / PREVIOUS / "manifest.json").read_text()
    assert outdir.release(out).path == out / PREVIOUS


def _user_folder(path: Path) -> None:
    path.mkdir()
    (path / "thesis.tex").write_text("mine")


@pytest.mark.parametrize("name", [PREVIOUS, ".alignaudit-previous.staging", ".alignaudit-previous.dropping"])
@pytest.mark.parametrize("make", [lambda p: p.write_text("x"), _user_folder, lambda p: p.symlink_to(p.parent)])
def test_a_folder_of_alignaudits_names_it_did_not_make_is_refused(tmp_path, name, make):
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "mine")
    outdir.release(out)
    make(out / name)
    with pytest.raises(InputError, match=f"{name} was not made by alignaudit; move it first"):
        outdir.prepare(out, True, CAPTURE_OUTPUTS)
    assert "mine" in (out / "manifest.json").read_text() and not outdir._held
    assert (out / name).is_symlink() or (out / name).is_file() or (out / name / "thesis.tex").is_file()


def test_completeness_is_read_from_alignaudits_own_record(tmp_path):
    """A run.json of the user's beside a capture is not the capture's record: the complete capture is set aside
    whole (before, it was judged incomplete and deleted); alignaudit's own names are never an output's name."""
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "mine")
    outdir.release(out)
    (out / "run.json").write_text('{"my": "notes"}')
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    assert "mine" in (out / PREVIOUS / "manifest.json").read_text() and (out / "run.json").read_text()
    for name in (PREVIOUS, outdir.MARKER, outdir.LOCK):
        with pytest.raises(InputError, match=f"{name} is a name alignaudit keeps for itself"):
            outdir.claim(out, (name,))
    assert outdir.release(out).reason == "the outputs beside it are incomplete"


def test_a_rename_the_file_system_refuses_is_an_input_error(tmp_path, monkeypatch):
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "mine")
    outdir.release(out)

    def refused(src, dst):
        raise PermissionError(1, "Operation not permitted", str(src))

    monkeypatch.setattr(outdir.os, "rename", refused)
    with pytest.raises(InputError, match="cannot write to .*: Operation not permitted"):
        outdir.prepare(out, True, CAPTURE_OUTPUTS)
    monkeypatch.undo()
    assert not outdir._held
    outdir.prepare(out, True, CAPTURE_OUTPUTS)  # the next run undoes the staging
    assert "mine" in (out / PREVIOUS / "manifest.json").read_text()
    outdir.release(out)


def test_a_move_aside_refused_halfway_leaves_the_results_whole_where_they_were(tmp_path, monkeypatch):
    """The file system refuses the second of the moves into STAGING: the first is undone, STAGING goes, and every
    earlier output is back at its place (before, they were split between the run directory and STAGING, unsaid)."""
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS, STAGING

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "mine")
    (out / "logprobs.parquet").write_text("rows")
    outdir.release(out)
    rename, calls = outdir.os.rename, []

    def second_refused(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise PermissionError(1, "Operation not permitted", str(src))
        return rename(src, dst)

    monkeypatch.setattr(outdir.os, "rename", second_refused)
    with pytest.raises(InputError, match="cannot write to .*: Operation not permitted"):
        outdir.prepare(out, True, CAPTURE_OUTPUTS)
    monkeypatch.undo()
    assert not (out / STAGING).exists() and "mine" in (out / "manifest.json").read_text()
    assert (out / "logprobs.parquet").read_text() == "rows"


def test_a_file_put_into_previous_is_never_removed(tmp_path):
    """A file of the user's inside PREVIOUS: the completed run keeps the folder (not an error: its results are
    written), and a --force that would replace it is refused naming the file, before anything moves."""
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "first")
    outdir.release(out)
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    (out / PREVIOUS / "notes.txt").write_text("mine")
    _complete_capture(out, "second")
    assert outdir.release(out).reason == f"it holds {out / PREVIOUS / 'notes.txt'}, which alignaudit did not write"
    with pytest.raises(InputError, match="notes.txt, which alignaudit did not write"):
        outdir.prepare(out, True, CAPTURE_OUTPUTS)
    assert "second" in (out / "manifest.json").read_text() and (out / PREVIOUS / "notes.txt").is_file()


def test_a_previous_folder_in_use_by_another_run_is_left_alone(tmp_path):
    """A gate or report of PREVIOUS holds its lock: the run that completes keeps the folder, saying why, and a
    --force that would replace it is refused before anything moves."""
    import fcntl

    from alignaudit.capture.rundir import CAPTURE_OUTPUTS

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "first")
    outdir.release(out)
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    fd = os.open(out / PREVIOUS / outdir.LOCK, os.O_RDWR | os.O_CREAT)  # another open file: another holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _complete_capture(out, "second")
        assert outdir.release(out) == outdir.Kept(
            out / PREVIOUS, "another alignaudit run holds it (another process)", True
        )
        with pytest.raises(InputError, match="is in use by another alignaudit run"):
            outdir.prepare(out, True, CAPTURE_OUTPUTS)
    finally:
        os.close(fd)
    assert "second" in (out / "manifest.json").read_text() and "first" in (out / PREVIOUS / "manifest.json").read_text()


def test_an_interrupted_move_aside_is_undone_by_the_next_run(tmp_path, monkeypatch):
    """Ctrl-C between two of --force's renames: the lock is released, and the next run moves what was staged back
    before deciding, so the complete results end up whole in PREVIOUS."""
    from alignaudit.capture.rundir import CAPTURE_OUTPUTS, STAGING

    out = outdir.prepare(tmp_path / "c", False, CAPTURE_OUTPUTS)
    _complete_capture(out, "first")
    (out / "logprobs.parquet").write_text("rows")
    outdir.release(out)
    renames = []

    def interrupted(src, dst):
        renames.append(src)
        if len(renames) == 2:
            raise KeyboardInterrupt
        os.rename(src, dst)

    monkeypatch.setattr(outdir.os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        outdir.prepare(out, True, CAPTURE_OUTPUTS)
    monkeypatch.undo()
    assert (out / STAGING).is_dir() and not outdir._held and not outdir._replacing
    outdir.prepare(out, True, CAPTURE_OUTPUTS)
    assert not (out / STAGING).exists()
    assert sorted(p.name for p in (out / PREVIOUS).iterdir()) == [outdir.MARKER, "logprobs.parquet", "manifest.json"]
    outdir.release(out)


def test_force_reuses_an_ablate_directory_and_still_guards_foreign_files(tmp_path):
    """ablate's configs/<row>/ hold whole comparisons (run.json, summary.json, ops-natural.parquet, ...):
    --force removes them, and still refuses a file alignaudit never writes."""
    from alignaudit.capture.rundir import ABLATE_OUTPUTS

    out = outdir.prepare(tmp_path / "a", False, ABLATE_OUTPUTS)
    row = out / "configs" / "all-strict"
    (row / "train").mkdir(parents=True)
    for name in (
        "run.json",
        "summary.json",
        "tokens.parquet",
        "sequences.parquet",
        "bisect.json",
        "ops-natural.parquet",
        "train/manifest.json",
        "report.html",
        outdir.MARKER,
        outdir.LOCK,
    ):
        (row / name).write_text("{}")
    outdir.release_all()
    outdir.prepare(out, True, ABLATE_OUTPUTS)
    assert not (out / "configs").exists()
    outdir.release_all()
    (row / "notes.txt").parent.mkdir(parents=True)
    (row / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="notes.txt, which alignaudit did not write"):
        outdir.prepare(out, True, ABLATE_OUTPUTS)


def test_force_reuses_an_rl_directory_with_the_libraries_exports(tmp_path):
    """rl --log-to: TensorBoard's event files and W&B's offline run are written whole by those libraries into
    tensorboard/ and wandb/: --force removes them (a foreign file elsewhere is still refused)."""
    from alignaudit.capture.rundir import RL_OUTPUTS

    out = outdir.prepare(tmp_path / "rl", False, RL_OUTPUTS)
    for name in (
        "tensorboard/events.out.tfevents.1.host",
        "wandb/debug-internal.log",
        "wandb/offline-run-1/run-1.wandb",
    ):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    outdir.release_all()
    outdir.prepare(out, True, RL_OUTPUTS)
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()
    outdir.release_all()
    (out / "tokens" / "notes.txt").parent.mkdir(parents=True)
    (out / "tokens" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="notes.txt, which alignaudit did not write"):
        outdir.prepare(out, True, RL_OUTPUTS)


def test_an_rl_run_claims_the_sinks_folders_only_when_it_logs_to_them(tmp_path):
    """rl without --log-to never claims tensorboard/ or wandb/: a user's folder of that name made later survives the
    next --force run (a claimed sink folder is removed whole; with RL_OUTPUTS claimed whatever --log-to said, it was),
    and a run that would log there is refused by name."""
    from alignaudit.capture.rundir import TENSORBOARD_DIR, WANDB_DIR, rl_outputs

    assert TENSORBOARD_DIR not in rl_outputs(()) and WANDB_DIR not in rl_outputs(())
    assert WANDB_DIR in rl_outputs(("wandb",)) and TENSORBOARD_DIR not in rl_outputs(("wandb",))
    out = outdir.prepare(tmp_path / "rl", False, rl_outputs(()))
    outdir.release_all()
    (out / "wandb").mkdir()
    (out / "wandb" / "my-run.wandb").write_text("mine")
    outdir.prepare(out, True, rl_outputs(()))  # a run that does not log there leaves it alone
    outdir.release_all()
    assert (out / "wandb" / "my-run.wandb").read_text() == "mine"
    with pytest.raises(InputError, match="wandb exists and was not written by alignaudit"):
        outdir.prepare(out, True, rl_outputs(("wandb",)))  # one that would write there is refused, naming it
    outdir.release_all()
    assert (out / "wandb" / "my-run.wandb").read_text() == "mine"


def test_force_judges_files_by_their_place_not_only_their_name(tmp_path):
    """--force removes a file inside a folder alignaudit owns only where alignaudit writes a file of that name
    (rundir.alignaudit_wrote): a user's manifest.json in a folder of their own inside train/ is refused, naming it,
    and stays; alignaudit's own files at their places are replaced."""
    from alignaudit.capture.rundir import COMPARE_OUTPUTS, alignaudit_wrote

    for parts in (
        ("train", "manifest.json"),
        ("train", "ops", "chunk-00000.safetensors"),
        ("configs", "linear-alone", "run.json"),
        ("configs", "linear-alone", "infer", "ops", "index.parquet"),
        ("vocab", "step-00003-train.safetensors"),
        ("sync", "weights.safetensors"),
    ):
        assert alignaudit_wrote(parts), parts
    for parts in (
        ("train", "mine", "manifest.json"),
        ("train", "run.json"),
        ("tokens", "manifest.json"),
        ("configs", "run.json"),
        ("train", "ops", "manifest.json"),
    ):
        assert not alignaudit_wrote(parts), parts
    out = outdir.prepare(tmp_path / "c", False, COMPARE_OUTPUTS)
    (out / "train" / "ops").mkdir(parents=True)
    (out / "train" / "manifest.json").write_text("{}")
    (out / "train" / "ops" / "index.parquet").write_text("x")
    outdir.release_all()
    outdir.prepare(out, True, COMPARE_OUTPUTS)  # alignaudit's own files: replaced
    outdir.release_all()
    assert not (out / "train").exists()
    (out / "train" / "mine").mkdir(parents=True)
    (out / "train" / "mine" / "manifest.json").write_text("mine")
    outdir.claim(out, ("train",))
    with pytest.raises(InputError, match=r"--force would remove .*train/mine/manifest.json, which alignaudit did not"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert (out / "train" / "mine" / "manifest.json").read_text() == "mine"
