"""`alignaudit report RUN_A RUN_B ...`: two or more logprob comparisons side by side, one column per run.

What the page holds: the key numbers of each run in a column (engines, strict or not, model, mode, mismatches,
fraction, max |d|, ULP, KL, clip fraction, and any importance / vocab metrics a run recorded), the cells of
the settings that differ from the first run highlighted, and every run's fp32 ULP distances in log2 buckets
as grouped bars.

When runs are comparable: a column is a stack measured on a workload, so the workload must be the same.
Runs of different checkpoints (sha256 of config and weights), different prompts (the prompt digest) or a
different mode (prompt vs rollout) are refused with one line naming what differs, since their mismatch
counts are over different tokens; report each alone. Everything else (engines, dtype, strict ops, options,
sampling settings, --clip-eps) may differ: that is what the page compares; sampling and clip settings that
differ are highlighted, since they change what the numbers count. Runs must be finished (sealed and checked
as `alignaudit report RUN` checks one), and hold a comparison (compare, gate, diff, rescore).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from alignaudit import __version__
from alignaudit.capture.rundir import SUMMARY, TOKENS
from alignaudit.errors import InputError
from alignaudit.reports.html.compare import SUMMARY_FIELDS, TOKEN_COLUMNS
from alignaudit.reports.html.page import Page, esc
from alignaudit.reports.html.runs import RunDir, detect, read_json, read_table
from alignaudit.reports.views import bucket_label, number, readable, side_label, ulp_buckets

# what a run measured beyond its stack (workload()); runs side by side must agree on these
WORKLOAD = ("model checkpoint", "mode", "prompts")


@dataclass
class RunColumn:
    """One run of the page: its directory (checked), summary.json, ULP buckets and workload identity."""

    run: RunDir
    summary: dict
    buckets: list[dict]
    special: dict[str, int]
    workload: dict[str, str]


def _manifest(run: RunDir, role: str = "train") -> dict:
    capture = run.captures.get(role)
    return capture.manifest if capture is not None else {}


def workload(run: RunDir) -> dict[str, str]:
    """What a run measured, beyond its stack: the checkpoint (name, sha256 of config and weights: the checked train
    capture's manifest), the mode and the prompts (source, digest) as run.json records them; a diff run's record
    has neither, so the infer capture's manifest (whose digest, in rollout mode, covers the sampled tokens too)."""
    model, prompts, mode = _workload_records(run)
    return {
        "model checkpoint": f"{model.get('name', '?')} (sha256 {str(model.get('checkpoint_sha256', '?'))[:12]})",
        "prompts": f"{prompts.get('source') or '?'}, digest {str(prompts.get('digest', '?'))[:12]}",
        "mode": mode,
    }


def workload_identity(run: RunDir) -> dict[str, str]:
    """What must be equal for two runs to count the same tokens (WORKLOAD's fields): the checkpoint's sha256, the
    prompts' digest (of the token ids, whatever file or name they came from) and the mode."""
    model, prompts, mode = _workload_records(run)
    return {
        "model checkpoint": str(model.get("checkpoint_sha256")),
        "prompts": str(prompts.get("digest")),
        "mode": mode,
    }


def _workload_records(run: RunDir) -> tuple[dict, dict, str]:
    record, m, infer = run.record or {}, _manifest(run), _manifest(run, "infer")
    model = m.get("model") or record.get("model") or {}
    prompts = record.get("prompts") or infer.get("prompts") or {}
    return model, prompts, str(record.get("mode") or infer.get("mode") or "prompt")


def load_column(run_dir: Path | str) -> RunColumn:
    """A run for the page, read and checked (runs.detect).

    Raises:
        InputError: as detect; not a comparison; not finished; summary.json or tokens.parquet lacking fields.
    """
    run = detect(run_dir)
    if "compare" not in run.kinds:
        raise InputError(
            f"{run.path} holds no logprob comparison (a {' and '.join(run.kinds)} run); several runs "
            "side by side need compare, gate, diff or rescore runs: report it alone"
        )
    if not run.complete or not run.captures:
        raise InputError(
            f"{run.path} did not finish (run.json status {(run.record or {}).get('status')!r}); only "
            "finished runs go side by side: report it alone, or run it again"
        )
    summary = read_json(run.path / SUMMARY)
    missing = [f for f in SUMMARY_FIELDS if f not in summary]
    if missing:
        raise InputError(f"{run.path / SUMMARY} lacks {', '.join(missing)}; run the comparison again")
    buckets, special = ulp_buckets(read_table(run.path / TOKENS, TOKEN_COLUMNS))
    return RunColumn(run, summary, buckets, special, workload(run))


def check_comparable(columns: list[RunColumn]) -> None:
    """Refuse runs of different workloads (module docstring).

    Raises:
        InputError: one line naming the field and each run's value.
    """
    for field in WORKLOAD:
        values = [c.workload[field] for c in columns]
        if len({workload_identity(c.run)[field] for c in columns}) > 1:
            shown = "; ".join(f"{c.run.path.name}: {v}" for c, v in zip(columns, values, strict=True))
            raise InputError(
                f"the runs differ in {field} ({shown}), so their numbers count different tokens; put "
                f"side by side runs of the same model, prompts and mode, or report each alone"
            )


def _strict(side: dict) -> str:
    return f"strict {side['strict']}" if side.get("strict") else "default"


def _thresholds(summary: dict) -> str:
    """The importance-sampling thresholds a summary's fractions were computed at ("-" for a run without them)."""
    imp = summary.get("importance") or {}
    if "tis_threshold" not in imp:
        return "-"
    return (
        f"{imp['tis_threshold']:g}; [{imp['mask_low']:g}, {imp['mask_high']:g}]; "
        f"[{imp['geo_mask_low']:g}, {imp['geo_mask_high']:g}]"
    )


def _sampling(run: RunDir) -> str:
    rollout = (run.record or {}).get("rollout") or _manifest(run).get("rollout")
    return ", ".join(f"{k}={v}" for k, v in rollout.items()) if isinstance(rollout, dict) else "-"


def _scalars(record, prefix: str = "") -> dict[str, object]:
    """A record's scalar values by dotted key (nested dicts flattened, lists left out)."""
    out = {}
    for k, v in (record or {}).items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def rows(columns: list[RunColumn]) -> list[tuple[str, str, str, list[tuple[object, str]]]]:
    """The page's table: (group, field key, label, [(raw value, text) per run]). A row no run has is left out;
    a run without it shows '-'. Settings rows whose values differ from the first run's are highlighted by
    the page (group "Run")."""

    def side(c: RunColumn, role: str) -> dict:
        return (c.summary.get("sides") or {}).get(role) or (c.run.record or {}).get(role) or {}

    out = []

    def add(group, key, label, values):
        if any(v[0] is not None for v in values):
            out.append((group, key, label, values))

    def each(get, spec=""):
        vals = []
        for c in columns:
            v = get(c)
            vals.append((v, number(v, spec) if v is not None else "-"))
        return vals

    def text(get):
        return [(None if t == "-" else t, t) for t in (get(c) for c in columns)]

    add("Run", "command", "command", text(lambda c: str((c.run.record or {}).get("command", "?"))))
    add("Run", "model", "model", text(lambda c: c.workload["model checkpoint"]))
    add("Run", "mode", "mode", text(lambda c: c.workload["mode"]))
    add("Run", "prompts", "prompts", text(lambda c: c.workload["prompts"]))
    add("Run", "train", "train engine", text(lambda c: side_label(side(c, "train")) if side(c, "train") else "-"))
    add("Run", "infer", "infer engine", text(lambda c: side_label(side(c, "infer")) if side(c, "infer") else "-"))
    add(
        "Run",
        "strict",
        "strict (train / infer)",
        text(lambda c: f"{_strict(side(c, 'train'))} / {_strict(side(c, 'infer'))}"),
    )
    add("Run", "sampling", "sampling (rollout)", text(lambda c: _sampling(c.run)))
    add("Run", "clip_eps", "clip eps", each(lambda c: (c.summary.get("rl") or {}).get("clip_eps")))
    add("Run", "is_thresholds", "IS thresholds (TIS C; mask; geometric mask)", text(lambda c: _thresholds(c.summary)))
    add("Alignment", "tokens_compared", "tokens compared", each(lambda c: c.summary["tokens_compared"]))
    add("Alignment", "mismatches", "mismatches (bitwise)", each(lambda c: c.summary["mismatches"]))
    add(
        "Alignment", "mismatch_fraction", "mismatch fraction", each(lambda c: c.summary.get("mismatch_fraction"), ".2%")
    )
    add("Alignment", "max_abs_diff", "max |d logprob|", each(lambda c: c.summary.get("max_abs_diff"), ".3e"))
    add("Alignment", "ulp_max", "ULP max", each(lambda c: c.summary.get("ulp_max")))
    add("Alignment", "ulp_median", "ULP median", each(lambda c: c.summary.get("ulp_median")))
    add("Alignment", "ulp_p99", "ULP p99", each(lambda c: c.summary.get("ulp_p99")))
    add(
        "Alignment",
        "nan_inf",
        "NaN / Inf mismatches",
        each(lambda c: (c.summary.get("nan_mismatches") or 0) + (c.summary.get("inf_mismatches") or 0)),
    )

    def rl(key):
        return lambda c: (c.summary.get("rl") or {}).get(key)

    add("RL impact", "rl.kl_k3_mean", "KL k3 (infer || train), mean", each(rl("kl_k3_mean")))
    add("RL impact", "rl.clip_fraction", "clip fraction", each(rl("clip_fraction"), ".2%"))
    add("RL impact", "rl.ratio_min", "importance ratio min", each(rl("ratio_min"), ".6f"))
    add("RL impact", "rl.ratio_max", "importance ratio max", each(rl("ratio_max"), ".6f"))
    add("RL impact", "rl.token_mult_prob_error", "token_mult_prob_error", each(rl("token_mult_prob_error"), ".9f"))
    add("RL impact", "rl.prob_diff_max", "|p_train - p_infer| max", each(rl("prob_diff_max")))
    for group, key in (("Importance weights", "importance"), ("Distribution (full vocabulary)", "vocab")):
        flat = [_scalars(c.summary.get(key) or (c.summary.get("rl") or {}).get(key)) for c in columns]
        for name in dict.fromkeys(k for f in flat for k in f):
            add(
                group,
                f"{key}.{name}",
                " ".join(readable(p) for p in name.split(".")),
                [(f.get(name), number(f.get(name)) if name in f else "-") for f in flat],
            )

    def rerouted(c):
        layers = c.summary.get("routing") or []
        return f"{sum(r['rerouted'] for r in layers)} of {sum(r['tokens'] for r in layers)}" if layers else None

    add("Routing (MoE)", "routing", "positions rerouted (all layers)", [(v, v or "-") for v in map(rerouted, columns)])

    def generated(c):
        g = c.summary.get("generated")
        return f"{g['mismatches']} of {g['tokens_compared']}" if g else None

    add(
        "Generated tokens (rollout)",
        "generated.mismatches",
        "mismatches",
        [(v, v or "-") for v in map(generated, columns)],
    )
    return out


def ulp_bars(columns: list[RunColumn]):
    """Grouped bars: each run's fp32 ULP distances in log2 buckets (one range for all, to the largest bucket any
    run has), NaN / Inf mismatches as their own categories when any run has them; y axis linear or log."""
    import plotly.graph_objects as go

    top = max(len(c.buckets) for c in columns)
    labels = [bucket_label(k) for k in range(top)]
    specials = [k for k in ("NaN mismatch", "Inf mismatch") if any(c.special[k] for c in columns)]
    fig = go.Figure()
    for c in columns:
        counts = [b["count"] for b in c.buckets] + [0] * (top - len(c.buckets))
        fig.add_trace(
            go.Bar(
                x=labels + specials,
                y=counts + [c.special[k] for k in specials],
                name=c.run.path.name,
                hovertemplate=f"{esc(c.run.path.name)}<br>%{{x}} ULP: %{{y}} tokens<extra></extra>",
            )
        )
    scales = [dict(label=s, method="relayout", args=[{"yaxis.type": s}]) for s in ("linear", "log")]
    fig.update_layout(
        height=420,
        barmode="group",
        title="fp32 ULP distance per run (log2 buckets)",
        xaxis=dict(title="fp32 ULP distance (0 = bitwise equal)", type="category"),
        yaxis=dict(title="tokens"),
        legend=dict(orientation="h", y=-0.3),
        updatemenus=[
            dict(type="buttons", direction="right", x=1, y=1.02, xanchor="right", yanchor="bottom", buttons=scales)
        ],
    )
    return fig


def build_side_by_side(run_dirs: Sequence[Path | str]) -> str:
    """The page of several runs side by side (module docstring).

    Raises:
        InputError: fewer than two runs, the same run twice, a run that is not a finished comparison, or runs of
            different workloads (check_comparable).
    """
    if len(run_dirs) < 2:
        raise InputError("give two or more run directories to put side by side (one: `alignaudit report RUN`)")
    seen = {}
    for d in run_dirs:
        resolved = Path(d).resolve()
        if resolved in seen:
            raise InputError(f"{d} is given twice; give each run once")
        seen[resolved] = d
    columns = [load_column(d) for d in run_dirs]
    check_comparable(columns)
    page = Page(f"alignaudit report: {len(columns)} runs side by side")
    first = columns[0].workload
    page.add(f"<h1>alignaudit report: {len(columns)} runs side by side</h1>")
    page.add(
        f'<p class="sub">{esc(first["model checkpoint"])}; {esc(first["mode"])} mode; prompts '
        f"{esc(first['prompts'])}</p>"
    )
    page.add(
        f'<p class="sub">report by alignaudit {esc(__version__)} at {datetime.now():%Y-%m-%d %H:%M:%S}; runs '
        + ", ".join(f"<code>{esc(c.run.path.resolve())}</code>" for c in columns)
        + "</p>"
    )
    table_rows = rows(columns)
    differing = [
        label
        for group, key, label, values in table_rows
        if group == "Run" and key in ("sampling", "clip_eps", "is_thresholds") and len({t for _, t in values}) > 1
    ]
    if differing:
        page.banner(
            f"the runs differ in {', '.join(differing)}: their clip fractions, importance-sampling "
            "fractions or generated tokens count different things (highlighted below)",
            None,
        )
    page.note("one column per run; highlighted: a setting that differs from the first run's")
    head = "".join(f'<th class="l">{esc(c.run.path.name)}</th>' for c in columns)
    body, group = [], None
    for g, key, label, values in table_rows:
        if g != group:
            body.append(f'<tr class="group"><td colspan="{len(columns) + 1}">{esc(g)}</td></tr>')
            group = g
        cells = []
        for i, (raw, txt) in enumerate(values):
            mark = " diff" if g == "Run" and i and txt != values[0][1] else ""
            if key == "mismatches" and raw is not None:
                mark = " ok" if raw == 0 else " bad"
            v = "" if raw is None else str(raw)
            cells.append(f'<td class="l{mark}" data-key="run{i}" data-v="{esc(v)}">{esc(txt)}</td>')
        body.append(f'<tr><td data-key="metric" data-v="{esc(key)}">{esc(label)}</td>{"".join(cells)}</tr>')
    page.add(
        f'<div class="scroll"><table id="runs" class="runs"><thead><tr><th class="l">run</th>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
    page.figure(ulp_bars(columns), "runs-ulp")
    return page.render()


def default_target(root: Path = Path("alignaudit-runs")) -> Path:
    """``alignaudit-runs/report-<YYYYmmdd-HHMMSS>.html``, a name no file has (the directory created)."""
    root.mkdir(parents=True, exist_ok=True)
    stem = f"report-{datetime.now():%Y%m%d-%H%M%S}"
    for n in range(1000):
        path = root / (f"{stem}.html" if n == 0 else f"{stem}-{n}.html")
        if not path.exists():
            return path
    raise InputError(f"no free report name in {root}; pass --html FILE")


def write_side_by_side(run_dirs: Sequence[Path | str], html: Path | str | None = None) -> Path:
    """Write the side-by-side page to ``html`` (default ``default_target()``); returns the path.

    Raises:
        InputError: as build_side_by_side; or the target is a directory, an existing file alignaudit did not
            write, in a missing directory, or inside one of the runs (outdir.check_file_outputs).
    """
    from alignaudit.capture import outdir
    from alignaudit.reports.html import _is_report

    target = Path(html) if html is not None else default_target()
    outdir.check_file_outputs({"--html": target}, runs=tuple(Path(r) for r in run_dirs))
    text = build_side_by_side(run_dirs)
    if target.is_dir():
        raise InputError(f"--html {target} is a directory; give a file name such as {target / 'runs.html'}")
    if target.exists() and not _is_report(target):
        raise InputError(f"--html {target} exists and is not a report alignaudit wrote; give a new file name")
    if not target.parent.is_dir():
        raise InputError(f"--html {target}: no directory {target.parent}; create it first or give another path")
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write {target}: {e.strerror}; pass --html FILE to write it elsewhere") from e
    return target


__all__ = ["build_side_by_side", "write_side_by_side"]
