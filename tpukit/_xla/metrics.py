"""torch_xla's counters and metrics (``torch_xla.debug.metrics``), as plain values.

A counter is an event count (``UncachedCompile``, ``CachedCompile``, ...). A
metric is ``(count, accumulator, samples)`` where each sample is
``(unix time, value)``: per-event timelines without parsing the text report.
``tpukit.metrics`` builds its snapshots and deltas from these calls.
"""

from __future__ import annotations

from typing import Any

from .loader import module


def _met() -> Any:
    return module("torch_xla.debug.metrics")


def metric_data(name: str) -> Any:
    """``(count, accumulator, samples)`` of one metric, or None if never recorded."""
    return _met().metric_data(name)


def counter_names() -> list[str]:
    """Names of torch_xla's counters (plain event counts)."""
    return list(_met().counter_names())


def fallback_ops() -> list[str]:
    """Names of the counters of ops torch_xla ran on the CPU for lack of a lowering (``aten::<op>``,
    ``.item()``'s ``aten::_local_scalar_dense`` among them): torch_xla's own list where it has one
    (a few times cheaper than every counter's name; the step clock reads it every step)."""
    listed = getattr(module("torch_xla")._XLAC, "_get_executed_fallback_ops", None)
    if listed is None:
        return [n for n in counter_names() if n.startswith("aten::")]
    return list(listed())


def counter_value(name: str) -> int | None:
    """Value of one counter, or None if it was never incremented."""
    return _met().counter_value(name)
