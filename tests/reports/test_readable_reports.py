"""Readable report pages, on real runs of the fixture opened in a real headless Chromium (tests/helpers.py).

What must hold:
1. The compare page groups its summary (Alignment, RL impact; Importance weights and Distribution only where
   summary.json has them) and renders with no console output.
2. Its ULP histogram is the tokens table's fp32 ULP distances in log2 buckets up to the largest distance,
   counted here independently (Python's int.bit_length of each distance), NaN/Inf pairs apart.
3. In rollout mode each drawn sequence has a prompt-end marker between its last prompt token and its first
   generated one; the prompt lengths come from the sampling capture's manifest, not from the page's code.
4. The worst-tokens table's text is ``tokenizer.decode([id])`` of the fixture's own tokenizer; without a
   tokenizer the page says so and still renders.
5. ``report RUN_A RUN_B`` shows each run's numbers (read back from each run's summary.json and tokens.parquet)
   and refuses runs of different modes, a run given twice and a run that holds no comparison.
Runs are `alignaudit diff` of the session's cached captures (tests/conftest.py), the same ones the engine
tests make, so the engines start once per session.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from alignaudit.commands import cli
from alignaudit.errors import EXIT_OK, EXIT_USAGE, InputError
from helpers import FIXTURE, needs_chromium, one_line_error, open_in_chromium

pytestmark = pytest.mark.engines

ROLLOUT = {"max_new_tokens": 32, "temperature": 1.0, "seed": 0}  # tests/engines/test_strict.py's sampling


def diff_run(out: Path, train, infer) -> Path:
    assert cli.main(["diff", str(train.path), str(infer.path), "--out", str(out)]) == EXIT_OK
    return out


@pytest.fixture(scope="module")
def runs(captures, tmp_path_factory):
    """Default (megatron vs vllm, bf16), strict (both strict all) and rollout (vllm samples, megatron rescores)."""
    root = tmp_path_factory.mktemp("readable")
    sampled = captures.get("vllm", "bf16", rollout=ROLLOUT)
    return {
        "default": diff_run(root / "default", captures.get("megatron", "bf16"), captures.get("vllm", "bf16")),
        "strict": diff_run(
            root / "strict", captures.get("megatron", "bf16", strict="all"), captures.get("vllm", "bf16", strict="all")
        ),
        "rollout": diff_run(root / "rollout", captures.get("megatron", "bf16", batch=sampled), sampled),
        "sampled": sampled,
    }


def log2_counts(tokens: pd.DataFrame) -> tuple[list[int], int, int]:
    """Finite pairs (pair_class 0 or 1) per log2 bucket (bucket = bit length of the distance), NaN and Inf
    mismatches."""
    finite = tokens[tokens["pair_class"] <= 1]["ulp"].tolist()
    lengths = [int(u).bit_length() for u in finite]
    counts = [0] * (max(lengths) + 1)
    for k in lengths:
        counts[k] += 1
    return counts, int((tokens["pair_class"] == 2).sum()), int((tokens["pair_class"] == 3).sum())


def page_of(run: Path, tmp_path: Path, name: str):
    page = tmp_path / f"{name}.html"
    assert cli.main(["report", str(run), "--html", str(page)]) == EXIT_OK
    probe, dom, console = open_in_chromium(page, tmp_path)
    assert console == []
    return probe, dom


@needs_chromium
def test_compare_page_groups_the_summary_and_buckets_ulp_in_log2(runs, tmp_path):
    from transformers import AutoTokenizer

    run = runs["default"]
    probe, dom = page_of(run, tmp_path, "default")
    summary = json.loads((run / "summary.json").read_text())
    tokens = pd.read_parquet(run / "tokens.parquet")
    for anchor in ("alignment", "rl-impact"):
        assert f'id="summary-{anchor}"' in dom
    assert ('id="distribution"' in dom) == bool(summary.get("vocab"))  # shown only where the summary has it
    assert ('id="importance"' in dom) == bool(summary.get("importance") or summary["rl"].get("importance"))
    assert 'id="routing"' not in dom and 'id="generated"' not in dom  # a dense model, prompt mode
    assert f'data-field="mismatches">{summary["mismatches"]}<' in dom and summary["mismatches"] > 0
    assert "Settings and environment" in dom and 'id="environment"' in dom

    counts, nan, inf = log2_counts(tokens)
    bars = probe["plots"]["plot-ulp-histogram"]["traces"]
    assert bars[0]["y"] == counts and len(counts) > 6  # the default stack spreads over many buckets
    assert bars[0]["x"][:4] == ["0", "1", "2-3", "4-7"] and len(bars) == (2 if nan or inf else 1)
    assert max(tokens["ulp"]) < 2 ** (len(counts) - 1) * 2 and max(tokens["ulp"]) >= 2 ** (len(counts) - 2)

    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    worst = probe["tables"]["worst-tokens"]
    assert len(worst) == min(20, summary["mismatches"])
    by_key = tokens.set_index(["seq", "pos"])
    for row in worst:
        token_id = int(by_key.loc[(int(row["seq"]), int(row["pos"])), "token_id"])
        assert int(row["token_id"]) == token_id
        assert row["text"] == tokenizer.decode([token_id])
        assert float(row["diff"]) == pytest.approx(by_key.loc[(int(row["seq"]), int(row["pos"])), "diff"], rel=1e-12)


@needs_chromium
def test_rollout_page_marks_where_each_prompt_ends(runs, tmp_path):
    probe, dom = page_of(runs["rollout"], tmp_path, "rollout")
    lengths = runs["sampled"].manifest["rollout"]["prompt_lengths"]
    plot = probe["plots"]["plot-positions"]
    lines = [t for t in plot["traces"] if t["name"].startswith("seq ")]
    assert len(lines) == len(lengths) == 4 and len(set(lengths)) == 4
    marks = {s["name"]: s for s in plot["shapes"]}
    assert plot["drawn_shapes"] >= len(lines)
    for trace in lines:
        seq = int(trace["name"].split()[1])
        mark = marks[f"prompt end seq {seq}"]
        assert mark["x0"] == mark["x1"] == lengths[seq] - 0.5
        symbols = dict(zip(trace["x"], trace["symbol"], strict=True))
        assert {symbols[p] for p in symbols if p < lengths[seq]} == {"circle-open"}
        assert {symbols[p] for p in symbols if p >= lengths[seq]} == {"circle"}
    assert 'id="generated"' in dom  # the generated tokens' own section
    tokens = pd.read_parquet(runs["rollout"] / "tokens.parquet")
    generated = set(zip(tokens.loc[tokens["generated"], "seq"], tokens.loc[tokens["generated"], "pos"], strict=True))
    for row in probe["tables"]["worst-tokens"]:
        assert row["where"] == ("generated" if (int(row["seq"]), int(row["pos"])) in generated else "prompt")


@needs_chromium
def test_page_without_a_tokenizer_says_so(runs, tmp_path):
    """An unfinished run (shown under its banner, nothing sealed) whose model directory holds no tokenizer."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("summary.json", "tokens.parquet", "sequences.parquet"):
        shutil.copy2(runs["default"] / name, run / name)
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy2(FIXTURE / "config.json", model / "config.json")
    (run / "run.json").write_text(
        json.dumps({"command": "compare", "status": "running", "model": {"name": "x", "path": str(model)}})
    )
    probe, dom = page_of(run, tmp_path, "no-tokenizer")
    assert "holds no tokenizer (tokenizer.json or tokenizer.model): token ids are shown as ids" in dom
    assert "text" not in probe["tables"]["worst-tokens"][0] and probe["tables"]["worst-tokens"][0]["token_id"]


@needs_chromium
def test_runs_side_by_side_show_each_runs_numbers(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", str(runs["default"]), str(runs["strict"])]) == EXIT_OK
    written = sorted((tmp_path / "alignaudit-runs").glob("report-*.html"))
    assert len(written) == 1 and f"results: {written[0].relative_to(tmp_path)}" in capsys.readouterr().out
    probe, dom, console = open_in_chromium(written[0], tmp_path)
    assert console == []
    table = {row["metric"]: row for row in probe["tables"]["runs"] if "metric" in row}
    summaries = [json.loads((runs[k] / "summary.json").read_text()) for k in ("default", "strict")]
    assert summaries[0]["mismatches"] > 0 and summaries[1]["mismatches"] == 0  # tests/engines/test_strict.py
    for i, s in enumerate(summaries):
        cell = f"run{i}"
        assert int(table["mismatches"][cell]) == s["mismatches"]
        assert int(table["tokens_compared"][cell]) == s["tokens_compared"]
        assert float(table["mismatch_fraction"][cell]) == s["mismatch_fraction"]
        assert float(table["max_abs_diff"][cell]) == s["max_abs_diff"]
        assert int(table["ulp_max"][cell]) == s["ulp_max"]
        assert float(table["rl.kl_k3_mean"][cell]) == s["rl"]["kl_k3_mean"]
        assert float(table["rl.clip_fraction"][cell]) == s["rl"]["clip_fraction"]
    assert table["strict"]["run0"] == "default / default" and table["strict"]["run1"] == "strict all / strict all"
    assert "sampling" not in table  # prompt mode: no row of dashes
    imp = summaries[0]["importance"]  # the thresholds every fraction was computed at, per run (verl's defaults here)
    shown = (
        f"{imp['tis_threshold']:g}; [{imp['mask_low']:g}, {imp['mask_high']:g}]; "
        f"[{imp['geo_mask_low']:g}, {imp['geo_mask_high']:g}]"
    )
    assert table["is_thresholds"]["run0"] == table["is_thresholds"]["run1"] == shown == "2; [0.5, 5]; [0.999, 1.001]"
    bars = {t["name"]: t for t in probe["plots"]["plot-runs-ulp"]["traces"]}
    for key in ("default", "strict"):
        counts = log2_counts(pd.read_parquet(runs[key] / "tokens.parquet"))[0]
        assert bars[key]["y"][: len(counts)] == counts and not any(bars[key]["y"][len(counts) :])
    assert bars["strict"]["y"][0] == summaries[1]["tokens_compared"]


def test_runs_side_by_side_refusals(runs, bisect_dir, tmp_path, capsys):
    base = ["report", "--html", str(tmp_path / "r.html")]
    err = one_line_error(capsys, [*base, str(runs["default"]), str(runs["rollout"])], EXIT_USAGE)
    assert "the runs differ in mode (default: prompt; rollout: rollout)" in err
    err = one_line_error(capsys, [*base, str(runs["default"]), str(runs["default"])], EXIT_USAGE)
    assert "is given twice" in err
    err = one_line_error(capsys, [*base, str(runs["default"]), str(bisect_dir)], EXIT_USAGE)
    assert "holds no logprob comparison (a bisect run)" in err
    assert not (tmp_path / "r.html").exists()


@pytest.fixture
def bisect_dir(tmp_path):
    """A sealed bisect-like directory: ops tables only (the kind is read from the files)."""
    from alignaudit.comparison.integrity import seal
    from alignaudit.pipelines.runs import write_json

    out = tmp_path / "bisect"
    out.mkdir()
    pd.DataFrame({"op": ["embed"], "name": ["embed"], "layer": [np.nan], "status": ["equal"]}).to_parquet(
        out / "ops-natural.parquet"
    )
    write_json(out / "run.json", seal({"command": "bisect"}, out, ("ops-natural.parquet",)))
    return out


def test_runs_side_by_side_are_compared_by_prompt_digest_not_file_name(tmp_path):
    """Two runs of the same token ids, read from prompt files of different names, count the same tokens: side by
    side they go; the same file name over other ids does not."""
    from types import SimpleNamespace

    from alignaudit.reports.html.side_by_side import RunColumn, check_comparable, workload

    def column(name, source, digest):
        record = {
            "mode": "prompt",
            "prompts": {"source": source, "digest": digest},
            "model": {"name": "qwen3-tiny", "checkpoint_sha256": "ab" * 32},
        }
        run = SimpleNamespace(record=record, captures={}, path=tmp_path / name)
        return RunColumn(run, {}, [], {}, workload(run))

    check_comparable([column("a", "prompts-a.jsonl", "d1" * 32), column("b", "renamed.jsonl", "d1" * 32)])
    with pytest.raises(InputError, match=r"the runs differ in prompts \(a: same.jsonl, digest d1d1"):
        check_comparable([column("a", "same.jsonl", "d1" * 32), column("b", "same.jsonl", "e2" * 32)])
