"""Small text helpers: ``plural`` and the one key/value table renderer (text and HTML)."""

from __future__ import annotations

import html as _html
from typing import Sequence

CELL_STYLE = "padding:1px 8px;text-align:left;vertical-align:top"


def plural(n: int, word: str, suffix: str = "s") -> str:
    """``plural(1, "compile") == "1 compile"``, ``plural(3, "compile") == "3 compiles"``."""
    return f"{n} {word}" + ("" if n == 1 else suffix)


def seconds(x: float | None) -> str:
    """A duration for people: ``12.3 ms``, ``1.25 s``, ``–`` when unknown."""
    if x is None:
        return "–"
    if x < 1:
        return f"{x * 1000:.1f} ms"
    return f"{x:.2f} s"


def table_text(rows: Sequence[Sequence[str]], title: str | None = None,
               head: Sequence[str] | None = None) -> str:
    """Rows as aligned plain text (first column padded), with an optional title line and header."""
    rows = [tuple(str(c) for c in r) for r in rows]
    all_rows = ([tuple(head)] if head else []) + rows
    if not all_rows:
        return title or ""
    widths = [max(len(r[i]) for r in all_rows if i < len(r)) for i in range(max(len(r) for r in all_rows))]
    lines = [title] if title else []
    for r in all_rows:
        cells = [c.ljust(widths[i]) if i < len(r) - 1 else c for i, c in enumerate(r)]
        lines.append(("  " if title else "") + "  ".join(cells).rstrip())
    return "\n".join(lines)


def table_html(rows: Sequence[Sequence[str]], title: str | None = None, head: Sequence[str] | None = None,
               css_class: str | None = None, raw: bool = False) -> str:
    """Rows as an HTML table (escaped unless ``raw``), with an optional caption and header row."""
    esc = (lambda s: str(s)) if raw else (lambda s: _html.escape(str(s)))
    cls = f" class='{css_class}'" if css_class else ""
    cap = f"<caption style='text-align:left'><b>{_html.escape(title)}</b></caption>" if title else ""
    th = ("<tr>" + "".join(f"<th style='{CELL_STYLE}'>{_html.escape(str(h))}</th>" for h in head) + "</tr>"
          if head else "")
    body = "".join("<tr>" + "".join(f"<td style='{CELL_STYLE}'>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table{cls} style='border-collapse:collapse;font-size:90%'>{cap}{th}{body}</table>"
