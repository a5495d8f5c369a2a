"""The strict-vs-default picture of rl runs (alignaudit.rl.records.plot_runs), on tables shaped as steps.parquet."""

from __future__ import annotations

import pandas as pd
import pytest

from alignaudit.rl.records import RUNS_PANELS, plot_runs


def steps_table(mismatching: bool) -> pd.DataFrame:
    rows = []
    for step in range(1, 6):
        d = 0.01 * step if mismatching else 0.0
        rows.append({"step": step, "reward_mean": 0.2 + 0.1 * step, "mismatch_fraction": 0.9 if mismatching else 0.0,
                     "max_abs_diff": d, "kl_k3": d * d, "is_geo_mask_fraction": 0.3 if mismatching else 0.0,
                     "ratio_max": 1 + d, "ratio_min": 1 - d, "sync_bit_equal": True})
    return pd.DataFrame(rows)


def test_plot_runs_overlays_a_strict_and_a_default_run(tmp_path):
    from PIL import Image

    path = tmp_path / "runs.png"
    plot_runs({"strict": steps_table(False), "default": steps_table(True)}, path, "title")
    assert Image.open(path).size == (1100, 1000)  # figsize 11 x 10 at 100 dpi


def test_plot_runs_needs_every_panels_column(tmp_path):
    assert {column for column, _, _ in RUNS_PANELS} | {"ratio_min", "sync_bit_equal", "step"} == set(steps_table(True))
    with pytest.raises(KeyError):
        plot_runs({"old": steps_table(True).drop(columns="is_geo_mask_fraction")}, tmp_path / "x.png")
