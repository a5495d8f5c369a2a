"""The strict-vs-default picture of rl runs (alignaudit.rl.records.plot_runs), on tables shaped as steps.parquet."""

from __future__ import annotations

import pandas as pd
import pytest

from alignaudit.rl.records import RUNS_PANELS, plot_runs, runs_figure


def steps_table(mismatching: bool) -> pd.DataFrame:
    rows = []
    for step in range(1, 6):
        d = 0.01 * step if mismatching else 0.0
        rows.append(
            {
                "step": step,
                "reward_mean": 0.2 + 0.1 * step,
                "mismatch_fraction": 0.9 if mismatching else 0.0,
                "max_abs_diff": d,
                "kl_k3": d * d,
                "is_geo_mask_fraction": 0.3 if mismatching else 0.0,
                "ratio_max": 1 + d,
                "ratio_min": 1 - d,
                "sync_bit_equal": True,
            }
        )
    return pd.DataFrame(rows)


def test_plot_runs_overlays_a_strict_and_a_default_run(tmp_path):
    from PIL import Image

    path = tmp_path / "runs.png"
    plot_runs({"strict": steps_table(False), "default": steps_table(True)}, path, "title")
    assert Image.open(path).size == (1100, 1000)  # figsize 11 x 10 at 100 dpi


def test_runs_figure_draws_each_runs_values_and_names_runs_at_zero():
    import matplotlib.pyplot as plt

    strict, default = steps_table(False), steps_table(True)
    default.loc[2, "sync_bit_equal"] = False
    fig = runs_figure({"strict": strict, "default": default}, "title")
    try:
        panels = dict(zip((column for column, _, _ in RUNS_PANELS), fig.axes, strict=False))
        for column, ax in panels.items():
            lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
            assert lines["default"].get_ydata().tolist() == default[column].tolist()
            notes = [t.get_text() for t in ax.texts]
            if column in ("max_abs_diff", "kl_k3"):  # log axes: strict's zeros are named, not drawn
                assert "strict" not in lines and notes == ["strict: 0 at every step"]
                assert ax.get_yscale() == "log"
            else:
                assert lines["strict"].get_ydata().tolist() == strict[column].tolist() and notes == []
        dashed = [line for line in panels["ratio_max"].get_lines() if line.get_linestyle() == "--"]
        assert sorted(line.get_ydata().tolist() for line in dashed) == sorted(
            [default["ratio_min"].tolist(), strict["ratio_min"].tolist()]
        )
        assert fig._suptitle.get_text() == "title\nweight sync bit-equal at every step: strict yes, default NO"
    finally:
        plt.close(fig)


def test_plot_runs_needs_every_panels_column(tmp_path):
    assert {column for column, _, _ in RUNS_PANELS} | {"ratio_min", "sync_bit_equal", "step"} == set(steps_table(True))
    with pytest.raises(KeyError):
        plot_runs({"old": steps_table(True).drop(columns="is_geo_mask_fraction")}, tmp_path / "x.png")


def test_held_out_evaluations_get_a_panel_of_their_own_first(tmp_path):
    """eval.parquet's headline per run (accuracy under the task, the greedy reward otherwise), in the run's place
    among the runs' colors; the step panels follow in their order, the eighth place of the grid stays empty."""
    import matplotlib.pyplot as plt
    from PIL import Image

    strict, default = steps_table(False), steps_table(True)
    accuracy = pd.DataFrame({"step": [0, 5], "reward_mean": [0.4, 0.6], "accuracy": [0.70, 0.75]})
    reward_only = pd.DataFrame({"step": [0, 5], "reward_mean": [0.1, 0.3], "accuracy": [float("nan")] * 2})
    fig = runs_figure({"strict": strict, "default": default}, "title", {"strict": accuracy, "default": reward_only})
    try:
        held_out, *rest = fig.axes
        lines = {line.get_label(): line.get_ydata().tolist() for line in held_out.get_lines()}
        assert lines == {"strict": [0.70, 0.75], "default": [0.1, 0.3]}
        assert held_out.get_title() == "held-out accuracy (greedy) / held-out reward (greedy)"
        assert [ax.get_title() for ax in rest[: len(RUNS_PANELS)]] == [label for _, label, _ in RUNS_PANELS]
        assert not rest[-1].get_visible() and all(ax.get_visible() for ax in rest[:-1])
        assert rest[len(RUNS_PANELS) - 1].get_xlabel() == "step" and rest[len(RUNS_PANELS) - 2].get_xlabel() == "step"
    finally:
        plt.close(fig)
    path = tmp_path / "runs.png"
    plot_runs({"strict": strict}, path, "title", {"strict": accuracy})
    assert Image.open(path).size == (1100, 1300)
    plot_runs({"strict": strict}, path, "title", {"strict": accuracy.iloc[:0]})  # no evaluation: no panel
    assert Image.open(path).size == (1100, 1000)


def test_a_run_without_held_out_evaluations_is_named_in_that_panel():
    import matplotlib.pyplot as plt

    accuracy = pd.DataFrame({"step": [0, 5], "reward_mean": [0.4, 0.6], "accuracy": [0.70, 0.75]})
    fig = runs_figure({"strict": steps_table(False), "default": steps_table(True)}, "t", {"strict": accuracy})
    try:
        held_out = fig.axes[0]
        assert [line.get_label() for line in held_out.get_lines()] == ["strict"]
        assert [t.get_text() for t in held_out.texts] == ["default: no held-out evaluation"]
    finally:
        plt.close(fig)


def test_plot_rl_runs_refuses_an_eval_table_it_cannot_read(tmp_path):
    """bench/plot_rl_runs.py: a run's eval.parquet that is no parquet, or lacks the held-out columns, is one line and
    exit 2 (the script's rule for bad input), not a traceback."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    run = tmp_path / "run"
    run.mkdir()
    steps_table(False).to_parquet(run / "steps.parquet")
    record = {"model": {"name": "m"}, "prompts": {"digest": "d"}, "rollout": {}, "rl": {}}
    (run / "run.json").write_text(json.dumps(record))
    script = Path(__file__).parents[2] / "bench" / "plot_rl_runs.py"
    for content, message in ((b"not parquet", "is not a readable parquet file"), (None, "lacks accuracy")):
        if content is None:
            pd.DataFrame({"step": [0], "reward_mean": [0.1]}).to_parquet(run / "eval.parquet")
        else:
            (run / "eval.parquet").write_bytes(content)
        done = subprocess.run(
            [sys.executable, str(script), f"a={run}", "--out", str(tmp_path / "p.png")], capture_output=True, text=True
        )
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
