"""Guards that turn unexpected compiles into a :class:`~tpukit.RecompilationError`
naming each compile's cause and line: :class:`expect_compiles` for a block,
:func:`no_recompile_after` for a tracked loop."""

from __future__ import annotations

import functools
from typing import Callable

from . import _xla, compiles, metrics
from .compiles import CompileEvent
from .errors import RecompilationError
from .steps import StepRecord


def compile_lines(events: list[CompileEvent], compiled: int) -> str:
    """The compiles of a guarded block, one per line (or why causes are unknown)."""
    if not events:
        why = "" if compiles.tracing_enabled() else (
            " (causes unknown: compile tracing is off; call tpukit.setup() before importing torch_xla)")
        return f"  {compiled} compile(s){why}"
    return "\n".join(f"  - {compiles.describe(e)}" for e in events)


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
        self._mark = compiles.mark()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.sync and exc_type is None:
            _xla.sync()
        self.compiled = (metrics.snapshot() - self._before).compiles
        self.events = compiles.settled(since=self._mark)
        if exc_type is None and self.compiled > self.max:
            raise RecompilationError(
                f"expected at most {self.max} compile(s) but the block compiled {self.compiled}:\n"
                + compile_lines(self.events, self.compiled))
        return False

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with expect_compiles(self.max, self.sync):
                return fn(*args, **kwargs)
        return wrapper


class StepGuard:
    """Raises RecompilationError when a step after warm-up recompiles (see :func:`no_recompile_after`)."""

    def __init__(self, warmup_steps: int):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError("no_recompile_after(warmup_steps=k) needs a non-negative int k.")
        self.warmup_steps = warmup_steps
        self.seen = 0

    def check(self, rec: StepRecord) -> None:
        """Called by track() after each step."""
        self.seen += 1
        if self.seen <= self.warmup_steps or not rec.compiles:
            return
        alarms = list(rec.recompilations)
        if alarms:
            raise RecompilationError(
                f"step {rec.step} recompiled after {self.warmup_steps} warm-up step(s):\n"
                + compile_lines(alarms, len(alarms)))
        if not rec.compile_events:  # no causes recorded (tracing off): every compile counts
            raise RecompilationError(
                f"step {rec.step} compiled {rec.compiles} graph(s) after {self.warmup_steps} warm-up step(s):\n"
                + compile_lines([], rec.compiles))


def no_recompile_after(warmup_steps: int = 2) -> StepGuard:
    """A guard for ``track(..., guard=...)``: a recompilation (the same computation compiled
    again for a changed shape or value) after ``warmup_steps`` steps raises, naming its cause
    and line. New graphs (a new code path, the optimizer's state) and expected compiles (a
    declared bucket) never raise. Without compile tracing, any compile after warm-up raises."""
    return StepGuard(warmup_steps)
