"""What the renderers draw: frozen records of one moment of a dashboard.

:class:`View` holds the numbers, the now line and the compile rows; :class:`Timeline`
the per-step columns for the plot. A :class:`Compile` row refers to the compile event
the reader published (it does not copy it): the step it belongs to and when it was
seen are the dashboard's own. :func:`now_line` is the one-line status. Pure: no UI
library, no torch_xla, no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Compile:
    """One classified compile, as listed: a recompilation (an alert), a new graph or an expected compile.

    ``event`` is the reader's own final :class:`~tpukit.compiles.CompileEvent` (finished and classified);
    every other field but ``step`` and ``time`` is read from it.
    """

    event: Any
    step: int | None            # the step it belongs to (guessed until its step record tells)
    time: float                 # when the dashboard saw it classified

    @property
    def index(self) -> int:
        """The event's stable identity."""
        return self.event.index

    @property
    def kind(self) -> str:
        """"recompilation", "new graph" or "expected" (``tpukit.compiles.KINDS``)."""
        return self.event.kind

    @property
    def label(self) -> str:
        """"recompilation", "new graph" or "expected compile"."""
        return self.event.label

    @property
    def name(self) -> str:
        """Where the graph was cut and its size: ``step graph at cell [7] line 5 (3 -> 2)``."""
        return self.event.name

    @property
    def evidence(self) -> tuple[str, ...]:
        """What changed (or what is new), as the classifier found it."""
        return tuple(self.event.evidence or ())

    @property
    def hint(self) -> str:
        """What to do about it ("" when nothing)."""
        return self.event.hint or ""

    @property
    def graph_hash(self) -> str:
        """The graph's hash ("" for an eager-mode op)."""
        return self.event.graph_hash

    @property
    def where(self) -> str:
        """The user's line: ``cell [7] line 5`` or ``train.py:12 in step``."""
        return self.event.where

    @property
    def cause(self) -> str:
        """torch_xla's own words for why it compiled."""
        return self.event.cause

    @property
    def duration(self) -> float | None:
        """Seconds the compilation took."""
        return self.event.duration


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
    alerts: tuple[Compile, ...]  # recompilations only, latest first
    alerts_total: int
    note: str | None = None
    new_graphs: int = 0
    expected: int = 0
    graphs: tuple[Compile, ...] = ()  # new graphs and expected compiles, latest first
    verdict: Any = None          # tpukit.verdict.Verdict of the tracked loop, None before/without one
    settled_after: int | None = None
    tracked: bool = False        # a tracked loop fed this dashboard (warm-up and verdict are known)
    loop_done: bool = False      # ... and it has ended
    eager_compiles: int = 0      # of ``compiles``: eager mode's per-op compiles (each also an event)
    eager_places: tuple = ()     # their ops and lines, first seen first: ("linear at train.py:12 in step", ...)
    tpu: tuple = ()              # (graph name, TpuEstimate) per distinct graph, first compiled first
    step_compiles: int | None = None  # of ``compiles``: those the step records count (None: not known)
    compiles_before: int = 0     # of ``compiles``: those of the work tracked loops flushed as they began
    closed: bool = False         # the dashboard was closed: the step records are all in
    stopped: str | None = None   # "stopped by RuntimeError at step 1": the tracked loop ended by an exception
    rate: Any = None             # tpukit.verdict.Rate of the latest steps with tokens or FLOPs (None: none had)


@dataclass(frozen=True)
class Timeline:
    """Per-step columns for the plot (copies, safe to use outside the lock).

    The bars split each step's wall time: ``compile``, ``input`` (waiting for the
    next batch), ``tracing`` (host time in the loop body and the sync) and ``device``
    (host blocked on the device). Steps outside ``track()`` have no input/tracing
    measurement: their host time goes to ``tracing`` and their execution time to ``device``.
    """

    steps: list
    compile: list
    input: list
    tracing: list
    device: list
    scalars: dict = field(default_factory=dict)  # name -> (steps, values)
    version: int = 0
    x_end: float | None = None  # the last step the loop will have (the x axis stops there)


def now_line(compiling: Any, now: float, busy_step: int | None) -> tuple[str, str]:
    """The one-line status: ('compiling step graph at cell [7] line 5 (3 -> 2) for 12 s', 'compiling').

    ``compiling``: the started compile event still waiting for its finished version (or None).
    """
    if compiling is not None:
        secs = max(0.0, now - compiling.start)
        return f"compiling {compiling.name} for {secs:.0f} s", "compiling"
    if busy_step is not None:
        return f"executing step {busy_step}", "executing"
    return "idle", "idle"
