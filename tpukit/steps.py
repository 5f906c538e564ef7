"""Steps: :class:`StepRecord`, the sync hook, :func:`log` and :func:`on_step`.

The lazy runtime only knows "a sync happened". tpukit turns each sync into a
:class:`StepRecord` (wall time, compiles and their causes, executions, logged
scalars) and publishes it through :mod:`tpukit.events`.

Scalars given to :func:`log` are read once their step has been synced, when
they are already device data: logging never adds an execution to the step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import _xla, compiles, events, metrics
from .compiles import CompileEvent


@dataclass(frozen=True)
class StepRecord:
    """What one step (one sync) cost, and the scalars logged in it. Times in seconds.

    Compiles happen inside the step's sync and are exact. Executions run
    asynchronously and are counted when they finish, so on a device that runs
    ahead of the host a step's ``executions``/``execute_time`` may include the
    previous step's graph; totals over a loop are exact.
    """

    step: int
    start: float
    end: float
    compiles: int = 0
    eager_compiles: int = 0  # of those, eager mode's per-op ones (their events: cause "eager op <name>")
    compile_time: float = 0.0
    executions: int = 0
    execute_time: float = 0.0
    to_host: int = 0
    item_reads: int = 0
    scalars: dict = field(default_factory=dict)
    batch_size: int | None = None
    compile_events: tuple[CompileEvent, ...] = ()
    fallbacks: dict = field(default_factory=dict)
    # Where the wall time went, each measured (None outside track()): waiting for the
    # next batch, host time tracing the loop body and syncing (compiles and device waits
    # excluded), host time blocked on the device, and device busy time (which overlaps).
    input_time: float | None = None
    tracing_time: float | None = None
    wait_time: float | None = None
    device_time: float | None = None
    # How fast against the chip (None where unknown; see docs/dashboard.md#how-fast-against-the-chip):
    # tokens: the input_ids elements of the step's batches (a language model's); flops: the step's model FLOPs
    # over all the chips it ran on, flops_source saying whose count (the TPU compiler's for the target, or
    # 6·N·tokens); peak_flops: those chips' dense bf16 peak FLOP/s (None off a TPU), peak_source what it is
    # of, or why there is none ("n/a: not a TPU").
    tokens: int | None = None
    flops: float | None = None
    flops_source: str | None = None
    peak_flops: float | None = None
    peak_source: str | None = None

    @property
    def wall(self) -> float:
        """Seconds from the end of the previous step to the end of this one."""
        return self.end - self.start

    @property
    def host_time(self) -> float:
        """Wall time not spent compiling or executing (tracing, data, Python)."""
        return max(0.0, self.wall - self.compile_time - self.execute_time)

    @property
    def recompilations(self) -> tuple[CompileEvent, ...]:
        """Compile events of this step classified as recompilations (the alarms)."""
        return tuple(e for e in self.compile_events if e.recompilation)

    @property
    def new_graphs(self) -> tuple[CompileEvent, ...]:
        """Compile events of this step that are new graphs or expected compiles (not alarms)."""
        return tuple(e for e in self.compile_events if not e.recompilation)

    @property
    def throughput(self) -> float | None:
        """Examples per second, when the batch size is known."""
        return self.batch_size / self.wall if self.batch_size and self.wall > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens per second of wall time, for a language model's batch (``tokens``)."""
        return self.tokens / self.wall if self.tokens and self.wall > 0 else None

    @property
    def flops_per_s(self) -> float | None:
        """Achieved model FLOP/s: the step's ``flops`` over its wall time."""
        return self.flops / self.wall if self.flops and self.wall > 0 else None

    def mfu_against(self, peak: float) -> float | None:
        """Model FLOPs utilization against ``peak`` FLOP/s (of all the chips the step ran on): achieved / peak."""
        achieved = self.flops_per_s
        return achieved / peak if achieved is not None and peak > 0 else None

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization against the chips' peak (``peak_flops``); None off a TPU or without FLOPs."""
        return self.mfu_against(self.peak_flops) if self.peak_flops else None


class Clock:
    """Turns consecutive syncs into StepRecords by differencing metric snapshots."""

    def __init__(self, first_step: int = 1):
        self.step = first_step - 1
        self.last = metrics.snapshot()
        self.last_time = time.time()
        self.mark = compiles.mark()
        self.span: tuple[compiles.Mark, compiles.Mark] = (self.mark, self.mark)  # the last step's compiles
        self.busy_until = self.last_time

    def tick(self, scalars: dict, batch_size: int | None = None, settle: float = 3.0,
             sync: tuple[float, float] | None = None, tokens: int | None = None, **times: float) -> StepRecord:
        """The record of the step that ended at the sync just made (``times``: the measured
        ``input_time``, ``tracing_time``, ``wait_time`` of a tracked step; compile time is
        taken out of the tracing time here, and with ``sync``, the sync's ``(unix start,
        seconds)``, so is the time the sync waited for the device: see :func:`sync_wait`; ``tokens``: the
        tokens of its batches, a language model's).
        Its compile events are the reader's, classified (waiting at most ``settle`` seconds),
        or as they are now with ``settle=0``: a tracked loop settles them later, with
        :func:`settle`, when waiting costs nothing."""
        now_snap, executed = metrics.snapshot_and_executions()
        d = now_snap - self.last
        if "tracing_time" in times:
            blocked = sync_wait(executed, *sync, d.compile_time) if sync else 0.0
            times["tracing_time"] = max(0.0, times["tracing_time"] - d.compile_time - blocked)
            times["wait_time"] = times.get("wait_time", 0.0) + blocked
        upto = compiles.mark()
        self.span, self.mark = (self.mark, upto), upto
        events_ = ()
        if d.compiles or upto != self.span[0]:
            found = compiles.settled(upto, self.span[0], settle) if settle else compiles.started_between(*self.span)
            events_ = _own(found)
        self.step += 1
        rec = StepRecord(step=self.step, start=self.last_time, end=now_snap.time, compiles=d.compiles,
                         eager_compiles=d.eager_compiles,
                         compile_time=d.compile_time, executions=d.executions, execute_time=d.execute_time,
                         to_host=d.to_host, item_reads=d.item_reads, scalars=scalars,
                         batch_size=batch_size, tokens=tokens, compile_events=events_, fallbacks=d.fallbacks,
                         device_time=self.drain(executed) if times else None, **times)
        self.last, self.last_time = now_snap, now_snap.time
        return rec

    @staticmethod
    def settle(record: StepRecord, span: tuple[compiles.Mark, compiles.Mark], timeout: float = 3.0) -> StepRecord:
        """``record`` with its compile events classified: the reader's final events of ``span``."""
        if not record.compile_events and not record.compiles:
            return record
        return dataclasses.replace(record, compile_events=_own(compiles.settled(span[1], span[0], timeout)))

    def drain(self, samples: list[tuple[float, float]] | None = None) -> float:
        """Device busy seconds that completed since the last drain (executions merged as intervals);
        ``samples`` when the caller has just read them, else read now."""
        found = metrics.execute_samples() if samples is None else samples
        added, self.busy_until = busy_time(found, self.busy_until)
        return added


def _own(found: list[CompileEvent]) -> tuple[CompileEvent, ...]:
    """The compiles of a step that belong to the loop open on this thread (and those no loop
    claims): another thread's loop's compiles, made meanwhile, are not this step's."""
    loop = compiles.context.current()
    return tuple(found) if loop is None else tuple(e for e in found if e.loop in (None, loop.id))


def sync_wait(samples: list[tuple[float, float]], began: float, seconds: float, compile_time: float = 0.0) -> float:
    """Seconds a sync that began at unix time ``began`` and took ``seconds`` spent waiting for the device.

    A step that reuses buffers the previous one updated in place (torch_xla donates the parameters'
    buffers) cannot launch before that execution has finished, and on XLA:CPU a sync may also return
    only once its own execution has: the host is then blocked while the device runs. The wait is the
    part of the sync during which an execution was running (``samples``: ``(end_time, duration)``,
    see :func:`~tpukit.metrics.execute_samples`, merged as intervals), at most the sync's time not
    spent compiling; the sync's own host work is short next to it.
    """
    end = began + seconds
    inside = [(min(e, end), min(e, end) - max(e - d, began)) for e, d in samples if e > began and e - d < end]
    return min(busy_time(inside, began)[0], max(0.0, seconds - compile_time))


def busy_time(samples: list[tuple[float, float]], since: float) -> tuple[float, float]:
    """Seconds after ``since`` covered by at least one ``(end_time, duration)`` interval, and the
    new ``since`` (the latest end seen).

    torch_xla's execution samples run from dispatch to completion and overlap when
    several executions are in flight, so they are merged as intervals, not summed.
    """
    spans = sorted((max(since, e - d), e) for e, d in samples if e > since)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return max(0.0, total), max([since] + [b for _, b in spans])


class _SyncState:
    """Everything the sync hook shares between threads, with its one lock.

    ``pending``: values logged since the last sync; ``synced``: logged at or
    before the last sync (device data, not read yet); ``loops``: tracked loops
    running (they make their own records); ``free_clock``: records syncs made
    outside any tracked loop.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.pending: list[tuple[str, Any]] = []
        self.synced: list[tuple[str, Any]] = []
        self.hook_armed = False
        self.loops = 0
        self.free_clock: Clock | None = None


_STATE = _SyncState()


def _reset() -> None:
    """Forget logged values and loop state (for tests); an armed hook disarms itself."""
    global _STATE
    _STATE = _SyncState()


def _wants_hook(st: _SyncState) -> bool:
    return bool(st.pending or st.loops or events.has("on_step"))


def ensure_hook() -> None:
    """Arm the self-renewing step closure that runs after every sync (once the runtime runs)."""
    if not _xla.runtime_initialized():
        return  # arming would start the runtime; track()/log() arm it once the device is in use
    st = _STATE
    with st.lock:
        if st.free_clock is None and events.has("on_step"):
            st.free_clock = Clock()
        if st.hook_armed:
            return
        st.hook_armed = True
    _xla.add_step_closure(lambda: _on_sync(st))


def _on_sync(st: _SyncState) -> None:
    """Runs in torch_xla's step closures, right after a sync launched the step's graph."""
    if st is not _STATE:
        return  # state was reset: this closure belongs to the old one
    with st.lock:
        st.hook_armed = False
        st.synced.extend(st.pending)  # now device data: readable without an execution
        st.pending.clear()
        free = not st.loops and events.has("on_step")
        if free:
            st.free_clock = st.free_clock or Clock()
            clock = st.free_clock
    if free:  # a sync outside track(): one record per sync
        events.call("on_step", clock.tick(take_scalars()))
    if _wants_hook(st):
        ensure_hook()


def loop_started() -> None:
    """A tracked loop begins: its own clock makes the records, not the free one."""
    with _STATE.lock:
        _STATE.loops += 1


def loop_ended() -> None:
    """A tracked loop ended (see :func:`loop_started`)."""
    with _STATE.lock:
        _STATE.loops = max(0, _STATE.loops - 1)


def read_values(pending: list[tuple[str, Any]]) -> dict[str, float]:
    """Turn logged ``(name, tensor-or-number)`` pairs into floats (one device read for all tensors)."""
    return read_steps([pending])[0]


def read_steps(pendings: list[list[tuple[str, Any]]]) -> list[dict[str, float]]:
    """:func:`read_values` of several steps' logged values, with one device read for all of them."""
    tensors = [v for pending in pendings for _, v in pending if hasattr(v, "detach")]
    cpu = iter(_xla.to_cpu(tensors, sync=False)) if tensors else iter(())
    return [{name: float(next(cpu).item()) if hasattr(v, "detach") else float(v) for name, v in pending}
            for pending in pendings]


#: Logged values wait this long (seconds since their step's sync) before the loop reads them, or
#: :data:`READ_AFTER_STEPS` steps. A read waits for every execution launched before it, so reading each
#: step as it ends kept host and device in lockstep: the device idled while the host came back from
#: the read (on XLA:CPU often a few milliseconds, behind the data loader's thread) and launched the next
#: step. Reading several steps at once pays that once.
READ_AFTER_S = 1.0
READ_AFTER_STEPS = 64


class Unread:
    """A loop's synced steps not published yet, oldest first: each step's record, its logged values
    (device data) until they are read, its compile span and when it was synced. Their values are read
    together, in one device read, once the oldest has waited :data:`READ_AFTER_S` seconds or
    :data:`READ_AFTER_STEPS` steps, and at the end of the loop."""

    def __init__(self) -> None:
        self._steps: collections.deque = collections.deque()  # [record, values, span, synced_at]
        self._pending = 0  # steps with values not read yet

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def pending(self) -> int:
        """How many of the steps have logged values not read yet."""
        return self._pending

    def add(self, rec: StepRecord, values: list, span: tuple, synced_at: float) -> None:
        """A step just synced, with the values logged in it."""
        self._steps.append([rec, values, span, synced_at])
        self._pending += bool(values)

    def due(self, now: float) -> bool:
        """Whether to read now: there are values to read and they are old enough."""
        if not self._pending:
            return False
        oldest = next(s[3] for s in self._steps if s[1])
        return now - oldest >= READ_AFTER_S or self._pending >= READ_AFTER_STEPS

    def read(self) -> None:
        """Read every unread step's values (one device read; it waits for the device)."""
        waiting = [s for s in self._steps if s[1]]
        if not waiting:
            return
        for s, found in zip(waiting, read_steps([s[1] for s in waiting])):
            s[0] = dataclasses.replace(s[0], scalars={**s[0].scalars, **found})
            s[1] = []
        self._pending = 0

    def take_read(self, keep_last: bool) -> list[tuple[StepRecord, tuple]]:
        """Remove and return ``(record, span)`` of the oldest steps whose values are read, in order;
        ``keep_last``: never the newest step (its compiles are classified after the next sync)."""
        out = []
        while len(self._steps) > keep_last and not self._steps[0][1]:
            rec, _, span, _ = self._steps.popleft()
            out.append((rec, span))
        return out


def take_synced() -> list[tuple[str, Any]]:
    """The logged values whose step has been synced, not yet read (and forget them)."""
    with _STATE.lock:
        out = list(_STATE.synced)
        _STATE.synced.clear()
    return out


def take_scalars() -> dict[str, float]:
    """Read the logged values of the synced step now (waits for its execution)."""
    return read_values(take_synced())


def log(**scalars: Any) -> None:
    """Record scalar values for the current step without forcing an execution.

    Tensors are read after the step's sync, so ``tpukit.log(loss=loss)`` costs
    no extra graph execution. Floats and ints are recorded as they are. In a
    tracked loop several steps' values are read at once (:data:`READ_AFTER_S`),
    so the host is not held back to the device's pace every step: a step's
    record, with its values, reaches listeners after the next step's sync, or
    with the records of the next second's short steps.
    """
    items = []
    for name, value in scalars.items():
        if hasattr(value, "detach"):
            if value.numel() != 1:
                raise ValueError(
                    f"tpukit.log({name}=...) got a tensor of shape {tuple(value.shape)}; log takes scalars. "
                    f"Reduce it first, e.g. {name}={name}.mean().")
            items.append((name, value.detach().reshape(())))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            items.append((name, float(value)))
        else:
            raise TypeError(f"tpukit.log({name}=...) got {type(value).__name__}; pass a scalar tensor or a number.")
    with _STATE.lock:
        _STATE.pending.extend(items)
    ensure_hook()


class _EveryN:
    """The listener behind :func:`on_step`: calls ``fn(record)`` on every ``every``-th step."""

    def __init__(self, fn: Callable[[StepRecord], Any], every: int):
        self.fn, self.every = fn, every

    def on_step(self, record: StepRecord) -> None:
        if record.step % self.every == 0:
            self.fn(record)


def on_step(fn: Callable[[StepRecord], Any], every: int = 1) -> Callable[[], None]:
    """Call ``fn(record)`` after every ``every``-th step; returns a function that removes it.

    A callback that raises is removed and reported once (a TpukitWarning).
    """
    if not callable(fn) or not isinstance(every, int) or every < 1:
        raise ValueError("on_step(fn, every=N) needs a callable and a positive int N.")
    listener = add_listener(_EveryN(fn, every))
    return lambda: events.remove_listener(listener)


def add_listener(listener: Any) -> Any:
    """Register a listener (see :mod:`tpukit.events`): an object whose optional ``on_step(record)``,
    ``on_compile(event)``, ``on_track_start(tracker)`` and ``on_track_end(tracker)`` methods receive
    records as they happen. One with ``on_step`` arms the sync hook, so syncs outside ``track()``
    make step records too."""
    events.add_listener(listener)
    if callable(getattr(listener, "on_step", None)):
        ensure_hook()
    return listener
