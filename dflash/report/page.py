"""The report page: one HTML file that holds everything it shows (plots as data URIs, styles inline, no script), so it
opens from disk, mailed or archived, with no network. Pure formatting: ``build`` gathers what goes in."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

# Wide enough for the results table's ten columns at the page's font size; the browser check (``browser``) asserts
# that no table is wider than the page at the width it renders.
STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; color: #1d1d1f; max-width: 70rem; margin: 2rem auto; padding: 0 1.5rem; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
.lede { color: #555; margin-top: 0; } .note { color: #555; font-size: .9rem; }
table { border-collapse: collapse; margin: .6rem 0 1rem; font-size: .92rem; }
table.results { width: 100%; } table.kv td { overflow-wrap: break-word; }
th, td { padding: .3rem .7rem; border-bottom: 1px solid #e4e4e4; vertical-align: top; }
th { background: #f5f5f7; font-weight: 600; text-align: center; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td small { color: #666; } table.kv th { text-align: left; width: 16rem; }
.fail { color: #b00020; font-weight: 600; }
figure { margin: 1rem 0 1.6rem; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: .9rem; max-width: 52rem; }
.grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(28rem, 1fr)); gap: 1rem; }
"""


def _class(names: str) -> str:
    return f' class="{names}"' if names else ""


@dataclass
class Cell:
    """A table cell: its text (escaped when rendered), a smaller second line, whether it is a number (right-aligned)
    and whether it marks a failure."""

    text: str
    detail: str = ""
    number: bool = False
    failed: bool = False

    def render(self) -> str:
        classes = " ".join(c for c, on in (("num", self.number), ("fail", self.failed)) if on)
        detail = f"<br><small>{html.escape(self.detail)}</small>" if self.detail else ""
        return f"<td{_class(classes)}>{html.escape(self.text)}{detail}</td>"


@dataclass
class Table:
    """Header rows (each cell ``(text, colspan, rowspan)``) over body rows of cells."""

    header: list[list[tuple[str, int, int]]]
    rows: list[list[Cell]]
    css: str = ""

    def render(self) -> str:
        head = "".join("<tr>" + "".join(f'<th colspan="{c}" rowspan="{r}">{html.escape(text)}</th>' for text, c, r in row) + "</tr>" for row in self.header)
        body = "".join("<tr>" + "".join(cell.render() for cell in row) + "</tr>" for row in self.rows)
        return f"<table{_class(self.css)}><thead>{head}</thead><tbody>{body}</tbody></table>"


def key_values(pairs: list[tuple[str, str]]) -> str:
    """A two-column table of named values (``(name, value)``), names as row headers."""
    rows = "".join(f"<tr><th>{html.escape(name)}</th><td>{html.escape(value)}</td></tr>" for name, value in pairs)
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def figure(png: Path, caption: str) -> str:
    """A plot embedded as a data URI, with its caption (the file's name is its alt text)."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(png.name)}"><figcaption>{html.escape(caption)}</figcaption></figure>'


@dataclass
class Section:
    """A heading, an optional sentence under it, then blocks of HTML (tables, figures) in order."""

    title: str
    blocks: list[str] = field(default_factory=list)
    note: str = ""

    def render(self) -> str:
        note = f'<p class="note">{html.escape(self.note)}</p>' if self.note else ""
        return f"<h2>{html.escape(self.title)}</h2>{note}" + "".join(self.blocks)


def render_page(title: str, lede: str, sections: list[Section]) -> str:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n"
        f'<body><h1>{html.escape(title)}</h1><p class="lede">{html.escape(lede)}</p>\n'
        + "\n".join(section.render() for section in sections)
        + "\n</body></html>\n"
    )


def duration(seconds: float | None) -> str:
    """Seconds as a person reads them: ``850 ms``, ``13.3 s``, ``22 min 01 s``, ``1 h 02 min``."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
