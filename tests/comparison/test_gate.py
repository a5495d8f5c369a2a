"""alignaudit gate: verdicts on real comparisons of the fixture, damaged captures, and a bit-flip property. gate running
the comparison itself (docs/ci.md's examples, a NaN checkpoint) is test_gate_compare.py's."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignaudit.capture.digest import file_sha256
from alignaudit.capture.rundir import LOGPROBS, MANIFEST
from alignaudit.commands import cli
from alignaudit.comparison import gate
from alignaudit.comparison.token_diff import align_tokens, compare_tokens
from alignaudit.errors import EXIT_ENGINE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from helpers import one_line_error, reseal

pytestmark = [pytest.mark.engines, pytest.mark.long]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real comparisons of the fixture: megatron vs hf without --strict, and with it."""
    root = tmp_path_factory.mktemp("gate-runs")
    for name, extra in (("stock", []), ("strict", ["--strict"])):
        assert (
            cli.main(["compare", "--train", "megatron", "--infer", "hf", *extra, "--out", str(root / name)]) == EXIT_OK
        )
    return root


def copy_run(runs, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(runs / name, dst)
    return dst


def test_gate_fails_a_stock_comparison_with_exit_1(runs, tmp_path):
    run = copy_run(runs, "stock", tmp_path)
    assert cli.main(["gate", str(run)]) == EXIT_MISMATCH
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["verdict"] == "fail" and verdict["mismatches"] == 176
    suite = ET.fromstring((run / "junit.xml").read_text())
    cases = suite.findall("testcase")
    assert len(cases) == 4 and suite.get("failures") == "4"
    message = cases[0].find("failure").get("message")
    assert "first at position 1" in message and "ULP" in message and "0x" in message
    assert "FAIL" in (run / "summary.md").read_text()
    assert "gate FAIL" in (run / "report.html").read_text()  # the page shows the verdict


def test_relaxations_and_baseline(runs, tmp_path):
    run = copy_run(runs, "stock", tmp_path)
    assert cli.main(["gate", str(run)]) == EXIT_MISMATCH
    v = json.loads((run / "verdict.json").read_text())
    n, ulp, dmax = v["mismatches"], v["ulp_max"], v["max_abs_diff"]
    for args, code in [
        (["--max-mismatch", str(n)], EXIT_OK),
        (["--max-mismatch", str(n - 1)], EXIT_MISMATCH),
        (["--max-mismatch", "100%"], EXIT_OK),
        (["--max-mismatch", "0.5"], EXIT_MISMATCH),
        (["--max-ulp", str(ulp)], EXIT_OK),
        (["--max-ulp", str(ulp - 1)], EXIT_MISMATCH),
        (["--max-abs", str(dmax)], EXIT_OK),
        (["--max-abs", str(dmax / 2)], EXIT_MISMATCH),
        (["--max-ulp", str(ulp), "--max-mismatch", "3"], EXIT_MISMATCH),
    ]:
        assert cli.main(["gate", str(run), "--json", str(tmp_path / "v.json"), *args]) == code, args
    baseline = tmp_path / "baseline.json"
    shutil.copy(run / "verdict.json", baseline)
    assert cli.main(["gate", str(run), "--baseline", str(baseline), "--json", str(tmp_path / "v.json")]) == EXIT_OK
    strict = copy_run(runs, "strict", tmp_path)
    assert cli.main(["gate", str(strict)]) == EXIT_OK
    shutil.copy(strict / "verdict.json", baseline)
    assert (
        cli.main(["gate", str(run), "--baseline", str(baseline), "--json", str(tmp_path / "v.json")]) == EXIT_MISMATCH
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-abs", "nan"], "--max-abs nan: give a finite number >= 0"),
        (["--max-abs", "-1"], "--max-abs -1.0: give a finite number >= 0"),
        (["--max-abs", "inf"], "--max-abs inf: give a finite number >= 0"),
        (["--max-ulp", "-1"], "--max-ulp -1: give a whole number"),
        (["--max-mismatch", "nan"], "--max-mismatch 'nan': a fraction must lie in [0, 1]"),
    ],
)
def test_thresholds_that_would_pass_anything_are_refused(runs, tmp_path, capsys, args, message):
    run = copy_run(runs, "stock", tmp_path)
    err = one_line_error(capsys, ["gate", str(run), *args], EXIT_USAGE)
    assert message in err
    assert not (run / "verdict.json").exists()  # refused before anything is judged or written


@pytest.mark.parametrize(
    "field, value",
    [
        ("mismatches", float("nan")),
        ("ulp_max", float("nan")),
        ("max_abs_diff", float("nan")),
        ("mismatches", -1),
        ("mismatches", None),
        ("ulp_max", 2.5),
        ("max_abs_diff", "0.1"),
        ("mismatches", True),
    ],
)
def test_a_baseline_no_regression_could_be_measured_against_is_refused(runs, tmp_path, capsys, field, value):
    run = copy_run(runs, "stock", tmp_path)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"mismatches": 0, "ulp_max": 0, "max_abs_diff": 0.0, field: value}))
    err = one_line_error(capsys, ["gate", str(run), "--baseline", str(baseline)], EXIT_USAGE)
    assert f"{field} is {value!r}" in err


def test_markdown_is_appended_for_ci_job_summaries(runs, tmp_path):
    run = copy_run(runs, "strict", tmp_path)
    summary = tmp_path / "step-summary.md"
    summary.write_text("# earlier step\n")
    assert cli.main(["gate", str(run), "--markdown", str(summary)]) == EXIT_OK
    text = summary.read_text()
    assert text.startswith("# earlier step\n") and "alignaudit gate: PASS" in text


def rewrite_table(capture_dir, edit, fix_manifest=True):
    """Apply ``edit`` to a capture's logprob table; keep the manifest consistent (sha, counts, digest)."""
    table = pd.read_parquet(capture_dir / LOGPROBS)
    table = edit(table)
    table.to_parquet(capture_dir / LOGPROBS, index=False)
    if fix_manifest:
        manifest = json.loads((capture_dir / MANIFEST).read_text())
        manifest["files"][LOGPROBS] = file_sha256(capture_dir / LOGPROBS)
        (capture_dir / MANIFEST).write_text(json.dumps(manifest))


def _drop_sequence(t):
    return t[t["seq"] != 2]


def _change_token(t):
    t = t.copy()
    t.loc[(t["seq"] == 0) & (t["pos"] == 3), "token_id"] = 7
    return t


def _nan_logprob(t):
    t = t.copy()
    t.loc[(t["seq"] == 1) & (t["pos"] == 2), "logprob"] = np.nan
    return t


def _empty(t):
    return t.iloc[0:0]


def _drop_files_entry(d):
    manifest = json.loads((d / MANIFEST).read_text())
    del manifest["files"]
    (d / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: rewrite_table(d, _drop_sequence), "the capture is damaged"),
        (lambda d: rewrite_table(d, _change_token), "token ids do not match"),
        (lambda d: rewrite_table(d, _nan_logprob), "is not the capture this run wrote"),
        (lambda d: rewrite_table(d, _empty), "damaged"),
        (
            lambda d: (d / LOGPROBS).write_bytes((d / LOGPROBS).read_bytes()[:200]),
            "does not match the manifest's sha256",
        ),
        (
            lambda d: rewrite_table(d, lambda t: t.assign(logprob=t["logprob"] + 1), fix_manifest=False),
            "does not match the manifest's sha256",
        ),
        (lambda d: (d / MANIFEST).unlink(), "incomplete"),
        (_drop_files_entry, "records no sha256 of logprobs.parquet"),
    ],
)
def test_damaged_captures_never_pass(runs, tmp_path, capsys, damage, message):
    run = copy_run(runs, "strict", tmp_path)
    damage(run / "infer")
    assert message in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    assert not (run / "verdict.json").exists()


def test_zero_tokens_is_an_input_error():
    empty = pd.DataFrame(
        {
            "seq": [],
            "pos": [],
            "token_id": [],
            "lp_train": [],
            "lp_infer": [],
            "diff": [],
            "bitwise_equal": [],
            "ulp": [],
            "pair_class": [],
        }
    )
    with pytest.raises(Exception, match="never passes on nothing"):
        gate.evaluate(empty, gate.Rule())


def _swap_in(run, source):
    shutil.rmtree(run / "infer")
    shutil.copytree(source, run / "infer")


def test_foreign_captures_never_pass(runs, tmp_path, capsys):
    """A capture that is not the one the run wrote: of the other run, the other run's infer with its manifest digest
    patched into run.json, its train side so patched, the run's own train side copied over the infer side."""
    run = copy_run(runs, "strict", tmp_path)
    _swap_in(run, runs / "stock" / "infer")
    assert "is not the capture this run wrote" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    record = json.loads((run / "run.json").read_text())
    record["captures"]["infer"]["manifest_sha256"] = _manifest_sha(run / "infer")
    reseal(run, record)
    assert "strict '' differs from run.json's 'all'" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    _swap_in(run, runs / "stock" / "train")
    record["captures"]["infer"]["manifest_sha256"] = _manifest_sha(run / "infer")
    reseal(run, record)
    assert "made as the train side" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    _swap_in(run, run / "train")
    record["captures"]["infer"]["manifest_sha256"] = _manifest_sha(run / "infer")
    reseal(run, record)
    assert "one is a copy of the other" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)


def _manifest_sha(capture_dir):
    import hashlib

    return hashlib.sha256((capture_dir / MANIFEST).read_bytes()).hexdigest()


def test_a_capture_of_another_checkpoint_is_refused_by_gate_and_diff(runs, tmp_path, capsys):
    run = copy_run(runs, "strict", tmp_path)
    manifest = json.loads((run / "infer" / MANIFEST).read_text())
    manifest["model"]["checkpoint_sha256"] = "0" * 64
    (run / "infer" / MANIFEST).write_text(json.dumps(manifest))
    record = json.loads((run / "run.json").read_text())
    record["captures"]["infer"]["manifest_sha256"] = _manifest_sha(run / "infer")
    reseal(run, record)
    assert "different checkpoints" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    err = one_line_error(
        capsys, ["diff", str(run / "train"), str(run / "infer"), "--out", str(tmp_path / "d")], EXIT_USAGE
    )
    assert "different checkpoints" in err


def test_options_that_do_not_apply_to_a_run_dir_are_refused(runs, tmp_path, capsys):
    run = copy_run(runs, "strict", tmp_path)
    err = one_line_error(
        capsys, ["gate", str(run), "--strict", "--model", "/nonexistent", "--train", "bogus", "--out", "x"], EXIT_USAGE
    )
    assert "--train, --strict, --model, --out apply only when gate runs the comparison itself" in err
    assert not (run / "verdict.json").exists()


def test_an_unfinished_run_is_refused(runs, tmp_path, capsys):
    run = copy_run(runs, "strict", tmp_path)
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "status": "running"}))
    assert "the run did not finish" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    # report shows an unfinished run's partial results under a banner; a sealed one whose status was edited
    # to look unfinished would skip every checksum that way: its seal gives it away
    assert "was changed after the run finished" in one_line_error(capsys, ["report", str(run)], EXIT_USAGE)


@pytest.mark.parametrize(
    "edit, resealed, message",
    [
        (lambda r: r["model"].update(name="Qwen3-32B"), False, "was changed after the run finished"),
        (lambda r: r.update(mode="rollout"), False, "was changed after the run finished"),
        (lambda r: r["model"].update(name="Qwen3-32B"), True, "names the model 'Qwen3-32B', its captures 'qwen3-tiny'"),
        (
            lambda r: r.update(mode="rollout", rollout={"max_new_tokens": 16}),
            True,
            "says mode 'rollout', the inference capture was made in 'prompt' mode",
        ),
        (lambda r: r["outputs"].pop("summary.json"), True, "summary.json is not among the files run.json lists"),
    ],
)
def test_record_fields_a_verdict_or_page_shows_are_checked(runs, tmp_path, capsys, edit, resealed, message):
    """run.json is sealed (its own sha256) and cross-checked against the captures: an edited field is refused
    by gate and report alike (exit 2, nothing written), also when the seal is recomputed."""
    run = copy_run(runs, "strict", tmp_path)
    page = (run / "report.html").read_bytes()  # compare's own page, from before the edit
    record = json.loads((run / "run.json").read_text())
    edit(record)
    if resealed:
        reseal(run, record)
    else:
        (run / "run.json").write_text(json.dumps(record))
    for argv in (["gate", str(run)], ["report", str(run)]):
        assert message in one_line_error(capsys, argv, EXIT_USAGE), argv
    assert not (run / "verdict.json").exists() and (run / "report.html").read_bytes() == page


@pytest.mark.parametrize("name, mismatches", [("stock", 0), ("strict", 99)])
def test_pages_never_show_an_unchecked_summary(runs, tmp_path, capsys, name, mismatches):
    """summary.json says 0 mismatches on a failing run (or 99 on a passing one): gate and report refuse it;
    no page shows it."""
    run = copy_run(runs, name, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "mismatches": mismatches}))
    page = (run / "report.html").read_bytes()
    for argv in (["gate", str(run)], ["report", str(run)]):
        assert "summary.json is missing or is not the file this run wrote" in one_line_error(capsys, argv, EXIT_USAGE)
    assert (run / "report.html").read_bytes() == page and not (run / "verdict.json").exists()


def test_a_page_shows_the_verdict_judged_again_not_the_stored_one(runs, tmp_path, capsys):
    run = copy_run(runs, "stock", tmp_path)
    assert cli.main(["gate", str(run)]) == EXIT_MISMATCH
    stored = json.loads((run / "verdict.json").read_text())
    assert stored["rule_params"]["max_mismatch"] is None and "gate FAIL" in (run / "report.html").read_text()
    (run / "verdict.json").write_text(json.dumps({**stored, "verdict": "pass", "mismatches": 0}))
    err = one_line_error(capsys, ["report", str(run), "--html", str(tmp_path / "r.html")], EXIT_USAGE)
    assert "verdict.json says verdict 'pass', but judging the run again gives 'fail'" in err
    assert not (tmp_path / "r.html").exists()
    (run / "verdict.json").write_text(
        json.dumps({**stored, "rule_params": {**stored["rule_params"], "max_ulp": 10**9}})
    )
    err = one_line_error(capsys, ["report", str(run), "--html", str(tmp_path / "r.html")], EXIT_USAGE)
    assert "verdict.json says verdict 'fail'" in err  # a verdict of another rule than it names


def test_gate_judges_a_diff_directory_against_its_captures(runs, tmp_path, capsys):
    """diff writes a sealed record naming its two captures: gate judges it like a compare run (issue [20]'s
    split-container audit), and an edit of what diff wrote is refused."""
    out = tmp_path / "d"
    assert (
        cli.main(["diff", str(runs / "stock" / "train"), str(runs / "stock" / "infer"), "--out", str(out)]) == EXIT_OK
    )
    assert cli.main(["gate", str(out)]) == EXIT_MISMATCH
    assert json.loads((out / "verdict.json").read_text())["mismatches"] == 176
    assert (
        cli.main(["diff", str(runs / "strict" / "train"), str(runs / "strict" / "infer"), "--out", str(tmp_path / "s")])
        == EXIT_OK
    )
    assert cli.main(["gate", str(tmp_path / "s")]) == EXIT_OK
    tokens = pd.read_parquet(out / "tokens.parquet")
    tokens.assign(bitwise_equal=True).to_parquet(out / "tokens.parquet", index=False)
    assert "tokens.parquet is missing or is not the file" in one_line_error(capsys, ["gate", str(out)], EXIT_USAGE)


def test_gate_on_a_read_only_run_writes_elsewhere_or_says_how(runs, tmp_path, capsys, monkeypatch):
    """A run directory gate cannot write to: refused with the fix; judged when the verdict goes elsewhere."""
    import os

    from alignaudit.capture import outdir

    run = copy_run(runs, "strict", tmp_path)
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).startswith(str(run)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(outdir.os, "open", read_only)
    err = one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)
    assert "cannot write to" in err and "pass --json, --junit and --markdown" in err
    elsewhere = [f"--{k}={tmp_path / ('v.' + k)}" for k in ("json", "junit", "markdown")]
    assert cli.main(["gate", str(run), *elsewhere]) == EXIT_OK
    assert json.loads((tmp_path / "v.json").read_text())["verdict"] == "pass"


@pytest.fixture(scope="module")
def identical_tables(runs):
    train = pd.read_parquet(runs / "strict" / "train" / LOGPROBS)
    infer = pd.read_parquet(runs / "strict" / "infer" / LOGPROBS)
    return train, infer


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_single_flipped_bit_always_fails(identical_tables, data):
    train, infer = identical_tables
    assert gate.evaluate(compare_tokens(align_tokens(train, infer)), gate.Rule()).passed
    scored = infer.index[infer["scored"]]
    row = data.draw(st.sampled_from(list(scored)))
    bit = data.draw(st.integers(0, 31))
    flipped = infer.copy()
    value = np.array([flipped.at[row, "logprob"]], dtype=np.float32)
    value.view(np.uint32)[0] ^= np.uint32(1 << bit)
    flipped["logprob"] = flipped["logprob"].astype("float32")
    flipped.at[row, "logprob"] = value[0]
    verdict = gate.evaluate(compare_tokens(align_tokens(train, flipped)), gate.Rule())
    assert not verdict.passed and verdict.mismatches == 1
    if np.isnan(value[0]):
        assert verdict.error and verdict.exit_code == EXIT_ENGINE


def _repair_capture(capture_dir):
    """Make a damaged capture self-consistent again: table sha, counts and token digest in its manifest."""
    from alignaudit.capture.directory import Capture

    table = pd.read_parquet(capture_dir / LOGPROBS)
    manifest = json.loads((capture_dir / MANIFEST).read_text())
    manifest["files"][LOGPROBS] = file_sha256(capture_dir / LOGPROBS)
    manifest["prompts"].update(
        num_sequences=int(table["seq"].nunique()),
        num_tokens=len(table),
        digest=Capture(capture_dir, manifest, table).token_batch().digest(),
    )
    (capture_dir / MANIFEST).write_text(json.dumps(manifest))


def _repair_run(run):
    record = json.loads((run / "run.json").read_text())
    for role in ("train", "infer"):
        record["captures"][role]["manifest_sha256"] = _manifest_sha(run / role)
    reseal(run, record)


def _damage(run, side, kind, row, value):
    d = run / side
    table = pd.read_parquet(d / LOGPROBS)
    if kind == "drop":
        table = table.drop(index=row % len(table))
    elif kind == "duplicate":
        table = pd.concat([table, table.iloc[[row % len(table)]]]).sort_values(["seq", "pos"], kind="stable")
    elif kind == "reorder":
        table = table.iloc[np.roll(np.arange(len(table)), 1 + row % (len(table) - 1))]
    elif kind == "alter":
        scored = table.index[table["scored"]]
        i = scored[row % len(scored)]
        bits = np.array([table.loc[i, "logprob"]], dtype=np.float32)
        bits.view(np.uint32)[0] ^= np.uint32(1 << value)
        table.loc[i, "logprob"] = bits[0]
    elif kind == "swap":
        shutil.move(run / "train", run / "tmp")
        shutil.move(run / "infer", run / "train")
        shutil.move(run / "tmp", run / "infer")
        return
    elif kind == "edit_record":  # a field of run.json a verdict or page shows
        record = json.loads((run / "run.json").read_text())
        edits = [
            lambda r: r["model"].update(name="Qwen3-32B"),
            lambda r: r.update(mode="rollout"),
            lambda r: r.update(rollout={"max_new_tokens": 8, "temperature": 0.5}),
            lambda r: r[side].update(strict=""),
            lambda r: r[side].update(engine="vllm"),
            lambda r: r[side].update(dtype="fp32"),
            lambda r: r[side].update(options={"micro_batch_size": 3}),
            lambda r: r["model"].update(path="/elsewhere"),
        ]
        edits[row % len(edits)](record)
        (run / "run.json").write_text(json.dumps(record))
        return
    elif kind == "edit_output":  # a file of the run's results the page reads
        name = ["summary.json", "tokens.parquet", "sequences.parquet"][row % 3]
        if name == "summary.json":
            summary = json.loads((run / name).read_text())
            (run / name).write_text(json.dumps({**summary, "mismatches": 1 + value}))
        else:
            frame = pd.read_parquet(run / name)
            frame.iloc[:0].to_parquet(run / name, index=False) if value % 2 else frame.iloc[::-1].to_parquet(
                run / name, index=False
            )
        return
    elif kind == "edit_manifest":
        manifest = json.loads((d / MANIFEST).read_text())
        key = ["engine", "role", "dtype", "strict", "options"][row % 5]
        if key in ("engine", "role"):
            manifest[key] = {"engine": "vllm", "role": "train" if side == "infer" else "infer"}[key]
        else:
            manifest["settings"][key] = {"dtype": "fp32", "strict": "", "options": {"micro_batch_size": 2}}[key]
        (d / MANIFEST).write_text(json.dumps(manifest))
        return
    table.reset_index(drop=True).to_parquet(d / LOGPROBS, index=False)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    side=st.sampled_from(["train", "infer"]),
    kind=st.sampled_from(
        ["drop", "duplicate", "reorder", "alter", "swap", "edit_manifest", "edit_record", "edit_output"]
    ),
    row=st.integers(0, 10_000),
    value=st.sampled_from([0, 7, 22, 23, 30, 31]),
    repair_capture=st.booleans(),
    repair_run=st.booleans(),
)
def test_damaged_run_directories_never_pass(
    runs, tmp_path_factory, capsys, side, kind, row, value, repair_capture, repair_run
):
    """Whatever is done to a passing run directory (its captures, run.json's fields, its result files), and
    however its checksums are patched up afterwards (the captures' and run.json's own seal, short of
    recomputing the sha256 of the result files), gate and report do not exit 0."""
    run = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(runs / "strict", run)
    _damage(run, side, kind, row, value)
    if repair_capture and kind not in ("swap", "edit_manifest", "edit_record", "edit_output"):
        _repair_capture(run / side)
    if repair_run:
        _repair_run(run)
    out = run.parent
    code = cli.main(
        [
            "gate",
            str(run),
            "--json",
            str(out / "v.json"),
            "--junit",
            str(out / "j.xml"),
            "--markdown",
            str(out / "s.md"),
        ]
    )
    page = cli.main(["report", str(run), "--html", str(out / "r.html")])
    capsys.readouterr()
    assert code != EXIT_OK and page != EXIT_OK, (side, kind, row, value, repair_capture, repair_run)


def test_values_that_are_no_logprobs_never_pass_however_equal_their_bits(runs, tmp_path, capsys):
    """+inf at one token and 0.5 at another, with the same bits on both sides (engines, or files, that wrote
    something other than log-probabilities): the tokens are bitwise equal, yet diff's summary counts them per side
    and gate on that diff exits 3 naming them."""

    def corrupt(t):
        t = t.copy()
        t.loc[(t["seq"] == 1) & (t["pos"] == 2), "logprob"] = np.inf
        t.loc[(t["seq"] == 2) & (t["pos"] == 5), "logprob"] = 0.5
        return t

    for side in ("train", "infer"):
        shutil.copytree(runs / "strict" / side, tmp_path / side)
        rewrite_table(tmp_path / side, corrupt)
    out = tmp_path / "d"
    assert cli.main(["diff", str(tmp_path / "train"), str(tmp_path / "infer"), "--out", str(out)]) == EXIT_OK
    summary = json.loads((out / "summary.json").read_text())
    assert summary["positive_tokens"] == {"train": 2, "infer": 2, "both": 2} and summary["mismatches"] == 0
    capsys.readouterr()
    err = one_line_error(capsys, ["gate", str(out)], EXIT_ENGINE)
    assert "train side holds logprobs above 0, which no log-probability is (2 of 176 tokens" in err
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == "error" and verdict["mismatches"] == 0
    kinds = {e.get("type") for e in ET.fromstring((out / "junit.xml").read_text()).iter("error")}
    assert kinds == {"NotALogprob"}
