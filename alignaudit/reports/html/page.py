"""The HTML page: sections, tables and plotly figures in one self-contained file.

Plotly's JavaScript is embedded once in the page head (``plotly.offline.get_plotlyjs``), each figure's data
in its own ``<div>``; a small inline script sorts a table by the column whose header is clicked. Nothing is
fetched when the page opens, so it works offline and as a CI artifact.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1320px;
       color: #1f2933; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #d9e2ec; }
h3 { font-size: 15px; margin-top: 18px; }
.sub { color: #52606d; margin: 2px 0; } .note { color: #52606d; font-size: 13px; }
.banner { padding: 8px 12px; border-radius: 4px; font-weight: 600; margin: 10px 0; }
.good { background: #e3f9e5; color: #05400a; } .bad { background: #ffe3e3; color: #610404; }
.warn { background: #fffbea; color: #513c06; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e7eb; text-align: right; white-space: nowrap; }
th { background: #f0f4f8; position: sticky; top: 0; }
td.l, th.l { text-align: left; } table.kv td:first-child { text-align: left; font-weight: 600; }
table.sortable th { cursor: pointer; user-select: none; } table.sortable th:hover { background: #d9e2ec; }
th[data-dir="asc"]::after { content: " \\25B2"; } th[data-dir="desc"]::after { content: " \\25BC"; }
tr.differs td { color: #9b1c1c; } .scroll { max-height: 560px; max-width: 100%; overflow: auto; display: inline-block; }
td.tok { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre; color: #0b4f8a; }
td.ctx { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre; color: #7b8794; }
.sections { display: flex; flex-direction: column; gap: 2px; }
.sections h3 { margin: 10px 0 2px 0; } .sections table { margin: 2px 0 8px 0; }
table.kv td[data-field] { font-variant-numeric: tabular-nums; }
table.runs td.diff { background: #fff3bf; font-weight: 600; }
table.runs td.ok { color: #05400a; font-weight: 700; } table.runs td.bad { color: #9b1c1c; font-weight: 700; }
table.runs td:first-child { text-align: left; font-weight: 600; }
table.runs td { text-align: left; } tr.group td { background: #f0f4f8; font-weight: 700; color: #334e68; }
details > summary { cursor: pointer; color: #334e68; font-weight: 600; margin: 10px 0; }
details pre { background: #f5f7fa; padding: 8px; font-size: 12px; overflow: auto; max-height: 400px; }
"""

# Sorts a table.sortable by the clicked column: numbers (a cell's data-v) numerically, text otherwise;
# a second click reverses. Empty values sort last either way.
SORT_JS = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var dir = th.dataset.dir === "desc" ? "asc" : "desc";
      table.querySelectorAll("th").forEach(function (h) { delete h.dataset.dir; });
      th.dataset.dir = dir;
      var body = table.tBodies[0], rows = Array.from(body.rows);
      function key(row) {
        var cell = row.cells[col], v = cell.dataset.v !== undefined ? cell.dataset.v : cell.textContent;
        var n = parseFloat(v);
        return v === "" ? null : (isNaN(n) || !isFinite(v) ? v : n);
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null || y === null) { return x === y ? 0 : (x === null ? 1 : -1); }
        var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
        return dir === "asc" ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
});
"""


def esc(value) -> str:
    """HTML-escape any value's text."""
    return html.escape(str(value), quote=True)


def fmt(value, spec: str = "") -> str:
    """A cell's text: '-' for None/NaN, numbers through ``spec`` (default: ints as is, floats ``.4g``)."""
    if value is None or isinstance(value, float) and math.isnan(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec:
        return format(value, spec)
    if isinstance(value, float):
        return format(value, ".4g")
    return str(value)


def _sort_value(value) -> str:
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "" if value is None or math.isnan(value) else repr(value)
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


@dataclass
class Column:
    """A table column: header, key into each row dict (the sort value), number format, left-aligned text,
    and optionally another key whose value is shown instead (e.g. ">99.9%" for a value that rounds to 100%)."""

    title: str
    key: str
    spec: str = ""
    text: bool = False
    shown: str = ""
    cls: str = ""  # an extra CSS class of the column's cells (e.g. "tok": token text, whitespace kept)


def table(rows: list[dict], columns: list[Column], sortable: bool = True, table_id: str = "", row_class=None) -> str:
    """An HTML table of ``rows`` (dicts); cells carry their raw value in ``data-v`` for sorting.
    ``row_class(row)`` may give a CSS class per row (e.g. "differs")."""

    def align(c: Column) -> str:
        return " ".join(x for x in ("l" if c.text else "", c.cls) if x)

    head = "".join(f'<th class="{align(c)}" data-key="{esc(c.key)}">{esc(c.title)}</th>' for c in columns)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{align(c)}" data-key="{esc(c.key)}" data-v="{esc(_sort_value(row.get(c.key)))}">'
            f"{esc(fmt(row.get(c.shown or c.key), '' if c.shown else c.spec))}</td>"
            for c in columns
        )
        cls = row_class(row) if row_class else ""
        body.append(f'<tr class="{cls or ""}">{cells}</tr>')
    attrs = (f' id="{esc(table_id)}"' if table_id else "") + (' class="sortable"' if sortable else "")
    return (
        f'<div class="scroll"><table{attrs}><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'
    )


def key_values(pairs: list[tuple[str, object]], table_id: str = "") -> str:
    """A two-column table (field, value); each value cell carries ``data-field`` for readers and tests."""
    rows = "".join(f'<tr><td>{esc(k)}</td><td data-field="{esc(k)}">{esc(fmt(v))}</td></tr>' for k, v in pairs)
    attrs = f' id="{esc(table_id)}"' if table_id else ""
    return f'<table class="kv"{attrs}><tbody>{rows}</tbody></table>'


# Marks a page as alignaudit's: `report --html FILE` replaces an existing FILE only when it carries this.
GENERATOR = '<meta name="generator" content="alignaudit report">'


def flatten(record: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts as dotted (key, value) pairs; lists as their JSON-ish text."""
    out = []
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flatten(value, name + ".")
        elif isinstance(value, list):
            out.append((name, ", ".join(str(v) for v in value) if value else "-"))
        else:
            out.append((name, value))
    return out


@dataclass
class Page:
    """An HTML report being assembled: ``add`` HTML fragments and ``figure`` plotly figures, then ``render``."""

    title: str
    parts: list[str] = field(default_factory=list)
    figures: int = 0

    def add(self, fragment: str) -> None:
        self.parts.append(fragment)

    def heading(self, text: str, level: int = 2, anchor: str = "") -> None:
        attrs = f' id="{esc(anchor)}"' if anchor else ""
        self.add(f"<h{level}{attrs}>{esc(text)}</h{level}>")

    def note(self, text: str) -> None:
        self.add(f'<p class="note">{esc(text)}</p>')

    def banner(self, text: str, good: bool | None) -> None:
        kind = "warn" if good is None else "good" if good else "bad"
        self.add(f'<div class="banner {kind}">{esc(text)}</div>')

    def figure_html(self, fig, name: str) -> str:
        """A plotly figure's ``<div>`` (its data and layout; the library's JS is in the page head, once),
        with id ``plot-NAME``."""
        self.figures += 1
        top = 60 if fig.layout.title.text or fig.layout.updatemenus or fig.layout.annotations else 20
        fig.update_layout(template="plotly_white", margin=dict(l=60, r=30, t=top, b=50))
        return fig.to_html(
            full_html=False,
            include_plotlyjs=False,
            div_id=f"plot-{name}",
            config={"displaylogo": False, "responsive": True},
        )

    def figure(self, fig, name: str) -> None:
        """Add a plotly figure (figure_html)."""
        self.add(self.figure_html(fig, name))

    def row(self, *fragments: str) -> None:
        """HTML fragments side by side; the last one takes the remaining width."""
        cells = "".join(
            f'<div style="flex: {"1 1 0; min-width: 0" if i == len(fragments) - 1 else "0 0 auto"}">{f}</div>'
            for i, f in enumerate(fragments)
        )
        self.add(f'<div style="display: flex; gap: 24px; align-items: flex-start">{cells}</div>')

    def details(self, summary: str, fragment: str, open_: bool = False) -> None:
        """A collapsible block."""
        self.add(f"<details{' open' if open_ else ''}><summary>{esc(summary)}</summary>{fragment}</details>")

    def render(self) -> str:
        """The whole page as one string."""
        from plotly.offline import get_plotlyjs

        plotly_js = f'<script type="text/javascript">{get_plotlyjs()}</script>' if self.figures else ""
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            + GENERATOR
            + f"<title>{esc(self.title)}</title><style>{CSS}</style>{plotly_js}</head><body>"
            + "\n".join(self.parts)
            + f"<script>{SORT_JS}</script></body></html>\n"
        )
