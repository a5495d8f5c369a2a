"""``alignaudit report``: the HTML page of a run, or of several comparisons side by side (registered on the app by
alignaudit.commands.cli)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from alignaudit.commands.console import results


def report(
    run_dirs: Annotated[
        list[Path],
        typer.Argument(
            metavar="RUN_DIR",
            help="A run directory of compare, bisect, gate, rl or diff; two or more "
            "comparisons (compare, gate, diff, rescore): side by side.",
        ),
    ],
    html: Annotated[
        Optional[Path],
        typer.Option(
            "--html",
            metavar="FILE",
            help="Write the page here (default: RUN_DIR/report.html; several runs: alignaudit-runs/report-TIME.html).",
        ),
    ] = None,
) -> None:
    """One self-contained HTML page of a run, or of several comparisons side by side; opens offline.

    compare and gate: the summary grouped (alignment, RL impact, importance weights, distribution, routing),
    the fp32 ULP distances in log2 buckets, |d logprob| along each sequence (rollout: where each prompt
    ends), the worst tokens with their text, the sequences worst first (sortable), the settings and
    environment. bisect: layer x op heatmaps (share of bitwise-equal elements, max ULP), the first
    diverging op outlined, natural and forced mode. rl: every per-step series. An ablation matrix
    (ablate.parquet): table and bars. The kind of run is read from its files. compare, bisect, gate and rl
    write RUN_DIR/report.html themselves when they finish; this command makes it again, or elsewhere.

    Several runs: one column per run (engines, strict ops, mismatches, ULP, KL, clip fraction, ...) and
    their ULP histograms together; runs of different models, prompts or modes are refused.

    Examples:

    ```
    alignaudit report alignaudit-runs/compare-20260101-120000
    alignaudit report runs/ci --html alignment.html
    alignaudit report runs/default runs/strict --html default-vs-strict.html
    ```
    """
    if len(run_dirs) > 1:
        from alignaudit.reports.html.side_by_side import write_side_by_side

        results(write_side_by_side(run_dirs, html))
        return
    from alignaudit.reports.html import write_report

    results(write_report(run_dirs[0], html))
