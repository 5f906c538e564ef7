"""Everything about compiles, in one package: where the evidence comes from (:mod:`.config`),
the one reader that turns it into events (:mod:`.reader`), the frames that triggered a
compile (:mod:`.frames`), the graphs XLA compiled (:mod:`.graphs`), why each compiled
(:mod:`.classify`, the alarm contract), the loop context a compile is judged in
(:mod:`.context`), and the record with its one line of text (:mod:`.event`).

Data flows one way: ``tpukit.setup()`` calls :func:`configure`; torch_xla and XLA write
the trace file and the dump; the reader's thread reads them, classifies, and publishes
each :class:`CompileEvent` through ``tpukit.events`` when it starts and once classified.
Consumers listen (``on_compile``) or ask for :func:`settled` events; nobody else reads.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from . import config
from .classify import EXPECTED, KINDS, NEW, RECOMPILATION
from .context import LoopContext, flush, own
from .event import EAGER_NOTE, FLUSH_CUT, FORCED_CAUSE, PENDING, CompileEvent, Mark, describe
from .frames import Frame, explained
from .reader import Reader, reader

__all__ = ["CompileEvent", "Mark", "Frame", "explained", "LoopContext", "own", "flush", "Reader", "describe", "reader", "configure", "trace_file",
           "tracing_enabled", "keep_hlo", "hlo_kept", "compiling_now", "mark", "settled", "event_count", "events_since",
           "NEW", "EXPECTED", "RECOMPILATION", "KINDS", "PENDING", "EAGER_NOTE", "FORCED_CAUSE", "FLUSH_CUT"]


def configure(runtime_imported: bool) -> tuple[str | None, list[str]]:
    """Turn compile tracing on before torch_xla starts (see :func:`.config.configure`) and start the
    reader; returns the trace file (None when off) and the problems to report."""
    trace, problems = config.configure(runtime_imported)
    if trace:
        reader()
    return trace, problems


def keep_hlo(owner: str, on: bool = True) -> None:
    """From now on each graph recorded keeps its HLO for ``owner`` (``on=False``: no longer for it), a
    consumer that compiles it again (:meth:`Reader.keep_protos`); nothing when tracing is off."""
    if tracing_enabled():
        reader().keep_protos(owner, on)


@contextmanager
def hlo_kept(owner: str | None) -> Iterator[None]:
    """Inside the block, each graph recorded keeps its HLO for ``owner`` (:func:`keep_hlo`); None: nothing
    is kept."""
    if owner is not None:
        keep_hlo(owner)
    try:
        yield
    finally:
        if owner is not None:
            keep_hlo(owner, False)


def trace_file() -> str | None:
    """The compile-trace file of this process, or None when tracing is off."""
    return config.trace_file()


def tracing_enabled() -> bool:
    """True when compile causes are being recorded (otherwise only counts are known)."""
    return reader().enabled


def compiling_now() -> CompileEvent | None:
    """The compilation in progress, with ``start`` telling since when; None when idle or untraced."""
    return reader().compiling_now()


def mark() -> Mark:
    """A point in the compile trace: the compiles started before this call lie before it."""
    return reader().mark()


def settled(upto: Mark | None = None, since: Mark | None = None, timeout: float = 3.0) -> list[CompileEvent]:
    """The compiles between two :func:`mark` points (``since`` included, ``upto``: now by default),
    each finished and classified: waits for the reader (at most ``timeout`` seconds) when needed."""
    return reader().settled(upto, timeout, since)


def started_between(since: Mark, upto: Mark) -> list[CompileEvent]:
    """The compiles between two marks as they are now (not waiting for any to be classified)."""
    return [e for e in reader().events if upto.before(e) and not since.before(e)]


def event_count() -> int:
    """How many compile events there are up to now, all of them classified (use with :func:`events_since`)."""
    return len(settled())


def events_since(index: int) -> list[CompileEvent]:
    """The compile events with ``index >= index`` up to now, classified."""
    return [e for e in settled() if e.index >= index]
