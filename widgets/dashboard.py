"""The live compile/execute dashboard: a tpukit listener, a polling thread, a front end.

Listener calls (on the training thread) only append to a :class:`DashboardState`.
A daemon thread polls the compile-trace file (so the now line moves while the
main thread is blocked in a long compilation), samples the counters and
refreshes the view at most ``refresh_hz`` times a second; a second daemon
thread draws the timeline PNG, which the next refresh shows. The front end is
chosen once (:func:`~tpukit.widgets.frontend.choose_frontend`): live ipywidgets
in a notebook, a short text line every ``text_every`` seconds elsewhere. Any
exception inside the dashboard disables it with one TpukitWarning; the training
loop never sees it. When the tracked loop that opened it ends, the live widget is
replaced in its output by the static report (:mod:`~tpukit.widgets.report`).
"""

from __future__ import annotations

import html
import logging
import math
import threading
import time
import warnings
from collections import deque
from typing import Any

from tpukit import compiles, events, metrics
from tpukit import runtime as _runtime
from tpukit._text import plural
from tpukit.errors import TpukitWarning

from . import frontend, render
from . import report as _report
from .model import DashboardState, View
from .report import Report

logger = logging.getLogger("tpukit")
MAX_REFRESH_HZ = 2.0


def _runtime_started() -> bool:
    # The dashboard must never import torch_xla or start the runtime (setup() has
    # to configure both first), so it reads counters and arms step hooks only once
    # someone else started the runtime. Never imports anything itself.
    return _runtime.started()


class _EarlyListener:
    """Stands in for a dashboard opened before the XLA runtime started.

    The core arms a step closure (importing torch_xla) for any listener with
    ``on_step``; this one has none. The dashboard replaces it by itself once the
    runtime runs (at the start of a tracked loop, or seen by the polling thread).
    """

    def __init__(self, dash: "Dashboard"):
        self.dash = dash

    def on_compile(self, event: Any) -> None:
        self.dash.on_compile(event)

    def on_track_start(self, tracker: Any) -> None:
        self.dash._attach(now=True)  # track() has imported torch_xla and synced by now
        self.dash.on_track_start(tracker)

    def on_track_end(self, tracker: Any) -> None:
        self.dash.on_track_end(tracker)


class Dashboard:
    """Live view of steps, compiles, recompilations, transfers and fallbacks.

    ``tpukit.dashboard()`` opens one; ``track(..., dashboard=True)`` opens one for
    the loop, closes it when the loop ends and renders :meth:`report` in its place.

    batch_size: examples per step, for the throughput (else taken from the step records).
    mode: ``"auto"`` (widgets in Jupyter/Colab, text elsewhere; see
      :func:`~tpukit.widgets.frontend.choose_frontend`), ``"widgets"`` or ``"text"``.
    refresh_hz: live refreshes per second, at most 2.
    text_every: seconds between text summaries in text mode.
    max_alerts: recompilation rows kept (latest first).
    plot: draw the per-step timeline (matplotlib) in widget mode.
    show: display the dashboard now (otherwise display the object yourself).
    """

    def __init__(self, batch_size: int | None = None, *, mode: str = "auto", refresh_hz: float = 2.0,
                 text_every: float = 10.0, max_alerts: int = 20, plot: bool = True, show: bool = True):
        if not (isinstance(refresh_hz, (int, float)) and 0 < refresh_hz <= MAX_REFRESH_HZ):
            raise ValueError(f"Dashboard(refresh_hz={refresh_hz!r}) must be > 0 and <= {MAX_REFRESH_HZ:g}: "
                             f"faster refreshes cost training time and are not readable anyway.")
        if not (isinstance(text_every, (int, float)) and text_every >= 0):
            raise ValueError(f"Dashboard(text_every={text_every!r}) must be a number of seconds >= 0.")
        if not isinstance(max_alerts, int) or max_alerts < 1:
            raise ValueError(f"Dashboard(max_alerts={max_alerts!r}) must be a positive int.")
        self.context = frontend.detect_context()
        self.mode = frontend.choose_frontend(mode, self.context)
        if mode == "widgets" and self.mode != "widgets":
            warnings.warn("tpukit dashboard: ipywidgets is not installed, showing text instead "
                          "(pip install ipywidgets).", TpukitWarning, stacklevel=2)
        self.state = DashboardState(batch_size=batch_size, max_alerts=max_alerts)
        self.refresh_hz = float(refresh_hz)
        self.text_every = float(text_every)
        self.renders = 0
        self.render_times: deque = deque(maxlen=1024)  # monotonic times of refreshes (throttle checks)
        self.disabled = False
        self.closed = False
        self.error: BaseException | None = None
        self._render_lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._stop = threading.Event()
        self._plot_on = bool(plot)
        self._plot = None
        self._plot_lock = threading.Lock()  # one TimelinePlot, one renderer at a time
        self._plot_wanted = threading.Event()
        self._png: bytes | None = None  # drawn by the plot thread, shown by the next refresh
        self._png_version = -1  # state version of the last PNG drawn
        self._asked_version = -1
        self._plot_thread: threading.Thread | None = None
        self._last_parts: dict = {}
        self._last_render = -math.inf
        self._last_print = time.monotonic()
        self._final_printed = False
        self._owner = None
        self._displayed = False
        self._slot: _report.Slot | None = None  # where the live box is shown (the report replaces it)
        self._memory = True  # ask for device memory until the device says it does not report it
        self._baseline = None
        self._live = None
        self._thread: threading.Thread | None = None
        self._early = _EarlyListener(self)
        self._attached = False
        self._attach_lock = threading.Lock()
        try:
            self._baseline = self._snapshot()  # counters count from here
            if self.mode == "widgets":
                from . import live

                self._live = live.LiveView(plot=self._plot_on)
                self._refresh(force=True, draw_plot=False)  # the plot comes from its thread
                if show:
                    self._slot = _report.show(self._live.box)
                    self._displayed = True
            elif show:
                print(f"{render.header_text(_runtime.current())} (text mode: a summary every "
                      f"{self.text_every:g} s and at the end)")
                self._displayed = True
        except Exception as exc:
            self._fail(exc, "opening")
            return
        if not self._attach():
            events.add_listener(self._early)
        self._thread = threading.Thread(target=self._run, name="tpukit-dashboard", daemon=True)
        self._thread.start()
        if self._live is not None and self._plot_on:
            self._plot_thread = threading.Thread(target=self._run_plot, name="tpukit-dashboard-plot", daemon=True)
            self._plot_thread.start()

    # ------------------------------------------------------------ listener (training thread, O(1))
    def on_step(self, record: Any) -> None:
        if self.disabled:
            return
        try:
            self.state.add_step(record)
            if self.mode == "text" and time.monotonic() - self._last_print >= self.text_every:
                self._print(render.text_line(self.state.view()))
        except Exception as exc:
            self._fail(exc, "on_step")

    def on_compile(self, event: Any) -> None:
        if self.disabled:
            return
        try:
            self.state.add_compile(event)
        except Exception as exc:
            self._fail(exc, "on_compile")

    def on_track_start(self, tracker: Any) -> None:
        self.state.track_started(tracker)
        if getattr(tracker, "dashboard", None) is self:
            self._owner = tracker

    def on_track_end(self, tracker: Any) -> None:
        self.state.track_ended(tracker)
        if tracker is self._owner:  # the loop that opened this dashboard is over
            self.close()

    def _attach(self, now: bool = False) -> bool:
        """Listen to steps once the runtime runs (see _EarlyListener), or ``now``; True when attached."""
        with self._attach_lock:
            if self._attached or self.closed or self.disabled or not (now or _runtime_started()):
                return self._attached
            events.add_listener(self)
            events.remove_listener(self._early)
            self._attached = True
            return True

    def _detach(self) -> None:
        events.remove_listener(self)
        events.remove_listener(self._early)

    # ------------------------------------------------------------ polling thread
    def _run(self) -> None:
        # One poll per refresh period, timed so that a refresh is never skipped by
        # waking a hair too early: after a refresh, sleep until the next one is allowed.
        period = 1.0 / self.refresh_hz
        timeout = period
        while not self._stop.wait(timeout):
            try:
                self.tick()
            except Exception as exc:
                self._fail(exc, "refresh")
                return
            since = time.monotonic() - self._last_render
            timeout = period - since + 0.002 if since < period else period

    def _run_plot(self) -> None:
        # Drawing text with matplotlib releases the GIL per glyph, so while the
        # training thread runs Python a full redraw of the plot's frame can take a
        # second of wall time (not of the training thread's time). It runs here, so
        # the now line and the counters never wait for it.
        while not self._stop.is_set():
            if not self._plot_wanted.wait(0.5):
                continue
            self._plot_wanted.clear()
            if self._stop.is_set():
                return
            try:
                self.draw_plot()
            except Exception as exc:
                self._fail(exc, "plot")
                return

    @property
    def plot_version(self) -> int:
        """State version of the last timeline PNG drawn (-1 before the first)."""
        return self._png_version

    def draw_plot(self) -> bytes | None:
        """Render the timeline if the steps changed since the last PNG; keep it for the next refresh."""
        with self._plot_lock:
            if self.state.version in (0, self._png_version):
                return None
            if self._plot is None:
                from .plot import TimelinePlot

                self._plot = TimelinePlot()
            tl = self.state.timeline()
            png = self._plot.render(tl)
            self._png, self._png_version = png, tl.version
            return png

    def tick(self, force: bool = False) -> None:
        """One poll: attach once the runtime runs, read compiles and counters, refresh
        the widgets when a refresh is due (or now, with ``force``)."""
        if not self._attached:
            self._attach()
        if compiles.tracing_enabled():
            # Reads only the new bytes of the trace file; may call on_compile on this thread.
            self.state.set_compiling(compiles.compiling_now())
        self._sample()
        if self.mode == "widgets":
            self._refresh(force=force)
        elif not frontend.has_rich_display(self.context):
            # Terminals and scripts: say so during a long compile, when no step can print.
            v = self.state.view()
            if v.now_kind == "compiling" and time.monotonic() - self._last_print >= self.text_every:
                self._print(render.text_line(v))

    def _snapshot(self):
        if not _runtime_started():
            return None
        snap = metrics.snapshot(memory=self._memory)
        if self._memory and snap.memory is None:
            self._memory = False  # CPU: GetAllocatorStats is unimplemented; stop asking
        return snap

    def _sample(self) -> None:
        snap = self._snapshot()
        if snap is None:
            return
        if self._baseline is None:
            self._baseline = snap
        self.state.set_metrics(snap - self._baseline)

    # ------------------------------------------------------------ rendering
    def refresh(self) -> None:
        """Render the current state now, on the calling thread (the thread does this by itself)."""
        if self.disabled:
            return
        try:
            self._refresh(force=True)
        except Exception as exc:
            self._fail(exc, "refresh")

    def _refresh(self, force: bool, draw_plot: bool = True) -> bool:
        with self._render_lock:
            now = time.monotonic()
            if not force and now - self._last_render < 1.0 / self.refresh_hz:
                return False
            if self.mode != "widgets" or self._live is None:
                return False
            view = self.state.view()
            parts = {"header": render.header_html(_runtime.current(), compiles.tracing_enabled()),
                     "now": render.now_html(view),
                     "verdict": render.verdict_html(view),
                     "counters": render.counters_html(view),
                     "alerts": render.alerts_html(view),
                     "graphs": render.graphs_html(view),
                     "fallbacks": render.fallbacks_html(view)}
            changed = {k: v for k, v in parts.items() if self._last_parts.get(k) != v}
            png = None
            if draw_plot and self._plot_on:
                if force:  # close() / refresh(): draw now, on this thread
                    self.draw_plot()
                elif self.state.version != self._asked_version:
                    self._asked_version = self.state.version
                    self._plot_wanted.set()  # the plot thread draws; a later refresh shows it
                png, self._png = self._png, None
            if not changed and png is None:
                return False
            self._live.update(changed, png)
            self._last_parts.update(changed)
            self._last_render = now
            self.renders += 1
            self.render_times.append(now)
            return True

    def _print(self, line: str) -> None:
        self._last_print = time.monotonic()
        self.renders += 1
        self.render_times.append(self._last_print)
        print(line, flush=True)

    # ------------------------------------------------------------ public
    def view(self) -> View:
        """The current numbers (steps, compiles, now line, alerts, ...) as a frozen record."""
        return self.state.view()

    def values(self) -> dict:
        """What the live widgets show now, by part (empty in text mode)."""
        return self._live.values() if self._live is not None else {}

    @property
    def image(self) -> bytes | None:
        """The PNG the live timeline shows (None in text mode or before the first plot)."""
        img = getattr(self._live, "image", None)
        return bytes(img.value) if img is not None and img.value else None

    @property
    def running(self) -> bool:
        """True while the polling or the plot thread is alive."""
        return any(t is not None and t.is_alive() for t in (self._thread, self._plot_thread))

    def close(self) -> None:
        """Stop the thread, detach the listeners and render the final state (widgets stay, frozen,
        until :meth:`report` replaces them)."""
        if self.closed:
            return
        with self._attach_lock:  # no _attach() may slip in after this
            self.closed = True
            self._detach()
        self._stop.set()
        self._plot_wanted.set()
        for t in (self._thread, self._plot_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=10)
        if self.disabled:
            return
        try:
            self._sample()
            self.state.finish()
            if self.mode == "widgets":
                self._refresh(force=True)
            else:
                self._print(render.text_line(self.state.view(), final=True))
                self._final_printed = True
        except Exception as exc:
            self._fail(exc, "close")

    def report(self) -> None:
        """Show the static report (HTML tables and the PNG timeline, kept in the saved file and
        on GitHub, no widget state needed; plain text elsewhere). Called in the cell that shows
        the live widgets, it takes their place: the cell keeps the report only."""
        try:
            view = self.state.view()
            rt, tracing = _runtime.current(), compiles.tracing_enabled()
            if frontend.has_rich_display(self.context):
                from .plot import report_png

                png = report_png(self.state.timeline(), _report.title(view))
                slot = self._slot
                if slot is not None and slot.cell == _report.current_cell():
                    self._slot = None
                    slot.replace(Report(view, rt, tracing, png=png))  # the live box becomes the report
                    self._live.close()
                else:
                    from IPython.display import Image

                    _report.display(Report(view, rt, tracing), Image(data=png, format="png"))
            else:
                text = render.text_report(view, rt, summary=not self._final_printed)
                if text:
                    print(text, flush=True)
        except Exception as exc:
            self._fail(exc, "report")

    def _fail(self, exc: BaseException, where: str) -> None:
        """Disable the dashboard after an internal error and say so once."""
        with self._fail_lock:
            if self.disabled:
                return
            self.disabled = True
            self.error = exc
        self._stop.set()
        self._plot_wanted.set()
        with self._attach_lock:
            self._detach()
        note = f"dashboard stopped after an error in {where}: {type(exc).__name__}: {exc}"
        self.state.note = note
        logger.debug("tpukit dashboard failed in %s", where, exc_info=exc)
        warnings.warn(f"tpukit {note}. The training loop is not affected.", TpukitWarning, stacklevel=3)
        if self._live is not None:
            try:  # no renderer here: it may be what failed
                self._live.update({"now": f"<div style='color:{render.BAD}'>{html.escape(note)}</div>"})
            except Exception:
                pass

    # ------------------------------------------------------------ display protocol
    def _ipython_display_(self) -> None:
        # Opened dashboards display themselves; a bare `tpukit.dashboard()` at the end of a cell adds nothing.
        if self._displayed:
            return
        self._displayed = True
        if self._live is not None:
            self._slot = _report.show(self._live.box)
        else:
            print(render.text_line(self.state.view()))

    def __repr__(self) -> str:
        status = "disabled" if self.disabled else "closed" if self.closed else "live"
        return (f"<tpukit Dashboard {self.mode} {status}: {plural(self.state.steps, 'step')}, "
                f"{plural(self.state.view().recompilations, 'recompilation')}>")
