"""DashboardState: what the dashboard knows, fed by listener calls, read by renderers.

Pure and thread-safe: no UI library, no torch_xla. The listener side
(:meth:`DashboardState.add_step`, :meth:`DashboardState.add_compile`) is O(1): it
appends and marks the state dirty. Summarizing (medians, the now line, copies for
the plot) happens in :meth:`DashboardState.view` and
:meth:`DashboardState.timeline`, on the rendering thread.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# After the last step record, the loop counts as running for this long (syncs
# outside track() have no start/end signal of their own).
BUSY_AFTER_STEP_S = 2.0


@dataclass(frozen=True)
class Alert:
    """One recompilation, as shown in the alert list."""

    index: int
    step: int | None
    graph_hash: str
    where: str
    cause: str
    hint: str
    time: float


@dataclass(frozen=True)
class View:
    """An immutable picture of the dashboard state at one moment (what renderers draw)."""

    time: float
    elapsed: float
    steps: int
    last_step: int | None
    compiles: int
    cached_compiles: int | None  # None: not measured (no metrics snapshot)
    compile_time: float
    compile_events: int
    recompilations: int
    executions: int
    execute_time: float
    to_device: int | None
    to_host: int
    item_reads: int
    fallbacks: dict
    last_step_s: float | None
    median_step_s: float | None
    throughput: float | None
    batch_size: int | None
    memory: dict | None
    scalars: dict
    now: str
    now_kind: str  # "idle", "executing", "compiling", "stopped"
    alerts: tuple[Alert, ...]
    alerts_total: int
    note: str | None = None


@dataclass(frozen=True)
class Timeline:
    """Per-step columns for the plot (copies, safe to use outside the lock)."""

    steps: list
    compile: list
    execute: list
    host: list
    scalars: dict = field(default_factory=dict)  # name -> (steps, values)
    version: int = 0


def _short_hash(h: str) -> str:
    return (h[:6] + "…") if h else "?"


def now_line(compiling: Any, now: float, busy_step: int | None) -> tuple[str, str]:
    """The one-line status: ('compiling graph 5ca807… for 12 s, triggered by cell [7] line 5', 'compiling')."""
    if compiling is not None:
        verb = "recompiling" if getattr(compiling, "recompilation", False) else "compiling"
        secs = max(0.0, now - compiling.start)
        return (f"{verb} graph {_short_hash(compiling.graph_hash)} for {secs:.0f} s, "
                f"triggered by {compiling.where}", "compiling")
    if busy_step is not None:
        return f"executing step {busy_step}", "executing"
    return "idle", "idle"


class DashboardState:
    """Thread-safe accumulator of step records, compile events and metric deltas."""

    def __init__(self, batch_size: int | None = None, max_alerts: int = 20, max_history: int = 10_000,
                 clock=time.time):
        if max_alerts < 1 or max_history < 1:
            raise ValueError("max_alerts and max_history must be positive ints.")
        self.batch_size = batch_size
        self.max_alerts = max_alerts
        self._clock = clock
        self._lock = threading.RLock()
        self.opened = clock()
        h = max_history
        self._steps: deque = deque(maxlen=h)
        self._wall: deque = deque(maxlen=h)
        self._compile_t: deque = deque(maxlen=h)
        self._exec_t: deque = deque(maxlen=h)
        self._host_t: deque = deque(maxlen=h)
        self._steady: deque = deque(maxlen=h)  # walls of steps without a compile
        self._scalars: dict[str, tuple[deque, deque]] = {}
        self._last_scalars: dict = {}
        self._max_history = h
        self._n_steps = 0
        self._last_step: int | None = None
        self._last_end: float | None = None
        self._record_batch: int | None = None
        self._sums = {"compiles": 0, "compile_time": 0.0, "executions": 0, "execute_time": 0.0,
                      "to_host": 0, "item_reads": 0}
        self._fallbacks: dict[str, int] = {}
        self._max_event = -1
        self._n_events = 0
        self._compiling = None
        self._alerts: deque = deque(maxlen=max_alerts)
        self._alerted: set[int] = set()
        self._alerts_total = 0
        self._delta = None
        self._tracking = 0
        self.note: str | None = None
        self._finished: float | None = None
        self.dirty = True
        self.version = 0  # bumped by every step (the plot re-renders only then)

    # ------------------------------------------------------------ listener side (O(1))
    def add_step(self, rec: Any) -> None:
        """Consume one StepRecord."""
        with self._lock:
            self._n_steps += 1
            self._last_step = rec.step
            self._last_end = rec.end
            wall = rec.wall
            self._steps.append(rec.step)
            self._wall.append(wall)
            self._compile_t.append(rec.compile_time)
            self._exec_t.append(rec.execute_time)
            self._host_t.append(rec.host_time)
            if not rec.compiles and not rec.compile_events:
                self._steady.append(wall)
            s = self._sums
            s["compiles"] += rec.compiles
            s["compile_time"] += rec.compile_time
            s["executions"] += rec.executions
            s["execute_time"] += rec.execute_time
            s["to_host"] += rec.to_host
            s["item_reads"] += rec.item_reads
            for op, n in (rec.fallbacks or {}).items():
                self._fallbacks[op] = self._fallbacks.get(op, 0) + n
            if rec.batch_size:
                self._record_batch = rec.batch_size
            for name, value in (rec.scalars or {}).items():
                xs_ys = self._scalars.get(name)
                if xs_ys is None:
                    xs_ys = self._scalars[name] = (deque(maxlen=self._max_history), deque(maxlen=self._max_history))
                xs_ys[0].append(rec.step)
                xs_ys[1].append(value)
                self._last_scalars[name] = value
            for ev in rec.compile_events:  # usually seen already through on_compile
                self._add_compile(ev, step=rec.step)
            self.version += 1
            self.dirty = True

    def add_compile(self, event: Any) -> None:
        """Consume one CompileEvent (new, or an update of one already seen)."""
        with self._lock:
            self._add_compile(event, step=None)
            self.dirty = True

    def _add_compile(self, ev: Any, step: int | None) -> None:
        if ev.index > self._max_event:
            self._max_event = ev.index
            self._n_events += 1
        if ev.end is None:
            if self._compiling is None or ev.index >= self._compiling.index:
                self._compiling = ev
        elif self._compiling is not None and self._compiling.index == ev.index:
            self._compiling = None
        if ev.recompilation:
            if ev.index not in self._alerted:
                self._alerted.add(ev.index)
                self._alerts_total += 1
                guess = step if step is not None else (self._last_step or 0) + 1
                self._alerts.appendleft(Alert(ev.index, guess, ev.graph_hash, ev.where, ev.cause,
                                              ev.hint or "", self._clock()))
            elif step is not None:  # the record tells the step for sure
                for i, a in enumerate(self._alerts):
                    if a.index == ev.index and a.step != step:
                        self._alerts[i] = Alert(a.index, step, a.graph_hash, a.where, a.cause, a.hint, a.time)

    def set_compiling(self, event: Any) -> None:
        """The compilation running now according to the trace file (None: none)."""
        with self._lock:
            if event is not self._compiling:
                self._compiling = event
                self.dirty = True

    def set_metrics(self, delta: Any) -> None:
        """Counters since the dashboard opened (a tpukit ``Delta``), sampled by the polling thread."""
        with self._lock:
            self._delta = delta
            self.dirty = True

    def track_started(self) -> None:
        with self._lock:
            self._tracking += 1
            self.dirty = True

    def track_ended(self) -> None:
        with self._lock:
            self._tracking = max(0, self._tracking - 1)
            self._compiling = None
            self._last_end = None  # the loop is over: idle until another step arrives
            self.dirty = True

    def finish(self) -> None:
        """The dashboard was closed: the now line says what ran, not what runs."""
        with self._lock:
            self._finished = self._clock()
            self._compiling = None
            self.dirty = True

    def take_dirty(self) -> bool:
        """Return whether anything changed since the last call, and clear the flag."""
        with self._lock:
            d, self.dirty = self.dirty, False
            return d

    # ------------------------------------------------------------ reader side
    @property
    def steps(self) -> int:
        return self._n_steps

    def view(self, now: float | None = None) -> View:
        """Everything the renderers need, computed now."""
        now = self._clock() if now is None else now
        with self._lock:
            s = dict(self._sums)
            fallbacks = dict(self._fallbacks)
            d = self._delta
            steady = list(self._steady) or list(self._wall)
            last_wall = self._wall[-1] if self._wall else None
            busy = None
            if self._tracking or (self._last_end is not None and now - self._last_end < BUSY_AFTER_STEP_S):
                busy = (self._last_step or 0) + 1
            text, kind = now_line(self._compiling, now, busy)
            if self._finished is not None:
                text, kind = f"closed: {self._n_steps} steps in {self._finished - self.opened:.1f} s", "idle"
            alerts = tuple(self._alerts)
            n_steps, last_step, n_events = self._n_steps, self._last_step, self._n_events
            alerts_total, scalars, note = self._alerts_total, dict(self._last_scalars), self.note
            record_batch = self._record_batch
        # Step records cover syncs; the metrics delta covers everything since the
        # dashboard opened but is sampled less often. The larger is the fresher.
        cached = to_device = memory = None
        if d is not None:
            for k in s:
                s[k] = max(s[k], getattr(d, k))
            for op, n in d.fallbacks.items():
                fallbacks[op] = max(n, fallbacks.get(op, 0))
            cached, to_device, memory = d.cached_compiles, d.to_device, d.memory
        median = statistics.median(steady) if steady else None
        batch = self.batch_size or record_batch
        throughput = batch / median if batch and median else None
        if note:
            text, kind = note, "stopped"
        return View(time=now, elapsed=now - self.opened, steps=n_steps, last_step=last_step,
                    compiles=s["compiles"], cached_compiles=cached, compile_time=s["compile_time"],
                    compile_events=n_events, recompilations=alerts_total, executions=s["executions"],
                    execute_time=s["execute_time"], to_device=to_device, to_host=s["to_host"],
                    item_reads=s["item_reads"], fallbacks=fallbacks, last_step_s=last_wall,
                    median_step_s=median, throughput=throughput, batch_size=batch, memory=memory,
                    scalars=scalars, now=text, now_kind=kind, alerts=alerts, alerts_total=alerts_total,
                    note=note)

    def timeline(self) -> Timeline:
        """Copies of the per-step columns and scalar curves for the plot."""
        with self._lock:
            return Timeline(list(self._steps), list(self._compile_t), list(self._exec_t), list(self._host_t),
                            {k: (list(x), list(y)) for k, (x, y) in self._scalars.items()}, self.version)
