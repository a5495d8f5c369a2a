"""alignaudit gate: verdicts on real comparisons of the fixture, damaged captures, and a bit-flip property."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignaudit import cli, gate
from alignaudit.capture import LOGPROBS, MANIFEST, _sha256
from alignaudit.diff import align_tokens, compare_tokens
from alignaudit.errors import EXIT_ENGINE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, EngineError

from test_cli import one_line_error


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real comparisons of the fixture: megatron vs hf without --strict, and with it."""
    root = tmp_path_factory.mktemp("gate-runs")
    for name, extra in (("stock", []), ("strict", ["--strict"])):
        assert cli.main(["compare", "--train", "megatron", "--infer", "hf", *extra, "--out", str(root / name)]) == EXIT_OK
    return root


def copy_run(runs, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(runs / name, dst)
    return dst


def test_gate_runs_a_strict_comparison_with_vllm_and_passes(tmp_path):
    out = tmp_path / "ci"
    assert cli.main(["gate", "--strict", "--train", "megatron", "--infer", "vllm", "--out", str(out)]) == EXIT_OK
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == "pass" and verdict["tokens_compared"] == 176 and verdict["mismatches"] == 0
    suite = ET.fromstring((out / "junit.xml").read_text())
    assert suite.get("tests") == "4" and suite.get("failures") == "0"


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


def test_relaxations_and_baseline(runs, tmp_path):
    run = copy_run(runs, "stock", tmp_path)
    assert cli.main(["gate", str(run)]) == EXIT_MISMATCH
    v = json.loads((run / "verdict.json").read_text())
    n, ulp, dmax = v["mismatches"], v["ulp_max"], v["max_abs_diff"]
    for args, code in [
        (["--max-mismatch", str(n)], EXIT_OK), (["--max-mismatch", str(n - 1)], EXIT_MISMATCH),
        (["--max-mismatch", "100%"], EXIT_OK), (["--max-mismatch", "0.5"], EXIT_MISMATCH),
        (["--max-ulp", str(ulp)], EXIT_OK), (["--max-ulp", str(ulp - 1)], EXIT_MISMATCH),
        (["--max-abs", str(dmax)], EXIT_OK), (["--max-abs", str(dmax / 2)], EXIT_MISMATCH),
        (["--max-ulp", str(ulp), "--max-mismatch", "3"], EXIT_MISMATCH),
    ]:
        assert cli.main(["gate", str(run), "--json", str(tmp_path / "v.json"), *args]) == code, args
    baseline = tmp_path / "baseline.json"
    shutil.copy(run / "verdict.json", baseline)
    assert cli.main(["gate", str(run), "--baseline", str(baseline), "--json", str(tmp_path / "v.json")]) == EXIT_OK
    strict = copy_run(runs, "strict", tmp_path)
    assert cli.main(["gate", str(strict)]) == EXIT_OK
    shutil.copy(strict / "verdict.json", baseline)
    assert cli.main(["gate", str(run), "--baseline", str(baseline), "--json", str(tmp_path / "v.json")]) == EXIT_MISMATCH


def test_markdown_is_appended_for_ci_job_summaries(runs, tmp_path):
    run = copy_run(runs, "strict", tmp_path)
    summary = tmp_path / "step-summary.md"
    summary.write_text("# earlier step\n")
    assert cli.main(["gate", str(run), "--markdown", str(summary)]) == EXIT_OK
    text = summary.read_text()
    assert text.startswith("# earlier step\n") and "alignaudit gate: PASS" in text


def rewrite_table(capture_dir, edit, fix_manifest=True):
    """Apply ``edit`` to a capture's logprob table; keep the manifest consistent (sha, counts, digest)."""
    from alignaudit.capture import read_capture  # noqa: F401  (format documented there)

    table = pd.read_parquet(capture_dir / LOGPROBS)
    table = edit(table)
    table.to_parquet(capture_dir / LOGPROBS, index=False)
    if fix_manifest:
        manifest = json.loads((capture_dir / MANIFEST).read_text())
        manifest["files"][LOGPROBS] = _sha256(capture_dir / LOGPROBS)
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


@pytest.mark.parametrize("damage, code, message", [
    (lambda d: rewrite_table(d, _drop_sequence), EXIT_USAGE, "the capture is damaged"),
    (lambda d: rewrite_table(d, _change_token), EXIT_USAGE, "token ids do not match"),
    (lambda d: rewrite_table(d, _nan_logprob), EXIT_ENGINE, "produced NaN logprobs"),
    (lambda d: rewrite_table(d, _empty), EXIT_USAGE, "damaged"),
    (lambda d: (d / LOGPROBS).write_bytes((d / LOGPROBS).read_bytes()[:200]), EXIT_USAGE, "does not match the manifest's sha256"),
    (lambda d: rewrite_table(d, lambda t: t.assign(logprob=t["logprob"] + 1), fix_manifest=False), EXIT_USAGE,
     "does not match the manifest's sha256"),
    (lambda d: (d / MANIFEST).unlink(), EXIT_USAGE, "incomplete"),
])
def test_damaged_captures_never_pass(runs, tmp_path, capsys, damage, code, message):
    run = copy_run(runs, "strict", tmp_path)
    damage(run / "infer")
    assert message in one_line_error(capsys, ["gate", str(run)], code)
    assert not (run / "verdict.json").exists()


def test_zero_tokens_is_an_input_error():
    empty = pd.DataFrame({"seq": [], "pos": [], "token_id": [], "lp_train": [], "lp_infer": [], "diff": [],
                          "bitwise_equal": [], "ulp": [], "pair_class": []})
    with pytest.raises(Exception, match="never passes on nothing"):
        gate.evaluate(empty, gate.Rule())


def test_mismatched_token_ids_between_captures(runs, tmp_path, capsys):
    run = copy_run(runs, "strict", tmp_path)
    other = copy_run(runs, "stock", tmp_path / "x")
    shutil.rmtree(run / "infer")
    shutil.copytree(other / "infer", run / "infer")
    rewrite_table(run / "infer", _change_token)
    manifest = json.loads((run / "infer" / MANIFEST).read_text())
    from alignaudit.capture import Capture

    table = pd.read_parquet(run / "infer" / LOGPROBS)
    manifest["prompts"]["digest"] = Capture(run / "infer", manifest, table).token_batch().digest()
    (run / "infer" / MANIFEST).write_text(json.dumps(manifest))
    assert "different token ids" in one_line_error(capsys, ["gate", str(run)], EXIT_USAGE)


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
    scored = infer.index[infer["logprob"].notna()]
    row = data.draw(st.sampled_from(list(scored)))
    bit = data.draw(st.integers(0, 31))
    flipped = infer.copy()
    value = np.array([flipped.at[row, "logprob"]], dtype=np.float32)
    value.view(np.uint32)[0] ^= np.uint32(1 << bit)
    flipped["logprob"] = flipped["logprob"].astype("float32")
    flipped.at[row, "logprob"] = value[0]
    try:
        verdict = gate.evaluate(compare_tokens(align_tokens(train, flipped)), gate.Rule())
    except EngineError:
        return  # the flip made a NaN: an error, never a pass
    assert not verdict.passed and verdict.mismatches == 1
