"""The compare section: summary fields, the ULP histogram, |d logprob| along each sequence, the sequences
(worst first, sortable) and the largest single-token differences; a gate verdict above them."""

from __future__ import annotations

import numpy as np
import pandas as pd

from alignaudit.capture.rundir import SEQUENCES, SUMMARY, TOKENS
from alignaudit.comparison.token_diff import worst_sequences
from alignaudit.reports.html.page import Column, Page, esc, flatten, key_values, table
from alignaudit.reports.html.runs import RunDir, read_json, read_table

LINE_SEQUENCES = 20  # sequences drawn along their positions (the worst ones)
LINE_POINTS = 2000  # longer sequences are drawn as the max |d| per bin of positions
TABLE_SEQUENCES = 2000  # rows of the per-sequence table (worst first)
WORST_TOKENS = 20
TOKEN_COLUMNS = ("seq", "pos", "token_id", "lp_train", "lp_infer", "diff", "bitwise_equal", "ulp", "pair_class")
SEQUENCE_COLUMNS = ("seq", "tokens", "mismatches", "first_mismatch_pos", "nan_tokens", "ulp_max", "max_abs_diff")
SUMMARY_FIELDS = ("tokens_compared", "mismatches", "ulp_histogram")


def side_label(side: dict) -> str:
    """``engine (dtype, device, strict ..., options)`` of one side of a comparison."""
    extra = [side.get("dtype"), side.get("device")]
    if side.get("strict"):
        extra.append(f"strict {side['strict']}")
    if side.get("strict_exp") not in (None, "portable"):
        extra.append(f"{side['strict_exp']} exp")
    if side.get("lm_head_dtype") == "fp32":
        extra.append("fp32 lm_head")
    extra += [f"{k}={v}" for k, v in (side.get("options") or {}).items()]
    shown = ", ".join(str(e) for e in extra if e)
    return f"{side.get('engine', '?')} ({shown})" if shown else side.get("engine", "?")


def gate_section(page: Page, verdict: dict) -> None:
    """The gate's verdict (judged again from the checked run: gate.rejudge): pass, fail or error, its rule,
    reasons and what it did not judge."""
    label = str(verdict.get("verdict", "?"))
    page.heading("Gate verdict", anchor="gate")
    page.banner(f"gate {label.upper()} ({verdict.get('rule', '')}): {verdict.get('mismatches')} of "
                f"{verdict.get('tokens_compared')} tokens differ, max ULP {verdict.get('ulp_max')}", label == "pass")
    reasons = list(verdict.get("reasons") or []) + ([f"engine error: {verdict['error']}"]
                                                    if verdict.get("error") else [])
    reasons += [f"not judged: {n}" for n in verdict.get("notes") or []]
    if reasons:
        page.add("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in reasons) + "</ul>")


def compare_section(page: Page, run: RunDir) -> dict:
    """Add the compare section for ``run``; returns its summary record.

    Raises:
        InputError: summary.json, tokens.parquet or sequences.parquet unreadable or missing columns.
    """
    summary = read_json(run.path / SUMMARY)
    missing = [f for f in SUMMARY_FIELDS if f not in summary]
    if missing:
        from alignaudit.errors import InputError

        raise InputError(f"{run.path / SUMMARY} lacks {', '.join(missing)}; it was written by another alignaudit "
                         "version or altered: run the comparison again")
    tokens = read_table(run.path / TOKENS, TOKEN_COLUMNS)
    sequences = read_table(run.path / SEQUENCES, SEQUENCE_COLUMNS)
    n, bad = summary["tokens_compared"], summary["mismatches"]
    page.heading("Logprob comparison", anchor="compare")
    nan = summary.get("nan_tokens") or {}
    if nan.get("train") or nan.get("infer"):
        page.banner(f"NaN logprobs: {nan['train']} tokens on the train side, {nan['infer']} on the infer side; "
                    f"{bad} of {n} tokens differ", False)
    else:
        page.banner("BITWISE IDENTICAL: every compared logprob has the same fp32 bits" if bad == 0
                    else f"{bad} of {n} tokens differ ({summary.get('mismatch_fraction', 0):.2%})", bad == 0)
    sides = summary.get("sides") or {}
    left = key_values([(role, side_label(side)) for role, side in sides.items()], table_id="sides") if sides else ""
    fields = {k: v for k, v in summary.items() if k not in ("worst_sequences", "sides", "routing", "repeats")}
    left += "<h3>Summary (summary.json)</h3>" + key_values(flatten(fields), table_id="summary")
    left += _routing_html(summary.get("routing")) + _repeats_html(summary.get("repeats"))
    page.row(left, "<h3>fp32 ULP distance</h3>" + page.figure_html(ulp_figure(summary), "ulp-histogram"))
    page.heading("|d logprob| along each sequence", level=3)
    figure, caption = positions_figure(tokens, sequences)
    page.note(caption)
    page.figure(figure, "positions")
    page.heading("Sequences, worst first", level=3)
    sequence_table(page, sequences)
    if bad:
        page.heading(f"Largest single-token differences (top {min(bad, WORST_TOKENS)})", level=3)
        columns = [Column("seq", "seq"), Column("pos", "pos"), Column("token", "token_id"),
                   Column("lp_train", "lp_train", shown="train_text"), Column("bits", "train_hex", text=True),
                   Column("lp_infer", "lp_infer", shown="infer_text"), Column("bits", "infer_hex", text=True),
                   Column("d", "diff", ".3e"), Column("ULP", "ulp")]
        page.add(table(worst_tokens(tokens), columns, table_id="worst-tokens"))
    return summary


def _routing_html(layers: list[dict] | None) -> str:
    """MoE: per layer, prompt positions the two engines sent to other experts."""
    if not layers:
        return ""
    rows = [(f"layer {r['layer']}", f"{r['rerouted']} of {r['tokens']} positions rerouted ({r['agreement']:.1%} agree)")
            for r in layers]
    return "<h3>Routing (MoE)</h3>" + key_values(rows, table_id="routing")


def _repeats_html(repeats: dict | None) -> str:
    """compare --repeat: per engine and repeat, tokens that differ from the engine's first run."""
    if not repeats:
        return ""
    rows = [(f"{role} repeat {p['repeat']} ({p['kind']}, batch of {p['batch_size']})",
             f"{p['mismatches']} of {p['tokens']} tokens differ, max ULP {p['ulp_max']}")
            for role, r in repeats.items() for p in r["per_repeat"]]
    return "<h3>Repeats (each engine against its first run)</h3>" + key_values(rows, table_id="repeats")


def ulp_figure(summary: dict):
    """Bars of summary.json's ULP histogram (finite pairs), NaN/Inf mismatches as their own bars."""
    import plotly.graph_objects as go

    hist = summary["ulp_histogram"]
    labels, counts = list(hist), [int(v) for v in hist.values()]
    colors = ["#2f9e44"] + ["#e8590c"] * (len(labels) - 1)
    special = [(k, int(summary.get(f"{k.lower()}_mismatches") or 0)) for k in ("NaN", "Inf")]
    for name, count in special:
        if count:
            labels.append(f"{name} mismatch")
            counts.append(count)
            colors.append("#862e9c")
    fig = go.Figure(go.Bar(x=labels, y=counts, marker_color=colors, text=counts, textposition="outside",
                           hovertemplate="%{x} ULP: %{y} tokens<extra></extra>"))
    fig.update_layout(height=400, xaxis=dict(title="fp32 ULP distance of finite pairs (0 = bitwise equal)",
                                             type="category"), yaxis=dict(title="tokens"),
                      title=f"{summary['tokens_compared']} tokens, {summary['mismatches']} not bitwise equal")
    return fig


def _binned(pos: np.ndarray, y: np.ndarray, ulp: np.ndarray, points: int):
    """At most ``points`` points: per bin of consecutive positions, the one with the largest |d|."""
    if len(pos) <= points:
        return pos, y, ulp
    bins = np.array_split(np.arange(len(pos)), points)
    pick = np.array([b[np.argmax(np.nan_to_num(y[b], nan=-1.0))] for b in bins])
    return pos[pick], y[pick], ulp[pick]


def positions_figure(tokens: pd.DataFrame, sequences: pd.DataFrame):
    """One line per sequence (the LINE_SEQUENCES worst when there are more): |lp_train - lp_infer| at each
    scored position; NaN/Inf pairs leave a gap. A button switches the y axis to log scale. Returns the
    figure and a caption saying what is drawn."""
    import plotly.graph_objects as go

    shown = worst_sequences(sequences, LINE_SEQUENCES)["seq"].tolist()
    fig = go.Figure()
    binned = False
    for seq in shown:
        rows = tokens[tokens["seq"] == seq]
        d = rows["diff"].to_numpy(dtype=np.float64)
        y = np.where(np.isfinite(d), np.abs(d), np.nan)
        pos, y, ulp = _binned(rows["pos"].to_numpy(), y, rows["ulp"].to_numpy(), LINE_POINTS)
        binned |= len(pos) < len(rows)
        fig.add_trace(go.Scatter(x=pos, y=[None if v != v else v for v in y], customdata=ulp, mode="lines+markers",
                                 marker=dict(size=4), name=f"seq {seq}", connectgaps=False,
                                 hovertemplate=f"seq {seq}, pos %{{x}}<br>|d| %{{y:.3e}}<br>"
                                               f"%{{customdata}} ULP<extra></extra>"))
    more = len(sequences) - len(shown)
    caption = (f"{len(shown)} sequences" if not more else f"the {len(shown)} worst of {len(sequences)} sequences") + \
        (f"; at most {LINE_POINTS} points each (max |d| per bin)" if binned else "") + \
        "; NaN and Inf pairs leave gaps; the buttons switch the y axis between linear and log"
    scales = [dict(label=s, method="relayout", args=[{"yaxis.type": s}]) for s in ("linear", "log")]
    fig.update_layout(height=420, xaxis=dict(title="position"), yaxis=dict(title="|lp_train - lp_infer|"),
                      updatemenus=[dict(type="buttons", direction="right", x=0, y=1.02, xanchor="left",
                                        yanchor="bottom", buttons=scales)])
    return fig, caption


def sequence_table(page: Page, sequences: pd.DataFrame) -> None:
    """The per-sequence table, worst first (NaN, then most mismatches, then largest ULP), sortable."""
    ordered = worst_sequences(sequences, TABLE_SEQUENCES)
    rows = []
    for r in ordered.to_dict("records"):
        rows.append({**r, "mismatch_fraction": r["mismatches"] / r["tokens"] if r["tokens"] else None,
                     "first_mismatch_pos": None if r["first_mismatch_pos"] < 0 else r["first_mismatch_pos"],
                     "ulp_max": None if r["ulp_max"] < 0 else r["ulp_max"]})
    if len(sequences) > len(ordered):
        page.note(f"the {len(ordered)} worst of {len(sequences)} sequences; all are in {SEQUENCES}")
    page.note("click a column header to sort")
    page.add(table(rows, [Column("seq", "seq"), Column("tokens", "tokens"), Column("mismatches", "mismatches"),
                          Column("mismatching", "mismatch_fraction", ".1%"),
                          Column("first mismatch pos", "first_mismatch_pos"), Column("NaN tokens", "nan_tokens"),
                          Column("max ULP", "ulp_max"), Column("max |d|", "max_abs_diff", ".3e")],
                   table_id="sequences", row_class=lambda r: "differs" if r["mismatches"] else ""))


def worst_tokens(tokens: pd.DataFrame) -> list[dict]:
    """The WORST_TOKENS differing tokens with the largest |d| (NaN/Inf pairs first), fp32 bits in hex."""
    differing = tokens[~tokens["bitwise_equal"]]
    score = differing["diff"].abs().where(differing["ulp"] >= 0, np.inf)
    worst = differing.assign(score=score).sort_values(["score", "seq", "pos"], ascending=[False, True, True])
    rows = []
    for r in worst.head(WORST_TOKENS).to_dict("records"):
        bits = np.array([r["lp_train"], r["lp_infer"]], dtype=np.float32).view(np.uint32)
        rows.append({**r, "train_hex": f"0x{int(bits[0]):08x}", "infer_hex": f"0x{int(bits[1]):08x}",
                     "train_text": f"{r['lp_train']:.9g}", "infer_text": f"{r['lp_infer']:.9g}",
                     "ulp": None if r["ulp"] < 0 else r["ulp"]})
    return rows
