"""The ablate section: the factor matrix of ablate.parquet as a table, and mismatches per factor as bars."""

from __future__ import annotations

import pandas as pd

from alignaudit.capture.rundir import ABLATE_JSON, ABLATE_PARQUET
from alignaudit.reports.html.page import Column, Page, table
from alignaudit.reports.html.runs import RunDir, read_json, read_table

ABLATE_COLUMNS = ("factor", "kind", "mismatches", "tokens", "max_ulp", "max_abs_diff", "first_diverging_op")
KINDS = ("all strict", "default op", "strict op", "source")  # bar colours in this order
COLORS = ("#2f9e44", "#e8590c", "#1c7ed6", "#862e9c")


def ablate_figure(matrix: pd.DataFrame):
    """Grouped bars: mismatching tokens per factor, one colour per kind; the hover has the other columns."""
    import plotly.graph_objects as go

    fig = go.Figure()
    kinds = [k for k in KINDS if k in set(matrix["kind"])] + sorted(set(matrix["kind"]) - set(KINDS))
    for k, kind in enumerate(kinds):
        rows = matrix[matrix["kind"] == kind]
        hover = [
            f"{r.factor} ({kind})<br>{r.mismatches} of {r.tokens} tokens differ<br>max ULP {r.max_ulp}, "
            f"max |d| {r.max_abs_diff:.3e}<br>first diverging op: {r.first_diverging_op or '-'}"
            for r in rows.itertuples()
        ]
        fig.add_trace(
            go.Bar(
                x=rows["factor"].tolist(),
                y=rows["mismatches"].tolist(),
                name=kind,
                marker_color=COLORS[k] if k < len(COLORS) else None,
                text=rows["mismatches"].tolist(),
                textposition="outside",
                customdata=hover,
                hovertemplate="%{customdata}<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="group",
        height=420,
        title="mismatching tokens per factor",
        xaxis=dict(title="factor", type="category"),
        yaxis=dict(title="mismatching tokens"),
    )
    return fig


def ablate_section(page: Page, run: RunDir) -> pd.DataFrame:
    """Add the ablation matrix (table and bar chart); returns it.

    Raises:
        InputError: ablate.parquet unreadable or lacking one of ABLATE_COLUMNS.
    """
    matrix = read_table(run.path / ABLATE_PARQUET, ABLATE_COLUMNS)
    matrix = matrix.assign(
        first_diverging_op=matrix["first_diverging_op"].where(matrix["first_diverging_op"].notna(), None)
    )
    page.heading("Ablation matrix", anchor="ablate")
    record = read_json(run.path / ABLATE_JSON) if (run.path / ABLATE_JSON).is_file() else {}
    for note in record.get("notes") or ():
        page.note(note)
    page.figure(ablate_figure(matrix), "ablate")
    rows = [
        {**r, "mismatch_fraction": r["mismatches"] / r["tokens"] if r["tokens"] else None}
        for r in matrix.to_dict("records")
    ]
    page.add(
        table(
            rows,
            [
                Column("factor", "factor", text=True),
                Column("kind", "kind", text=True),
                *([Column("strict ops", "strict", text=True)] if "strict" in matrix.columns else []),
                Column("mismatches", "mismatches"),
                Column("tokens", "tokens"),
                Column("mismatching", "mismatch_fraction", ".1%"),
                Column("max ULP", "max_ulp"),
                Column("max |d|", "max_abs_diff", ".3e"),
                Column("first diverging op", "first_diverging_op", text=True),
            ],
            table_id="ablate",
            row_class=lambda r: "differs" if r["mismatches"] else "",
        )
    )
    return matrix
