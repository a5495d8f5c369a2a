"""Rendering: rich tables on the terminal, from the same records that go to JSON and parquet."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from alignaudit.numerics import hex_bits
from alignaudit.reports.views import side_label, summary_sections, ulp_buckets


def _num(x, fmt: str = ".3e") -> str:
    return "-" if x is None else format(x, fmt)


SEQUENCE_ROWS = 20


def _styled(key: str, text: str, summary: Mapping[str, Any]) -> str:
    """A summary value with the colour it warrants: mismatches red (green when none), NaN/Inf red, routing red
    when a token was rerouted, repeats red when a repeat differed."""
    red = "bold red" if key in ("nan_tokens", "inf_tokens") else "red"
    if key == "mismatches":
        return f"[{'green' if summary['mismatches'] == 0 else 'red'}]{escape(text)}[/]"
    if key in ("nan_tokens", "inf_tokens") or (key.startswith("routing.") and not text.startswith("0 of")):
        return f"[{red}]{escape(text)}[/]"
    if key == "routing_replay.rerouted_after":
        return f"[{'green' if text.endswith('-> 0') else 'red'}]{escape(text)}[/]"
    if key.startswith("repeats."):
        return f"[{'green' if text.startswith('0 of') else 'red'}]{escape(text)}[/]"
    return escape(text)


def render_comparison(
    console: Console,
    summary: Mapping[str, Any],
    tokens: pd.DataFrame | None = None,
    sequences: pd.DataFrame | None = None,
    worst: int = 8,
) -> None:
    """Print the summary table, the worst sequences (at most SEQUENCE_ROWS; every sequence is in
    sequences.parquet) and the worst tokens of a logprob comparison."""
    sides = summary.get("sides", {})
    train, infer = sides.get("train"), sides.get("infer")
    title = (
        f"{escape(summary.get('model', ''))}: {escape(side_label(train))} vs {escape(side_label(infer))}"
        if train and infer
        else ""
    )
    n, bad = summary["tokens_compared"], summary["mismatches"]
    table = Table(title=f"Logprob alignment  {title}", show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    buckets = ulp_buckets(tokens)[0] if tokens is not None and {"ulp", "pair_class"} <= set(tokens.columns) else None
    for k, section in enumerate(summary_sections(summary, buckets, brief=True)):
        if k:
            table.add_section()
        table.add_row(f"[cyan]{escape(section.title)}[/]", "")
        for label, text, key in section.rows:
            table.add_row(f"  {escape(label)}", _styled(key, text, summary))
        if section.note:
            table.add_row("", f"[dim]{escape(section.note)}[/]")
    console.print(table)

    rows = sequences if sequences is not None else pd.DataFrame(summary.get("worst_sequences", []))
    if len(rows):
        from alignaudit.comparison.token_diff import worst_sequences

        shown = worst_sequences(rows, SEQUENCE_ROWS)
        more = len(rows) - len(shown)
        title = (
            "Per sequence" if not more else f"Worst {len(shown)} of {len(rows)} sequences (all in sequences.parquet)"
        )
        seq_table = Table(title=title, title_justify="left")
        for col in ("seq", "tokens", "mismatches", "first mismatch pos", "max ULP", "max |Δ|"):
            seq_table.add_column(col, justify="right")
        for row in shown.itertuples():
            seq_table.add_row(
                str(row.seq),
                str(row.tokens),
                str(row.mismatches),
                "-" if row.first_mismatch_pos < 0 else str(row.first_mismatch_pos),
                "-" if row.ulp_max < 0 else str(row.ulp_max),
                "-" if row.max_abs_diff != row.max_abs_diff else _num(row.max_abs_diff),
            )
        console.print(seq_table)

    if tokens is not None and bad:
        render_worst_tokens(console, tokens, worst)
    nan = summary.get("nan_tokens") or {}
    if nan.get("train") or nan.get("infer"):
        verdict = (
            f"[bold red]NaN logprobs: {nan['train']} tokens on the train side, {nan['infer']} "
            f"on the infer side; {bad} of {n} tokens differ[/]"
        )
    else:
        verdict = "[bold green]BITWISE IDENTICAL[/]" if bad == 0 else f"[bold red]{bad} of {n} tokens differ[/]"
    console.print(verdict)


def render_worst_tokens(console: Console, tokens: pd.DataFrame, count: int) -> None:
    """The ``count`` differing tokens with the largest |Δ logprob|, values in decimal and fp32 hex."""
    import torch

    differing = tokens[~tokens["bitwise_equal"]]
    worst = differing.assign(absdiff=differing["diff"].abs()).nlargest(count, "absdiff")
    table = Table(
        title=f"Largest differences (top {len(worst)})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("seq", "pos", "token", "lp_train", "bits", "lp_infer", "bits", "ULP"):
        table.add_column(col, justify="right", no_wrap=True)
    for _, r in worst.iterrows():
        t = torch.tensor([r["lp_train"], r["lp_infer"]], dtype=torch.float32)
        table.add_row(
            str(r["seq"]),
            str(r["pos"]),
            str(r["token_id"]),
            f"{r['lp_train']:.9g}",
            hex_bits(t[0]),
            f"{r['lp_infer']:.9g}",
            hex_bits(t[1]),
            str(r["ulp"]),
        )
    console.print(table)


def _ulp(x) -> str:
    return "-" if x is None else str(x)


def _equal_fraction(r: dict) -> str:
    text = f"{r['equal_fraction']:.1%}"
    if r["status"] == "differs" and text == "100.0%":
        return ">99.9%"  # never print 100% beside an op that differs
    return text


def render_ops(console: Console, records: list[dict], mode: str, first: dict | None) -> None:
    """The per-op table of a bisect in topological order: ✓ bitwise equal, ✗ differs, ◀ first divergence.

    A note shared by every compared op (e.g. a dtype difference) is printed once under the table.
    """
    what = "each op on the train engine's inputs" if mode == "forced" else "both engines run freely"
    table = Table(
        title=f"Ops, {mode} mode ({what})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    notes = [r.get("note") or "" for r in records if "elements" in r]
    common = notes[0] if notes and all(n == notes[0] for n in notes) else ""
    with_notes = any((r.get("note") or "") not in ("", common) for r in records)
    for col in ["op", "", "equal", "max ULP", "median ULP", "max |diff|", "rel_diff"] + (
        ["note"] if with_notes else []
    ):
        table.add_column(col, justify="left" if col in ("op", "", "note") else "right", no_wrap=col != "note")
    for r in records:
        differs = r["status"] == "differs"
        is_first = mode == "natural" and first is not None and r["op"] == first["op"]
        mark = "◀" if is_first else ("✗" if differs else ("✓" if r["status"] == "equal" else "?"))
        if not r.get("forced", True):
            mark, differs = "~", False  # inputs not forced: shown, not judged
        note = [escape("" if (r.get("note") or "") == common else r.get("note") or "")] if with_notes else []
        if "elements" not in r:
            table.add_row(escape(r["op"]), mark, *["-"] * 5, *note, style="dim")
            continue
        style = "bold red" if is_first else ("red" if differs else "dim" if mark == "~" else None)
        table.add_row(
            escape(r["op"]),
            mark,
            _equal_fraction(r),
            _ulp(r["ulp_max"]),
            _num(r["ulp_median"], "g"),
            _num(r["abs_max"], ".2e"),
            _num(r["rel_diff"], ".1e"),
            *note,
            style=style,
        )
    console.print(table)
    if common:
        console.print(f"note (every op): {escape(common)}", highlight=False)


def render_op_verdict(console: Console, mode: str, records: list[dict], captured_only: bool = False) -> None:
    """One line: the first diverging op with its worst element (natural), or every op that differs (forced).
    ``captured_only``: op capture changed an engine's logprobs, so "all equal" holds for the captured runs only."""
    from alignaudit.comparison.op_diff import DIFFERS, first_divergence

    if mode == "natural":
        first = first_divergence(records)
        if first is None:
            if captured_only:
                console.print(
                    "[bold yellow]every op is bitwise equal in the captured runs[/], which differ from the "
                    "engines as configured (below)"
                )
            else:
                console.print("[bold green]every op is bitwise equal[/]")
            return
        w = first["worst"]
        head = f"[bold]first diverging op: [red]{escape(first['op'])}[/red][/bold] "
        if "train_experts" in w:
            console.print(
                f"{head}({_equal_fraction(first)} of {first['elements']} tokens routed the same); first "
                f"rerouted token seq {w['seq']}, pos {w['pos']}: train experts {w['train_experts']} vs infer "
                f"{w['infer_experts']}",
                highlight=False,
            )
            return
        console.print(
            f"{head}({_equal_fraction(first)} of {first['elements']} elements bitwise equal); worst element "
            f"seq {w['seq']}, pos {w['pos']}, index {w['index']}: train {w['train']:.9g} ({w['train_hex']}) "
            f"vs infer {w['infer']:.9g} ({w['infer_hex']}), {w['ulp']} ULP",
            highlight=False,
        )
        return
    judged = [r for r in records if r.get("forced", True)]
    differing = [r["op"] for r in judged if r["status"] == DIFFERS]
    names = list(dict.fromkeys(op.split(".")[-1] for op in differing))
    console.print(
        f"[bold]ops that compute differently on identical inputs:[/] {len(differing)} of {len(judged)} ops"
        + (f", {len(names)} kind{'' if len(names) == 1 else 's'}: {', '.join(names)}" if names else ": none"),
        highlight=False,
    )
    unforced = [r["op"] for r in records if not r.get("forced", True)]
    if unforced:
        console.print(f"not judged (inputs not forced): {', '.join(unforced)}", highlight=False)


def _routing_text(layers: list[dict]) -> str:
    """Per layer, the tokens the two engines sent to different experts (opdiff.routing_agreement rows)."""
    style = "red" if any(r["rerouted"] for r in layers) else "green"
    return (
        f"[{style}]"
        + "; ".join(f"layer {r['layer']}: {r['rerouted']} of {r['tokens']} positions" for r in layers)
        + "[/]"
    )


def render_routing(console: Console, layers: list[dict], title: str = "tokens rerouted (MoE)") -> None:
    """One line for a mixture-of-experts model: per layer, the tokens sent to other experts by the two engines."""
    if layers:
        console.print(f"[bold]{title}:[/] {_routing_text(layers)}", highlight=False)


def render_bisect(console: Console, result: dict) -> None:
    """Both modes' tables and verdict lines of a bisect, and, where op capture ran an engine otherwise than
    configured and that changed its logprobs, a line saying so (the op verdict then describes the captured
    runs only, never the configuration as asked)."""
    changed = {role: c for role, c in (result.get("as_configured") or {}).items() if c["mismatches"] != 0}
    for mode in ("natural", "forced"):
        if mode in result:
            part = result[mode]
            render_ops(console, part["records"], mode, part["first_divergence"])
            render_op_verdict(console, mode, part["records"], captured_only=bool(changed))
            render_routing(console, part.get("routing") or [], f"tokens rerouted (MoE, {mode} mode)")
    for role, c in changed.items():
        settings = ", ".join(f"{k}={v}" for k, v in c["overrides"].items())
        how = (
            "(forced mode: not compared)"
            if c["mismatches"] is None
            else f"its logprobs differ from the engine as configured in {c['mismatches']} of {c['tokens']} tokens"
        )
        console.print(
            f"[bold yellow]op capture changed how {escape(c['engine'])} ({role}) runs[/] "
            f"({escape(settings)}): {how}; the ops above describe the captured run, not the configuration "
            "asked for (compare it with `alignaudit compare`)",
            highlight=False,
        )
