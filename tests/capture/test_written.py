"""--force removes exactly the files alignaudit's own record says it wrote (capture/written.py): the marker records
every file a command wrote when it ends; a file added or changed since is refused, naming it, and stays; a command
killed before its record falls back to the layout rule; the record travels with results set aside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alignaudit.capture import outdir, written
from alignaudit.capture.rundir import ABLATE_OUTPUTS, CAPTURE_OUTPUTS, COMPARE_OUTPUTS, MARKER, PREVIOUS
from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, InputError


def _complete_compare(out: Path, force: bool = False) -> Path:
    """A compare-shaped run written through outdir as a command writes one: claimed, written, sealed, released."""
    out = outdir.prepare(out, force, COMPARE_OUTPUTS)
    (out / "train" / "ops").mkdir(parents=True)
    (out / "train" / "manifest.json").write_text("{}")
    (out / "train" / "ops" / "index.parquet").write_text("x")
    (out / "run.json").write_text(json.dumps({"status": "complete"}))
    outdir.release_all()
    return out


def test_the_record_lists_every_file_the_command_wrote_and_nothing_else(tmp_path):
    out = _complete_compare(tmp_path / "c")
    marker = written.read(out)
    assert marker.recorded == set(COMPARE_OUTPUTS)  # every name claimed, written or not
    on_disk = {
        p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name not in (MARKER, outdir.LOCK)
    }
    assert set(marker.files) == on_disk == {"run.json", "train/manifest.json", "train/ops/index.parquet"}
    size, mtime = marker.files["train/ops/index.parquet"]
    assert (size, mtime) == (1, os.stat(out / "train/ops/index.parquet").st_mtime_ns)


@pytest.mark.engines
def test_a_real_capture_records_exactly_the_files_it_wrote(tmp_path):
    out = tmp_path / "cap"
    assert cli.main(["capture", "--engine", "hf", "--no-ops", "--out", str(out)]) == EXIT_OK
    marker = written.read(out)
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name not in (MARKER,)}
    on_disk.discard(outdir.LOCK)
    assert set(marker.files) == on_disk and "manifest.json" in on_disk and "logprobs.parquet" in on_disk
    assert marker.recorded == set(CAPTURE_OUTPUTS)  # every name claimed is recorded, written or not


def test_a_file_of_alignaudits_name_and_place_added_after_the_run_is_refused(tmp_path):
    """The layout rule alone would take train/ops/chunk-00099.safetensors for alignaudit's: the record does not."""
    out = _complete_compare(tmp_path / "c")
    late = out / "train" / "ops" / "chunk-00099.safetensors"
    late.write_text("mine")
    with pytest.raises(InputError, match=r"chunk-00099.safetensors, which alignaudit did not write; move it first"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert late.read_text() == "mine" and (out / "train" / "manifest.json").exists()


@pytest.mark.parametrize("path", ["train/manifest.json", "run.json"])
def test_a_file_changed_after_alignaudit_wrote_it_is_refused(tmp_path, path):
    out = _complete_compare(tmp_path / "c")
    (out / path).write_text('{"status": "complete", "mine": 1}')
    with pytest.raises(InputError, match=rf"{path}, which changed after alignaudit wrote it; move it first"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert "mine" in (out / path).read_text()


def test_a_command_killed_before_its_record_falls_back_to_the_layout_rule(tmp_path):
    """A process killed after writing (no release, so no record): --force removes the files alignaudit writes at
    their places and refuses any other."""
    out = tmp_path / "k"
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from alignaudit.capture import outdir\n"
        "from alignaudit.capture.rundir import COMPARE_OUTPUTS\n"
        "out = outdir.prepare(Path(sys.argv[1]), False, COMPARE_OUTPUTS)\n"
        "(out / 'train' / 'ops').mkdir(parents=True)\n"
        "(out / 'train' / 'ops' / 'index.parquet').write_text('x')\n"
        "os.kill(os.getpid(), 9)\n"
    )
    assert subprocess.run([sys.executable, "-c", script, str(out)]).returncode == -9
    marker = written.read(out)
    assert "train" in marker.entries and not marker.recorded and not marker.files
    (out / "train" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"train/notes.txt, which alignaudit did not write"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    (out / "train" / "notes.txt").unlink()
    outdir.prepare(out, True, COMPARE_OUTPUTS)  # incomplete outputs of alignaudit's names: deleted
    outdir.release_all()
    assert not (out / "train").exists()


def test_results_set_aside_keep_their_record(tmp_path):
    """--force moves the complete results into PREVIOUS with their record; a file changed there in the meantime keeps
    PREVIOUS when the new run completes, and says why."""
    out = _complete_compare(tmp_path / "c")
    outdir.prepare(out, True, COMPARE_OUTPUTS)
    previous = written.read(out / PREVIOUS)
    assert previous.recorded == {"train", "run.json"} and "train/ops/index.parquet" in previous.files
    (out / PREVIOUS / "train" / "manifest.json").write_text('{"mine": 1}')
    (out / "run.json").write_text(json.dumps({"status": "complete"}))
    kept = outdir.release(out)
    assert kept is not None and "manifest.json, which changed after alignaudit wrote it" in kept.reason
    assert (out / PREVIOUS / "train" / "manifest.json").read_text() == '{"mine": 1}'


def test_a_run_inside_an_entry_is_judged_by_its_own_marker(tmp_path):
    """ablate's configs/<row>/ is a comparison; a gate of it writes verdict.json there later, under the row's own
    marker: --force of the ablate directory removes it, and still refuses a user's file beside it."""
    out = outdir.prepare(tmp_path / "a", False, ABLATE_OUTPUTS)
    row = out / "configs" / "all-strict"
    row.mkdir(parents=True)
    outdir.lock(row)  # ablate runs each row as a comparison of its own, claimed in the row
    outdir.claim(row, ("run.json",))
    (row / "run.json").write_text("{}")
    (out / "run.json").write_text(json.dumps({"status": "complete"}))
    outdir.release_all()
    assert "configs/all-strict/.alignaudit-outputs" in written.read(out).files
    outdir.lock(row)
    outdir.claim(row, ("verdict.json",))
    (row / "verdict.json").write_text("{}")
    outdir.release_all()
    assert written.read(row).files.keys() == {"run.json", "verdict.json"}
    (row / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"all-strict/notes.txt, which alignaudit did not write"):
        outdir.prepare(out, True, ABLATE_OUTPUTS)
    outdir.release_all()
    (row / "notes.txt").unlink()
    outdir.prepare(out, True, ABLATE_OUTPUTS)
    outdir.release_all()
    assert not (out / "configs").exists() and (out / PREVIOUS / "configs" / "all-strict" / "verdict.json").exists()


@pytest.mark.parametrize(
    "record",
    [
        [],
        {"entries": "run.json"},
        {"entries": ["..", "/etc", "a/b", PREVIOUS, "run.json"], "recorded": ["..", "run.json"]},
        {"entries": ["run.json"], "recorded": ["run.json"], "files": {"run.json": [True, -1], "../x": [1, 2]}},
        {"entries": ["run.json"], "recorded": ["run.json"], "files": ["run.json"]},
    ],
)
def test_a_marker_read_takes_only_what_it_can_trust(tmp_path, record):
    """A hand-edited or foreign marker never names anything outside its directory and never records a file whose
    size or time is not a pair of non-negative integers: such a record counts as no record."""
    (tmp_path / MARKER).write_text(json.dumps(record))
    marker = written.read(tmp_path)
    assert marker.entries <= {"run.json"} and marker.recorded <= marker.entries
    assert not marker.files


def test_a_file_put_into_an_output_while_the_run_writes_is_never_recorded(tmp_path):
    """Only what the command wrote is recorded: a user's notes added to train/ during the run (a name alignaudit never
    writes), and a file of alignaudit's name moved in with an older time, stay unrecorded and are refused later."""
    out = outdir.prepare(tmp_path / "c", False, COMPARE_OUTPUTS)
    (out / "train" / "ops").mkdir(parents=True)
    (out / "train" / "manifest.json").write_text("{}")
    (out / "train" / "notes.txt").write_text("mine")
    (out / "train" / "ops" / "index.parquet").write_text("older")
    os.utime(out / "train" / "ops" / "index.parquet", ns=(10**18, 10**18))  # 2001: moved in, not written now
    outdir.release_all()
    assert set(written.read(out).files) == {"train/manifest.json"}
    with pytest.raises(InputError, match=r"(notes.txt|index.parquet), which alignaudit did not write"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert (out / "train" / "notes.txt").read_text() == "mine"


def test_a_run_copied_into_an_output_is_not_vouched_for_by_its_own_marker(tmp_path):
    """A complete capture copied (times kept) into ops/ of another run brings its own marker along; the outer record
    does not list that marker, so the copy is the user's and --force refuses it."""
    import shutil

    other = _complete_compare(tmp_path / "other")
    out = _complete_compare(tmp_path / "c")
    shutil.copytree(other, out / "train" / "ops" / "backup", copy_function=shutil.copy2)
    with pytest.raises(InputError, match=r"backup/.*which alignaudit did not write"):
        outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert (out / "train" / "ops" / "backup" / "run.json").exists()


def test_a_changed_file_under_a_nested_marker_is_named_as_changed(tmp_path):
    out = outdir.prepare(tmp_path / "a", False, ABLATE_OUTPUTS)
    row = out / "configs" / "all-strict"
    row.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"status": "complete"}))
    outdir.claim(row, ("run.json",))
    (row / "run.json").write_text("{}")
    outdir.release_all()
    (row / "run.json").write_text('{"mine": 1}')
    with pytest.raises(InputError, match=r"all-strict/run.json, which changed after alignaudit wrote it"):
        outdir.prepare(out, True, ABLATE_OUTPUTS)
    outdir.release_all()


def test_an_interrupted_drop_or_staging_is_finished_by_the_next_run(tmp_path, monkeypatch):
    """The drop deletes the marker last, so a drop cut short (here: the file system refuses one file) leaves a folder
    that still shows alignaudit made it, and the next run deletes it; a STAGING holding only the marker's temporary
    file (a run killed while writing it) is removed too. Before, both made every later run refuse the directory."""
    out = _complete_compare(tmp_path / "c")
    outdir.prepare(out, True, COMPARE_OUTPUTS)
    (out / "run.json").write_text(json.dumps({"status": "complete"}))
    real = outdir._delete

    def refuse_the_index(path):
        if path.name == "train" and outdir.DROPPING in str(path):
            raise PermissionError(1, "Operation not permitted", str(path))
        real(path)

    monkeypatch.setattr(outdir, "_delete", refuse_the_index)
    assert outdir.release(out) is None  # PREVIOUS was renamed to DROPPING: the results beside it are complete
    assert (out / outdir.DROPPING / MARKER).is_file() and (out / outdir.DROPPING / "train").is_dir()
    monkeypatch.setattr(outdir, "_delete", real)
    (out / outdir.STAGING).mkdir()
    (out / outdir.STAGING / (MARKER + ".tmp")).write_text("{")
    outdir.prepare(out, True, COMPARE_OUTPUTS)
    outdir.release_all()
    assert not (out / outdir.DROPPING).exists() and not (out / outdir.STAGING).exists()


def test_gate_and_report_never_write_over_a_file_of_the_users_in_the_run(tmp_path):
    """check_replaceable: a file in the run under a name gate or report writes is replaced only where the record says
    alignaudit wrote it, unchanged; a user's file, a changed one and a link are refused, naming them."""
    out = _complete_compare(tmp_path / "c")
    fix = "or write elsewhere"
    (out / "summary.md").write_text("my notes")
    with pytest.raises(InputError, match=r"summary.md exists, which alignaudit did not write; move it, or write"):
        outdir.check_replaceable(out, ("summary.md",), fix)
    (out / "summary.md").unlink()
    (out / "elsewhere.txt").write_text("precious")
    (out / "verdict.json").symlink_to(out / "elsewhere.txt")
    outdir.lock(out)
    with pytest.raises(InputError, match=r"verdict.json exists, which alignaudit did not write"):
        outdir.check_replaceable(out, ("verdict.json",), fix)
    (out / "verdict.json").unlink()
    outdir.claim(out, ("verdict.json",))
    (out / "verdict.json").write_text("{}")
    outdir.release_all()
    outdir.check_replaceable(out, ("verdict.json", "junit.xml"), fix)  # its own, unchanged; one not there
    (out / "verdict.json").write_text('{"mine": 1}')
    with pytest.raises(InputError, match=r"verdict.json exists, which changed after alignaudit wrote it"):
        outdir.check_replaceable(out, ("verdict.json",), fix)
    assert (out / "elsewhere.txt").read_text() == "precious"


def test_links_planted_under_alignaudits_own_names_are_never_written_through(tmp_path):
    out = _complete_compare(tmp_path / "c")
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (out / (MARKER + ".tmp")).symlink_to(precious)
    outdir.lock(out)
    outdir.claim(out, ("verdict.json",))
    outdir.release_all()
    assert precious.read_text() == "mine" and not (out / (MARKER + ".tmp")).exists()
    (out / outdir.LOCK).unlink()
    (out / outdir.LOCK).symlink_to(precious)
    with pytest.raises(InputError, match="cannot write to"):
        outdir.lock(out)
    assert precious.read_text() == "mine"


def test_a_marker_nested_too_deep_to_parse_counts_as_none(tmp_path):
    (tmp_path / MARKER).write_text("[" * 200_000)
    assert written.read(tmp_path) == written.Marker()
