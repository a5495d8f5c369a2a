"""The bisect section: per mode (natural, forced; or a diff's ops.parquet) two layer x op heatmaps, the share
of bitwise-equal elements and the max ULP distance (the hover has every column), the first differing op
outlined, and the op table."""

from __future__ import annotations

import json
import math

from alignaudit.capture.rundir import BISECT, OPS_FILES
from alignaudit.reports.html.page import Column, Page, table
from alignaudit.reports.html.runs import RunDir, read_table

OP_COLUMNS = ("op", "name", "layer", "status")
MODE_TITLES = {
    "natural": "Natural mode (both engines run freely)",
    "forced": "Forced mode (each op on the train engine's inputs)",
    "diff": "Ops of the two captures (alignaudit diff)",
}
NO_LAYER = "model"  # the row of embed, final_norm, logits, logprobs


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def read_records(path) -> list[dict]:
    """Op rows of an ops-*.parquet table as dicts (NaN -> None, ``worst`` parsed, ``forced`` defaulted).

    Raises:
        InputError: unreadable, or lacking the op columns.
    """
    frame = read_table(path, OP_COLUMNS)
    records = []
    for row in frame.to_dict("records"):
        r = {k: _clean(v) for k, v in row.items()}
        if isinstance(r.get("worst"), str):
            r["worst"] = json.loads(r["worst"])
        r["forced"] = r.get("forced") is not False
        if r.get("layer") is not None:
            r["layer"] = int(r["layer"])
        records.append(r)
    return records


def equal_text(r: dict) -> str:
    """The share of bitwise-equal elements as text; never "100.0%" beside an op that differs."""
    if r.get("equal_fraction") is None:
        return "-"
    text = f"{r['equal_fraction']:.1%}"
    return ">99.9%" if r["status"] == "differs" and text == "100.0%" else text


def worst_text(w: dict | None) -> str:
    """``; worst element seq S, pos P, index [I]: train X (hex) vs infer Y (hex), N ULP`` ('' without one)."""
    if not w:
        return ""
    if "train_experts" in w:  # an MoE routing record: expert indices, no values
        return (
            f"; first token routed elsewhere seq {w.get('seq')}, pos {w.get('pos')}: train experts "
            f"{w['train_experts']} vs infer {w.get('infer_experts')}"
        )
    try:
        return (
            f"; worst element seq {w['seq']}, pos {w['pos']}, index {w['index']}: train {w['train']:.9g} "
            f"({w['train_hex']}) vs infer {w['infer']:.9g} ({w['infer_hex']}), {w['ulp']} ULP"
        )
    except (KeyError, TypeError, ValueError):  # a record of another shape: shown as it is
        return f"; worst: {json.dumps(w, default=str)}"


def _mark(r: dict, first: dict | None) -> str:
    if not r["forced"]:
        return "~"
    if first is not None and r["op"] == first["op"]:
        return "◀"
    return {"equal": "✓", "differs": "✗"}.get(r["status"], "?")


def _hover(r: dict) -> str:
    lines = [f"<b>{r['op']}</b>: {r['status']}" + ("" if r["forced"] else " (inputs not forced)")]
    if r.get("elements") is not None:
        lines += [
            f"bitwise equal: {equal_text(r)} of {r['elements']} elements",
            f"max ULP {r.get('ulp_max')}, median ULP {r.get('ulp_median')}" if r.get("ulp_max") is not None else "",
            f"max |diff| {r['abs_max']:.3e}" if r.get("abs_max") is not None else "",
            f"rel_diff {r['rel_diff']:.1e}" if r.get("rel_diff") is not None else "",
        ]
    if r.get("worst"):
        lines.append(worst_text(r["worst"])[2:])
    if r.get("note"):
        lines.append(f"note: {r['note']}")
    return "<br>".join(line for line in lines if line)


def _compact(n: int) -> str:
    """1, 999, 30k, 244k, 1.2M: a ULP count short enough for a heatmap cell."""
    return str(n) if n < 1000 else f"{n / 1000:.0f}k" if n < 10**6 else f"{n / 10**6:.1f}M"


def heatmap(records: list[dict], first: dict | None):
    """Two layer x op heatmaps, one above the other: the share of bitwise-equal elements (cell text ✓ equal,
    ✗ differs, ◀ the first differing op, ~ inputs not forced, ? missing) and the max ULP (log colour scale,
    the count in the cell). The first differing op is outlined in both; hovering a cell shows every column."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(dict.fromkeys(r["name"] for r in records))  # records are in topological order
    layers = sorted({r["layer"] for r in records if r["layer"] is not None})
    rows = [f"layer {i}" for i in layers] + ([NO_LAYER] if any(r["layer"] is None for r in records) else [])

    def grid(fill):
        return [[fill] * len(names) for _ in rows]

    equal, ulp, marks, counts, hover = grid(None), grid(None), grid(""), grid(""), grid("")
    where = None
    for r in records:
        i = rows.index(NO_LAYER if r["layer"] is None else f"layer {r['layer']}")
        j = names.index(r["name"])
        equal[i][j] = r.get("equal_fraction")
        if r.get("ulp_max") is not None:
            ulp[i][j], counts[i][j] = math.log10(1 + r["ulp_max"]), _compact(r["ulp_max"])
        marks[i][j], hover[i][j] = _mark(r, first), _hover(r)
        if first is not None and r["op"] == first["op"]:
            where = (i, j)
    top = max((v for row in ulp for v in row if v is not None), default=0.0)
    powers = range(0, 2) if top <= 1.5 else range(1, int(math.ceil(top)) + 1)  # 0 and 1 would overlap
    ticks = [0] + [10**k for k in powers if math.log10(1 + 10**k) <= max(top, 1) + 1e-9]
    band = 1 / 2 - 0.06
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        subplot_titles=("share of bitwise-equal elements", "max ULP distance"),
    )
    common = dict(
        x=names,
        y=rows,
        texttemplate="%{text}",
        customdata=hover,
        hoverongaps=False,
        hovertemplate="%{customdata}<extra></extra>",
        xgap=2,
        ygap=2,
    )
    fig.add_trace(
        go.Heatmap(
            z=equal,
            zmin=0,
            zmax=1,
            text=marks,
            name="equal",
            colorscale=[[0, "#c92a2a"], [0.5, "#fcc419"], [0.999, "#a9e34b"], [1, "#2f9e44"]],
            colorbar=dict(title="equal", tickformat=".0%", y=1, yanchor="top", len=band),
            **common,
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Heatmap(
            z=ulp,
            zmin=0,
            zmax=max(top, 1),
            text=counts,
            name="max ULP",
            colorscale=[[0, "#f8f9fa"], [0.15, "#ffc9c9"], [1, "#a51111"]],
            colorbar=dict(
                title="max ULP",
                tickvals=[math.log10(1 + t) for t in ticks],
                ticktext=[_compact(t) for t in ticks],
                y=0,
                yanchor="bottom",
                len=band,
            ),
            **common,
        ),
        row=2,
        col=1,
    )
    if where is not None:
        i, j = where
        for axis in ("", "2"):
            fig.add_shape(
                type="rect",
                x0=j - 0.5,
                x1=j + 0.5,
                y0=i - 0.5,
                y1=i + 0.5,
                xref=f"x{axis}",
                yref=f"y{axis}",
                line=dict(color="#1c7ed6", width=3),
            )
    fig.update_xaxes(type="category", tickangle=-40)
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_layout(height=230 + 60 * len(rows))
    return fig


def _capture_changed(run: RunDir) -> dict:
    """bisect.json's ``as_configured`` entries where op capture changed an engine's logprobs (or could not
    tell: forced mode); bisect.json is among the files the run's seal covers."""
    from alignaudit.reports.html.runs import read_json

    path = run.path / BISECT
    result = read_json(path) if path.is_file() else {}
    return {role: c for role, c in (result.get("as_configured") or {}).items() if c.get("mismatches") != 0}


def bisect_section(page: Page, run: RunDir) -> None:
    """Add one heatmap, verdict line and op table per mode present in ``run``.

    Raises:
        InputError: an ops table unreadable or lacking its columns.
    """
    from alignaudit.comparison.op_diff import DIFFERS, first_divergence

    page.heading("Ops (bisect)", anchor="bisect")
    changed = _capture_changed(run)
    for role, c in changed.items():
        how = (
            "not compared (forced mode)"
            if c["mismatches"] is None
            else f"its logprobs differ from the engine as configured in {c['mismatches']} of {c['tokens']} tokens"
        )
        page.banner(
            f"op capture changed how {c['engine']} ({role}) runs "
            f"({', '.join(f'{k}={v}' for k, v in c['overrides'].items())}): {how}; the ops below describe the "
            "captured run, not the configuration asked for",
            False,
        )
    for mode, path in run.ops.items():
        records = read_records(path)
        judged = [r for r in records if r["forced"]]
        first = first_divergence(judged)
        page.heading(MODE_TITLES[mode], level=3, anchor=f"bisect-{mode}")
        differing = [r["op"] for r in judged if r["status"] == DIFFERS]
        if mode == "forced":
            page.banner(
                f"ops that compute differently on identical inputs: {len(differing)} of {len(judged)}"
                + (f": {', '.join(differing)}" if differing else ""),
                not differing,
            )
        elif first is None:
            page.banner(
                f"every op is bitwise equal ({len(judged)} ops)" + (" in the captured runs" if changed else ""),
                not changed,
            )
        else:
            page.banner(
                f"first diverging op: {first['op']} ({equal_text(first)} of {first['elements']} elements "
                f"bitwise equal){worst_text(first.get('worst'))}",
                False,
            )
        page.note(
            f"{len(differing)} of {len(judged)} ops differ ({OPS_FILES[mode]}); ✓ equal, ✗ differs, "
            + (
                "◀ first op that computes differently (outlined), "
                if mode == "forced"
                else "◀ first diverging op (outlined), "
            )
            + "~ inputs not forced (not judged), ? missing; hover a cell for every number"
        )
        rerouted = [
            r
            for r in records
            if r.get("name") == "routing"
            and isinstance(r.get("rerouted"), (int, float))
            and r["rerouted"] == r["rerouted"]
        ]  # NaN: the column of the other ops
        if rerouted:
            page.note(
                "tokens rerouted (MoE): "
                + "; ".join(
                    f"layer {r['layer']}: {int(r['rerouted'])} of {int(r['elements'])} positions" for r in rerouted
                )
            )
        page.figure(heatmap(records, first), f"bisect-{mode}")
        rows = [{**r, "mark": _mark(r, first), "equal_text": equal_text(r)} for r in records]
        columns = [
            Column("op", "op", text=True),
            Column("", "mark", text=True),
            Column("status", "status", text=True),
            Column("equal", "equal_fraction", shown="equal_text"),
            Column("max ULP", "ulp_max"),
            Column("median ULP", "ulp_median", "g"),
            Column("max |diff|", "abs_max", ".2e"),
            Column("rel_diff", "rel_diff", ".1e"),
            Column("dtype", "dtype", text=True),
            Column("note", "note", text=True),
        ]
        page.details(
            f"every op, {mode} mode (sortable table)",
            table(
                rows, columns, table_id=f"ops-{mode}", row_class=lambda r: "differs" if r["status"] == DIFFERS else ""
            ),
        )
