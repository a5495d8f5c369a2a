"""Output directories you can trust: --force removes only what alignaudit wrote, runs lock their directory,
default names never collide, bad --out values are refused before anything runs, and long runs stay
readable (batched engines, a bounded terminal table, full data in the files). What --force sets aside and keeps,
at the level of the library (outdir, no command run), is in test_outputs_force.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from alignaudit.capture import outdir
from alignaudit.capture.rundir import PREVIOUS
from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE, InputError
from helpers import FIXTURE, one_line_error, run_cli, run_in_process

pytestmark = [pytest.mark.engines, pytest.mark.long]


@pytest.fixture(scope="module")
def two_captures(tmp_path_factory):
    """Two logprob-only captures of the fixture (hf, bf16), to diff without starting engines again (these tests are
    about output directories, not about bits)."""
    root = tmp_path_factory.mktemp("caps")
    for name, seed in (("a", "0"), ("b", "1")):  # two requests (the suite memoizes one request's capture)
        assert cli.main(["capture", "--engine", "hf", "--no-ops", "--seed", seed, "--out", str(root / name)]) == EXIT_OK
    return root / "a", root / "b"


def test_force_never_removes_files_alignaudit_did_not_write(two_captures, tmp_path, capsys):
    a, b = two_captures
    d = tmp_path / "d"
    (d / "train").mkdir(parents=True)
    (d / "train" / "data.txt").write_text("data")
    assert cli.main(["diff", str(a), str(b), "--out", str(d), "--force"]) == EXIT_OK
    assert (d / "train" / "data.txt").read_text() == "data" and (d / "summary.json").is_file()
    assert json.loads((d / outdir.MARKER).read_text())["entries"] == sorted(
        ["ops.parquet", "run.json", "sequences.parquet", "summary.json", "tokens.parquet"]
    )
    # compare would write train/: refused, and nothing is lost
    err = one_line_error(capsys, ["compare", "--train", "hf", "--infer", "hf", "--out", str(d), "--force"], EXIT_USAGE)
    assert "train exists and was not written by alignaudit" in err
    assert (d / "train" / "data.txt").read_text() == "data" and (d / "summary.json").is_file()
    # a foreign file inside a directory alignaudit did write is not removed either
    cap = tmp_path / "cap"
    assert cli.main(["capture", "--engine", "hf", "--no-ops", "--out", str(cap)]) == EXIT_OK
    (cap / "ops").mkdir()
    (cap / "ops" / "notes.txt").write_text("mine")
    err = one_line_error(capsys, ["capture", "--engine", "hf", "--no-ops", "--out", str(cap), "--force"], EXIT_USAGE)
    assert "would remove" in err and "notes.txt" in err
    assert (cap / "ops" / "notes.txt").read_text() == "mine" and (cap / "manifest.json").is_file()


def test_force_replaces_stale_outputs_of_alignaudit_and_keeps_other_files(two_captures, tmp_path):
    a, b = two_captures
    out = tmp_path / "run"
    assert cli.main(["diff", str(a), str(b), "--out", str(out)]) == EXIT_OK
    outdir.claim(out, ("bisect.json",))  # as an earlier bisect into the same directory would
    (out / "bisect.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert cli.main(["diff", str(a), str(b), "--out", str(out), "--force"]) == EXIT_OK
    assert not (out / "bisect.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert (out / "summary.json").is_file()


def test_a_force_run_that_fails_keeps_the_results_it_replaced(two_captures, tmp_path, capsys):
    """--force moves complete results aside and drops them only once the new outputs are complete: a run that fails
    after claiming the directory leaves its own (failed) outputs, which gate refuses, and the earlier results byte
    for byte in .alignaudit-previous/; a second failure deletes the first one's outputs and keeps those results; the
    next completed run drops them."""
    a, b = two_captures
    d = tmp_path / "d"
    assert cli.main(["diff", str(a), str(b), "--out", str(d)]) == EXIT_OK
    before = {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != outdir.LOCK}
    failing = [
        "compare",
        "--train",
        "hf",
        "--infer",
        "hf",
        "--train-opt",
        "attn_implementation=flash_attention_2",
        "--out",
        str(d),
        "--force",
    ]
    capsys.readouterr()
    for _ in range(2):
        err = one_line_error(capsys, failing, EXIT_USAGE)
        assert "cannot load" in err
        assert err.endswith(f"{d / PREVIOUS} keeps the last complete results: the outputs beside it are incomplete")
        assert json.loads((d / "run.json").read_text())["status"] == "failed"
        assert (d / "train" / "worker.log").is_file() and not (d / "summary.json").exists()
        kept = {p.relative_to(d / PREVIOUS): p.read_bytes() for p in (d / PREVIOUS).rglob("*") if p.is_file()}
        assert kept.pop(Path(outdir.MARKER)) and kept == {k: v for k, v in before.items() if k.name != outdir.MARKER}
    assert "did not finish (status 'failed')" in one_line_error(capsys, ["gate", str(d)], EXIT_USAGE)
    assert cli.main(["gate", str(d / PREVIOUS)]) == EXIT_OK  # the kept results are a run of their own
    assert cli.main(["diff", str(a), str(b), "--out", str(d), "--force"]) == EXIT_OK
    assert not (d / PREVIOUS).exists() and not (d / "train").exists()
    assert "keeps the last complete results" not in capsys.readouterr().err
    assert (d / "summary.json").read_bytes() == before[Path("summary.json")]


def test_gate_of_a_run_still_going_says_so(tmp_path, capsys):
    """A run.json still "running" whose directory another process has locked is a run in progress: wait for it, not
    "run it again"; unlocked, it is a run that died."""
    import fcntl

    d = tmp_path / "run"
    d.mkdir()
    (d / "run.json").write_text(json.dumps({"command": "compare", "status": "running"}))
    assert "did not finish (status 'running'); run it again" in one_line_error(capsys, ["gate", str(d)], EXIT_USAGE)
    fd = os.open(d / outdir.LOCK, os.O_RDWR | os.O_CREAT)  # another open file: flock sees another holder
    try:
        os.write(fd, json.dumps({"pid": 4242, "command": "compare", "started": "2026-12-06T16:00:00"}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        err = one_line_error(capsys, ["gate", str(d)], EXIT_USAGE)
    finally:
        os.close(fd)
    assert "the run is still going (pid 4242, `alignaudit compare`, started 2026-12-06T16:00:00); wait for it" in err


def test_empty_out_and_out_that_is_an_input_are_refused(two_captures, tmp_path, capsys):
    a, b = two_captures
    before = sorted(p.name for p in a.iterdir())
    for out in (str(a), str(a / "sub"), str(a.parent)):
        err = one_line_error(capsys, ["diff", str(a), str(b), "--out", out, "--force"], EXIT_USAGE)
        assert "overlaps the input" in err
    assert sorted(p.name for p in a.iterdir()) == before
    assert "--out is empty" in one_line_error(capsys, ["diff", str(a), str(b), "--out", ""], EXIT_USAGE)
    assert "--out is empty" in one_line_error(capsys, ["compare", "--out", " "], EXIT_USAGE)
    err = one_line_error(capsys, ["diff", str(a), str(b), "--out", "--force"], EXIT_USAGE)
    assert "--out --force looks like an option, not a directory; for a directory of that name give ./--force" in err
    assert not Path("--force").exists()


def test_a_second_run_on_a_locked_directory_says_who_holds_it(two_captures, tmp_path):
    a, b = two_captures
    d = tmp_path / "locked"
    d.mkdir()
    outdir.command_name = "compare"
    outdir.lock(d)
    try:
        proc = run_cli("diff", str(a), str(b), "--out", str(d), "--force")
    finally:
        outdir.release_all()
    assert proc.returncode == EXIT_USAGE
    assert f"is in use by another alignaudit run (pid {os.getpid()}, `alignaudit compare`" in proc.stderr
    assert not (d / "summary.json").exists()
    assert run_cli("diff", str(a), str(b), "--out", str(d), "--force").returncode == EXIT_OK  # released


def test_default_names_are_unique_within_one_second(tmp_path):
    names = {outdir.default_out("compare", tmp_path) for _ in range(3)}
    assert len(names) == 3 and all(p.is_dir() and not any(p.iterdir()) for p in names)


def test_read_only_out_is_an_input_error_before_any_engine(tmp_path):
    """A real read-only directory (as root, the command runs as nobody, for whom it is read-only)."""
    root = Path(tempfile.mkdtemp(prefix="alignaudit-ro-"))
    try:
        (root / "home").mkdir()
        (root / "ro").mkdir()
        os.chmod(root, 0o755)
        os.chmod(root / "home", 0o777)
        os.chmod(root / "ro", 0o555)
        prefix = []
        if os.geteuid() == 0:
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: cannot make a directory read-only")
            prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        env = {**os.environ, "HOME": str(root / "home"), "ALIGNAUDIT_CACHE": str(root / "home" / "cache")}
        proc = subprocess.run(
            [
                *prefix,
                sys.executable,
                "-m",
                "alignaudit",
                "compare",
                "--train",
                "hf",
                "--infer",
                "hf",
                "--model",
                str(FIXTURE),
                "--out",
                str(root / "ro"),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=root / "home",
        )
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.startswith("error: cannot write to") and "Permission denied" in proc.stderr
        assert "Traceback" not in proc.stderr and list((root / "ro").iterdir()) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_inconsistent_head_counts_are_refused_before_any_engine(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(FIXTURE, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    err = one_line_error(capsys, ["compare", "--model", str(model), "--out", str(tmp_path / "o")], EXIT_USAGE)
    assert "num_attention_heads 4 is not a multiple of num_key_value_heads 3" in err
    assert not (tmp_path / "o").exists()


def test_many_short_prompts_are_batched_and_reported_compactly(tmp_path, capsys, monkeypatch):
    """3,000 two-token prompts: megatron and hf batch them (the micro-batches are recorded), the terminal
    shows the 20 worst sequences, the files hold all of them, and summary.json stays small."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"token_ids": [i % 500 + 1, (7 * i) % 500 + 1]}) + "\n" for i in range(3000)))
    out = tmp_path / "run"
    proc = run_in_process(
        capsys,
        monkeypatch,
        "compare",
        "--train",
        "megatron",
        "--infer",
        "hf",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    for role in ("train", "infer"):
        settings = json.loads((out / role / "manifest.json").read_text())["engine_settings"]
        assert settings["micro_batch_size"] == "auto" and settings["micro_batches"] == 47  # ceil(3000 / 64)
    assert (
        len(pd.read_parquet(out / "sequences.parquet")) == 3000 and len(pd.read_parquet(out / "tokens.parquet")) == 3000
    )
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["worst_sequences"]) == 20 and (out / "summary.json").stat().st_size < 20_000
    assert "Worst 20 of 3000 sequences (all in sequences.parquet)" in proc.stdout
    assert len(proc.stdout.splitlines()) < 80


def test_progress_counts_reach_the_parent(tmp_path, tiny_spec):
    from alignaudit.inputs.prompts import load_prompts
    from alignaudit.inputs.request import EngineSettings
    from alignaudit.pipelines.runs import EngineRun, capture

    batch = load_prompts(tiny_spec, random_prompts=130, prompt_len=4)
    seen = []
    capture(
        tiny_spec,
        batch,
        EngineRun("hf", EngineSettings()),
        tmp_path / "c",
        on_progress=lambda d, t: seen.append((d, t)),
    )
    assert seen == [(64, 130), (128, 130), (130, 130)]


def test_ctrl_c_says_interrupted_and_keeps_what_was_written(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "alignaudit", "compare", "--train", "hf", "--infer", "hf", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 60
    while not (tmp_path / "o" / "train" / "worker.log").exists() and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does: the whole foreground group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.startswith("interrupted") and "Traceback" not in err
    record = json.loads((tmp_path / "o" / "run.json").read_text())  # never left looking as if it still ran
    assert record["status"] == "interrupted" and record["error"].startswith("KeyboardInterrupt")


def test_an_interrupt_python_could_not_raise_is_delivered_again():
    """A Ctrl-C landing in an at-fork callback (a worker starting) reaches sys.unraisablehook instead of the
    command; it used to print "Exception ignored ... Traceback" before "interrupted"."""
    import types

    from alignaudit.commands import interrupts

    previous = signal.signal(signal.SIGINT, interrupts.terminate)
    interrupts.signalled[:] = [signal.SIGINT]
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupts.unraisable(types.SimpleNamespace(exc_type=KeyboardInterrupt))
            for _ in range(1000):
                time.sleep(0.001)
        assert interrupts.signalled == [signal.SIGINT, signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupts.signalled.clear()


def test_an_interrupt_handled_inside_the_unraisable_hook_is_delivered_after_it():
    """The re-delivered interrupt (or a second Ctrl-C) can be handled while the hook still runs; raised there it
    was swallowed again with "Exception ignored in sys.unraisablehook" and a traceback (seen once in a full
    test run). The handler passes it on instead, and it arrives after the hook."""
    from alignaudit.commands import interrupts

    previous = signal.signal(signal.SIGINT, interrupts.terminate)
    interrupts.signalled.clear()
    try:
        interrupts._in_unraisable_hook[0] = True
        interrupts.terminate(signal.SIGINT, None)  # inside the hook: must not raise
        interrupts._in_unraisable_hook[0] = False
        with pytest.raises(KeyboardInterrupt):
            for _ in range(1000):
                time.sleep(0.001)
        assert interrupts.signalled == [signal.SIGINT, signal.SIGINT]
    finally:
        interrupts._in_unraisable_hook[0] = False
        signal.signal(signal.SIGINT, previous)
        interrupts.signalled.clear()


def test_a_closed_output_pipe_is_not_an_alignment_failure(tmp_path):
    """`alignaudit compare | head -1`: rich exits 1 on a broken pipe, and 1 means "alignment failure"."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "alignaudit", "compare", "--train", "hf", "--infer", "hf", "--out", str(tmp_path / "o")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err
    assert (tmp_path / "o" / "summary.json").is_file()


def test_paths_are_never_wrapped_and_manifests_are_reproducible(tmp_path):
    out = tmp_path / ("a-directory-name-long-enough-to-wrap-an-eighty-column-terminal-" * 2)
    proc = subprocess.run(
        [sys.executable, "-m", "alignaudit", "compare", "--train", "megatron", "--infer", "hf", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert f"results: {out}/summary.json" in proc.stdout
    manifest = (out / "train" / "manifest.json").read_text()
    assert " at 0x" not in manifest
    config = json.loads(manifest)["engine_settings"]["transformer_config"]
    assert config["activation_func"] == "torch.nn.functional.silu"


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip().startswith("alignaudit 0.")


def test_a_failed_command_releases_its_lock(tmp_path, capsys):
    d = tmp_path / "x"
    err = one_line_error(
        capsys,
        [
            "compare",
            "--train",
            "hf",
            "--infer",
            "hf",
            "--train-opt",
            "attn_implementation=flash_attention_2",
            "--out",
            str(d),
        ],
        EXIT_USAGE,
    )
    assert "cannot load" in err and (d / outdir.LOCK).exists() and not outdir._held
    record = json.loads((d / "run.json").read_text())
    assert record["status"] == "failed" and "cannot load" in record["error"]
    with pytest.raises(InputError, match="--out is empty"):
        outdir.prepare("", False, ())


def test_a_refused_out_directory_is_left_untouched(tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    assert "is not empty" in one_line_error(capsys, ["compare", "--out", str(d)], EXIT_USAGE)
    assert [p.name for p in d.iterdir()] == ["notes.txt"]


def test_no_output_overwrites_the_evidence_it_reports_on(two_captures, tmp_path, capsys):
    """gate's and report's file outputs (outdir.check_file_outputs): a record of the run, a capture's file, the
    baseline, two outputs naming one file and a reserved name are refused before anything is read or written, exit
    2, every file of the run byte for byte as it was; the outputs' own names in the run and paths outside it work."""
    a, b = two_captures
    d = tmp_path / "d"
    assert cli.main(["diff", str(a), str(b), "--out", str(d)]) == EXIT_OK
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    baseline = tmp_path / "base.json"
    assert cli.main(
        [
            "gate",
            str(d),
            "--json",
            str(baseline),
            "--junit",
            str(tmp_path / "j.xml"),
            "--markdown",
            str(tmp_path / "s.md"),
        ]
    ) in (0, 1)
    base_bytes = baseline.read_bytes()
    refused = [
        (["gate", str(d), "--json", str(d / "run.json")], "--json", "inside the run"),
        (["gate", str(d), "--junit", str(d / "summary.json")], "--junit", "inside the run"),
        (["gate", str(d), "--markdown", str(d / "tokens.parquet")], "--markdown", "inside the run"),
        (["gate", str(d), "--json", str(d / "verdict.json"), "--junit", str(d / "verdict.json")], "name one file", ""),
        (
            ["gate", str(d), "--json", str(tmp_path / "x.json"), "--junit", str(tmp_path / "x.json")],
            "name one file",
            "",
        ),
        (["gate", str(d), "--baseline", str(baseline), "--json", str(baseline)], "is an input", ""),
        (["gate", str(d), "--json", str(tmp_path / ".alignaudit.lock")], "keeps for itself", ""),
        (["report", str(d), "--html", str(d / "run.json")], "--html", "inside the run"),
        (["report", str(d), "--html", str(d / "sequences.parquet")], "--html", "inside the run"),
        (["report", str(d), str(d), "--html", str(d / "report.html")], "--html", "inside the run"),
    ]
    for argv, *says in refused:
        err = one_line_error(capsys, argv, EXIT_USAGE)
        assert all(s in err for s in says), (argv, err)
        assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before, argv
        assert baseline.read_bytes() == base_bytes
    for argv in (
        ["gate", str(d), "--json", str(d / "verdict.json")],
        ["report", str(d), "--html", str(d / "report.html")],
        ["report", str(d), "--html", str(tmp_path / "page.html")],
    ):
        assert cli.main(argv) in (0, 1), argv
    changed = [p.name for p, data in before.items() if p.read_bytes() != data]
    assert set(changed) <= {outdir.MARKER, outdir.LOCK}, changed  # the marker lists the verdict files claimed
    outdir.check_file_outputs({"--json": None, "--junit": tmp_path / "j.xml"}, runs=(d,))  # None: not written


def test_paths_and_messages_are_shown_literally(two_captures, tmp_path, capsys):
    """console.shown: a run directory named with rich markup is a name (gate passes, exit 0, and prints it), and a
    control character a user put in a path is shown escaped in the one-line error, never sent to the terminal."""
    a, b = two_captures
    d = tmp_path / "run[/]x[bold]"
    assert cli.main(["diff", str(a), str(b), "--out", str(d)]) == EXIT_OK
    capsys.readouterr()
    assert cli.main(["gate", str(d)]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"results: {d / 'verdict.json'}" in out
    err = one_line_error(capsys, ["gate", str(tmp_path / "no\x1b[31mrun\nhere")], EXIT_USAGE)
    assert "no\\x1b[31mrun\\nhere" in err and "\x1b" not in err and "\n" not in err
