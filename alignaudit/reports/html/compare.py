"""The compare section: the summary in sections (reports.views.summary_sections), the fp32 ULP histogram in log2
buckets from tokens.parquet, |d logprob| along each sequence (rollout: where each prompt ends), the largest
single-token differences with their text, the sequences (worst first, sortable), the settings and environment
folded; a gate verdict above them."""

from __future__ import annotations

import numpy as np
import pandas as pd

from alignaudit.capture.rundir import SEQUENCES, SUMMARY, TOKENS
from alignaudit.comparison.token_diff import worst_sequences
from alignaudit.reports.html.page import Column, Page, esc, fmt, key_values, table
from alignaudit.reports.html.runs import RunDir, read_json, read_table
from alignaudit.reports.views import Section, prompt_ends, side_label, summary_sections, ulp_buckets

LINE_SEQUENCES = 20  # sequences drawn along their positions (the worst ones)
LINE_POINTS = 2000  # longer sequences are drawn as the max |d| per bin of positions
TABLE_SEQUENCES = 2000  # rows of the per-sequence table (worst first)
WORST_TOKENS = 20
TOKEN_COLUMNS = ("seq", "pos", "token_id", "lp_train", "lp_infer", "diff", "bitwise_equal", "ulp", "pair_class")
SEQUENCE_COLUMNS = ("seq", "tokens", "mismatches", "first_mismatch_pos", "nan_tokens", "ulp_max", "max_abs_diff")
SUMMARY_FIELDS = ("tokens_compared", "mismatches", "ulp_histogram")


def gate_section(page: Page, verdict: dict) -> None:
    """The gate's verdict (judged again from the checked run: gate.rejudge): pass, fail or error, its rule,
    reasons and what it did not judge."""
    label = str(verdict.get("verdict", "?"))
    page.heading("Gate verdict", anchor="gate")
    page.banner(
        f"gate {label.upper()} ({verdict.get('rule', '')}): {verdict.get('mismatches')} of "
        f"{verdict.get('tokens_compared')} tokens differ, max ULP {verdict.get('ulp_max')}",
        label == "pass",
    )
    reasons = list(verdict.get("reasons") or []) + (
        [f"engine error: {verdict['error']}"] if verdict.get("error") else []
    )
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

        raise InputError(
            f"{run.path / SUMMARY} lacks {', '.join(missing)}; it was written by another alignaudit "
            "version or altered: run the comparison again"
        )
    tokens = read_table(run.path / TOKENS, TOKEN_COLUMNS)
    sequences = read_table(run.path / SEQUENCES, SEQUENCE_COLUMNS)
    n, bad = summary["tokens_compared"], summary["mismatches"]
    page.heading("Logprob comparison", anchor="compare")
    nan = summary.get("nan_tokens") or {}
    if nan.get("train") or nan.get("infer"):
        page.banner(
            f"NaN logprobs: {nan['train']} tokens on the train side, {nan['infer']} on the infer side; "
            f"{bad} of {n} tokens differ",
            False,
        )
    else:
        page.banner(
            "BITWISE IDENTICAL: every compared logprob has the same fp32 bits"
            if bad == 0
            else f"{bad} of {n} tokens differ ({summary.get('mismatch_fraction', 0):.2%})",
            bad == 0,
        )
    sides = summary.get("sides") or {}
    if sides:
        page.add(key_values([(role, side_label(side)) for role, side in sides.items()], table_id="sides"))
    buckets, special = ulp_buckets(tokens)
    page.row(
        sections_html(summary_sections(summary, histogram=False)),
        "<h3>fp32 ULP distance (log2 buckets)</h3>"
        + page.figure_html(ulp_figure(summary, buckets, special), "ulp-histogram"),
    )
    page.heading("|d logprob| along each sequence", level=3)
    figure, caption = positions_figure(tokens, sequences)
    page.note(caption)
    page.figure(figure, "positions")
    if bad:
        worst_tokens_table(page, tokens, run)
    page.heading("Sequences, worst first", level=3)
    sequence_table(page, sequences)
    settings_details(page, run)
    return summary


def sections_html(sections: list[Section]) -> str:
    """The summary's sections (reports.views.summary_sections), each a titled two-column table; a row's value
    cell carries ``data-field`` (its summary key, or its label for a row made of several keys)."""
    parts = []
    for sec in sections:
        rows = "".join(
            f'<tr><td>{esc(label)}</td><td data-field="{esc(key or label)}">{esc(text)}</td></tr>'
            for label, text, key in sec.rows
        )
        note = f'<p class="note">{esc(sec.note)}</p>' if sec.note else ""
        table_html = f'<table class="kv" id="summary-{esc(sec.anchor)}"><tbody>{rows}</tbody></table>' if rows else ""
        parts.append(f'<div><h3 id="{esc(sec.anchor)}">{esc(sec.title)}</h3>{table_html}{note}</div>')
    return f'<div class="sections">{"".join(parts)}</div>'


def ulp_figure(summary: dict, buckets: list[dict], special: dict[str, int]):
    """Bars of the finite pairs' fp32 ULP distances in log2 buckets (reports.views.ulp_buckets: 0, 1, 2-3,
    4-7, ... up to the largest distance measured), NaN and Inf mismatches as their own bars beside them; a button
    switches the y axis between linear and log."""
    import plotly.graph_objects as go

    labels = [b["label"] for b in buckets]
    counts = [b["count"] for b in buckets]
    hover = [f"{b['lo']}..{b['hi']} ULP" if b["hi"] != b["lo"] else f"{b['lo']} ULP" for b in buckets]
    colors = ["#2f9e44"] + ["#e8590c"] * (len(labels) - 1)
    fig = go.Figure(
        go.Bar(
            x=labels,
            y=counts,
            marker_color=colors,
            text=counts,
            textposition="outside",
            customdata=hover,
            name="finite pairs",
            hovertemplate="%{customdata}: %{y} tokens<extra></extra>",
        )
    )
    shown = {k: v for k, v in special.items() if v}
    if shown:
        fig.add_trace(
            go.Bar(
                x=list(shown),
                y=list(shown.values()),
                marker_color="#862e9c",
                name="NaN / Inf",
                text=list(shown.values()),
                textposition="outside",
                hovertemplate="%{x}: %{y} tokens (no ULP distance)<extra></extra>",
            )
        )
    scales = [dict(label=s, method="relayout", args=[{"yaxis.type": s}]) for s in ("linear", "log")]
    none = "" if shown else "; no NaN or Inf mismatches"
    fig.update_layout(
        height=420,
        showlegend=False,
        bargap=0.15,
        xaxis=dict(title=f"fp32 ULP distance, log2 buckets (0 = bitwise equal){none}", type="category"),
        yaxis=dict(title="tokens"),
        title=f"{summary['tokens_compared']} tokens, {summary['mismatches']} not bitwise equal"
        + (f"; max {summary['ulp_max']} ULP" if summary.get("ulp_max") is not None else ""),
        updatemenus=[
            dict(type="buttons", direction="right", x=1, y=1.0, xanchor="right", yanchor="bottom", buttons=scales)
        ],
    )
    return fig


def _binned(pos: np.ndarray, y: np.ndarray, ulp: np.ndarray, points: int):
    """At most ``points`` points: per bin of consecutive positions, the one with the largest |d|."""
    if len(pos) <= points:
        return pos, y, ulp
    bins = np.array_split(np.arange(len(pos)), points)
    pick = np.array([b[np.argmax(np.nan_to_num(y[b], nan=-1.0))] for b in bins])
    return pos[pick], y[pick], ulp[pick]


COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)  # plotly's default colour cycle, set explicitly so a sequence's prompt marker has its colour


def positions_figure(tokens: pd.DataFrame, sequences: pd.DataFrame):
    """One line per sequence (the LINE_SEQUENCES worst when there are more): |lp_train - lp_infer| at each
    scored position; NaN/Inf pairs leave a gap. Rollout mode: a dotted vertical line in the sequence's colour
    between its last prompt token and its first generated one (x = prompt length - 0.5; shape name
    ``prompt end seq N``, a ▾ above it says so on hover), prompt tokens drawn as open circles, generated ones
    filled. A button switches the y axis to log scale. Returns the figure and a caption saying what is drawn."""
    import plotly.graph_objects as go

    shown = worst_sequences(sequences, LINE_SEQUENCES)["seq"].tolist()
    ends = prompt_ends(tokens)
    fig = go.Figure()
    binned = False
    shapes, notes = [], []
    for k, seq in enumerate(shown):
        color = COLORS[k % len(COLORS)]
        rows = tokens[tokens["seq"] == seq]
        d = rows["diff"].to_numpy(dtype=np.float64)
        y = np.where(np.isfinite(d), np.abs(d), np.nan)
        pos, y, ulp = _binned(rows["pos"].to_numpy(), y, rows["ulp"].to_numpy(), LINE_POINTS)
        binned |= len(pos) < len(rows)
        marker = dict(size=4, color=color)
        if seq in ends:
            marker["symbol"] = ["circle-open" if p < ends[seq] else "circle" for p in pos]
            where = ["prompt" if p < ends[seq] else "generated" for p in pos]
        else:
            where = [""] * len(pos)
        fig.add_trace(
            go.Scatter(
                x=pos,
                y=[None if v != v else v for v in y],
                customdata=list(zip(ulp, where, strict=True)),
                mode="lines+markers",
                marker=marker,
                line=dict(color=color, width=1.5),
                name=f"seq {seq}",
                connectgaps=False,
                hovertemplate=f"seq {seq}, pos %{{x}} %{{customdata[1]}}<br>|d| %{{y:.3e}}<br>"
                f"%{{customdata[0]}} ULP<extra></extra>",
            )
        )
        if seq in ends:
            x = ends[seq] - 0.5
            shapes.append(
                dict(
                    type="line",
                    xref="x",
                    yref="paper",
                    x0=x,
                    x1=x,
                    y0=0,
                    y1=1,
                    name=f"prompt end seq {seq}",
                    line=dict(color=color, width=1.5, dash="dot"),
                )
            )
            notes.append(
                dict(
                    x=x,
                    y=1,
                    xref="x",
                    yref="paper",
                    yanchor="bottom",
                    showarrow=False,
                    text="▾",
                    font=dict(color=color, size=14),
                    name=f"prompt end seq {seq}",
                    hovertext=f"seq {seq}: prompt of {ends[seq]} tokens (positions 0..{ends[seq] - 1}); "
                    f"generated from position {ends[seq]}",
                )
            )
    more = len(sequences) - len(shown)
    caption = (
        (f"{len(shown)} sequences" if not more else f"the {len(shown)} worst of {len(sequences)} sequences")
        + (f"; at most {LINE_POINTS} points each (max |d| per bin)" if binned else "")
        + "; NaN and Inf pairs leave gaps; the buttons switch the y axis between linear and log"
    )
    if ends:
        lengths = sorted({ends[s] for s in shown if s in ends})
        caption += (
            "; rollout: the dotted line in each sequence's colour marks where its prompt ends (prompt length "
            + (f"{lengths[0]}" if len(lengths) == 1 else f"{lengths[0]} to {lengths[-1]}")
            + "), open circles are prompt tokens, filled ones generated"
        )
    scales = [dict(label=s, method="relayout", args=[{"yaxis.type": s}]) for s in ("linear", "log")]
    fig.update_layout(
        height=440,
        xaxis=dict(title="position"),
        yaxis=dict(title="|lp_train - lp_infer|"),
        shapes=shapes,
        annotations=notes,
        updatemenus=[
            dict(type="buttons", direction="right", x=0, y=1.04, xanchor="left", yanchor="bottom", buttons=scales)
        ],
    )
    return fig, caption


def sequence_table(page: Page, sequences: pd.DataFrame) -> None:
    """The per-sequence table, worst first (NaN, then most mismatches, then largest ULP), sortable."""
    ordered = worst_sequences(sequences, TABLE_SEQUENCES)
    rows = []
    for r in ordered.to_dict("records"):
        rows.append(
            {
                **r,
                "mismatch_fraction": r["mismatches"] / r["tokens"] if r["tokens"] else None,
                "first_mismatch_pos": None if r["first_mismatch_pos"] < 0 else r["first_mismatch_pos"],
                "ulp_max": None if r["ulp_max"] < 0 else r["ulp_max"],
            }
        )
    if len(sequences) > len(ordered):
        page.note(f"the {len(ordered)} worst of {len(sequences)} sequences; all are in {SEQUENCES}")
    page.note("click a column header to sort")
    page.add(
        table(
            rows,
            [
                Column("seq", "seq"),
                Column("tokens", "tokens"),
                Column("mismatches", "mismatches"),
                Column("mismatching", "mismatch_fraction", ".1%"),
                Column("first mismatch pos", "first_mismatch_pos"),
                Column("NaN tokens", "nan_tokens"),
                Column("max ULP", "ulp_max"),
                Column("max |d|", "max_abs_diff", ".3e"),
            ],
            table_id="sequences",
            row_class=lambda r: "differs" if r["mismatches"] else "",
        )
    )


def worst_tokens(tokens: pd.DataFrame) -> list[dict]:
    """The WORST_TOKENS differing tokens with the largest |d| (NaN/Inf pairs first), fp32 bits in hex."""
    differing = tokens[~tokens["bitwise_equal"]]
    score = differing["diff"].abs().where(differing["ulp"] >= 0, np.inf)
    worst = differing.assign(score=score).sort_values(["score", "seq", "pos"], ascending=[False, True, True])
    rows = []
    for r in worst.head(WORST_TOKENS).to_dict("records"):
        bits = np.array([r["lp_train"], r["lp_infer"]], dtype=np.float32).view(np.uint32)
        rows.append(
            {
                **r,
                "train_hex": f"0x{int(bits[0]):08x}",
                "infer_hex": f"0x{int(bits[1]):08x}",
                "train_text": f"{r['lp_train']:.9g}",
                "infer_text": f"{r['lp_infer']:.9g}",
                "ulp": None if r["ulp"] < 0 else r["ulp"],
            }
        )
    return rows


CONTEXT_TOKENS = 8  # tokens before a worst token shown as its context


def model_path(run: RunDir) -> str | None:
    """The checkpoint directory the run's train capture (else its record) names, or None."""
    for capture in run.captures.values():
        path = (capture.manifest.get("model") or {}).get("path")
        if path:
            return path
    return ((run.record or {}).get("model") or {}).get("path")


def token_ids(run: RunDir, tokens: pd.DataFrame) -> dict[int, np.ndarray]:
    """Each sequence's token ids by position: from a checked capture (every position), else from tokens.parquet
    (scored positions; position 0 left as -1)."""
    source = next(iter(run.captures.values())).logprobs if run.captures else tokens
    out = {}
    for seq, g in source.groupby("seq"):
        ids = np.full(int(g["pos"].max()) + 1, -1, dtype=np.int64)
        ids[g["pos"].to_numpy()] = g["token_id"].to_numpy()
        out[int(seq)] = ids
    return out


def worst_tokens_table(page: Page, tokens: pd.DataFrame, run: RunDir) -> list[dict]:
    """The worst tokens (worst_tokens) with their text, decoded by the checkpoint's tokenizer (reports.token_text),
    and the CONTEXT_TOKENS tokens before each; without a tokenizer, a note says why and ids are shown. Returns the
    rows (``text``: tokenizer.decode([token_id]), None without a tokenizer)."""
    from alignaudit.reports.token_text import decode, load_tokenizer, visible

    rows = worst_tokens(tokens)
    tokenizer, why = load_tokenizer(model_path(run))
    rollout = "generated" in tokens and bool(tokens["generated"].any())
    ids = token_ids(run, tokens) if tokenizer is not None else {}
    gen = (
        set(zip(tokens.loc[tokens["generated"], "seq"], tokens.loc[tokens["generated"], "pos"], strict=True))
        if rollout
        else set()
    )
    for r in rows:
        r["where"] = "generated" if (r["seq"], r["pos"]) in gen else "prompt"
        r["text"] = r["text_shown"] = r["context"] = None
        if tokenizer is not None:
            r["text"] = decode(tokenizer, [r["token_id"]])
            r["text_shown"] = visible(r["text"])
            before = ids[r["seq"]][max(0, r["pos"] - CONTEXT_TOKENS) : r["pos"]]
            before = before[before >= 0]
            r["context"] = ("…" if r["pos"] > CONTEXT_TOKENS else "") + visible(decode(tokenizer, before))[1:-1]
    page.heading(f"Largest single-token differences (top {len(rows)})", level=3)
    if tokenizer is None:
        page.note(why)
    else:
        page.note(
            f"token text decoded with the tokenizer in {model_path(run)}; context: the {CONTEXT_TOKENS} tokens "
            "before (whitespace shown as \\n, \\t)"
        )
    columns = [
        Column("seq", "seq"),
        Column("pos", "pos"),
        *([Column("in", "where", text=True)] if rollout else []),
        *(
            [
                Column("context before", "context", text=True, cls="ctx"),
                Column("token", "text", text=True, shown="text_shown", cls="tok"),
            ]
            if tokenizer is not None
            else []
        ),
        Column("token id", "token_id"),
        Column("lp_train", "lp_train", shown="train_text"),
        Column("lp_infer", "lp_infer", shown="infer_text"),
        Column("d", "diff", ".3e"),
        Column("ULP", "ulp"),
        Column("train bits", "train_hex", text=True),
        Column("infer bits", "infer_hex", text=True),
    ]
    page.add(table(rows, columns, table_id="worst-tokens"))
    return rows


def settings_details(page: Page, run: RunDir) -> None:
    """The run's settings (run.json: mode, prompts, sampling, both engines) and each capture's environment
    (package versions, hardware, numerics flags, timings), folded; rows whose train and infer values differ are
    marked. Nothing when the run records neither."""
    record = run.record or {}
    settings = []
    for key in ("command", "mode", "clip_eps", "repeat"):
        if record.get(key) is not None:
            settings.append((key, record[key]))
    for key in ("prompts", "rollout"):
        if isinstance(record.get(key), dict):
            settings += [(f"{key} {k}", v) for k, v in record[key].items() if not isinstance(v, (dict, list))]
    model = record.get("model") or {}
    settings += [(f"model {k}", model[k]) for k in ("name", "path", "architecture") if model.get(k) is not None]
    html = key_values(settings, table_id="settings") if settings else ""
    roles = [r for r in ("train", "infer") if isinstance(record.get(r), dict) or r in run.captures]
    environment = {}
    for role in roles:
        values = {}
        side = record.get(role)
        if not isinstance(side, dict):
            side = {}
        for k, v in side.items():
            values[f"setting {k}"] = v
        m = run.captures[role].manifest if role in run.captures else {}
        for part in ("versions", "hardware", "numerics", "timing_s"):
            for k, v in (m.get(part) or {}).items():
                values[f"{part} {k}"] = v
        if m.get("model", {}).get("checkpoint_sha256"):
            values["model checkpoint_sha256"] = m["model"]["checkpoint_sha256"]
        environment[role] = values
    if environment:
        keys = list(dict.fromkeys(k for v in environment.values() for k in v))
        body = []
        for k in keys:
            cells = [environment[r].get(k) for r in roles]
            shown = [
                ", ".join(map(str, c))
                if isinstance(c, list)
                else ", ".join(f"{a}={b}" for a, b in c.items())
                if isinstance(c, dict)
                else fmt(c)
                for c in cells
            ]
            differ = len(set(shown)) > 1
            body.append(
                f'<tr class="{"differs" if differ else ""}"><td class="l">{esc(k)}</td>'
                + "".join(f'<td class="l">{esc(v) or "-"}</td>' for v in shown)
                + "</tr>"
            )
        head = "".join(f"<th class='l'>{esc(r)}</th>" for r in roles)
        html += (
            '<p class="note">engines and environment (red: the two sides differ)</p>'
            f'<div class="scroll"><table id="environment"><thead><tr><th class="l">field</th>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>"
        )
    if html:
        page.details("Settings and environment", html)
