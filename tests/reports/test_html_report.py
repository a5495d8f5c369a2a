"""`alignaudit report`: the HTML page of real runs of the fixture, opened in a real headless Chromium.

What must hold for the page to be worth opening:
1. It renders offline with no console output at all (an error, a warning, an uncaught exception); the
   detector is proven by a negative control, a page that throws, which it must catch.
2. Every plot is drawn: plotly adds a ``.plot-container`` inside each figure's div only when it renders.
3. The numbers on the page are the run's: the mismatch count, the ULP histogram's bars, the per-sequence
   lines and the order of the sequences are read back from the rendered page (the figures' data as
   plotly.js holds it, and the tables' cells) and checked against tokens.parquet, sequences.parquet and the
   op tables; clicking a column header sorts its table.
The compare and bisect runs are built from the session's cached engine captures (tests/conftest.py), so no
engine starts here. rl and ablate pages are drawn from tables in their documented columns (rl runs start
both engines; tests/rl/test_rl.py covers the rl command writing its page; the ablate command does not exist
yet). Chromium: `apt-get install -y chromium` (make test does it), or CHROMIUM=/path/to/chrome.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.comparison.op_diff import DIFFERS, first_divergence
from alignaudit.comparison.token_diff import worst_sequences
from alignaudit.errors import EXIT_OK, EXIT_USAGE
from alignaudit.pipelines.runs import diff_ops, write_ops
from helpers import CHROMIUM, needs_chromium, one_line_error, open_in_chromium, run_chromium

pytestmark = pytest.mark.engines


def field(dom: str, name: str) -> str:
    match = re.search(rf'data-field="{re.escape(name)}">([^<]*)<', dom)
    assert match, f"no {name} field on the page"
    return match.group(1)


def assert_offline(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)\s*=\s*["']?(https?:)?//""", text, re.I), "fetches a URL"
    assert text.count("<script") >= 2 and len(text) > 3_000_000  # plotly.js is in the page


@pytest.fixture(scope="module")
def compare_run(captures, tmp_path_factory):
    """A comparison of the fixture, megatron vs vllm, bf16, from the session's captures (`alignaudit diff`)."""
    out = tmp_path_factory.mktemp("report") / "compare"
    train, infer = captures.get("megatron", "bf16"), captures.get("vllm", "bf16")
    assert cli.main(["diff", str(train.path), str(infer.path), "--out", str(out)]) == EXIT_OK
    return out


@pytest.fixture(scope="module")
def bisect_run(captures, tmp_path_factory):
    """A bisect of the fixture (megatron vs hf, bf16, both modes) from the session's op captures."""
    out = tmp_path_factory.mktemp("report") / "bisect"
    out.mkdir()
    train = captures.get("megatron", "bf16", ops=True)
    write_ops(diff_ops(train, captures.get("hf", "bf16", ops=True)), out / "ops-natural.parquet")
    write_ops(diff_ops(train, captures.get("hf", "bf16", reference=train)), out / "ops-forced.parquet")
    sealed_record(out, "bisect", ("ops-natural.parquet", "ops-forced.parquet"))
    return out


def sealed_record(out: Path, command: str, outputs: tuple[str, ...]) -> None:
    """A finished run's record over tables a test wrote (alignaudit.comparison.integrity.seal), so the page may
    read them."""
    from alignaudit.comparison.integrity import seal
    from alignaudit.pipelines.runs import write_json

    write_json(out / "run.json", seal({"command": command}, out, outputs))


def test_a_page_that_throws_is_caught(tmp_path):
    """Negative control for the console check: without it, a page could fail silently and pass."""
    if CHROMIUM is None:
        pytest.skip("no Chromium found (apt-get install -y chromium, or set CHROMIUM=/path/to/chrome)")
    page = tmp_path / "throws.html"
    page.write_text("<html><body><div id=x></div><script>undefinedFunction();</script></body></html>")
    _, console = run_chromium(page, tmp_path)
    assert any("Uncaught ReferenceError" in line for line in console), console


@needs_chromium
def test_compare_report_renders_the_run(compare_run, tmp_path, capsys):
    assert cli.main(["report", str(compare_run)]) == EXIT_OK
    page = compare_run / "report.html"
    assert f"results: {page}" in capsys.readouterr().out
    assert_offline(page)
    probe, dom, console = open_in_chromium(page, tmp_path, clicks=[("sequences", "seq")])
    assert console == []
    assert {"plot-ulp-histogram", "plot-positions"} <= set(probe["plots"])
    assert all(p["rendered"] for p in probe["plots"].values()) and dom.count('class="plot-container') >= 2

    tokens = pd.read_parquet(compare_run / "tokens.parquet")
    sequences = pd.read_parquet(compare_run / "sequences.parquet")
    summary = json.loads((compare_run / "summary.json").read_text())
    mismatches = int((~tokens["bitwise_equal"]).sum())
    assert mismatches == summary["mismatches"] > 0  # bf16 megatron vs vllm differ (tests/engines/test_engines.py)
    assert field(dom, "mismatches") == str(mismatches) and field(dom, "tokens_compared") == str(len(tokens))
    assert f"{mismatches} of {len(tokens)} tokens differ" in dom

    bars = probe["plots"]["plot-ulp-histogram"]["traces"][0]  # log2 buckets (tests/reports/test_readable_reports.py)
    assert sum(bars["y"]) == int((tokens["ulp"] >= 0).sum()) and bars["x"][0] == "0"

    lines = probe["plots"]["plot-positions"]["traces"]
    assert [t["name"] for t in lines] == [f"seq {s}" for s in worst_sequences(sequences, 20)["seq"]]
    for trace in lines:
        rows = tokens[tokens["seq"] == int(trace["name"].split()[1])]
        assert trace["x"] == rows["pos"].tolist()
        np.testing.assert_array_equal(np.array(trace["y"], dtype=float), rows["diff"].abs().to_numpy())

    # the table arrives worst first; one click on "seq" sorts it by seq, descending
    shown = [int(r["seq"]) for r in probe["tables"]["sequences"]]
    assert shown == sorted(sequences["seq"].tolist(), reverse=True)
    unclicked = open_in_chromium(page, tmp_path)[0]["tables"]["sequences"]
    worst = worst_sequences(sequences, len(sequences))
    assert [int(r["seq"]) for r in unclicked] == worst["seq"].tolist() != shown
    assert [int(r["mismatches"]) for r in unclicked] == worst["mismatches"].tolist()


@needs_chromium
def test_bisect_report_marks_the_first_diverging_op(bisect_run, tmp_path):
    assert cli.main(["report", str(bisect_run), "--html", str(tmp_path / "b.html")]) == EXIT_OK
    page = tmp_path / "b.html"
    assert not (bisect_run / "report.html").exists()
    probe, dom, console = open_in_chromium(page, tmp_path)
    assert console == []
    assert all(probe["plots"][f"plot-bisect-{m}"]["rendered"] for m in ("natural", "forced"))
    for mode in ("natural", "forced"):
        records = pd.read_parquet(bisect_run / f"ops-{mode}.parquet").to_dict("records")
        first = first_divergence(records)
        equal, ulp = probe["plots"][f"plot-bisect-{mode}"]["traces"][:2]
        rows, cols = equal["y"], equal["x"]
        cell = {}
        for r in records:
            i = rows.index("model" if r["layer"] is None or np.isnan(r["layer"]) else f"layer {int(r['layer'])}")
            cell[r["op"]] = (i, cols.index(r["name"]))
        marked = [op for op, (i, j) in cell.items() if equal["text"][i][j] == "◀"]
        assert marked == [first["op"]]
        crossed = {op for op, (i, j) in cell.items() if equal["text"][i][j] in ("✗", "◀")}
        assert crossed == {r["op"] for r in records if r["status"] == DIFFERS}
        for r in records:
            i, j = cell[r["op"]]
            assert equal["z"][i][j] == r["equal_fraction"], r["op"]
            assert ulp["z"][i][j] == pytest.approx(np.log10(1 + r["ulp_max"]), rel=1e-12), r["op"]
        assert [row["op"] for row in probe["tables"][f"ops-{mode}"]] == [r["op"] for r in records]
    natural = pd.read_parquet(bisect_run / "ops-natural.parquet").to_dict("records")
    assert first_divergence(natural)["op"] == "layers.0.input_norm"  # tests/commands/test_bisect.py
    assert "first diverging op: layers.0.input_norm" in dom


def steps_table() -> pd.DataFrame:
    """Five steps in steps.parquet's documented columns (docs/rl.md)."""
    step = np.arange(1, 6)
    mismatches = np.array([0, 3, 0, 7, 1])
    return pd.DataFrame(
        {
            "step": step,
            "tokens": 256,
            "mismatches": mismatches,
            "mismatch_fraction": mismatches / 256,
            "nan_tokens": 0,
            "positive_tokens": 0,
            "ulp_max": [0, 2, 0, 9, 1],
            "max_abs_diff": [0.0, 1e-6, 0.0, 4e-6, 5e-7],
            "mean_diff": 0.0,
            "ratio_min": 1.0,
            "ratio_max": 1.0,
            "clip_fraction": 0.0,
            "token_mult_prob_error": 1.0,
            "kl_k3": 0.0,
            "reward_mean": 0.5 + 0.01 * step,
            "loss": 0.0,
            "grad_norm": 1.0 / step,
            "train_clip_fraction": 0.0,
            "train_forward_equal": True,
            "sync_bit_equal": [True, True, False, True, True],
            "sync_tensors_differing": [0, 0, 2, 0, 0],
            "sync_stale_packed": 0,
            "sync_replicas_diverged": 0,
            "weights_digest": [f"{k:064x}" for k in step],
            "seconds": 1.5,
            "rollout_s": 0.5,
            "rescore_s": 0.3,
            "update_s": 0.6,
            "sync_s": 0.1,
        }
    )


@needs_chromium
def test_rl_and_ablate_reports_plot_every_series(tmp_path):
    rl = tmp_path / "rl"
    rl.mkdir()
    steps = steps_table()
    steps.to_parquet(rl / "steps.parquet", index=False)
    _running(rl, "rl")  # a synthetic table: shown as an unfinished run's, under the banner that says so
    assert cli.main(["report", str(rl)]) == EXIT_OK
    probe, dom, console = open_in_chromium(rl / "report.html", tmp_path)
    assert console == [] and probe["plots"]["plot-rl-steps"]["rendered"]
    traces = {t["name"]: t for t in probe["plots"]["plot-rl-steps"]["traces"]}
    assert (
        traces["mismatches"]["y"] == steps["mismatches"].tolist()
        and traces["mismatches"]["x"] == steps["step"].tolist()
    )
    assert traces["max_abs_diff"]["y"] == [None, 1e-6, None, 4e-6, 5e-7]  # log axis: 0 is a gap
    numeric = [c for c in steps if c not in ("step", "tokens", "weights_digest")]
    assert set(traces) == set(numeric)  # every series the steps hold
    assert "3 of 5 steps with mismatching tokens; 1 weight syncs not bit-equal" in dom

    ablate = tmp_path / "ablate"
    ablate.mkdir()
    matrix = pd.DataFrame(
        {
            "factor": ["all strict", "rmsnorm", "attention", "rmsnorm", "vllm compile"],
            "kind": ["all strict", "default op", "default op", "strict op", "source"],
            "mismatches": [0, 120, 95, 0, 14],
            "tokens": 176,
            "max_ulp": [0, 3, 30000, 0, 2],
            "max_abs_diff": [0.0, 1e-3, 2e-2, 0.0, 1e-6],
            "first_diverging_op": [None, "layers.0.input_norm", "layers.0.attn", None, "layers.0.q_rope"],
        }
    )
    matrix.to_parquet(ablate / "ablate.parquet", index=False)
    sealed_record(ablate, "ablate", ("ablate.parquet",))
    assert cli.main(["report", str(ablate)]) == EXIT_OK
    probe, dom, console = open_in_chromium(ablate / "report.html", tmp_path, clicks=[("ablate", "mismatches")])
    assert console == [] and probe["plots"]["plot-ablate"]["rendered"]
    bars = {t["name"]: dict(zip(t["x"], t["y"], strict=True)) for t in probe["plots"]["plot-ablate"]["traces"]}
    for r in matrix.itertuples():
        assert bars[r.kind][r.factor] == r.mismatches
    assert [int(r["mismatches"]) for r in probe["tables"]["ablate"]] == sorted(matrix["mismatches"], reverse=True)


def _running(d: Path, command: str = "compare") -> Path:
    (d / "run.json").write_text(f'{{"command": "{command}", "status": "running"}}')
    return d


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "holds no alignaudit results"),
        (
            _running,
            "records an `alignaudit compare` run (status 'running') but summary.json is missing; "
            "the run did not finish",
        ),
        (lambda d: (d / "summary.json").write_text("{}"), "holds results but no run.json, so nothing vouches for them"),
        (lambda d: (_running(d) / "summary.json").write_text("{}"), "holds summary.json but not tokens.parquet"),
        (
            lambda d: (_running(d, "rl") / "steps.parquet").write_bytes(b"PAR1 not parquet"),
            "steps.parquet is unreadable",
        ),
        (
            lambda d: pd.DataFrame({"factor": ["x"]}).to_parquet(_running(d, "ablate") / "ablate.parquet"),
            "lacks the column(s) kind",
        ),
    ],
)
def test_bad_run_directories_are_one_line_input_errors(tmp_path, capsys, make, message):
    make(tmp_path)
    assert message in one_line_error(capsys, ["report", str(tmp_path)], EXIT_USAGE)
    assert not (tmp_path / "report.html").exists()
    assert "does not exist" in one_line_error(capsys, ["report", str(tmp_path / "missing")], EXIT_USAGE)


def test_html_target_is_never_a_file_alignaudit_did_not_write(compare_run, tmp_path, capsys):
    """--html replaces an earlier report, never another file, and needs an existing directory."""
    precious = tmp_path / "summary.json"
    precious.write_text('{"mine": 1}')
    assert "is not a report alignaudit wrote" in one_line_error(
        capsys, ["report", str(compare_run), "--html", str(precious)], EXIT_USAGE
    )
    assert precious.read_text() == '{"mine": 1}'
    assert "no directory" in one_line_error(
        capsys, ["report", str(compare_run), "--html", str(tmp_path / "missing" / "r.html")], EXIT_USAGE
    )
    page = tmp_path / "r.html"
    assert cli.main(["report", str(compare_run), "--html", str(page)]) == EXIT_OK
    assert cli.main(["report", str(compare_run), "--html", str(page)]) == EXIT_OK  # its own page: replaced
