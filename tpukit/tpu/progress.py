"""Progress of long TPU work, pushed to listeners: what is compiling, for how long, what is done, the best
answer so far, and a time budget that ends the work with that answer.

A public call (``estimate``, ``largest_batch``, ``compare``) runs as one :class:`Job` (:func:`job`). The seam
(:func:`.ask.ask`) says when each compile starts and what it answered, the search says the best answer so
far; each change is one :class:`TpuProgress` record published to the listeners' ``on_tpu_progress``
(:mod:`tpukit.events`), and while a compile runs, again every second with its time, so that a view shows a
clock without a timer of its own. The view belongs to the UI (:class:`tpukit.widgets.progress.ProgressView`:
tqdm's bar in a terminal, its widget in a notebook); the job opens one when ``progress`` asks for it.

A call made inside a job (the advice's compiles inside an estimate, a search inside the advice) is part of
that job: one stream of records, one view, one budget. A budget (seconds) is checked before each compile,
and a compile still running when it runs out is stopped (its worker is killed; the next compile starts a
new one): :class:`~.compiler.worker.BudgetSpent` is raised to the search, which ends with the best answer
so far and says so.
"""

from __future__ import annotations

import contextvars
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

from .. import events
from .compiler.worker import BudgetSpent

STARTED, COMPILING, ANSWERED, ENDED = "started", "compiling", "answered", "ended"
TICK_S = 1.0  # while a compile runs, its record again this often


@dataclass(frozen=True)
class TpuProgress:
    """One moment of a job: what it is doing (``phase``, ``what``), what it has done, the best answer so far.

    ``job`` names the call (``"tpukit.largest_batch(step) for v5e-1"``); ``compiles`` counts the answers so
    far (a cached answer too); ``phase_s`` is the time in this phase (the compile's so far, or at ANSWERED its
    whole time); ``last`` is the last answer in words, ``best`` the best answer so far (a search's), ``note``
    what ended the job early (the budget), at ENDED.
    """

    job: str
    phase: str
    what: str = ""
    compiles: int = 0
    elapsed_s: float = 0.0
    phase_s: float = 0.0
    budget_s: float | None = None
    last: str | None = None
    best: str | None = None
    note: str = ""

    def line(self) -> str:
        """The record as one line: ``compiling batch 136 (12 s) · 4 compiles · best: ... · 31 s of 600 s``."""
        if self.phase == ENDED:
            head = f"done: {self.compiles} compile{'s' if self.compiles != 1 else ''}"
        elif self.phase == COMPILING:
            head = f"compiling {self.what} ({self.phase_s:.0f} s)"
        elif self.phase == ANSWERED:
            head = f"{self.what}: {self.last}" if self.last else f"compiled {self.what}"
        else:
            head = "tracing"
        parts = [head]
        if self.phase != ENDED and self.compiles:
            parts.append(f"{self.compiles} done")
        if self.best:
            parts.append(f"best: {self.best}")
        parts.append(f"{self.elapsed_s:.0f} s" + (f" of {self.budget_s:g} s" if self.budget_s else ""))
        if self.note:
            parts.append(self.note)
        return " · ".join(parts)


_CURRENT: contextvars.ContextVar["Job | None"] = contextvars.ContextVar("tpukit_tpu_job", default=None)


class Job:
    """One public call's TPU work: its records, its clock and its budget (see the module doc)."""

    def __init__(self, name: str, budget_s: float | None = None):
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget={budget_s!r}: give the seconds the work may take (a number above 0), or "
                             "None for no limit.")
        self.name, self.budget_s = name, budget_s
        self.started = time.monotonic()
        self.deadline = self.started + budget_s if budget_s else None
        self._lock = threading.Lock()
        self._state = TpuProgress(name, STARTED, budget_s=budget_s)
        self._phase_start = self.started
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.note = ""

    @property
    def state(self) -> TpuProgress:
        """The job's latest record."""
        with self._lock:
            return self._state

    def over(self) -> bool:
        """Whether the budget has run out."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def check(self, what: str) -> None:
        """Raise :class:`BudgetSpent` when the budget ran out before ``what`` could be compiled."""
        if self.over():
            raise BudgetSpent(f"the time budget of {self.budget_s:g} s ran out before {what} was compiled")

    def _publish(self, **changes: Any) -> None:
        now = time.monotonic()
        with self._lock:
            took = now - self._phase_start  # the phase that ends here (a compile's whole time, at its answer)
            if "phase" in changes:
                self._phase_start = now
            self._state = replace(self._state, elapsed_s=now - self.started,
                                  phase_s=took if changes.get("phase") == ANSWERED else now - self._phase_start,
                                  **changes)
            record = self._state
        events.call("on_tpu_progress", record)

    def compiling(self, what: str) -> None:
        """A compile of ``what`` starts (published now and every :data:`TICK_S` until it answers)."""
        self._publish(phase=COMPILING, what=what)
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="tpukit-tpu-progress", daemon=True)
            self._ticker.start()

    def answered(self, what: str, answer: str) -> None:
        """The compile of ``what`` answered ``answer`` (its time is the record's ``phase_s``)."""
        with self._lock:
            n = self._state.compiles + 1
        self._publish(phase=ANSWERED, what=what, compiles=n, last=answer)

    def best(self, text: str) -> None:
        """The best answer so far, in words (a search's: ``batch 64 fits (11.2 of 15.75 GB)``)."""
        with self._lock:
            self._state = replace(self._state, best=text)

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            if self.state.phase == COMPILING:
                now = time.monotonic()
                with self._lock:
                    self._state = replace(self._state, elapsed_s=now - self.started,
                                          phase_s=now - self._phase_start)
                    record = self._state
                events.call("on_tpu_progress", record)

    def end(self) -> None:
        """The job is over: its last record (with what ended it early, ``note``)."""
        self._stop.set()
        self._publish(phase=ENDED, what="", note=self.note)


def current() -> Job | None:
    """The job this thread's TPU work belongs to (None outside a public call)."""
    return _CURRENT.get()


@contextmanager
def job(name: str, budget: float | None = None, progress: bool = True) -> Iterator[Job]:
    """Run a public call's TPU work as one :class:`Job` named ``name``, ``budget`` seconds at most; with
    ``progress``, a view of it is open meanwhile (:func:`tpukit.events.open_ui` ``("progress")``). Inside
    another job, this is that job: its view and its budget (the outer call's)."""
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    new = Job(name, budget)
    view = None
    if progress:
        try:
            view = events.add_listener(events.open_ui("progress"))
        except Exception:  # no UI (a submodule imported alone): the records still reach listeners
            view = None
    token = _CURRENT.set(new)
    try:
        new._publish(phase=STARTED)
        yield new
    finally:
        _CURRENT.reset(token)
        try:
            new.end()
        finally:
            if view is not None:
                events.remove_listener(view)
