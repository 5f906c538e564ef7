"""Steps: ``log()``, ``on_step()``, ``track()``, the listener registry and the guards.

The lazy runtime only knows "a sync happened". tpukit turns each sync into a
:class:`StepRecord` (wall time, compiles and their causes, executions, logged
scalars) and publishes it to listeners (dashboard, magics, text reporter).

Scalars given to :func:`log` are read in a step closure, i.e. right after the
step's own sync, when they are already device data: logging never adds an
execution to the step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

from . import _xla, compiles, metrics
from .compiles import CompileEvent
from .errors import RecompilationError, TpukitWarning

logger = logging.getLogger("tpukit")


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


# ------------------------------------------------------------------ listeners

_LISTENERS: list[Any] = []
_LISTENERS_LOCK = threading.RLock()


def add_listener(listener: Any) -> Any:
    """Register an object whose optional ``on_step(record)``, ``on_compile(event)``,
    ``on_track_start(tracker)`` and ``on_track_end(tracker)`` methods receive records as they happen."""
    with _LISTENERS_LOCK:
        if listener not in _LISTENERS:
            _LISTENERS.append(listener)
    if hasattr(listener, "on_step"):
        _ensure_hook()
    return listener


def remove_listener(listener: Any) -> None:
    """Unregister a listener (no error if it was not registered)."""
    with _LISTENERS_LOCK:
        if listener in _LISTENERS:
            _LISTENERS.remove(listener)


def listeners() -> list[Any]:
    """The registered listeners (copy)."""
    with _LISTENERS_LOCK:
        return list(_LISTENERS)


def publish(method: str, record: Any) -> None:
    """Call ``listener.<method>(record)`` on every listener; a failing one is removed and reported once."""
    for lst in listeners():
        fn = getattr(lst, method, None)
        if fn is None:
            continue
        try:
            fn(record)
        except Exception as exc:  # a broken UI must never break the training loop
            remove_listener(lst)
            warnings.warn(f"tpukit: listener {lst!r} failed in {method} and was detached: "
                          f"{type(exc).__name__}: {exc}", TpukitWarning, stacklevel=2)


compiles.subscribe(lambda ev: publish("on_compile", ev))


# ------------------------------------------------------------------ step clock

class _Clock:
    """Turns consecutive syncs into StepRecords by differencing snapshots."""

    def __init__(self, first_step: int = 1):
        self.step = first_step - 1
        self.last = metrics.snapshot()
        self.last_time = time.time()
        self.events_seen = compiles.event_count()

    def tick(self, scalars: dict, batch_size: int | None = None) -> StepRecord:
        now_snap = metrics.snapshot()
        d = now_snap - self.last
        n = compiles.event_count()
        events = tuple(compiles.events_since(self.events_seen)) if n > self.events_seen else ()
        self.events_seen = n
        self.step += 1
        rec = StepRecord(step=self.step, start=self.last_time, end=now_snap.time, compiles=d.compiles,
                         compile_time=d.compile_time, executions=d.executions, execute_time=d.execute_time,
                         to_host=d.to_host, item_reads=d.item_reads, scalars=scalars,
                         batch_size=batch_size, compile_events=events, fallbacks=d.fallbacks)
        self.last, self.last_time = now_snap, now_snap.time
        return rec


_STATE_LOCK = threading.RLock()
_PENDING: list[tuple[str, Any]] = []  # (name, tensor-or-float) logged since the last sync
_SYNCED: list[tuple[str, Any]] = []  # logged at or before the last sync: device data, not read yet
_CALLBACKS: list[tuple[Callable, int]] = []
_HOOK_ARMED = False
_ACTIVE_TRACKERS: list["Tracker"] = []
_FREE_CLOCK: _Clock | None = None


def _ensure_hook() -> None:
    """Arm the self-renewing step closure that runs after every sync."""
    global _HOOK_ARMED, _FREE_CLOCK
    if not _xla.runtime_initialized():
        return  # arming would start the runtime; track()/log() arm it once the device is in use
    with _STATE_LOCK:
        if _FREE_CLOCK is None and (_CALLBACKS or any(hasattr(l, "on_step") for l in listeners())):
            _FREE_CLOCK = _Clock()
        if _HOOK_ARMED:
            return
        _HOOK_ARMED = True
    _xla.add_step_closure(_on_sync)


def _needs_hook() -> bool:
    return bool(_PENDING or _CALLBACKS or _ACTIVE_TRACKERS or any(hasattr(l, "on_step") for l in listeners()))


def _on_sync() -> None:
    """Runs in torch_xla's step closures, right after a sync launched the step's graph."""
    global _HOOK_ARMED, _FREE_CLOCK
    with _STATE_LOCK:
        _HOOK_ARMED = False
        _SYNCED.extend(_PENDING)  # now device data: readable without an execution
        _PENDING.clear()
    if not _ACTIVE_TRACKERS and (_CALLBACKS or any(hasattr(l, "on_step") for l in listeners())):
        # A sync outside track(): one record per sync.
        _FREE_CLOCK = _FREE_CLOCK or _Clock()
        _emit(_FREE_CLOCK.tick(take_scalars()))
    if _needs_hook():
        _ensure_hook()


def _read_values(pending: list[tuple[str, Any]]) -> dict[str, float]:
    tensors = [v for _, v in pending if hasattr(v, "detach")]
    cpu = iter(_xla.to_cpu(tensors, sync=False)) if tensors else iter(())
    out = {}
    for name, v in pending:
        out[name] = float(next(cpu).item()) if hasattr(v, "detach") else float(v)
    return out


def take_synced() -> list[tuple[str, Any]]:
    """The logged values whose step has been synced, not yet read (and forget them)."""
    with _STATE_LOCK:
        out = list(_SYNCED)
        _SYNCED.clear()
    return out


def take_scalars() -> dict[str, float]:
    """Read the logged values of the synced step now (waits for its execution)."""
    return _read_values(take_synced())


def _emit(rec: StepRecord) -> None:
    publish("on_step", rec)
    for fn, every in list(_CALLBACKS):
        if rec.step % every == 0:
            try:
                fn(rec)
            except Exception as exc:
                _CALLBACKS[:] = [(f, e) for f, e in _CALLBACKS if f is not fn]
                warnings.warn(f"tpukit: on_step callback {getattr(fn, '__name__', fn)!r} raised "
                              f"{type(exc).__name__}: {exc}; it was removed.", TpukitWarning, stacklevel=2)


# ------------------------------------------------------------------ log / on_step

def log(**scalars: Any) -> None:
    """Record scalar values for the current step without forcing an execution.

    Tensors are read after the step's sync (in a step closure), so ``tpukit.log(loss=loss)``
    costs no extra graph execution. Floats and ints are recorded as they are.
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
    with _STATE_LOCK:
        _PENDING.extend(items)
    _ensure_hook()


def on_step(fn: Callable[[StepRecord], Any], every: int = 1) -> Callable[[], None]:
    """Call ``fn(record)`` after every ``every``-th step; returns a function that removes it."""
    if not callable(fn) or not isinstance(every, int) or every < 1:
        raise ValueError("on_step(fn, every=N) needs a callable and a positive int N.")
    _CALLBACKS.append((fn, every))
    _ensure_hook()

    def remove() -> None:
        _CALLBACKS[:] = [(f, e) for f, e in _CALLBACKS if f is not fn]
    return remove


# ------------------------------------------------------------------ track

def _batch_size(batch: Any) -> int | None:
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        for v in batch.values():
            n = _batch_size(v)
            if n:
                return n
    if isinstance(batch, (list, tuple)):
        for v in batch:
            n = _batch_size(v)
            if n:
                return n
    return None


def _to_device(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, dict):
        return type(batch)((k, _to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, Mapping):  # e.g. transformers' BatchEncoding
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class Tracker:
    """Iterable returned by :func:`track`; holds the step history of the loop."""

    def __init__(self, iterable: Iterable, total: int | None, device: Any, mesh: Any, progress: bool,
                 desc: str | None, guard: "StepGuard | None", dashboard: bool, batch_size: int | None):
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.device = device
        self.mesh = mesh
        self.progress = progress
        self.desc = desc
        self.guard = guard
        self.batch_size = batch_size
        self.history: list[StepRecord] = []
        self.dashboard = None
        self._want_dashboard = dashboard
        self.started: float | None = None
        self.finished: float | None = None

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this tracker wraps an iterable without a length")
        return self.total

    def _source(self) -> tuple[Iterator, bool]:
        """The batch iterator and whether it syncs by itself (torch_xla's device loader does)."""
        from torch.utils.data import DataLoader

        if isinstance(self.iterable, DataLoader) or self.mesh is not None:
            from . import parallel

            return iter(parallel.device_loader(self.iterable, mesh=self.mesh, device=self.device)), True
        return iter(self.iterable), False

    def __iter__(self) -> Iterator:
        if self.device is None:
            self.device = _xla.device()
        if self._want_dashboard and self.dashboard is None:
            self.dashboard = dashboard(batch_size=self.batch_size)
        source, self_syncing = self._source()
        bar = _progress_bar(self.total, self.desc) if self.progress else None
        with _STATE_LOCK:  # registered first, so the flush below is not a free-standing step
            _ACTIVE_TRACKERS.append(self)
        _xla.sync()  # flush work queued before the loop so step 1 measures only itself
        clock = _Clock()
        _ensure_hook()
        self.started = time.time()
        publish("on_track_start", self)
        completed = False
        try:
            # A step's logged values are read, and its record published, once the
            # *next* step has been traced and just before that step's sync: the
            # host never waits for the device while it could be tracing, and the
            # sync would have waited for the previous execution anyway.
            held: tuple[StepRecord, list] | None = None
            batch = next(source, _END)
            while batch is not _END:
                if not self_syncing:
                    batch = _to_device(batch, self.device)
                n = self.batch_size or _batch_size(batch)
                yield batch
                if held is not None:
                    self._record(*held, bar)
                    held = None
                if not self_syncing:
                    _xla.sync()
                batch = next(source, _END)  # torch_xla's device loader syncs the step here
                held = (clock.tick({}, n), take_synced())
            if held is not None:
                self._record(*held, bar)
            completed = True
        finally:
            with _STATE_LOCK:
                if self in _ACTIVE_TRACKERS:
                    _ACTIVE_TRACKERS.remove(self)
            self.finished = time.time()
            if bar is not None:
                bar.close()
            publish("on_track_end", self)
            if completed and self.dashboard is not None:
                self.dashboard.report()

    def _record(self, rec: StepRecord, values: list, bar: Any) -> None:
        if values:
            rec = dataclasses.replace(rec, scalars=_read_values(values))
        self.history.append(rec)
        _emit(rec)
        if bar is not None:
            bar.update(1)
            if rec.scalars:
                bar.set_postfix({k: f"{v:.4g}" for k, v in list(rec.scalars.items())[:3]}, refresh=False)
        if self.guard is not None:
            self.guard.check(rec)

    # -- summaries -------------------------------------------------------------
    def step_times(self) -> list[float]:
        """Wall seconds of each step."""
        return [r.wall for r in self.history]

    def summary(self) -> dict:
        """Steps, compiles, recompilations, median step time and the last scalars of the loop."""
        h = self.history
        steady = [r.wall for r in h if r.compiles == 0] or [r.wall for r in h]
        return {
            "steps": len(h),
            "compiles": sum(r.compiles for r in h),
            "recompilations": sum(len(r.recompilations) for r in h),
            "median_step_s": statistics.median(steady) if steady else math.nan,
            "total_s": (self.finished or time.time()) - (self.started or time.time()),
            "last_scalars": dict(h[-1].scalars) if h else {},
        }


_END = object()


def _progress_bar(total: int | None, desc: str | None):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but never let progress break training
        return None
    return tqdm(total=total, desc=desc or "steps", unit="step", leave=True)


def track(iterable: Iterable, *, total: int | None = None, device: Any = None, mesh: Any = None,
          progress: bool = True, desc: str | None = None, guard: "StepGuard | None" = None,
          dashboard: bool = False, batch_size: int | None = None) -> Tracker:
    """Wrap a data loader: batches arrive on the device, each step is synced once and recorded.

    Use it as a plain ``for`` loop. A ``torch.utils.data.DataLoader`` (or any
    loader when ``mesh`` is given) goes through torch_xla's parallel loader, which
    overlaps host-to-device copies with compute; other iterables are moved batch
    by batch. Progress shows with tqdm.auto unless ``progress=False``. ``guard``
    takes :func:`no_recompile_after`; ``dashboard=True`` opens the live dashboard
    and renders its static report at the end. The returned :class:`Tracker` keeps
    ``history`` (one :class:`StepRecord` per step) and ``summary()``.
    """
    return Tracker(iterable, total, device, mesh, progress, desc, guard, dashboard, batch_size)


# ------------------------------------------------------------------ guards

def _compile_lines(events: list[CompileEvent], compiled: int) -> str:
    if not events:
        why = "" if compiles.tracing_enabled() else (
            " (causes unknown: compile tracing is off; call tpukit.setup() before importing torch_xla)")
        return f"  {compiled} compile(s){why}"
    return "\n".join(f"  - {e.describe()}" for e in events)


class expect_compiles:
    """Context manager / decorator: raise RecompilationError if the block compiled more than ``max`` graphs.

    ``with tpukit.expect_compiles(max=0): ...`` syncs at the end of the block (so
    its pending graph counts) and lists each compile with its cause and user frame.
    """

    def __init__(self, max: int = 0, sync: bool = True):
        if not isinstance(max, int) or max < 0:
            raise ValueError("expect_compiles(max=N) needs a non-negative int N.")
        self.max = max
        self.sync = sync
        self.compiled = 0
        self.events: list[CompileEvent] = []

    def __enter__(self) -> "expect_compiles":
        if self.sync:
            _xla.sync()
        self._before = metrics.snapshot()
        self._events_before = compiles.event_count()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.sync and exc_type is None:
            _xla.sync()
        self.compiled = (metrics.snapshot() - self._before).compiles
        self.events = compiles.events_since(self._events_before)
        if exc_type is None and self.compiled > self.max:
            raise RecompilationError(
                f"expected at most {self.max} compile(s) but the block compiled {self.compiled}:\n"
                + _compile_lines(self.events, self.compiled))
        return False

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with expect_compiles(self.max, self.sync):
                return fn(*args, **kwargs)
        return wrapper


class StepGuard:
    """Raises RecompilationError when a step after warm-up compiles (see :func:`no_recompile_after`)."""

    def __init__(self, warmup_steps: int):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError("no_recompile_after(warmup_steps=k) needs a non-negative int k.")
        self.warmup_steps = warmup_steps
        self.seen = 0

    def check(self, rec: StepRecord) -> None:
        """Called by track() after each step."""
        self.seen += 1
        if self.seen > self.warmup_steps and rec.compiles:
            raise RecompilationError(
                f"step {rec.step} compiled {rec.compiles} graph(s) after {self.warmup_steps} warm-up step(s):\n"
                + _compile_lines(list(rec.compile_events), rec.compiles))


def no_recompile_after(warmup_steps: int = 2) -> StepGuard:
    """A guard for ``track(..., guard=...)``: any compile after ``warmup_steps`` steps raises."""
    return StepGuard(warmup_steps)


def dashboard(**options: Any) -> Any:
    """Open the live compile/execute dashboard (``tpukit.widgets.Dashboard``) and return it.

    Widgets in a notebook front end, a periodic text summary elsewhere.
    """
    from .widgets import Dashboard  # UI is imported only when asked for

    return Dashboard(**options)
