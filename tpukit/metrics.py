"""Snapshots of torch_xla's counters and metrics, and the Delta between two.

Read through torch_xla's metrics API (``metric_data`` / ``counter_value``), never
by parsing the text report. ``later - earlier`` gives a :class:`Delta` whose
``str()`` is one readable line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

from . import _xla
from ._text import plural

NS = 1e-9
# Counters named aten::* are ops torch_xla ran on the CPU because it has no XLA
# lowering for them. _local_scalar_dense is the exception: it is `.item()`, a
# device-to-host read, reported separately.
ITEM_COUNTER = "aten::_local_scalar_dense"


def _metric(name: str) -> tuple[int, float]:
    data = _xla.metric_data(name)
    if not data:
        return 0, 0.0
    return int(data[0]), float(data[1]) * NS


def _counter(name: str) -> int:
    return int(_xla.counter_value(name) or 0)


@dataclass(frozen=True)
class Counts:
    """The counters a Snapshot holds and a Delta differences (times in seconds)."""

    compiles: int = 0  # uncached: a new graph was compiled (eager mode's per-op compiles included)
    eager_compiles: int = 0  # of those, single ops compiled by eager mode (tpukit.eager names their lines)
    cached_compiles: int = 0  # graph found in the in-memory cache
    compile_time: float = 0.0
    executions: int = 0
    execute_time: float = 0.0
    to_device: int = 0
    to_device_time: float = 0.0
    to_host: int = 0
    to_host_time: float = 0.0
    syncs: int = 0
    item_reads: int = 0
    cache_hits: int = 0  # persistent cache
    cache_misses: int = 0
    fallbacks: dict = field(default_factory=dict)  # {"aten::nonzero": 3}
    memory: dict | None = None  # {"bytes_used", "bytes_limit"} where supported


_NUMERIC = tuple(f.name for f in fields(Counts) if f.name not in ("fallbacks", "memory"))


@dataclass(frozen=True)
class Snapshot(Counts):
    """The runtime's cumulative counters at one moment."""

    time: float = 0.0

    def __sub__(self, earlier: "Snapshot") -> "Delta":
        if not isinstance(earlier, Snapshot):
            return NotImplemented
        values = {name: getattr(self, name) - getattr(earlier, name) for name in _NUMERIC}
        fb = {k: v - earlier.fallbacks.get(k, 0) for k, v in self.fallbacks.items()}
        return Delta(seconds=self.time - earlier.time, fallbacks={k: v for k, v in fb.items() if v > 0},
                     memory=self.memory, **values)


@dataclass(frozen=True)
class Delta(Counts):
    """What happened between two snapshots; ``str()`` is a one-line summary."""

    seconds: float = 0.0

    def __str__(self) -> str:
        return summary_line(self)

    def _repr_pretty_(self, p, cycle):  # IPython shows the readable line
        p.text(str(self))


def summary_line(d: Delta) -> str:
    """``2 compiles (1.4 s) · 5 executions (0.3 s) · 1 device->host transfer · CPU fallbacks: aten::nonzero x3``."""
    eager = f", {plural(d.eager_compiles, 'eager-mode op')}" if d.eager_compiles else ""
    parts = [f"{plural(d.compiles, 'compile')} ({d.compile_time:.1f} s{eager})"]
    if d.cached_compiles:
        parts.append(f"{d.cached_compiles} cached")
    parts.append(f"{plural(d.executions, 'execution')} ({d.execute_time:.1f} s)")
    if d.to_device:
        parts.append(plural(d.to_device, "host->device transfer"))
    if d.to_host:
        parts.append(plural(d.to_host, "device->host transfer"))
    if d.item_reads:
        parts.append(f"{d.item_reads} .item() read" + ("" if d.item_reads == 1 else "s"))
    if d.cache_hits or d.cache_misses:
        parts.append(f"persistent cache {d.cache_hits} hit / {d.cache_misses} miss")
    if d.fallbacks:
        parts.append("CPU fallbacks: " + ", ".join(f"{k} x{v}" for k, v in sorted(d.fallbacks.items())))
    return " · ".join(parts)


def fallback_counters() -> dict:
    """Every ``aten::`` CPU-fallback counter and its count (``.item()`` excluded)."""
    return {n: _counter(n) for n in _xla.fallback_ops() if n != ITEM_COUNTER}


_EXECUTE_METRICS = ("ExecuteTime", "ExecuteReplicatedTime", "EagerOpExecuteTime")  # lazy, SPMD, eager


def snapshot(memory: bool = False) -> Snapshot:
    """Read the runtime's counters now; ``memory=True`` adds device memory where supported."""
    return snapshot_and_executions(memory)[0]


def snapshot_and_executions(memory: bool = False) -> tuple[Snapshot, list[tuple[float, float]]]:
    """The snapshot and the recent execution samples (see :func:`execute_samples`) from one read
    of the execution metrics: the step clock needs both every step."""
    c_n, c_t = _metric("CompileTime")
    ec_n, ec_t = _metric("EagerOpCompileTime")  # eager mode compiles each new op by itself
    execs = [_xla.metric_data(name) for name in _EXECUTE_METRICS]
    h2d_n, h2d_t = _metric("TransferToDeviceTime")
    d2h_n, d2h_t = _metric("TransferFromDeviceTime")
    snap = Snapshot(
        time=time.time(),
        compiles=_counter("UncachedCompile"),
        eager_compiles=ec_n,
        cached_compiles=_counter("CachedCompile"),
        compile_time=c_t + ec_t,
        executions=sum(int(d[0]) for d in execs if d),
        execute_time=sum(float(d[1]) for d in execs if d) * NS,
        to_device=h2d_n,
        to_device_time=h2d_t,
        to_host=d2h_n,
        to_host_time=d2h_t,
        syncs=_counter("MarkStep"),
        item_reads=_counter(ITEM_COUNTER),
        cache_hits=_counter("PersistentCacheHit"),
        cache_misses=_counter("PersistentCacheMiss"),
        fallbacks=fallback_counters(),
        memory=_xla.memory_info() if memory else None,
    )
    return snap, _samples(execs)


def _samples(metric_datas: list) -> list[tuple[float, float]]:
    return [(float(t), float(v) * NS) for d in metric_datas if d for t, v in d[2]]


def compile_samples(metric: str = "CompileTime") -> list[tuple[float, float]]:
    """``[(end_unix_time, seconds), ...]`` of recent compilations (torch_xla keeps a bounded window);
    eager mode's per-op ones with ``metric="EagerOpCompileTime"``."""
    data = _xla.metric_data(metric)
    if not data:
        return []
    return [(float(t), float(v) * NS) for t, v in data[2]]


def execute_samples() -> list[tuple[float, float]]:
    """``[(end_unix_time, seconds), ...]`` of recent executions, dispatch to completion (they overlap);
    SPMD executions are recorded as replicated ones, eager mode's per op."""
    return _samples([_xla.metric_data(name) for name in _EXECUTE_METRICS])


def table(d: Snapshot | Delta, full: bool = False) -> list[tuple[str, str]]:
    """Readable (name, value) rows of a snapshot or delta, for the magics and reporters."""
    rows = [
        ("compiles", f"{d.compiles} ({d.compile_time:.2f} s)"),
        ("cached compiles", str(d.cached_compiles)),
        ("executions", f"{d.executions} ({d.execute_time:.2f} s)"),
        ("host->device transfers", f"{d.to_device} ({d.to_device_time:.3f} s)"),
        ("device->host transfers", f"{d.to_host} ({d.to_host_time:.3f} s)"),
        (".item() reads", str(d.item_reads)),
        ("syncs (MarkStep)", str(d.syncs)),
    ]
    if full or d.eager_compiles:  # counted per op; their events come from tpukit.eager
        rows.insert(1, ("of them eager-mode ops", str(d.eager_compiles)))
    if full or d.cache_hits or d.cache_misses:
        rows.append(("persistent cache hits / misses", f"{d.cache_hits} / {d.cache_misses}"))
    for name, n in sorted(d.fallbacks.items()):
        rows.append((f"CPU fallback {name}", str(n)))
    if not d.fallbacks:
        rows.append(("CPU fallbacks", "none"))
    if d.memory:
        rows.append(("device memory", f"{d.memory['bytes_used'] / 2**20:.0f} MiB of {d.memory['bytes_limit'] / 2**20:.0f} MiB"))
    elif full:
        rows.append(("device memory", "not reported by this device"))
    return rows
