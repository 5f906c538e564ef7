"""HTML and text renderers: pure functions of a :class:`~tpukit.widgets.view.View`.

The same numbers feed the live widgets, the periodic text summary and the static
report, so the three never disagree. Only inline styles (they survive in saved
notebooks and on GitHub, which drop <style> blocks). A compile is written from the
parts of its event (name, evidence, hint, hash: what ``tpukit.compiles.describe``
writes), never re-derived here.
"""

from __future__ import annotations

import base64
import html
from typing import Any

from tpukit import cache, tpu
from tpukit._text import plural, seconds, table_html
from tpukit.compiles import describe

from .view import Compile, View

WARN = "#b45309"
BAD = "#b91c1c"
MUTED = "#6b7280"
_KIND_COLOUR = {"idle": MUTED, "executing": "#15803d", "compiling": "#c2410c", "stopped": BAD}
_MUTED_COUNTERS = ("new graphs", "expected compiles", "warm-up")


def _e(x: Any) -> str:
    return html.escape(str(x))


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] if text else text


# ---------------------------------------------------------------- header

def header_rows(runtime: Any) -> list[tuple[str, str]]:
    """(label, value) rows describing the runtime, or how to get one."""
    if runtime is None:
        return [("runtime", "not set up yet: call tpukit.setup() first (it also enables compile causes)")]
    v = runtime.versions or {}
    vers = " · ".join(f"{k} {v[k]}" for k in ("torch", "torch_xla", "tpukit") if v.get(k))
    return [("platform", runtime.platform),
            ("devices", f"{runtime.device_count} × {runtime.device_type}" + (" · SPMD" if runtime.spmd else "")),
            ("versions", vers)] + ([("compile cache", f"{cache.stats()}")] if runtime.compile_cache else [])


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

def warmup_text(v: View) -> str | None:
    """'settled after step 2', 'no compiles', 'not settled yet' / 'never settled'; None outside track()."""
    if not v.tracked or not v.steps:
        return None
    if v.settled_after is None:
        return "never settled: new graphs kept compiling" if v.loop_done else "not settled yet"
    if v.settled_after == 0:
        return "none: nothing compiled"
    return f"settled after step {v.settled_after}"


def compiles_split(v: View) -> str | None:
    """``2 in the 20 steps, 1 before them``: where the compiles were, once the dashboard is closed (or its
    loop done) and some were outside the step records, which ``Tracker.summary()["compiles"]`` counts
    (a loop's flush of the work queued before it: ``summary()["compiles_before"]``); else None."""
    outside = v.compiles - v.step_compiles if v.step_compiles is not None else 0
    if outside <= 0 or not v.steps or not (v.closed or v.loop_done):
        return None
    before = min(v.compiles_before, outside)
    parts = [f"{v.step_compiles} in the {v.steps} steps" if v.steps != 1 else f"{v.step_compiles} in the one step"]
    if before:
        parts.append(f"{before} before them")
    if outside > before:
        parts.append(f"{outside - before} outside them")
    return ", ".join(parts)


def compiles_text(v: View) -> str:
    """``3 compiles (2 in the 20 steps, 1 before them)``, or ``3 compiles`` (see :func:`compiles_split`)."""
    split = compiles_split(v)
    return plural(v.compiles, "compile") + (f" ({split})" if split else "")


def flops_text(x: float) -> str:
    """``4.12 GFLOP``: a FLOP count with its unit."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def rate_rows(v: View) -> list[tuple[str, str]]:
    """Tokens/s, the model FLOPs per step with whose count it is and the achieved TFLOP/s, and the MFU (or
    why there is none: ``n/a: not a TPU``), as rows; none when no step counted tokens or FLOPs."""
    r = v.rate
    if r is None:
        return []
    rows = [("tokens/s", f"{r.tokens_per_s:,.0f}")] if r.tokens_per_s is not None else []
    if r.flops_per_step is not None:
        achieved = f", {r.tflops:.3g} TFLOP/s achieved" if r.tflops is not None else ""
        rows.append(("model FLOPs", f"{flops_text(r.flops_per_step)} per step{achieved} (by {r.flops_source})"))
    return rows + [("MFU", r.mfu_note)]


def counter_rows(v: View) -> list[tuple[str, str]]:
    """The counters as (label, value) rows, shared by HTML and text."""
    split = compiles_split(v)
    compiles = f"{v.compiles} ({seconds(v.compile_time)}" + (f"; {split})" if split else ")")
    if v.cached_compiles is not None:
        compiles += f", {v.cached_compiles} cached"
    transfers = (f"{v.to_device if v.to_device is not None else '?'} to device, "
                 f"{v.to_host} to host ({v.item_reads} .item())")
    rows = [("steps", str(v.steps)),
            ("compiles", compiles),
            ("recompilations", str(v.recompilations)),
            ("new graphs", str(v.new_graphs)),
            ("expected compiles", str(v.expected))]
    if v.eager_compiles:  # each also a compile event, named at its line (tpukit.eager)
        more = len(v.eager_places) - 4
        places = ", ".join(v.eager_places[:4]) + (f" (+{more} more)" if more > 0 else "")
        rows.append(("eager-mode ops", f"{v.eager_compiles} compiled one by one" + (f": {places}" if places else "")))
    warmup = warmup_text(v)
    if warmup:
        rows.append(("warm-up", warmup))
    rows += [("executions", f"{v.executions} ({seconds(v.execute_time)})"),
             ("transfers", transfers),
             ("CPU fallbacks", str(sum(v.fallbacks.values())) if v.fallbacks else "0"),
             ("step time", f"last {seconds(v.last_step_s)}, median {seconds(v.median_step_s)}")]
    if v.throughput is not None:
        rows.append(("throughput", f"{v.throughput:,.1f} examples/s (batch {v.batch_size})"))
    rows += rate_rows(v)
    if v.memory:
        used, limit = v.memory.get("bytes_used", 0), v.memory.get("bytes_limit", 0)
        rows.append(("device memory", f"{used / 2**20:,.0f} of {limit / 2**20:,.0f} MiB"))
    if v.scalars:
        rows.append(("last scalars", ", ".join(f"{k} {x:.4g}" for k, x in list(v.scalars.items())[:4])))
    return rows


def _counter_value(v: View, label: str, value: str) -> str:
    if label == "recompilations" and v.recompilations:
        return f"<b style='color:{BAD}'>{_e(value)}</b>"  # the alarm: only recompilations are red
    if label in _MUTED_COUNTERS:
        return f"<span style='color:{MUTED}'>{_e(value)}</span>"
    return _e(value)


def counters_html(v: View) -> str:
    """The counters as a compact two-column grid."""
    rows = counter_rows(v)
    half = (len(rows) + 1) // 2
    cols = []
    for chunk in (rows[:half], rows[half:]):
        cells = [(f"<span style='color:{MUTED}'>{_e(k)}</span>", _counter_value(v, k, val)) for k, val in chunk]
        cols.append(table_html(cells, raw=True))
    return "<div style='display:flex;gap:2em'>" + "".join(f"<div>{c}</div>" for c in cols) + "</div>"


# ---------------------------------------------------------------- now line, verdict

def now_html(v: View) -> str:
    """The now line (idle / executing step N / compiling <graph> for N s)."""
    colour = _KIND_COLOUR.get(v.now_kind, MUTED)
    return f"<div><span style='color:{colour}'>●</span> <b>now</b> {_e(v.now)}</div>"


def stopped_html(v: View) -> str:
    """``stopped by RuntimeError at step 1`` in the alarm colour when an exception ended the loop, else ''."""
    if not v.stopped:
        return ""
    return f"<div style='color:{BAD}'><b>{_e(v.stopped)}</b>: the loop ended with this exception</div>"


def verdict_text(v: View) -> str | None:
    """Where the time goes, as one sentence with the shares and one suggestion (None before a tracked loop)."""
    if v.verdict is None:
        return None
    return f"{v.verdict.sentence}; {v.verdict.suggestion}."


def verdict_html(v: View) -> str:
    """The verdict line, with the bottleneck in bold ('' before a tracked loop has steps)."""
    text = verdict_text(v)
    if text is None:
        return ""
    kind = v.verdict.bottleneck
    head, _, rest = text.partition(f"{kind}-bound")
    body = _e(head) + f"<b>{_e(kind)}-bound</b>" + _e(rest) if _ else _e(text)
    return f"<div><b>where the time goes:</b> {body}</div>"


# ---------------------------------------------------------------- compiles

def _step(step: int | None) -> str:
    """A listed compile's step: "3", "before 1" (a loop's flush of earlier work), "?" (not known)."""
    return "?" if step is None else "before 1" if step == 0 else str(step)


def alert_rows(v: View) -> list[tuple[str, ...]]:
    """(step, graph, what changed, what to do, hash) per shown recompilation, latest first."""
    return [(_step(a.step), a.name, "; ".join(a.evidence) or a.cause,
             _sentence(a.hint), (a.graph_hash[:6] + "…") if a.graph_hash else "?") for a in v.alerts]


def alerts_html(v: View) -> str:
    """One row per recompilation (latest first): the graph by name, the evidence, the hint; hash last."""
    if not v.alerts_total:
        return f"<div style='color:{MUTED}'>no recompilations</div>"
    more = v.alerts_total - len(v.alerts)
    title = (f"<div style='color:{BAD}'><b>{plural(v.alerts_total, 'recompilation')}</b>"
             f" (the same computation compiled again: it keeps happening until its cause is fixed)"
             + (f", latest {len(v.alerts)} shown" if more else "") + "</div>")
    rows = [(_e(s), _e(name), _e(ev), _e(hint), f"<span style='color:{MUTED}'>{_e(h)}</span>")
            for s, name, ev, hint, h in alert_rows(v)]
    return title + table_html(rows, head=("step", "graph", "what changed", "what to do", "hash"), raw=True)


def graph_rows(v: View) -> list[tuple[str, ...]]:
    """(step, kind, graph, what is new) per shown new graph or expected compile, latest first."""
    return [(_step(g.step), g.label, g.name, "; ".join(g.evidence))
            for g in v.graphs]


def graphs_title(v: View) -> str:
    """'2 new graphs, 1 expected compile (not alarms)'."""
    parts = [plural(v.new_graphs, "new graph")]
    if v.expected:
        parts.append(plural(v.expected, "expected compile"))
    return ", ".join(parts) + " (not alarms)"


def graphs_html(v: View) -> str:
    """New graphs and expected compiles, muted: what compiled and why it is not an alarm."""
    if not v.new_graphs and not v.expected:
        return ""
    more = v.new_graphs + v.expected - len(v.graphs)
    title = f"<div style='color:{MUTED}'><b>{_e(graphs_title(v))}</b>" + (
        f", latest {len(v.graphs)} shown" if more > 0 else "") + "</div>"
    return (f"<div style='color:{MUTED}'>" + title
            + table_html(graph_rows(v), head=("step", "kind", "graph", "what is new")) + "</div>")


def tpu_rows(v: View) -> list[tuple[str, ...]]:
    """(graph, fits, HBM per chip of the limit, TPU compile, step floor) per graph compiled for the target."""
    rows = []
    for name, e in v.tpu:
        fits, hbm, compile_s, floor = tpu.outcome.cells(e)
        rows.append((name, fits, hbm, compile_s, floor if e.fits else (e.message or "").splitlines()[0][:120]))
    return rows


def tpu_text(name: str, e: Any) -> str:
    """``on the target TPU: <graph>: v5e-1: fits, ...`` (tpukit.tpu's one line)."""
    return f"on the target TPU: {name}: {tpu.line(e)}"


def late_tpu_line(name: str, e: Any) -> str:
    """The line text mode prints for a TPU answer that came after the run's closing line."""
    return f"tpukit: {tpu_text(name, e)}"


def tpu_html(v: View) -> str:
    """Each graph compiled for the target TPU by the real TPU compiler: does it fit, how long it compiles."""
    if not v.tpu:
        return ""
    target, by = v.tpu[0][1].target, v.tpu[0][1].answered_by
    bad = any(not e.fits for _, e in v.tpu)
    title = (f"<div style='color:{BAD if bad else MUTED}'><b>on a {_e(target)}</b> (the TPU compiler's answer"
             + (f", {_e(by)}" if by else "") + ", ahead of time, per chip)</div>")
    return title + table_html(tpu_rows(v), head=("graph", "fits", "HBM per chip", "TPU compile", "step at best"))


def compile_text(c: Compile) -> str:
    """One listed compile as a line: ``recompilation at step 3: step graph at cell [7] line 5 (3 -> 2):
    input_ids: (8, 16) -> (8, 24). Bucket or pad ... [graph a1b2c3d4]``: ``tpukit.compiles.describe``
    with the step the dashboard knows in place of the duration."""
    return describe(c.event, step=c.step if c.step is not None else "?")


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
    parts = [f"step {v.last_step}" if v.last_step is not None else "no steps yet", compiles_text(v)]
    if v.recompilations:
        parts.append(plural(v.recompilations, "recompilation"))
    if v.median_step_s is not None:
        parts.append(f"step {seconds(v.last_step_s)} (median {seconds(v.median_step_s)})")
    if v.throughput is not None:
        parts.append(f"{v.throughput:,.1f} ex/s")
    r = v.rate
    if r is not None and r.tokens_per_s is not None:
        parts.append(f"{r.tokens_per_s:,.0f} tokens/s")
    if r is not None and r.tflops is not None:
        parts.append(f"{r.tflops:.3g} TFLOP/s, MFU " + (f"{r.mfu:.0%}" if r.mfu is not None else r.mfu_note))
    parts += [f"{k} {x:.4g}" for k, x in list(v.scalars.items())[:3]]
    if v.fallbacks:
        parts.append(plural(sum(v.fallbacks.values()), "CPU fallback"))
    if final:
        if v.verdict is not None:
            parts.append(f"{v.verdict.bottleneck}-bound")
        if v.stopped:  # "stopped by RuntimeError at step 1" in place of "done · step 1"
            return f"tpukit: {v.stopped} · " + " · ".join(parts[1:] + [f"{v.elapsed:.1f} s"])
        return "tpukit: done · " + " · ".join(parts + [f"{v.elapsed:.1f} s"])
    parts.append(v.now)
    return "tpukit: " + " · ".join(parts)


def text_report(v: View, runtime: Any = None, summary: bool = True) -> str:
    """Multi-line plain-text report: counters, where the time goes, recompilations, new graphs, fallbacks."""
    lines = []
    if summary:
        lines.append(header_text(runtime))
        if v.stopped:
            lines.append(f"  {v.stopped}")
        w = max(len(k) for k, _ in counter_rows(v))
        lines += [f"  {k:<{w}}  {val}" for k, val in counter_rows(v)]
    verdict = verdict_text(v)
    if verdict:
        lines.append(f"  where the time goes: {verdict}")
    lines += [f"  {compile_text(a)}" for a in v.alerts]
    if v.alerts_total > len(v.alerts):
        lines.append(f"  ... {plural(v.alerts_total - len(v.alerts), 'earlier recompilation')} not shown")
    lines += [f"  {compile_text(g)}" for g in v.graphs]
    lines += [f"  {tpu_text(name, e)}" for name, e in v.tpu]
    for op, n in sorted(v.fallbacks.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  CPU fallback {op} x{n}")
    return "\n".join(lines)


# ---------------------------------------------------------------- static report

def image_html(png: bytes) -> str:
    """A PNG inside the HTML itself (data URI), so the report is one self-contained output."""
    data = base64.b64encode(png).decode("ascii")
    return f"<div><img style='max-width:100%' alt='step timeline' src='data:image/png;base64,{data}'/></div>"


def report_html(v: View, runtime: Any, tracing: bool, png: bytes | None = None) -> str:
    """The static report: header, where the time goes, counters, the timeline (when ``png``),
    recompilations, new graphs and fallbacks (no widgets needed)."""
    return ("<div class='tpukit-report'>" + header_html(runtime, tracing, title="tpukit report")
            + stopped_html(v) + verdict_html(v) + table_html([(_e(k), _counter_value(v, k, val)) for k, val in counter_rows(v)], raw=True)
            + (image_html(png) if png else "")
            + alerts_html(v) + graphs_html(v) + tpu_html(v) + fallbacks_html(v) + "</div>")
