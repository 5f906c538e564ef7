"""Compile events read from torch_xla's compile-trace file, mapped to notebook cells.

With ``PT_XLA_DEBUG_LEVEL=1`` and ``PT_XLA_DEBUG_FILE`` set before torch_xla starts
(``tpukit.setup()`` does that), torch_xla appends a "Compilation Analysis" block
when a compilation starts and a "Post Compilation Analysis" block when it ends.
:class:`CompileLog` tails that file incrementally (only new bytes are read) and
turns the blocks into :class:`CompileEvent` records. Each compile is matched
with the HLO XLA dumped for it (:mod:`tpukit.graphs`) and classified by the
alarm contract of :mod:`tpukit.classify`: a new graph, an expected compile, or a
recompilation, with the evidence and a hint for its cause.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass

from . import _ipython, _xla, classify, events, graphs, metrics, runtime
from .frames import Frame, parse_block
from .graphs import Graph

PENDING = "compile"  # kind of an event not classified yet (still compiling)
_LABELS = {classify.NEW: "new graph", classify.EXPECTED: "expected compile",
           classify.RECOMPILATION: "recompilation", PENDING: "compile"}
FORCED_CAUSE = "access tensor value"
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
    def where(self) -> str:
        """'cell [7] line 5' or 'train.py:12 in step', or 'unknown location'."""
        f = self.user_frame
        return str(f) if f else "unknown location"

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
        "dynamo" (torch.compile's openxla backend) or "eager op" (eager mode)."""
        cause = self.cause.lower()
        if self.forced:
            return "forced read"
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
        took = "still compiling" if self.end is None else f"{self.duration:.1f} s"
        text = f"{self.label}: {self.name}, {took}"
        if self.evidence:
            text += ": " + "; ".join(self.evidence)
        if self.hint:
            text += f". {self.hint[0].upper()}{self.hint[1:]}"
        return text + ("" if self.eager else f" [graph {self.graph_hash[:8]}]")


# ----------------------------------------------------------------- cell mapping

def _with_cell(frame: Frame) -> Frame:
    label = _ipython.cell_label(frame.filename)
    return dataclasses.replace(frame, cell=label) if label else frame


class CompileLog:
    """Incremental reader of one compile-trace file; thread-safe and cheap to poll."""

    def __init__(self, path: str | None, hlo_dir: str | None = None):
        self.path = path
        self.hlo = graphs.HloDump(hlo_dir)
        self.classifier = classify.Classifier()
        self.inputs: classify.Signature | None = None  # the batch of the step being traced
        self.declared: frozenset = frozenset()         # shapes the loop declared (buckets)
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = ""
        self._block: list[str] | None = None
        self._events: list[CompileEvent] = []
        self._in_post = False
        self._event_inputs: dict[int, classify.Signature | None] = {}
        self._graph_of: dict[int, Graph] = {}
        self._next_graph = 0  # first graph of self.hlo.graphs not matched to an event yet
        self._ended_at: dict[int, float] = {}
        self._unsettled: set[int] = set()  # indices of events not classified yet
        self._lazy: dict[int, int] = {}  # event index -> its rank among traced compiles (CompileTime's count)

    @property
    def enabled(self) -> bool:
        """True when there is a trace file to read (causes and frames available)."""
        return bool(self.path)

    @property
    def events(self) -> list[CompileEvent]:
        """All events read so far (copy)."""
        with self._lock:
            return list(self._events)

    def poll(self) -> list[CompileEvent]:
        """Read what was appended since the last poll; return new or updated events."""
        if not self.path:
            return []
        with self._lock:
            changed = self._read_new()
        return self._notify(changed)

    def _read_new(self) -> list[CompileEvent]:
        changed: list[CompileEvent] = []
        now = time.time()
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return changed
        if size < self._offset:  # file truncated / replaced: start over
            self._offset, self._partial, self._block = 0, "", None
        if size > self._offset:
            with open(self.path, "r", errors="replace") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
            lines = (self._partial + chunk).split("\n")
            self._partial = lines.pop()  # incomplete last line
            for line in lines:
                self._feed(line, now, changed)
        self._end_by_count(now, changed)
        ended = [e for e in changed if e.end is not None]
        if ended:
            self._fix_times(ended, changed)
        self._classify_ended(now, changed)
        return changed

    @staticmethod
    def _notify(changed: list[CompileEvent]) -> list[CompileEvent]:
        for ev in changed:  # called outside the lock: listeners may poll again
            events.call("on_compile", ev)
        return changed

    def _pending(self) -> list[CompileEvent]:
        """Events not classified yet (running, or ended and waiting for their HLO), oldest first."""
        return [self._events[i] for i in sorted(self._unsettled)]

    def _end_by_count(self, now: float, changed: list[CompileEvent]) -> None:
        """End events the runtime counts as compiled even though no "Post Compilation" block
        reached the file (under SPMD torch_xla writes that block to stderr instead)."""
        running = [e for e in self._pending() if e.end is None]
        if not running:
            return
        done = _compile_count()
        for e in running:
            if self._lazy[e.index] < done:
                self._events[e.index] = ev = dataclasses.replace(e, end=now)
                changed.append(ev)

    def _feed(self, line: str, now: float, changed: list) -> None:
        if line.startswith("Compilation Analysis:"):
            self._in_post = False
            body = line[len("Compilation Analysis:"):]
            if self._block is None:
                self._block = [body]
            else:
                self._block.append(body)
                if body.strip().startswith("===") and len(self._block) > 2:
                    changed.append(self._start_event(self._block, now))
                    self._block = None
        elif line.startswith("Post Compilation Analysis:"):
            # The post block is written when the compilation has finished.
            if not self._in_post:
                self._in_post = True
                for e in self._pending():
                    if e.end is None:
                        self._events[e.index] = ev = dataclasses.replace(e, end=now)
                        changed.append(ev)
                        break
        else:
            self._in_post = False

    def _fix_times(self, ended: list[CompileEvent], changed: list[CompileEvent]) -> None:
        """Replace poll-time estimates by the runtime's own compile timings (newest samples)."""
        samples = _compile_samples()
        if len(samples) < len(ended):
            return
        for ev, (end, seconds) in zip(ended, samples[-len(ended):]):
            fixed = dataclasses.replace(ev, start=end - seconds, end=end)
            self._events[ev.index] = fixed
            changed[changed.index(ev)] = fixed
            self._ended_at[ev.index] = time.time()

    def _start_event(self, block: list[str], now: float) -> CompileEvent:
        fields = parse_block(block)
        frames = tuple(_with_cell(f) for f in fields["frames"])
        ev = CompileEvent(index=len(self._events), start=now, end=None, cause=fields["cause"],
                          graph_hash=fields["graph_hash"], inputs=fields["inputs"],
                          outputs=fields["outputs"], frames=frames, analysis="\n".join(block).strip())
        self._lazy[ev.index] = len(self._lazy)
        self._events.append(ev)
        self._unsettled.add(ev.index)
        self._event_inputs[ev.index] = self.inputs
        return ev

    def add_seen(self, cause: str, frames: tuple[Frame, ...], counts: tuple[int, int], place: tuple,
                 inputs: classify.Signature, start: float, end: float) -> CompileEvent:
        """Publish a finished compile that tpukit saw itself (an eager-mode op), classified at once at
        ``place`` with ``inputs`` (the op's tensors) as the batch; numbered after the traced ones so far."""
        with self._lock:
            found = self.classifier.classify(place, None, inputs, counts, self.declared)
            ev = CompileEvent(index=len(self._events), start=start, end=end, cause=cause, graph_hash="",
                              inputs=counts[0], outputs=counts[1], frames=frames, kind=found.kind,
                              evidence=found.evidence, hint=found.hint,
                              recompilation=found.kind == classify.RECOMPILATION)
            self._events.append(ev)
        return self._notify([ev])[0]

    def _match_graphs(self) -> None:
        """Pair events with the HLO modules XLA dumped, in compile order, checking the
        (inputs, outputs) counts so a module without an event never shifts the rest."""
        if self.hlo.poll() and len(self.hlo.graphs) == 1:
            runtime.release_hlo_dump_flags()  # XLA read them at its first compile
        pool = self.hlo.graphs
        for ev in self._pending():
            if ev.index in self._graph_of:
                continue
            for k in range(self._next_graph, len(pool)):
                g = pool[k]
                if (len(g.inputs), len(g.outputs)) == (ev.inputs, ev.outputs):
                    self._graph_of[ev.index] = g
                    self._next_graph = k + 1
                    break
            else:
                return

    def _classify_ended(self, now: float, changed: list[CompileEvent]) -> None:
        """Classify events whose compilation ended (with their graph once XLA dumped it)."""
        if not any(e.end is not None for e in self._pending()):
            return
        self._match_graphs()
        for ev in self._pending():
            i = ev.index
            if ev.end is None:
                continue
            graph = self._graph_of.get(i)
            if graph is None and self.hlo.path and now - self._ended_at.setdefault(i, now) < 2.0:
                continue  # its HLO file may still be on its way
            user, read = ev.user_frames, ev.read_frame
            place = (ev.cut,) + (tuple((f.filename, f.line) for f in (user or ev.frames)) or ("<unknown>",))
            place += ((read.filename, read.line),) if read is not None else ()
            found = self.classifier.classify(place, graph, self._event_inputs.pop(i, None),
                                             (ev.inputs, ev.outputs), self.declared)
            hint = classify.forced_hint(read) if ev.forced and found.kind == classify.NEW else found.hint
            new = dataclasses.replace(ev, kind=found.kind, evidence=found.evidence, hint=hint, graph=graph,
                                      recompilation=found.kind == classify.RECOMPILATION)
            self._events[i] = new
            self._unsettled.discard(i)
            for k, c in enumerate(changed):
                if c.index == i:
                    changed[k] = new
                    break
            else:
                changed.append(new)

    def compiling_now(self) -> CompileEvent | None:
        """The compilation running right now (after a poll), or None."""
        self.poll()
        with self._lock:
            for ev in reversed(self._events):
                if ev.end is None:
                    return ev
                break
        return None


def _compile_count() -> int:
    data = _xla.metric_data("CompileTime") if _xla.is_imported() else None
    return int(data[0]) if data else 0


def _compile_samples() -> list[tuple[float, float]]:
    return metrics.compile_samples()


_LOGS: dict[str, CompileLog] = {}
_LOGS_LOCK = threading.Lock()


def log() -> CompileLog:
    """The process-wide CompileLog of the trace file ``setup()`` configured (disabled if none)."""
    path = runtime.trace_file()
    with _LOGS_LOCK:
        key = path or ""
        if key not in _LOGS:
            _LOGS[key] = CompileLog(path, runtime.hlo_dir())
        return _LOGS[key]


def tracing_enabled() -> bool:
    """True when compile causes are being recorded (otherwise only counts are known)."""
    return log().enabled


def compiling_now() -> CompileEvent | None:
    """The compilation in progress, with ``start`` telling since when; None when idle or untraced."""
    return log().compiling_now()


def events_since(index: int) -> list[CompileEvent]:
    """Compile events with ``index >= index`` (after polling the trace file)."""
    lg = log()
    lg.poll()
    return [e for e in lg.events if e.index >= index]


def current(events: tuple[CompileEvent, ...], wait: float = 0.0) -> tuple[CompileEvent, ...]:
    """The latest version of each event (classified since it was first read), waiting up to
    ``wait`` seconds for ended compiles whose classification is still pending."""
    if not events:
        return events
    lg = log()
    deadline = time.time() + wait
    while True:
        lg.poll()
        latest = lg.events
        out = tuple(latest[e.index] if e.index < len(latest) else e for e in events)
        if not any(e.kind == PENDING and e.end is not None for e in out) or time.time() >= deadline:
            return out
        time.sleep(0.05)


def event_count() -> int:
    """Number of compile events read so far (after polling); use with ``events_since``."""
    lg = log()
    lg.poll()
    return len(lg.events)


def note_inputs(batch_signature: classify.Signature | None) -> None:
    """Tell the classifier the batch of the step being traced (``((path, shape, dtype), ...)``)."""
    log().inputs = batch_signature


def declare_shapes(shapes) -> None:
    """Shapes (tuples) or lengths (ints) the running loop expects to compile for: no alarm for those."""
    log().declared = frozenset(tuple(s) if isinstance(s, (tuple, list)) else int(s) for s in (shapes or ()))
