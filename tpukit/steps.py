"""Steps: :class:`StepRecord`, the sync hook, :func:`log` and :func:`on_step`.

The lazy runtime only knows "a sync happened". tpukit turns each sync into a
:class:`StepRecord` (wall time, compiles and their causes, executions, logged
scalars) and publishes it through :mod:`tpukit.events`.

Scalars given to :func:`log` are read once their step has been synced, when
they are already device data: logging never adds an execution to the step.
"""

from __future__ import annotations

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
    compile_time: float = 0.0
    executions: int = 0
    execute_time: float = 0.0
    to_host: int = 0
    item_reads: int = 0
    scalars: dict = field(default_factory=dict)
    batch_size: int | None = None
    compile_events: tuple[CompileEvent, ...] = ()
    fallbacks: dict = field(default_factory=dict)

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
        """Compile events of this step flagged as recompilations."""
        return tuple(e for e in self.compile_events if e.recompilation)

    @property
    def throughput(self) -> float | None:
        """Examples per second, when the batch size is known."""
        return self.batch_size / self.wall if self.batch_size and self.wall > 0 else None


class Clock:
    """Turns consecutive syncs into StepRecords by differencing metric snapshots."""

    def __init__(self, first_step: int = 1):
        self.step = first_step - 1
        self.last = metrics.snapshot()
        self.last_time = time.time()
        self.events_seen = compiles.event_count()

    def tick(self, scalars: dict, batch_size: int | None = None) -> StepRecord:
        """The record of the step that ended at the sync just made."""
        now_snap = metrics.snapshot()
        d = now_snap - self.last
        n = compiles.event_count()
        events_ = tuple(compiles.events_since(self.events_seen)) if n > self.events_seen else ()
        self.events_seen = n
        self.step += 1
        rec = StepRecord(step=self.step, start=self.last_time, end=now_snap.time, compiles=d.compiles,
                         compile_time=d.compile_time, executions=d.executions, execute_time=d.execute_time,
                         to_host=d.to_host, item_reads=d.item_reads, scalars=scalars,
                         batch_size=batch_size, compile_events=events_, fallbacks=d.fallbacks)
        self.last, self.last_time = now_snap, now_snap.time
        return rec


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
    tensors = [v for _, v in pending if hasattr(v, "detach")]
    cpu = iter(_xla.to_cpu(tensors, sync=False)) if tensors else iter(())
    return {name: float(next(cpu).item()) if hasattr(v, "detach") else float(v) for name, v in pending}


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
    no extra graph execution. Floats and ints are recorded as they are.
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
    listener = events.add_listener(_EveryN(fn, every))
    return lambda: events.remove_listener(listener)


# A listener with on_step added while the runtime runs needs the sync hook armed.
events.when_added(lambda listener: ensure_hook() if callable(getattr(listener, "on_step", None)) else None)
