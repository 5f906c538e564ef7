"""HTML and text renderers: pure functions of a :class:`~tpukit.widgets.model.View`.

The same numbers feed the live widgets, the periodic text summary and the static
report, so the three never disagree. Only inline styles (they survive in saved
notebooks and on GitHub, which drop <style> blocks).
"""

from __future__ import annotations

import html
from typing import Any

from tpukit._text import plural, seconds, table_html

from .model import View

WARN = "#b45309"
BAD = "#b91c1c"
MUTED = "#6b7280"
_KIND_COLOUR = {"idle": MUTED, "executing": "#15803d", "compiling": "#c2410c", "stopped": BAD}


def _e(x: Any) -> str:
    return html.escape(str(x))


# ---------------------------------------------------------------- header

def header_rows(runtime: Any) -> list[tuple[str, str]]:
    """(label, value) rows describing the runtime, or how to get one."""
    if runtime is None:
        return [("runtime", "not set up yet: call tpukit.setup() first (it also enables compile causes)")]
    v = runtime.versions or {}
    vers = " · ".join(f"{k} {v[k]}" for k in ("torch", "torch_xla", "tpukit") if v.get(k))
    return [("platform", runtime.platform),
            ("devices", f"{runtime.device_count} × {runtime.device_type}" + (" · SPMD" if runtime.spmd else "")),
            ("versions", vers)]


def header_html(runtime: Any, tracing: bool, title: str = "tpukit dashboard") -> str:
    """Platform, devices, SPMD, versions; setup problems in the warning colour."""
    parts = [f"<b>{_e(title)}</b>"]
    parts += [f"<span style='color:{MUTED}'>{_e(k)}</span> {_e(v)}" for k, v in header_rows(runtime)]
    out = " &nbsp;·&nbsp; ".join(parts)
    problems = list(getattr(runtime, "problems", ()) or ())
    if runtime is not None and not tracing and not problems:
        problems.append("compile tracing is off: counts only, no causes (call tpukit.setup() before importing torch_xla)")
    for p in problems:
        out += f"<div style='color:{WARN}'>⚠ {_e(p)}</div>"
    return f"<div style='font-size:90%'>{out}</div>"


def header_text(runtime: Any) -> str:
    """The header as one plain-text line."""
    return "tpukit dashboard: " + " · ".join(f"{k} {v}" for k, v in header_rows(runtime))


# ---------------------------------------------------------------- counters

def counter_rows(v: View) -> list[tuple[str, str]]:
    """The counters as (label, value) rows, shared by HTML and text."""
    compiles = f"{v.compiles} ({seconds(v.compile_time)})"
    if v.cached_compiles is not None:
        compiles += f", {v.cached_compiles} cached"
    transfers = (f"{v.to_device if v.to_device is not None else '?'} to device, "
                 f"{v.to_host} to host ({v.item_reads} .item())")
    rows = [("steps", str(v.steps)),
            ("compiles", compiles),
            ("recompilations", str(v.recompilations)),
            ("executions", f"{v.executions} ({seconds(v.execute_time)})"),
            ("transfers", transfers),
            ("CPU fallbacks", str(sum(v.fallbacks.values())) if v.fallbacks else "0"),
            ("step time", f"last {seconds(v.last_step_s)}, median {seconds(v.median_step_s)}")]
    if v.throughput is not None:
        rows.append(("throughput", f"{v.throughput:,.1f} examples/s (batch {v.batch_size})"))
    if v.memory:
        used, limit = v.memory.get("bytes_used", 0), v.memory.get("bytes_limit", 0)
        rows.append(("device memory", f"{used / 2**20:,.0f} of {limit / 2**20:,.0f} MiB"))
    if v.scalars:
        rows.append(("last scalars", ", ".join(f"{k} {x:.4g}" for k, x in list(v.scalars.items())[:4])))
    return rows


def counters_html(v: View) -> str:
    """The counters as a compact two-column grid."""
    rows = counter_rows(v)
    half = (len(rows) + 1) // 2
    cols = []
    for chunk in (rows[:half], rows[half:]):
        cells = [(f"<span style='color:{MUTED}'>{_e(k)}</span>",
                  f"<b style='color:{BAD}'>{_e(val)}</b>" if k == "recompilations" and v.recompilations
                  else _e(val)) for k, val in chunk]
        cols.append(table_html(cells, raw=True))
    return "<div style='display:flex;gap:2em'>" + "".join(f"<div>{c}</div>" for c in cols) + "</div>"


# ---------------------------------------------------------------- now line

def now_html(v: View) -> str:
    """The now line (idle / executing step N / compiling graph ... for N s, triggered by ...)."""
    colour = _KIND_COLOUR.get(v.now_kind, MUTED)
    return f"<div><span style='color:{colour}'>●</span> <b>now</b> {_e(v.now)}</div>"


# ---------------------------------------------------------------- alerts

def alert_rows(v: View) -> list[tuple[str, ...]]:
    """(step, graph, where, cause, hint) per shown recompilation, latest first."""
    return [(str(a.step) if a.step is not None else "?", (a.graph_hash[:6] + "…") if a.graph_hash else "?",
             a.where, a.cause, a.hint) for a in v.alerts]


def alerts_html(v: View) -> str:
    """One row per recompilation (latest first), with hint, cause and the user's cell and line."""
    if not v.alerts_total:
        return f"<div style='color:{MUTED}'>no recompilations</div>"
    more = v.alerts_total - len(v.alerts)
    title = (f"<div style='color:{BAD}'><b>{plural(v.alerts_total, 'recompilation')}</b>"
             + (f" (latest {len(v.alerts)} shown)" if more else "") + "</div>")
    return title + table_html(alert_rows(v), head=("step", "graph", "where", "cause", "hint"))


# ---------------------------------------------------------------- fallbacks

def fallbacks_html(v: View) -> str:
    """CPU-fallback ops (no XLA lowering) with their counts, most frequent first."""
    if not v.fallbacks:
        return f"<div style='color:{MUTED}'>no CPU fallbacks</div>"
    rows = [(op, str(n)) for op, n in sorted(v.fallbacks.items(), key=lambda kv: (-kv[1], kv[0]))]
    return (f"<div style='color:{WARN}'><b>CPU fallbacks</b> (ops without an XLA lowering run on the host)</div>"
            + table_html(rows, head=("op", "count")))


# ---------------------------------------------------------------- text

def text_line(v: View, final: bool = False) -> str:
    """One short line for the periodic text summary (``final``: the line printed at the end)."""
    parts = [f"step {v.last_step}" if v.last_step is not None else "no steps yet",
             plural(v.compiles, "compile")]
    if v.recompilations:
        parts.append(plural(v.recompilations, "recompilation"))
    if v.median_step_s is not None:
        parts.append(f"step {seconds(v.last_step_s)} (median {seconds(v.median_step_s)})")
    if v.throughput is not None:
        parts.append(f"{v.throughput:,.1f} ex/s")
    parts += [f"{k} {x:.4g}" for k, x in list(v.scalars.items())[:3]]
    if v.fallbacks:
        parts.append(f"{sum(v.fallbacks.values())} CPU fallbacks")
    if final:
        return "tpukit: done · " + " · ".join(parts + [f"{v.elapsed:.1f} s"])
    parts.append(v.now)
    return "tpukit: " + " · ".join(parts)


def text_report(v: View, runtime: Any = None, summary: bool = True) -> str:
    """Multi-line plain-text report: counters, recompilations, fallbacks."""
    lines = []
    if summary:
        lines.append(header_text(runtime))
        w = max(len(k) for k, _ in counter_rows(v))
        lines += [f"  {k:<{w}}  {val}" for k, val in counter_rows(v)]
    for a in v.alerts:
        lines.append(f"  recompilation at step {a.step if a.step is not None else '?'}, {a.where}: {a.cause}. {a.hint}")
    if v.alerts_total > len(v.alerts):
        lines.append(f"  ... {v.alerts_total - len(v.alerts)} earlier recompilation(s) not shown")
    for op, n in sorted(v.fallbacks.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  CPU fallback {op} x{n}")
    return "\n".join(lines)


# ---------------------------------------------------------------- static report

def report_html(v: View, runtime: Any, tracing: bool) -> str:
    """The static report: header, counters table, recompilations and fallbacks (no widgets needed)."""
    return ("<div class='tpukit-report'>" + header_html(runtime, tracing, title="tpukit report")
            + table_html(counter_rows(v))
            + alerts_html(v) + fallbacks_html(v) + "</div>")
