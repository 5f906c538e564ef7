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


class Clock:
    """Turns consecutive syncs into StepRecords by differencing metric snapshots."""

    def __init__(self, first_step: int = 1):
        self.step = first_step - 1
        self.last = metrics.snapshot()
        self.last_time = time.time()
        self.events_seen = compiles.event_count()
        self.busy_until = self.last_time

    def tick(self, scalars: dict, batch_size: int | None = None, **times: float) -> StepRecord:
        """The record of the step that ended at the sync just made (``times``: the measured
        ``input_time``, ``tracing_time``, ``wait_time`` of a tracked step; compile time is
        taken out of the tracing time here)."""
        now_snap, executed = metrics.snapshot_and_executions()
        d = now_snap - self.last
        if "tracing_time" in times:
            times["tracing_time"] = max(0.0, times["tracing_time"] - d.compile_time)
        n = compiles.event_count()
        events_ = tuple(compiles.events_since(self.events_seen)) if n > self.events_seen else ()
        self.events_seen = n
        self.step += 1
        rec = StepRecord(step=self.step, start=self.last_time, end=now_snap.time, compiles=d.compiles,
                         eager_compiles=d.eager_compiles,
                         compile_time=d.compile_time, executions=d.executions, execute_time=d.execute_time,
                         to_host=d.to_host, item_reads=d.item_reads, scalars=scalars,
                         batch_size=batch_size, compile_events=events_, fallbacks=d.fallbacks,
                         device_time=self.drain(executed) if times else None, **times)
        self.last, self.last_time = now_snap, now_snap.time
        return rec

    def drain(self, samples: list[tuple[float, float]] | None = None) -> float:
        """Device busy seconds that completed since the last drain (executions merged as intervals);
        ``samples`` when the caller has just read them, else read now."""
        found = metrics.execute_samples() if samples is None else samples
        added, self.busy_until = busy_time(found, self.busy_until)
        return added


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


# ------------------------------------------------------------------ where the time goes

BOTTLENECKS = ("compile", "input", "tracing", "device")
_SUGGEST = {
    "compile": "compiling dominates: find the recompilation alarms and fix their cause (bucket or pad the "
               "inputs, pass changing values as tensors); on a TPU keep the persistent compilation cache on",
    "input": "the loop waits for its data: use more DataLoader workers (num_workers), prefetch with "
             "tpukit.device_loader / track(DataLoader), or preprocess once up front",
    "tracing": "the host spends the step tracing Python ops: wrap the step in torch_xla.compile, fuse small "
               "ops, or do more work per step (a bigger batch)",
    "device": "the device is the limit: use bf16 (torch.autocast('xla', dtype=torch.bfloat16)), a bigger "
              "batch per chip, or more chips",
}


@dataclass(frozen=True)
class Verdict:
    """Where a loop's time went: the bottleneck, the measured shares of wall time, and what to do.

    ``shares`` are fractions of wall time over the judged steps: ``compile``, ``input``
    (waiting for the next batch) and ``tracing`` (host time in the loop body and the
    sync, compiles excluded) are host-side and add up to at most 1; ``device`` is the
    time the device was busy, which overlaps the host's.
    """

    bottleneck: str
    shares: dict
    steps: int
    settled: bool
    sentence: str
    suggestion: str


def bottleneck(records: list, settled_after: int | None = None, tail_wait: float = 0.0,
               tail_device: float = 0.0) -> Verdict | None:
    """Judge a loop's bottleneck over the steps after ``settled_after`` (all steps when None
    or when too few are left), with ``tail_wait``/``tail_device`` the final wait for the device.

    compile when compiling takes at least half the wall time; else input when waiting
    for data is the largest host share (and at least a quarter); else device when the
    device was busy at least 60% of the time; else tracing.
    """
    timed = [r for r in records if r.input_time is not None]
    if not timed:
        return None
    judged = [r for r in timed if settled_after is not None and r.step > settled_after]
    settled = settled_after is not None and len(judged) >= 2
    if not settled:
        judged = timed
    wall = sum(r.wall for r in judged) + tail_wait
    if wall <= 0:
        return None

    def share(total: float) -> float:
        return min(1.0, total / wall)

    shares = {"compile": share(sum(r.compile_time for r in judged)),
              "input": share(sum(r.input_time for r in judged)),
              "tracing": share(sum(r.tracing_time for r in judged)),
              "device": share(sum(r.device_time or 0.0 for r in judged) + tail_device)}
    if shares["compile"] >= 0.5:
        kind = "compile"
    elif shares["input"] >= max(shares["tracing"], 0.25):
        kind = "input"
    elif shares["device"] >= 0.6:
        kind = "device"
    else:
        kind = "tracing"
    over = (f"the {len(judged)} steps after step {settled_after}" if settled and settled_after
            else f"all {len(judged)} steps" + ("" if settled else " (the loop never settled)"))
    pct = ", ".join(f"{k} {shares[k]:.0%}" for k in BOTTLENECKS)
    sentence = f"{kind}-bound over {over}: {pct} of the wall time"
    return Verdict(kind, shares, len(judged), settled, sentence, _SUGGEST[kind])
