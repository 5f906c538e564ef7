"""The compile event: one record per graph compilation, and :func:`describe`, the one way
every surface (dashboard, report, ``%%xla``, guards, errors) writes it as a line.

Records are frozen. The reader publishes each compile at most twice through
``tpukit.events``: when it starts (``end`` None, ``kind`` "compile") and once it has
finished and been classified; ``index`` is the stable identity consumers key on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from . import classify
from .context import FLUSH
from .frames import Frame
from .graphs import Graph

class Mark(NamedTuple):
    """A point in the stream of compiles: the trace file's size and how many compiles tpukit saw
    itself (eager ops) at that moment. The compiles between two marks are a step's."""

    size: int = 0
    seen: int = 0

    def before(self, ev: "CompileEvent") -> bool:
        """True when ``ev`` started before this point."""
        return ev.seen < self.seen if ev.seen >= 0 else ev.offset < self.size


PENDING = "compile"  # kind of an event not classified yet (still compiling)
_LABELS = {classify.NEW: "new graph", classify.EXPECTED: "expected compile",
           classify.RECOMPILATION: "recompilation", PENDING: "compile"}
FORCED_CAUSE = "access tensor value"
FLUSH_CUT = "earlier-work flush"  # the cut of a sync tpukit made to run work queued before its own
# Eager mode's compiles are seen by tpukit.eager (torch_xla writes no compilation analysis for them).
EAGER_NOTE = "eager mode compiles op by op, each named at its line"


@dataclass(frozen=True)
class CompileEvent:
    """One graph compilation: when, why, which graph, and the code that triggered it."""

    index: int
    start: float
    end: float | None
    cause: str
    graph_hash: str
    inputs: int
    outputs: int
    frames: tuple[Frame, ...]
    recompilation: bool = False
    hint: str | None = None
    kind: str = PENDING          # "new graph", "expected", "recompilation" (see tpukit.classify)
    evidence: tuple[str, ...] = ()
    graph: Graph | None = None   # the compiled HLO, reduced (size, inputs, outputs)
    analysis: str = ""           # torch_xla's own "Compilation Analysis" text
    offset: int = -1             # where its block starts in the trace file (orders it among steps)
    seen: int = -1               # for a compile tpukit saw itself (eager op): its number among those
    loop: int | None = None      # the tracked loop it belongs to (its LoopContext.id), if known
    place: str | None = None     # the place in its loop's terms (LoopContext.place), else the user's line

    @property
    def graph_key(self) -> str:
        """The one key of its graph, as the target's follower sends it and the dashboard waits for it: torch_xla's
        graph hash, else the graph's structure, else the event's index."""
        return self.graph_hash or (self.graph.structure if self.graph is not None else "") or str(self.index)

    @property
    def compiling(self) -> bool:
        """True while the compilation has not finished."""
        return self.end is None

    @property
    def duration(self) -> float | None:
        """Seconds the compilation took, or None while it runs."""
        return None if self.end is None else max(0.0, self.end - self.start)

    @property
    def forced(self) -> bool:
        """True when a tensor value was read mid-step (``.item()``, ``print``, ``.cpu()``)."""
        return FORCED_CAUSE in self.cause

    @property
    def user_frames(self) -> tuple[Frame, ...]:
        """Frames outside torch, torch_xla, tpukit and IPython, innermost first."""
        return tuple(f for f in self.frames if not f.is_library)

    @property
    def user_frame(self) -> Frame | None:
        """The innermost user frame: where the user should look. When the trace holds only
        library frames (torch_xla keeps the innermost few), the innermost one outside
        torch, torch_xla and tpukit, e.g. a line inside transformers."""
        uf = self.user_frames
        if uf:
            return uf[0]
        return next((f for f in self.frames if not f.is_machinery), None)

    @property
    def line(self) -> str:
        """The user's line: 'cell [7] line 5' or 'train.py:12 in step', or 'unknown location'."""
        f = self.user_frame
        return str(f) if f else "unknown location"

    @property
    def where(self) -> str:
        """Where it happened, as every surface shows it: the loop's own place when its loop names one
        ("the Trainer's training step (trainer.train() at cell [5] line 3)"), else :attr:`line`."""
        return self.place or self.line

    @property
    def read_frame(self) -> Frame | None:
        """For a forced read inside an installed library (transformers checking a mask's values):
        the library's line that read the value, the innermost frame outside torch, torch_xla and
        tpukit. None when the read is on the user's own line (``where``) or the compile not forced."""
        if not self.forced:
            return None
        f = next((f for f in self.frames if not f.is_machinery), None)
        return f if f is not None and f.is_library and f != self.user_frame else None

    @property
    def cut(self) -> str:
        """What cut the graph: "step" (a sync), "loader sync" (torch_xla's device loader),
        "forced read", "torch_xla.compile" (a compiled function, or the flush before it),
        "dynamo" (torch.compile's openxla backend), "eager op" (eager mode) or "earlier-work
        flush" (the sync a tracked loop or ``%%xla`` makes first, to run work queued before it:
        :func:`~tpukit.compiles.context.flush`)."""
        cause = self.cause.lower()
        if self.forced:
            return "forced read"
        if any(f.function == FLUSH for f in self.frames):
            return FLUSH_CUT
        if "dynamo" in cause:
            return "dynamo input sync" if "sync" in cause else "dynamo"
        if "torch_xla.compile" in cause:
            return "torch_xla.compile flush" if "prior" in cause else "torch_xla.compile"
        if "eager" in cause:
            return "eager op"
        if any("parallel_loader" in f.filename for f in self.frames):
            return "loader sync"
        return "step"

    @property
    def name(self) -> str:
        """A name a person recognizes: ``step graph at cell [4] line 9 (312 ops, 12 -> 9)``; a read
        in a library is named at its line, then the user's: ``forced read graph at
        transformers/masking_utils.py:369 in _ignore_bidirectional_mask_sdpa, called from cell [4] line 9``."""
        size = f" ({self.graph.size})" if self.graph is not None else f" ({self.inputs} -> {self.outputs})"
        read = self.read_frame
        at = f"{read}, called from {self.where}" if read is not None else self.where
        return f"{self.cause if self.eager else self.cut + ' graph'} at {at}{size}"

    @property
    def eager(self) -> bool:
        """True for one op compiled by eager mode (seen by tpukit.eager, no graph hash or HLO)."""
        return self.cause.startswith("eager op ")

    @property
    def label(self) -> str:
        """"new graph", "expected compile", "recompilation" or "compile" (not classified yet)."""
        return _LABELS.get(self.kind, self.kind)

    def describe(self) -> str:
        """One line: what compiled, for how long, what kind, the evidence and the hint; hash last."""
        return describe(self)

    @property
    def settled(self) -> bool:
        """True once the compile has finished and been classified (its final version)."""
        return self.kind != PENDING


def describe(ev: CompileEvent, where: str | None = None, trusted: bool = True, hint: bool = True,
             compact: bool = False, step: int | str | None = None) -> str:
    """``recompilation: step graph at cell [4] line 9 (12 ops, 2 -> 1), 0.3 s: input_ids: (8, 16) ->
    (8, 24). Bucket or pad ... [graph 1a2b3c4d]``: the label, the name (``where`` replaces its place),
    the evidence and the hint, the hash last. Untrusted (a place shared by unrelated code): only
    "compile" and the name. ``compact``: evidence without the graph size the name already shows.
    ``step`` (a dashboard's list): ``recompilation at step 3: ...`` in place of the duration (step 0:
    ``before step 1``, work a loop flushed as it began), and torch_xla's cause as the evidence of a
    recompilation that has none."""
    name = ev.name if where is None else ev.name.replace(f" at {ev.where}", f" at {where}", 1)
    label = ev.label if trusted else "compile"
    if step is None:
        text = f"{label}: {name}, {'still compiling' if ev.end is None else f'{ev.duration:.1f} s'}"
    else:
        text = f"{label} {'before step 1' if step == 0 else f'at step {step}'}: {name}"
    size = f" ({ev.graph.size})" if ev.graph is not None and compact else ""
    evidence = [e[:-len(size)] if size and e.endswith(size) else e for e in ev.evidence] if trusted else []
    if not evidence and step is not None and trusted and ev.kind == classify.RECOMPILATION:
        evidence = [ev.cause]
    if evidence:
        text += ": " + "; ".join(evidence)
    if trusted and hint and ev.hint:
        text += f". {ev.hint[0].upper()}{ev.hint[1:]}"
    return text + ("" if ev.eager or (step is not None and not ev.graph_hash) else f" [graph {ev.graph_hash[:8] or '?'}]")
