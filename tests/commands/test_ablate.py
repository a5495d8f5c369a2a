"""alignaudit ablate on the fixture (megatron vs hf, bf16, rmsnorm as the factor): one comparison per
configuration, each with a natural-mode op capture naming its first diverging op."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from alignaudit.capture.ops import OpGraph
from alignaudit.errors import EXIT_OK
from alignaudit.pipelines.ablate import STRICT_OP_COVERS, configurations
from helpers import CHROMIUM, one_line_error, open_in_chromium, run_in_process

pytestmark = [pytest.mark.engines, pytest.mark.long]


def test_configurations_cover_each_factor_both_ways():
    rows = configurations(("linear", "rope"))
    assert [(c.kind, c.factor) for c in rows] == [
        ("all strict", "all"),
        ("default op", "linear"),
        ("default op", "rope"),
        ("strict op", "linear"),
        ("strict op", "rope"),
        ("all default", "none"),
    ]
    assert rows[1].strict == frozenset({"rmsnorm", "rope", "silu", "attention", "logprobs"})
    assert rows[4].strict == {"rope"} and rows[5].strict == frozenset() and len({c.name for c in rows}) == 6


def test_ablate_rmsnorm_megatron_vs_hf(tmp_path, capsys, monkeypatch):
    """All strict: 0 mismatches. RMSNorm left at each engine's default (every other op strict): the first
    diverging op is an RMSNorm (Megatron and transformers round at different points). RMSNorm alone
    strict: the first divergence moves past it. All default: every token differs. In-process (the command's
    workers forked from the test session's preloaded engines)."""
    out = tmp_path / "ablate"
    proc = run_in_process(
        capsys, monkeypatch, "ablate", "--train", "megatron", "--infer", "hf", "--factors", "rmsnorm", "--out", str(out)
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    matrix = pd.read_parquet(out / "ablate.parquet").set_index("kind")
    assert list(matrix.index) == ["all strict", "default op", "strict op", "all default"]
    assert matrix.loc["all strict", "mismatches"] == 0 and matrix.loc["all strict", "tokens"] == 176
    assert pd.isna(matrix.loc["all strict", "first_diverging_op"])
    default = matrix.loc["default op"]
    assert default["mismatches"] > 0 and default["first_diverging_op"].split(".")[-1] in STRICT_OP_COVERS["rmsnorm"]
    order = OpGraph(2).op_ids()
    alone = matrix.loc["strict op"]
    assert order.index(alone["first_diverging_op"]) > order.index("layers.0.input_norm")
    assert matrix.loc["all default", "mismatches"] == 176
    record = json.loads((out / "ablate.json").read_text())
    assert record["capture_ops"] and [r["strict"] for r in record["rows"]] == [
        "all",
        "linear,rope,silu,attention,logprobs",
        "rmsnorm",
        "none",
    ]
    assert (out / "configs" / "default-rmsnorm" / "ops-natural.parquet").is_file()
    assert "Ablation matrix" in (out / "report.html").read_text()
    if CHROMIUM is not None:  # the page of a real run renders (tests/reports/test_html_report.py checks it in depth)
        probe, _, console = open_in_chromium(out / "report.html", tmp_path)
        assert console == [] and probe["plots"]["plot-ablate"]["rendered"]
    assert "first diverging op" in proc.stdout and "rmsnorm" in proc.stdout
    # each row has a marker of its own, listed in ablate's record: a later command writing into a row (as gate and
    # report do: lock, claim, write, release) is recorded there, and ablate --force removes it as alignaudit's
    from alignaudit.capture import outdir, written
    from alignaudit.capture.rundir import ABLATE_OUTPUTS

    row = out / "configs" / "default-rmsnorm"
    assert "configs/default-rmsnorm/.alignaudit-outputs" in written.read(out).files
    outdir.lock(row)
    outdir.claim(row, ("report.html",))
    (row / "report.html").write_text("<html></html>")
    outdir.release_all()
    assert "report.html" in written.read(row).files
    outdir.prepare(out, True, ABLATE_OUTPUTS)
    outdir.release_all()
    assert (out / ".alignaudit-previous" / "configs" / "default-rmsnorm" / "report.html").is_file()


def test_ablate_refuses_strict_and_unknown_factors(capsys, tmp_path):
    assert "drop --strict" in one_line_error(capsys, ["ablate", "--strict", "--out", str(tmp_path / "a")], 2)
    assert "--factors: unknown op(s) softmax" in one_line_error(
        capsys, ["ablate", "--factors", "softmax", "--out", str(tmp_path / "b")], 2
    )
    assert "names no op" in one_line_error(capsys, ["ablate", "--factors", "", "--out", str(tmp_path / "b")], 2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
