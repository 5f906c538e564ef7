"""The live compile/execute dashboard: a controller that consumes records, and a front end that shows them.

:class:`Dashboard` is the controller. It is a tpukit listener: step records
(``on_step``) and compile events (``on_compile``, once when a compile starts and
once finished and classified) land in a :class:`~tpukit.widgets.model.DashboardState`
on the thread that publishes them, in O(1). It picks its front end once, in the
constructor, with :func:`~tpukit.widgets.frontend.choose_frontend`: live widgets
in a notebook (:mod:`~tpukit.widgets.ui_widgets`), a short text line every
``text_every`` seconds elsewhere (:mod:`~tpukit.widgets.ui_text`). The front end's
thread only renders, after the controller's periodic :meth:`Dashboard.poll`.

Nothing here reads compiles: "compiling now" is a started event whose finished
version has not arrived. Any exception inside the dashboard disables it with one
TpukitWarning; the training loop never sees it. When the tracked loop that opened
it ends, the live widget is replaced in its output by the static report
(:mod:`~tpukit.widgets.report`).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

from tpukit import events, metrics, steps, tpu
from tpukit import runtime as _runtime
from tpukit._text import plural
from tpukit.errors import TpukitWarning

from . import frontend, render
from . import report as _report
from .model import DashboardState
from .report import Report
from .ui import FrontEnd, runtime_info
from .ui_text import TextFrontEnd
from .ui_widgets import WidgetsFrontEnd
from .view import View

logger = logging.getLogger("tpukit")
MAX_REFRESH_HZ = 2.0


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
        self.disabled = False
        self.closed = False
        self.error: BaseException | None = None
        self._fail_lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._attached = False  # the step hook is armed for this dashboard (the runtime runs)
        self._owner = None
        self._memory = True  # ask for device memory until the device says it does not report it
        self._baseline = None
        options = dict(context=self.context, refresh_hz=float(refresh_hz), text_every=float(text_every),
                       poll=self.poll, fail=self._fail)
        self.ui: FrontEnd = FrontEnd(self.state, **options)  # the front end; shows nothing until the real one opens
        try:
            self._baseline = self._snapshot()  # counters count from here
            if self.mode == "widgets":
                self.ui = WidgetsFrontEnd(self.state, plot=plot, **options)
            else:
                self.ui = TextFrontEnd(self.state, **options)
            if show:
                self.ui.show()
        except Exception as exc:
            self._fail(exc, "opening")
            return
        # Listening from now on. steps.add_listener arms the sync hook (syncs outside track()
        # make step records) only once the runtime runs: arming it would start the runtime,
        # which setup() must configure first. poll() arms it when the runtime is seen running.
        running = _runtime.started()
        steps.add_listener(self)
        self._attached = running
        self.ui.start()

    # ------------------------------------------------------------ listener (publishing threads, O(1))
    def on_step(self, record: Any) -> None:
        """Consume one step record (and print a text line when one is due)."""
        if self.disabled or self.closed:
            return
        try:
            self.state.add_step(record)
            self.ui.stepped()
        except Exception as exc:
            self._fail(exc, "on_step")

    def on_compile(self, event: Any) -> None:
        """Consume one compile event: started (compiling now), or finished and classified; after the loop
        ended, only the graph of a compile it saw (a target's follower compiles it: its answer is awaited)."""
        if self.disabled:
            return
        if self.closed:
            self.state.settle(event)
            self._stop_waiting_if_done()
            return
        try:
            self.state.add_compile(event)
        except Exception as exc:
            self._fail(exc, "on_compile")

    def on_tpu_pending(self, event: Any) -> None:
        """The target's follower sent a compile's graph to the TPU compiler: wait for its answer."""
        if self.disabled:
            return
        try:
            self.state.add_pending(event, seen_only=self.closed)
        except Exception as exc:
            self._fail(exc, "on_tpu_pending")

    def on_tpu_estimate(self, event: Any, estimate: Any) -> None:
        """Consume what the TPU compiler says about a compile's graph on the target TPU; an answer that
        comes after the loop ended is shown then (the TPU compiler takes longer than a short run)."""
        if self.disabled:
            return
        try:
            added = self.state.add_estimate(event, estimate, seen_only=self.closed)
            if self.closed:
                if added:
                    self.ui.late_estimate()
                self._stop_waiting_if_done()
        except Exception as exc:
            self._fail(exc, "on_tpu_estimate")

    def on_track_start(self, tracker: Any) -> None:
        """A tracked loop begins (track() has armed the step hook itself). A closed dashboard still
        waiting for TPU answers stops waiting: the next run is another dashboard's."""
        if self.closed:
            events.remove_listener(self)
            return
        self.state.track_started(tracker)
        if getattr(tracker, "dashboard", None) is self:
            self._owner = tracker

    def on_track_end(self, tracker: Any) -> None:
        """A tracked loop ended; the one that opened this dashboard closes it."""
        if self.closed:
            return
        self.state.track_ended(tracker)
        if tracker is self._owner:
            self.close()

    def _stop_waiting_if_done(self) -> None:
        """Once closed: stop listening when no TPU answer for this dashboard's compiles is still to come."""
        follower = tpu.follower()
        if not self.state.awaiting_estimates(following=follower is not None and follower in events.listeners()):
            events.remove_listener(self)

    # ------------------------------------------------------------ the front end's thread asks
    def poll(self) -> None:
        """The periodic part the front end's thread runs before it renders: arm the step hook once
        the runtime runs, sample the counters. Never reads compiles (they arrive as events)."""
        if not self._attached:
            self._attach()
        self._sample()

    def _attach(self) -> None:
        with self._attach_lock:  # close() holds it: no arming after it
            if self._attached or self.closed or self.disabled or not _runtime.started():
                return
            steps.ensure_hook()
            self._attached = True

    def _snapshot(self) -> Any:
        if not _runtime.started():  # never start the runtime (or import torch_xla) to read counters
            return None
        snap = metrics.snapshot(memory=self._memory)
        if self._memory and snap.memory is None:
            self._memory = False  # CPU: GetAllocatorStats is unimplemented; stop asking
        return snap

    def _sample(self) -> None:
        # The counters (torch_xla's metrics, not compile events) are sampled here, on the
        # front end's thread: while the training thread is blocked in a long compile or
        # execution no step record comes, and these are what still moves (executions,
        # transfers, compile time).
        snap = self._snapshot()
        if snap is None:
            return
        if self._baseline is None:
            self._baseline = snap
        self.state.set_metrics(snap - self._baseline)

    def tick(self, force: bool = False) -> None:
        """One period of the front end's thread, on the calling thread: :meth:`poll`, then a
        render if one is due (or now, with ``force``)."""
        self.poll()
        self.ui.tick(force=force)

    # ------------------------------------------------------------ public
    def refresh(self) -> None:
        """Render the current state now, on the calling thread (the thread does this by itself)."""
        if self.disabled:
            return
        try:
            self.ui.refresh(force=True)
        except Exception as exc:
            self._fail(exc, "refresh")

    def view(self) -> View:
        """The current numbers (steps, compiles, now line, alerts, ...) as a frozen record."""
        return self.state.view()

    def values(self) -> dict:
        """What the live widgets show now, by part (empty in text mode)."""
        return self.ui.values()

    @property
    def image(self) -> bytes | None:
        """The PNG the live timeline shows (None in text mode or before the first plot)."""
        return self.ui.image

    @property
    def running(self) -> bool:
        """True while a thread of the front end (refresh, plot) is alive."""
        return self.ui.running

    @property
    def renders(self) -> int:
        """How many refreshes (or text lines) the front end made."""
        return self.ui.renders

    @property
    def render_times(self) -> Any:
        """Monotonic times of the latest renders (a deque of at most 1024)."""
        return self.ui.render_times

    @property
    def plot_version(self) -> int:
        """State version of the last timeline PNG drawn (-1 before the first, and in text mode)."""
        return getattr(self.ui, "plot_version", -1)

    def draw_plot(self) -> bytes | None:
        """Render the timeline now if the steps changed since the last PNG (widgets mode; else None)."""
        draw = getattr(self.ui, "draw_plot", None)
        return draw() if draw is not None else None

    @property
    def _live(self) -> Any:
        """The ipywidgets view (``LiveView``) in widgets mode, else None."""
        return getattr(self.ui, "live", None)

    def close(self) -> None:
        """Stop the threads, detach the listener and render the final state (widgets stay, frozen,
        until :meth:`report` replaces them; in text mode, the closing line). While TPU answers for the
        run's graphs are still on their way, it stays listening for those alone and shows them as they
        come (until they all came, or the next tracked loop starts)."""
        if self.closed:
            return
        with self._attach_lock:  # no _attach() may slip in after this
            self.closed = True
            self._stop_waiting_if_done()  # else it listens for the TPU answers still to come
        self.ui.stop()
        if self.disabled:
            return
        try:
            self._sample()
            self.state.finish()
            self.ui.close()
        except Exception as exc:
            self._fail(exc, "close")

    def report(self) -> None:
        """Show the static report (HTML tables and the PNG timeline, kept in the saved file and
        on GitHub, no widget state needed; plain text elsewhere). Called in the cell that shows
        the live widgets, it takes their place: the cell keeps the report only."""
        try:
            view = self.state.view()
            rt, tracing = runtime_info()
            if frontend.has_rich_display(self.context):
                from .plot import report_png

                png = report_png(self.state.timeline(), _report.title(view))
                if not self.ui.replace_with(Report(view, rt, tracing, png=png)):
                    from IPython.display import Image

                    _report.display(Report(view, rt, tracing), Image(data=png, format="png"))
            else:
                text = render.text_report(view, rt, summary=not self.ui.final_printed)
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
        self.ui.halt()  # no join: this may run on the front end's own thread
        with self._attach_lock:
            events.remove_listener(self)
        note = f"dashboard stopped after an error in {where}: {type(exc).__name__}: {exc}"
        self.state.note = note
        logger.debug("tpukit dashboard failed in %s", where, exc_info=exc)
        warnings.warn(f"tpukit {note}. The training loop is not affected.", TpukitWarning, stacklevel=3)
        try:
            self.ui.failed(note)
        except Exception:
            pass

    # ------------------------------------------------------------ display protocol
    def _ipython_display_(self) -> None:
        # Opened dashboards display themselves; a bare `tpukit.dashboard()` at the end of a cell adds nothing.
        self.ui.display()

    def __repr__(self) -> str:
        status = "disabled" if self.disabled else "closed" if self.closed else "live"
        return (f"<tpukit Dashboard {self.mode} {status}: {plural(self.state.steps, 'step')}, "
                f"{plural(self.state.view().recompilations, 'recompilation')}>")
