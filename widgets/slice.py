"""The per-host view of a slice run (``tpukit.run_on_slice(..., dashboard=True)``).

A listener like the dashboard: each host's step records and compile events arrive in the notebook
tagged with ``.host`` (``tpukit.hosts.HostStepRecord`` / ``HostCompileEvent``) and land in a
:class:`SliceState`, which keeps, per host, the steps done, the last and the median step time,
the compiles and recompilations, and names the slowest host (the largest median step time: in a
synchronous SPMD program every host waits for it). The front end is one HTML table updated in
place in a notebook (its last state stays in the saved file), a line of text every ``text_every``
seconds and the table at the end elsewhere. No widget state, no torch_xla.
"""

from __future__ import annotations

import html
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from tpukit import events
from tpukit._text import plural, seconds, table_html, table_text
from tpukit.compiles import RECOMPILATION

from . import frontend


@dataclass(frozen=True)
class HostRow:
    """One host's numbers so far. Step times in seconds; the median is over steps without a compile."""

    host: int
    steps: int
    last_step_s: float | None
    median_step_s: float | None
    compiles: int
    recompilations: int
    compile_time: float
    compiling: bool


@dataclass(frozen=True)
class SliceSummary:
    """Every host's row, the slowest host and how much slower it is than the fastest."""

    hosts: int | None  # hosts in the slice (None: not told)
    rows: tuple[HostRow, ...]
    slowest: int | None  # None until two hosts have step times
    spread: float | None  # slowest median / fastest median

    def row(self, host: int) -> HostRow | None:
        """The row of ``host``, or None before it reported anything."""
        return next((r for r in self.rows if r.host == host), None)


class SliceState:
    """Thread-safe accumulator of the step records and compile events of a slice's hosts."""

    def __init__(self, hosts: int | None = None):
        self.hosts = hosts
        self._lock = threading.Lock()
        self._walls: dict[int, list[float]] = {}
        self._steady: dict[int, list[float]] = {}
        self._compiles: dict[tuple[int, int], Any] = {}  # (host, event index) -> latest event

    def add_step(self, record: Any) -> None:
        """Consume one step record (``record.host``; a record without one is host 0's)."""
        host = getattr(record, "host", None) or 0
        with self._lock:
            self._walls.setdefault(host, []).append(record.wall)
            self._steady.setdefault(host, [])
            if not record.compiles and not record.compile_events:
                self._steady[host].append(record.wall)
            for event in record.compile_events:
                self._compiles.setdefault((host, event.index), event)

    def add_compile(self, event: Any) -> None:
        """Consume one compile event (a new one or an update of one seen before)."""
        host = getattr(event, "host", None) or 0
        with self._lock:
            self._compiles[(host, event.index)] = event
            self._walls.setdefault(host, [])
            self._steady.setdefault(host, [])

    def summary(self) -> SliceSummary:
        """The rows, host by host, and the slowest host."""
        with self._lock:
            hosts = sorted(self._walls)
            walls = {h: list(self._walls[h]) for h in hosts}
            steady = {h: list(self._steady[h]) for h in hosts}
            events_ = dict(self._compiles)
        rows = []
        for h in hosts:
            mine = [e for (host, _), e in events_.items() if host == h]
            times = steady[h] or walls[h]
            rows.append(HostRow(h, len(walls[h]), walls[h][-1] if walls[h] else None,
                                statistics.median(times) if times else None, len(mine),
                                sum(1 for e in mine if getattr(e, "kind", None) == RECOMPILATION),
                                sum(e.duration or 0.0 for e in mine), any(e.end is None for e in mine)))
        timed = [r for r in rows if r.median_step_s is not None]
        slowest = spread = None
        if len(timed) >= 2:
            slow, fast = max(timed, key=lambda r: r.median_step_s), min(timed, key=lambda r: r.median_step_s)
            slowest = slow.host
            spread = slow.median_step_s / fast.median_step_s if fast.median_step_s > 0 else None
        return SliceSummary(self.hosts, tuple(rows), slowest, spread)


# ------------------------------------------------------------------------------ renderers

HEAD = ("host", "steps", "last step", "median step", "compiles", "recompilations", "")


def _cells(row: HostRow, summary: SliceSummary) -> tuple[str, ...]:
    note = "slowest" if row.host == summary.slowest else ""
    if row.compiling:
        note = (note + ", compiling").lstrip(", ")
    return (str(row.host), str(row.steps), seconds(row.last_step_s), seconds(row.median_step_s),
            str(row.compiles), str(row.recompilations), note)


def headline(summary: SliceSummary) -> str:
    """One sentence: hosts reporting, steps, the slowest host."""
    n = len(summary.rows)
    total = f"{n} of {summary.hosts} hosts" if summary.hosts else plural(n, "host")
    steps = "/".join(str(r.steps) for r in summary.rows) or "0"
    text = f"slice: {total} reporting, steps {steps}"
    if summary.slowest is not None:
        row = summary.row(summary.slowest)
        times = f", {summary.spread:.2f}× the fastest" if summary.spread else ""
        text += f"; slowest host {summary.slowest} (median step {seconds(row.median_step_s)}{times})"
    return text


def summary_text(summary: SliceSummary) -> str:
    """The per-host table as plain text."""
    return table_text([_cells(r, summary) for r in summary.rows], title=headline(summary), head=HEAD)


def summary_html(summary: SliceSummary) -> str:
    """The per-host table as HTML (inline styles only, so it survives in saved notebooks)."""
    body = table_html([_cells(r, summary) for r in summary.rows], head=HEAD)
    return f"<div class='tpukit-slice'><b>tpukit</b> {html.escape(headline(summary))}{body}</div>"


# ------------------------------------------------------------------------------ the view

class SliceView:
    """Live per-host view of a slice run; a listener (``on_step``, ``on_compile``) until :meth:`close`.

    hosts: the slice's host count (to say "3 of 4 hosts"). mode: ``"auto"`` (an HTML table updated
    in place in a notebook front end, text elsewhere; ``TPUKIT_DASHBOARD`` overrides), ``"widgets"``
    or ``"text"``. refresh_hz: table refreshes per second at most. text_every: seconds between text lines.
    """

    def __init__(self, hosts: int | None = None, *, mode: str = "auto", refresh_hz: float = 2.0,
                 text_every: float = 10.0, show: bool = True):
        if not (isinstance(refresh_hz, (int, float)) and 0 < refresh_hz <= 2):
            raise ValueError(f"SliceView(refresh_hz={refresh_hz!r}) must be > 0 and <= 2.")
        self.state = SliceState(hosts)
        self.context = frontend.detect_context()
        self.mode = frontend.choose_frontend(mode, self.context)
        self.refresh_hz, self.text_every = float(refresh_hz), float(text_every)
        self.closed = False
        self._handle = None
        self._last = -float("inf")
        self._last_text = time.monotonic()
        if show and self.mode == "widgets":
            from IPython.display import HTML, display

            self._handle = display(HTML(summary_html(self.summary())), display_id=True)
        # events, not steps.add_listener: the hosts' records arrive forwarded; arming this process's
        # sync hook would add its own syncs to host 0's row.
        events.add_listener(self)

    def on_step(self, record: Any) -> None:
        self.state.add_step(record)
        self._tick()

    def on_compile(self, event: Any) -> None:
        self.state.add_compile(event)
        self._tick()

    def summary(self) -> SliceSummary:
        """The numbers now (a frozen record)."""
        return self.state.summary()

    def _tick(self) -> None:
        now = time.monotonic()
        if self._handle is not None and now - self._last >= 1.0 / self.refresh_hz:
            self._last = now
            self._show()
        elif self.mode == "text" and now - self._last_text >= self.text_every:
            self._last_text = now
            print(headline(self.summary()), flush=True)

    def _show(self) -> None:
        from IPython.display import HTML

        self._handle.update(HTML(summary_html(self.summary())))

    def close(self) -> None:
        """Stop listening and show the final table (updated in place, or printed)."""
        if self.closed:
            return
        self.closed = True
        events.remove_listener(self)
        if self._handle is not None:
            self._show()
        else:
            print(summary_text(self.summary()), flush=True)

    def _repr_html_(self) -> str:
        return summary_html(self.summary())

    def __repr__(self) -> str:
        return f"<tpukit SliceView {'closed' if self.closed else 'live'}: {headline(self.summary())}>"
