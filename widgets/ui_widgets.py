"""The widgets front end: the live ipywidgets view, refreshed by its thread, and the timeline plot.

The refresh thread (``tpukit-dashboard``) renders the state's parts to HTML at most
``refresh_hz`` times a second and sets only the widgets whose value changed; a
second thread (``tpukit-dashboard-plot``) draws the timeline PNG, which the next
refresh shows. Neither reads compiles. ipywidgets and matplotlib are imported here,
only when this front end is chosen.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from . import render
from . import report as _report
from .ui import FrontEnd, runtime_info

PLOT_THREAD = "tpukit-dashboard-plot"


class WidgetsFrontEnd(FrontEnd):
    """Live widgets in a notebook; ``plot``: draw the per-step timeline."""

    mode = "widgets"

    def __init__(self, state: Any, *, plot: bool = True, **options: Any):
        super().__init__(state, **options)
        from . import live

        self.live = live.LiveView(plot=plot)
        self._plot_on = bool(plot)
        self._plot = None
        self._plot_lock = threading.Lock()  # one TimelinePlot, one renderer at a time
        self._plot_wanted = threading.Event()
        self._png: bytes | None = None  # drawn by the plot thread, shown by the next refresh
        self._png_version = -1  # state version of the last PNG drawn
        self._asked_version = -1
        self._render_lock = threading.Lock()
        self._last_parts: dict = {}
        self._slot: _report.Slot | None = None  # where the live box is shown (the report replaces it)
        self.refresh(force=True, draw_plot=False)  # the plot comes from its thread

    def start(self) -> None:
        """Start the refresh thread and, with a plot, the plot thread."""
        super().start()
        if self._plot_on:
            self._spawn(self._run_plot, PLOT_THREAD)

    def halt(self) -> None:
        """Ask both threads to stop."""
        super().halt()
        self._plot_wanted.set()

    def _run_plot(self) -> None:
        # Drawing text with matplotlib releases the GIL per glyph, so while the
        # training thread runs Python a full redraw of the plot's frame can take a
        # second of wall time (not of the training thread's time). It runs here, so
        # the now line and the counters never wait for it. matplotlib is imported and the figure made before
        # the first step (seconds on a busy host), so the first plot follows the first steps.
        try:
            with self._plot_lock:
                if self._plot is None:
                    from .plot import TimelinePlot

                    self._plot = TimelinePlot()
        except Exception as exc:
            self._fail(exc, "plot")
            return
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

    # ------------------------------------------------------------ rendering
    def tick(self, force: bool = False) -> None:
        """Refresh the widgets if a refresh is due (or now, with ``force``)."""
        self.refresh(force=force)

    def refresh(self, force: bool = True, draw_plot: bool = True) -> bool:
        """Render the state's parts and set the widgets that changed; True when something was set.

        At most ``refresh_hz`` times a second unless ``force``. A forced refresh draws the plot
        on the calling thread; otherwise the plot thread is asked and a later refresh shows it.
        """
        with self._render_lock:
            now = time.monotonic()
            if not force and now - self._last_render < 1.0 / self.refresh_hz:
                return False
            view = self.state.view()
            rt, tracing = runtime_info()
            parts = {"header": render.header_html(rt, tracing),
                     "now": render.now_html(view),
                     "verdict": render.verdict_html(view),
                     "counters": render.counters_html(view),
                     "alerts": render.alerts_html(view),
                     "graphs": render.graphs_html(view),
                     "tpu": render.tpu_html(view),
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
            self.live.update(changed, png)
            self._last_parts.update(changed)
            self._rendered()
            return True

    def close(self) -> None:
        """The final refresh: the widgets stay, frozen, until the report replaces them."""
        self.refresh(force=True)

    def late_estimate(self) -> None:
        """Render the frozen widgets again with the TPU answer that came after the loop ended."""
        self.refresh(force=True, draw_plot=False)

    def failed(self, note: str) -> None:
        """The now line says the dashboard stopped (no renderer involved)."""
        self.live.update({"now": f"<div style='color:{render.BAD}'>{html.escape(note)}</div>"})

    # ------------------------------------------------------------ in the notebook
    def show(self) -> None:
        """Display the live box where it can be replaced later."""
        self._slot = _report.show(self.live.box)
        self.displayed = True

    def display(self) -> None:
        """Display the live box as a cell's value (once)."""
        if not self.displayed:
            self.show()

    def replace_with(self, report: Any) -> bool:
        """Replace the live box by ``report`` in its output when it was shown in the cell running now;
        the widget models are closed then (their values stay readable)."""
        slot = self._slot
        if slot is None or slot.cell != _report.current_cell():
            return False
        self._slot = None
        slot.replace(report)
        self.live.close()
        return True

    def values(self) -> dict:
        """The HTML each part shows now."""
        return self.live.values()

    @property
    def image(self) -> bytes | None:
        """The PNG the live timeline shows (None before the first plot, or without a plot)."""
        return self.live.png
