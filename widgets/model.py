"""DashboardState: what the dashboard knows, fed by listener calls, read by renderers.

Pure and thread-safe: no UI library, no torch_xla. The listener side
(:meth:`DashboardState.add_step`, :meth:`DashboardState.add_compile`) is O(1): it
appends. Summarizing (medians, the now line, the verdict, copies for the plot)
happens in :meth:`DashboardState.view` and :meth:`DashboardState.timeline`, on the
rendering thread, into the frozen records of :mod:`~tpukit.widgets.view`.

Compile events arrive as the reader publishes them: once when a compile starts, once
finished and classified (``index`` is the identity). "Compiling now" is a started
event whose finished version has not arrived; nothing here reads the compile trace.
Compiles are shown by the alarm contract of ``tpukit.compiles.classify``: only a
*recompilation* is an alert (the red counter, the alert list); *new graphs* and
*expected* compiles are counted and listed apart. Where the time goes comes from
the tracked loop itself (``Tracker.verdict()``, ``Tracker.settled_after()``).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Any

from tpukit.compiles import EXPECTED, FLUSH_CUT, KINDS, NEW, RECOMPILATION
from tpukit.verdict import rate

from .view import Compile, Timeline, View, now_line

# After the last step record, the loop counts as running for this long (syncs
# outside track() have no start/end signal of their own).
BUSY_AFTER_STEP_S = 2.0
# The live verdict walks the loop's whole history: at most once a second, and never
# more often than 50 times its own cost (a long history costs the loop under 2%).
JUDGE_EVERY_S = 1.0
JUDGE_COST_RATIO = 50.0
# Tokens/s, TFLOP/s and MFU are over the latest steps that counted tokens or FLOPs (the steady ones among them).
RATE_STEPS = 64


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
        self._cols = {k: deque(maxlen=h) for k in ("steps", "compile", "input", "tracing", "device")}
        self._wall: deque = deque(maxlen=h)
        self._steady: deque = deque(maxlen=h)  # walls of steps without a compile
        self._rated: deque = deque(maxlen=RATE_STEPS)  # the latest records with tokens or model FLOPs
        self._scalars: dict[str, tuple[deque, deque]] = {}
        self._last_scalars: dict = {}
        self._max_history = h
        self._n_steps = 0
        self._last_step: int | None = None
        self._last_end: float | None = None
        self._record_batch: int | None = None
        self._x_offset = 0  # plotted x = step + offset: loops restart at step 1, the plot goes on
        self._last_x = 0
        self._x_end: float | None = None
        self._sums = {"compiles": 0, "compile_time": 0.0, "executions": 0, "execute_time": 0.0,
                      "to_host": 0, "item_reads": 0, "eager_compiles": 0}
        self._fallbacks: dict[str, int] = {}
        self._max_event = -1
        self._n_events = 0
        self._eager_places: dict[str, None] = {}  # "op at line" of eager-mode compiles, in order
        self._tpu: dict[str, tuple[str, Any]] = {}  # graph -> (its name, the target TPU's estimate)
        self._for_tpu: set[str] = set()  # graphs a target's follower compiles (their HLO was kept for it)
        self._unsettled: set[int] = set()  # compiles classified whose graph is not matched to them yet
        self._pending: dict[int, Any] = {}  # index -> a started compile whose finished version has not come
        self._alerts: deque = deque(maxlen=max_alerts)
        self._graphs: deque = deque(maxlen=max_alerts)
        self._kind_of: dict[int, str] = {}  # event index -> kind, once classified
        self._step_of: dict[int, int] = {}  # event index -> step, as its step record tells
        self._counts = dict.fromkeys(KINDS, 0)
        self._delta = None
        self._tracking = 0
        self._tracker = None  # the latest tracked loop (its verdict and warm-up)
        self._compiles_before = 0  # compiles of the work tracked loops flushed as they began (in no step)
        self._judge_lock = threading.Lock()
        self._judged: tuple = (None, None, None)  # (key, verdict, settled_after)
        self._judge_next = 0.0
        self.note: str | None = None
        self._finished: float | None = None
        self.version = 0  # bumped by every step (the plot re-renders only then)

    # ------------------------------------------------------------ listener side (O(1))
    def add_step(self, rec: Any) -> None:
        """Consume one StepRecord (of this process, or of host 0 of a slice: see widgets/slice.py)."""
        if getattr(rec, "host", 0):
            return  # the other hosts of a run_on_slice run: their steps are the SliceView's
        with self._lock:
            self._n_steps += 1
            self._last_step = rec.step
            self._last_end = rec.end
            wall = rec.wall
            x = rec.step + self._x_offset
            if x <= self._last_x:  # a new loop started at step 1: continue the x axis after the last one
                self._x_offset = self._last_x - rec.step + 1
                x = self._last_x + 1
            self._last_x = x
            if rec.input_time is not None:  # measured by track()
                parts = (rec.input_time, rec.tracing_time or 0.0, rec.wait_time or 0.0)
            else:
                parts = (0.0, rec.host_time, rec.execute_time)
            c = self._cols
            c["steps"].append(x)
            c["compile"].append(rec.compile_time)
            c["input"].append(parts[0])
            c["tracing"].append(parts[1])
            c["device"].append(parts[2])
            self._wall.append(wall)
            if not rec.compiles and not rec.compile_events:
                self._steady.append(wall)
            s = self._sums
            s["compiles"] += rec.compiles
            s["eager_compiles"] += getattr(rec, "eager_compiles", 0)
            s["compile_time"] += rec.compile_time
            s["executions"] += rec.executions
            s["execute_time"] += rec.execute_time
            s["to_host"] += rec.to_host
            s["item_reads"] += rec.item_reads
            for op, n in (rec.fallbacks or {}).items():
                self._fallbacks[op] = self._fallbacks.get(op, 0) + n
            if rec.batch_size:
                self._record_batch = rec.batch_size
            if getattr(rec, "tokens", None) or getattr(rec, "flops", None):
                self._rated.append(rec)
            for name, value in (rec.scalars or {}).items():
                xs_ys = self._scalars.get(name)
                if xs_ys is None:
                    xs_ys = self._scalars[name] = (deque(maxlen=self._max_history), deque(maxlen=self._max_history))
                xs_ys[0].append(x)
                xs_ys[1].append(value)
                self._last_scalars[name] = value
            for ev in rec.compile_events:  # usually seen already through on_compile
                self._add_compile(ev, step=rec.step)
            self.version += 1

    def add_compile(self, event: Any) -> None:
        """Consume one CompileEvent as the reader publishes it (started, then finished and classified;
        ``index`` is its identity); host 0's only, as add_step."""
        if getattr(event, "host", 0):
            return
        with self._lock:
            self._add_compile(event, step=None)

    def _note_graph(self, ev: Any) -> None:
        """Keep track of the compiles not yet matched to their graph (under the lock)."""
        if getattr(ev, "settled", False):
            self._unsettled.discard(ev.index)
        elif ev.kind in KINDS:
            self._unsettled.add(ev.index)

    def add_pending(self, event: Any, seen_only: bool = False) -> None:
        """The target's follower sent ``event``'s graph to the TPU compiler: an answer is on its way (``seen_only``:
        only for a compile this dashboard saw)."""
        if getattr(event, "host", 0):
            return
        with self._lock:
            if not seen_only or event.index in self._kind_of:
                self._for_tpu.add(event.graph_key)

    def settle(self, event: Any) -> None:
        """After the loop ended: a compile it saw now has its graph (a target's follower compiles it)."""
        with self._lock:
            if event.index in self._kind_of or event.index in self._unsettled:
                self._note_graph(event)

    def _add_compile(self, ev: Any, step: int | None) -> None:
        self._note_graph(ev)
        if ev.index > self._max_event:
            self._max_event = ev.index
            self._n_events += 1
        if getattr(ev, "eager", False):
            self._eager_places[f"{ev.cause[len('eager op '):]} at {ev.where}"] = None
        if ev.end is None and ev.kind not in KINDS:
            if ev.index not in self._kind_of:  # started, its finished version not here yet: compiling
                self._pending[ev.index] = ev
        else:
            self._pending.pop(ev.index, None)
        if step is not None:
            self._step_of[ev.index] = step
        kind = ev.kind
        if kind not in KINDS:
            return  # not classified yet: only the now line shows it
        known = self._step_of.get(ev.index)
        old = self._kind_of.get(ev.index)
        if old is None:
            self._kind_of[ev.index] = kind
            self._counts[kind] += 1
            guess = known if known is not None else (self._last_step or 0) + 1
            if known is None and getattr(ev, "cut", None) == FLUSH_CUT:
                guess = 0  # a loop's flush of earlier work is in no step: "before step 1"
            (self._alerts if kind == RECOMPILATION else self._graphs).appendleft(Compile(ev, guess, self._clock()))
        elif known is not None:  # the record tells the step for sure
            for rows in (self._alerts, self._graphs):
                for i, a in enumerate(rows):
                    if a.index == ev.index and a.step != known:
                        rows[i] = Compile(ev, known, a.time)

    def add_estimate(self, event: Any, estimate: Any, seen_only: bool = False) -> bool:
        """What the TPU compiler says about ``event``'s graph on the target TPU (one row per graph);
        ``seen_only``: only for a compile this dashboard saw. True when it is a new row."""
        if getattr(event, "host", 0):
            return False
        key = event.graph_key
        with self._lock:
            if key in self._tpu or (seen_only and key not in self._for_tpu and event.index not in self._kind_of):
                return False
            self._tpu[key] = (event.name, estimate)
            return True

    def awaiting_estimates(self, following: bool = False) -> bool:
        """True while a graph this dashboard saw was sent to a target's TPU compiler and has no answer yet;
        with ``following`` (a target is set), also while a compile it saw has not been matched to its graph
        (the follower gets it once it is)."""
        with self._lock:
            return bool(self._for_tpu - self._tpu.keys()) or (following and bool(self._unsettled))

    def latest_estimate(self) -> tuple[str, Any] | None:
        """(graph name, estimate) of the TPU answer that came last, or None."""
        with self._lock:
            return next(reversed(self._tpu.values()), None)

    def _compiling(self) -> Any:
        """The latest compile that started and has not finished (None: none); under the lock."""
        return self._pending[max(self._pending)] if self._pending else None

    def set_metrics(self, delta: Any) -> None:
        """Counters since the dashboard opened (a tpukit ``Delta``), sampled by the dashboard's thread."""
        with self._lock:
            self._delta = delta

    def track_started(self, tracker: Any = None) -> None:
        """A tracked loop begins: its verdict and warm-up are shown, its ``total`` ends the x axis."""
        with self._lock:
            self._tracking += 1
            if tracker is not None:
                self._tracker = tracker
                self._compiles_before += getattr(tracker, "compiles_before", 0) or 0
                total = getattr(tracker, "total", None)
                self._x_end = self._last_x + total if isinstance(total, int) and total > 0 else None

    def track_ended(self, tracker: Any = None) -> None:
        """A tracked loop ended (ran out or broke off): idle, the axis ends, the final verdict."""
        with self._lock:
            self._tracking = max(0, self._tracking - 1)
            self._pending.clear()
            self._last_end = None  # the loop is over: idle until another step arrives
            self._x_end = self._last_x or None  # a loop ended early: the axis stops at its last step
        self.judge(force=True)  # the final verdict (with the last wait for the device)

    def finish(self) -> None:
        """The dashboard was closed: the now line says what ran, not what runs."""
        with self._lock:
            self._finished = self._clock()
            self._pending.clear()
            self._x_end = self._last_x or None
        self.judge(force=True)

    # ------------------------------------------------------------ renderer side
    @property
    def steps(self) -> int:
        """Step records consumed so far."""
        return self._n_steps

    def judge(self, force: bool = False) -> tuple[Any, int | None]:
        """(verdict, settled_after) of the latest tracked loop, from ``tracker.verdict()`` and
        ``tracker.settled_after()``; recomputed when its history grew (throttled unless ``force``)."""
        tracker = self._tracker
        if tracker is None or not callable(getattr(tracker, "verdict", None)):
            return None, None
        with self._judge_lock:
            key = (id(tracker), len(getattr(tracker, "history", ()) or ()), getattr(tracker, "finished", None))
            cached_key, verdict, settled = self._judged
            mono = time.monotonic()
            if key == cached_key or (not force and cached_key is not None and cached_key[0] == key[0]
                                     and mono < self._judge_next):
                return verdict, settled
            t0 = time.perf_counter()
            verdict, settled = tracker.verdict(), tracker.settled_after()
            cost = time.perf_counter() - t0
            self._judge_next = mono + max(JUDGE_EVERY_S, JUDGE_COST_RATIO * cost)
            self._judged = (key, verdict, settled)
            return verdict, settled

    def view(self, now: float | None = None) -> View:
        """Everything the renderers need, computed now."""
        now = self._clock() if now is None else now
        verdict, settled = self.judge()
        with self._lock:
            s = dict(self._sums)
            fallbacks = dict(self._fallbacks)
            d = self._delta
            steady = list(self._steady) or list(self._wall)
            last_wall = self._wall[-1] if self._wall else None
            busy = None
            if self._tracking or (self._last_end is not None and now - self._last_end < BUSY_AFTER_STEP_S):
                busy = (self._last_step or 0) + 1
            text, kind = now_line(self._compiling(), now, busy)
            stopped = getattr(self._tracker, "stopped", None)
            stopped = str(stopped) if stopped is not None else None
            if self._finished is not None:
                text, kind = f"closed: {self._n_steps} steps in {self._finished - self.opened:.1f} s", "idle"
                if stopped:
                    text, kind = f"{stopped} · {text}", "stopped"
            alerts, graphs, counts = tuple(self._alerts), tuple(self._graphs), dict(self._counts)
            n_steps, last_step, n_events = self._n_steps, self._last_step, self._n_events
            scalars, note, record_batch = dict(self._last_scalars), self.note, self._record_batch
            tracker, eager_places, tpu = self._tracker, tuple(self._eager_places), tuple(self._tpu.values())
            before, closed = self._compiles_before, self._finished is not None
            rated = list(self._rated)
            tracked, loop_done = tracker is not None, getattr(tracker, "finished", None) is not None
        # Step records cover syncs; the metrics delta covers everything since the
        # dashboard opened but is sampled less often. The larger is the fresher.
        cached = to_device = memory = None
        in_steps = s["compiles"]  # the step records'; the counters' delta may count compiles outside them
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
        rated = [r for r in rated if not r.compiles] or rated
        speed = rate(rated) if rated else None
        return View(time=now, elapsed=now - self.opened, steps=n_steps, last_step=last_step,
                    compiles=s["compiles"], cached_compiles=cached, compile_time=s["compile_time"],
                    compile_events=n_events, recompilations=counts[RECOMPILATION], executions=s["executions"],
                    execute_time=s["execute_time"], to_device=to_device, to_host=s["to_host"],
                    item_reads=s["item_reads"], fallbacks=fallbacks, last_step_s=last_wall,
                    median_step_s=median, throughput=throughput, batch_size=batch, memory=memory,
                    scalars=scalars, now=text, now_kind=kind, alerts=alerts,
                    alerts_total=counts[RECOMPILATION], note=note, new_graphs=counts[NEW],
                    expected=counts[EXPECTED], graphs=graphs, verdict=verdict, settled_after=settled,
                    tracked=tracked, loop_done=loop_done, eager_compiles=s["eager_compiles"],
                    eager_places=eager_places, tpu=tpu, step_compiles=in_steps, compiles_before=before,
                    closed=closed, stopped=stopped, rate=speed)

    def timeline(self) -> Timeline:
        """Copies of the per-step columns and scalar curves for the plot."""
        with self._lock:
            c = self._cols
            return Timeline(list(c["steps"]), list(c["compile"]), list(c["input"]), list(c["tracing"]),
                            list(c["device"]), {k: (list(x), list(y)) for k, (x, y) in self._scalars.items()},
                            self.version, self._x_end)
