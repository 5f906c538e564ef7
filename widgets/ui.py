"""What a dashboard front end is, and the one thread every front end renders from.

The controller (:class:`~tpukit.widgets.dashboard.Dashboard`) consumes events and
step records into a :class:`~tpukit.widgets.model.DashboardState`; a front end only
shows that state. :func:`~tpukit.widgets.frontend.choose_frontend` picks one once,
as ``tqdm.auto`` does: :class:`~tpukit.widgets.ui_widgets.WidgetsFrontEnd` (live
ipywidgets) or :class:`~tpukit.widgets.ui_text.TextFrontEnd` (a line of text now and
then). :class:`FrontEnd` itself shows nothing: it stands in when opening a real one failed.

Each front end has one daemon thread, ``tpukit-dashboard``, that wakes at most
``refresh_hz`` times a second, lets the controller do its periodic part (``poll``:
arm the step hook once the runtime runs, sample the counters) and renders. It never
reads compiles: what compiles now is in the state, from the events the controller received.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Callable

from tpukit import runtime as _runtime

THREAD = "tpukit-dashboard"


def runtime_info() -> tuple[Any, bool]:
    """The Runtime record (None before ``tpukit.setup()``) and whether compile causes are traced.

    Configuration only: it neither starts nor waits for the compile reader.
    """
    return _runtime.current(), _runtime.trace_file() is not None


class FrontEnd:
    """The front-end interface, with the shared thread; every hook is a no-op here.

    state: what to show. context: :func:`~tpukit.widgets.frontend.detect_context`'s answer.
    poll: the controller's periodic part, run by the thread before each render.
    fail: the controller's failure handler, ``fail(exc, where)``.
    """

    mode = "none"

    def __init__(self, state: Any, *, context: str, refresh_hz: float, text_every: float,
                 poll: Callable[[], None], fail: Callable[[BaseException, str], None]):
        self.state = state
        self.context = context
        self.refresh_hz = refresh_hz
        self.text_every = text_every
        self._poll, self._fail = poll, fail
        self.renders = 0
        self.render_times: deque = deque(maxlen=1024)  # monotonic times of renders (throttle checks)
        self.displayed = False
        self.final_printed = False  # the closing summary went out as text (the report then skips it)
        self._stop = threading.Event()
        self._last_render = -math.inf
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the front end's thread(s)."""
        self._spawn(self._run, THREAD)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _run(self) -> None:
        # One period per refresh, timed so that a refresh is never skipped by waking
        # a hair too early: after a render, sleep until the next one is allowed.
        period = 1.0 / self.refresh_hz
        timeout = period
        while not self._stop.wait(timeout):
            try:
                self._poll()
                self.tick()
            except Exception as exc:
                self._fail(exc, "refresh")
                return
            since = time.monotonic() - self._last_render
            timeout = period - since + 0.002 if since < period else period

    def _rendered(self) -> float:
        """Count one render (refresh or printed line); returns its monotonic time."""
        now = time.monotonic()
        self._last_render = now
        self.renders += 1
        self.render_times.append(now)
        return now

    @property
    def running(self) -> bool:
        """True while a thread of this front end is alive."""
        return any(t.is_alive() for t in self._threads)

    def halt(self) -> None:
        """Ask the threads to stop (safe from any thread, the front end's own included)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the threads and wait for them (at most 10 s each)."""
        self.halt()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)

    # ------------------------------------------------------------ what each front end does
    def show(self) -> None:
        """Display the front end now (at open, with ``show=True``)."""

    def stepped(self) -> None:
        """A step record was consumed (training thread: keep it O(1))."""

    def tick(self, force: bool = False) -> None:
        """One render of the thread, if one is due (or now, with ``force``)."""

    def refresh(self, force: bool = True, draw_plot: bool = True) -> bool:
        """Render the live view now (``force``) or when due; True when something changed."""
        return False

    def close(self) -> None:
        """The final render, after the threads stopped."""

    def late_estimate(self) -> None:
        """A TPU compiler's answer came after :meth:`close` (the follower's thread): show it."""

    def failed(self, note: str) -> None:
        """Say that the dashboard stopped (without any renderer: one may be what failed)."""

    def display(self) -> None:
        """Show the front end as the value of a cell (``_ipython_display_``), once."""

    def replace_with(self, report: Any) -> bool:
        """Put ``report`` in place of the live view if it was shown in the current cell; True when done."""
        return False

    def values(self) -> dict:
        """What the live widgets show, by part (empty without widgets)."""
        return {}

    @property
    def image(self) -> bytes | None:
        """The PNG the live timeline shows (None without one)."""
        return None
