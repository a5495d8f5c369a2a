"""`alignaudit report`: one self-contained HTML page per run directory (plotly, its JS and the data embedded).

The kind of run is read from the files present (alignaudit.reports.html.runs): compare (and gate, which holds
a compare or rl run), bisect, rl, ablate; a directory may hold several (diff: a comparison and ops). Each kind
has its own module that adds a section to the page (compare, bisect, rl, ablate); page.py holds the HTML.
Several comparisons side by side, one column each: side_by_side.py (`alignaudit report RUN_A RUN_B ...`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from alignaudit import __version__
from alignaudit.capture.rundir import REPORT
from alignaudit.errors import InputError
from alignaudit.reports.html.page import Page, esc
from alignaudit.reports.views import side_label

TITLES = {"compare": "logprob comparison", "bisect": "ops (bisect)", "rl": "RL steps", "ablate": "ablation"}

__all__ = ["REPORT", "build_report", "write_report"]


def _header(page: Page, run, summary_model: str | None) -> None:
    record = run.record or {}
    model = (record.get("model") or {}).get("name") or summary_model or "?"
    sides = [record.get(role) for role in ("train", "infer")]
    pair = " vs ".join(side_label(s) for s in sides if isinstance(s, dict))
    page.add(f"<h1>alignaudit report: {esc(', '.join(TITLES[k] for k in run.kinds))}</h1>")
    page.add(f'<p class="sub">{esc(model)}{": " + esc(pair) if pair else ""}</p>')
    page.add(
        f'<p class="sub">run <code>{esc(run.path.resolve())}</code>'
        + (f" ({esc(record.get('command'))}, status {esc(record.get('status'))})" if record else "")
        + f"; report by alignaudit {esc(__version__)} at {datetime.now():%Y-%m-%d %H:%M:%S}</p>"
    )
    if not run.complete:
        page.banner(
            f"this run did not finish (run.json status {record.get('status')!r}): the report shows what it "
            "wrote, which no checksum covers yet",
            None,
        )
    links = [("gate", "gate verdict")] if run.verdict else []
    links += [(k, TITLES[k]) for k in run.kinds]
    page.add('<p class="sub">' + " · ".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in links) + "</p>")


def _is_report(path: Path) -> bool:
    """Whether ``path`` is a page alignaudit wrote (page.GENERATOR in its first bytes)."""
    from alignaudit.reports.html.page import GENERATOR

    try:
        with open(path, "rb") as f:
            return GENERATOR.encode() in f.read(4096)
    except OSError:
        return False


def build_report(run_dir: Path | str) -> str:
    """The HTML report of a run directory, as one self-contained page.

    Args:
        run_dir: a directory written by compare, bisect, gate, rl, diff (or ablate: ``ablate.parquet``).

    Raises:
        InputError: not a run directory, an unfinished one whose results are missing, or a results file that
            is unreadable or lacks its columns (one line: the problem and the fix).
    """
    from alignaudit.capture.rundir import SUMMARY
    from alignaudit.reports.html.ablate import ablate_section
    from alignaudit.reports.html.bisect import bisect_section
    from alignaudit.reports.html.compare import compare_section, gate_section
    from alignaudit.reports.html.rl import rl_section
    from alignaudit.reports.html.runs import detect, read_json

    run = detect(run_dir)
    page = Page(f"alignaudit report: {run.path.name}")
    summary_model = read_json(run.path / SUMMARY).get("model") if "compare" in run.kinds else None
    _header(page, run, summary_model)
    if run.verdict:
        gate_section(page, run.verdict)
    sections = {"compare": compare_section, "bisect": bisect_section, "rl": rl_section, "ablate": ablate_section}
    for kind in run.kinds:
        sections[kind](page, run)
    if run.record:
        page.add(
            "<details><summary>run.json (the resolved configuration)</summary><pre>"
            + esc(json.dumps(run.record, indent=2, default=str))
            + "</pre></details>"
        )
    return page.render()


def write_report(run_dir: Path | str, html: Path | str | None = None) -> Path:
    """Write the report of ``run_dir`` to ``html`` (default RUN_DIR/report.html); returns the path.

    A report inside the run directory is claimed in its output marker (alignaudit.capture.outdir) first, under the
    run's lock, so ``--force`` may later replace it.

    Raises:
        InputError: as build_report; or the target cannot be written, or is inside the run other than
            RUN_DIR/report.html (outdir.check_file_outputs), or the run is locked by a running command (the message
            suggests --html FILE).
    """
    from alignaudit.capture import outdir

    run_dir = Path(run_dir)
    target = Path(html) if html is not None else run_dir / REPORT
    outdir.check_file_outputs({"--html": target}, runs=(run_dir,), own={"--html": REPORT})
    if target.exists() and target.is_dir():
        raise InputError(f"--html {target} is a directory; give a file name such as {target / REPORT}")
    inside = target.resolve().parent == run_dir.resolve()
    if inside and run_dir.is_dir():
        try:
            outdir.lock(run_dir)  # before reading: a --force run replacing these results waits, or this one does
        except InputError as e:
            raise InputError(f"{e}, or pass --html FILE to write the report elsewhere") from e
    text = build_report(run_dir)
    if inside and run_dir.is_dir():  # in the run: only a report its record says alignaudit wrote, unchanged since
        outdir.check_replaceable(run_dir, (target.name,), "or pass --html FILE to write the report elsewhere")
    elif target.exists() and not _is_report(target):
        raise InputError(
            f"--html {target} exists and is not a report alignaudit wrote; give a new file name "
            "(an earlier report is replaced, any other file is kept)"
        )
    if not target.parent.is_dir():
        raise InputError(f"--html {target}: no directory {target.parent}; create it first or give another path")
    if inside:
        try:
            outdir.claim(run_dir, (target.name,))
        except InputError as e:
            raise InputError(f"{e}, or pass --html FILE to write the report elsewhere") from e
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot write {target}: {e.strerror}; pass --html FILE to write the report elsewhere") from e
    return target
