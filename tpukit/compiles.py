"""Compile events read from torch_xla's compile-trace file, mapped to notebook cells.

With ``PT_XLA_DEBUG_LEVEL=1`` and ``PT_XLA_DEBUG_FILE`` set before torch_xla starts
(``tpukit.setup()`` does that), torch_xla appends a "Compilation Analysis" block
when a compilation starts and a "Post Compilation Analysis" block when it ends.
:class:`CompileLog` tails that file incrementally (only new bytes are read) and
turns the blocks into :class:`CompileEvent` records. When the same user code
location produces yet another graph after warm-up, the event is flagged as a
recompilation with a one-sentence hint.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass

from . import _ipython, _xla, events, metrics, runtime

# Graphs per code location that count as warm-up: a training step compiles once
# before the optimizer has state and once more for the steady step (on the next
# sync). A location's third graph, or a second one after a steady stretch, is a
# recompilation.
WARMUP_GRAPHS = 2
FORCED_CAUSE = "access tensor value"
_FRAME_RE = re.compile(r"^\s*(?P<func>.+?) \((?P<file>.*):(?P<line>\d+)\)\s*$")
# Installed packages (torch, torch_xla, IPython, decorator, ...) and tpukit itself
# are machinery; the user's code is everything else.
_HIDDEN_PARTS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
                 os.sep + "torch" + os.sep, os.sep + "torch_xla" + os.sep, os.sep + "IPython" + os.sep,
                 os.sep + "ipykernel" + os.sep)
_MACHINERY_PARTS = _HIDDEN_PARTS[2:]
_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIB_ROOTS = (os.path.join(_SRC, "tpukit") + os.sep, os.path.join(_SRC, "widgets") + os.sep)


@dataclass(frozen=True)
class Frame:
    """One Python frame of the stack that triggered a compilation."""

    function: str
    filename: str
    line: int
    cell: str | None = None  # "[7]" when the file is a notebook cell

    @property
    def is_library(self) -> bool:
        """True for frames inside torch, torch_xla, tpukit or IPython's machinery."""
        if self.cell:
            return False
        f = self.filename
        if f.startswith("<") and "ipython-input" not in f:
            return True
        return any(p in f for p in _HIDDEN_PARTS) or f.startswith(_LIB_ROOTS)

    @property
    def is_machinery(self) -> bool:
        """True for frames inside torch, torch_xla, tpukit or IPython (never worth showing)."""
        f = self.filename
        return not self.cell and (any(p in f for p in _MACHINERY_PARTS) or f.startswith(_LIB_ROOTS))

    def __str__(self) -> str:
        if self.cell:
            return f"cell {self.cell} line {self.line}"
        return f"{os.path.basename(self.filename)}:{self.line} in {self.function}"


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

    def describe(self) -> str:
        """One line: what compiled, for how long, why and where."""
        took = "still compiling" if self.end is None else f"{self.duration:.1f} s"
        flag = "recompilation" if self.recompilation else "compile"
        text = f"{flag} of graph {self.graph_hash[:6]}… ({took}) at {self.where}: {self.cause}"
        return text + (f". {self.hint}" if self.hint else "")


# ----------------------------------------------------------------- cell mapping

def _with_cell(frame: Frame) -> Frame:
    label = _ipython.cell_label(frame.filename)
    return dataclasses.replace(frame, cell=label) if label else frame


# ----------------------------------------------------------------- parsing

def parse_block(lines: list[str]) -> dict:
    """Fields of one "Compilation Analysis" block (lines without the prefix)."""
    out: dict = {"cause": "", "graph_hash": "", "inputs": 0, "outputs": 0, "frames": []}
    section = None
    for raw in lines:
        line = raw.rstrip("\n")
        s = line.strip()
        if s == "Compilation Cause":
            section = "cause"
        elif s.startswith("Graph Info"):
            section = "graph"
        elif s.startswith("Python Frame Triggered Execution"):
            section = "frames"
        elif s.startswith("---") or s.startswith("==="):
            section = None
        elif section == "cause" and s:
            out["cause"] = (out["cause"] + " " + s).strip()
        elif section == "graph":
            if s.startswith("Graph Hash:"):
                out["graph_hash"] = s.split(":", 1)[1].strip()
            elif s.startswith("Number of Graph Inputs:"):
                out["inputs"] = int(s.split(":", 1)[1])
            elif s.startswith("Number of Graph Outputs:"):
                out["outputs"] = int(s.split(":", 1)[1])
        elif section == "frames" and s:
            m = _FRAME_RE.match(line)
            if m:
                out["frames"].append(Frame(m["func"], m["file"], int(m["line"])))
    return out


def hint_for(event: CompileEvent, previous: CompileEvent | None) -> str:
    """One sentence saying the likely reason a location compiled another graph."""
    if event.forced:
        return ("A tensor value was read before the step's sync (.item(), print, .cpu() or Python control "
                "flow on a tensor), which cuts the step in two graphs: log it with tpukit.log() or read it after the sync.")
    if previous is not None and (previous.inputs, previous.outputs) != (event.inputs, event.outputs):
        return ("This line produced a graph with a different number of inputs/outputs than before: the traced code "
                "took another path (Python control flow, a new tensor captured, or a changing Python scalar).")
    return ("This line produced a new graph with the same inputs: most likely a tensor shape changed "
            "(pad or bucket with tpukit.data) or a Python scalar that varies is baked into the graph (pass it as a tensor).")


class CompileLog:
    """Incremental reader of one compile-trace file; thread-safe and cheap to poll."""

    def __init__(self, path: str | None, warmup_graphs: int = WARMUP_GRAPHS):
        self.path = path
        self.warmup_graphs = warmup_graphs
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = ""
        self._block: list[str] | None = None
        self._events: list[CompileEvent] = []
        self._graphs_at: dict[tuple, list[tuple[str, int]]] = {}  # location -> [(graph hash, sync no)]
        self._in_post = False
        self._last_at: dict[tuple, CompileEvent] = {}

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
        first_new = len(self._events)
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
        if len(self._events) > first_new:
            self._classify(range(first_new, len(self._events)), changed)
        ended = [e for e in changed if e.end is not None]
        if ended:
            self._fix_times(ended, changed)
        return changed

    @staticmethod
    def _notify(changed: list[CompileEvent]) -> list[CompileEvent]:
        for ev in changed:  # called outside the lock: listeners may poll again
            events.call("on_compile", ev)
        return changed

    def _pending_ends(self) -> bool:
        return any(e.end is None for e in self._events[-4:])

    def _end_by_count(self, now: float, changed: list[CompileEvent]) -> None:
        """End events the runtime counts as compiled even though no "Post Compilation" block
        reached the file (under SPMD torch_xla writes that block to stderr instead)."""
        if not self._pending_ends():
            return
        done = _compile_count()
        for i, e in enumerate(self._events):
            if e.end is None and i < done:
                self._events[i] = ev = dataclasses.replace(e, end=now)
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
                for i, e in enumerate(self._events):
                    if e.end is None:
                        self._events[i] = ev = dataclasses.replace(e, end=now)
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

    def _start_event(self, block: list[str], now: float) -> CompileEvent:
        fields = parse_block(block)
        frames = tuple(_with_cell(f) for f in fields["frames"])
        ev = CompileEvent(index=len(self._events), start=now, end=None, cause=fields["cause"],
                          graph_hash=fields["graph_hash"], inputs=fields["inputs"],
                          outputs=fields["outputs"], frames=frames)
        self._events.append(ev)
        return ev

    def _classify(self, indices: range, changed: list[CompileEvent]) -> None:
        """Flag the events started in this poll that are recompilations, with a hint.

        Each compile is dated by the sync it belongs to. torch_xla counts a sync
        (MarkStep) after its compilation, so a compile still running belongs to
        the next count.
        """
        count = _sync_count()
        for i in indices:
            ev = self._events[i]
            sync_no = count if ev.end is not None else count + 1
            user = ev.user_frames
            key = tuple((f.filename, f.line) for f in user) or ("<unknown>",)
            seen = self._graphs_at.setdefault(key, [])
            new = ev
            if ev.forced:
                new = dataclasses.replace(new, hint=hint_for(ev, None))
            if all(g != ev.graph_hash for g, _ in seen):
                # Warm-up: a location may compile a second graph on the very next
                # sync (the step after the optimizer created its state). A third
                # graph, or a second one after a steady stretch, is a recompilation.
                late = bool(seen) and sync_no - seen[0][1] >= 2
                if user and (len(seen) >= self.warmup_graphs or late):
                    new = dataclasses.replace(new, recompilation=True, hint=hint_for(ev, self._last_at.get(key)))
                seen.append((ev.graph_hash, sync_no))
                self._last_at[key] = ev
            if new is not ev:
                self._events[i] = new
                changed[:] = [dataclasses.replace(new, end=c.end, start=c.start) if c.index == i else c
                              for c in changed]

    def compiling_now(self) -> CompileEvent | None:
        """The compilation running right now (after a poll), or None."""
        self.poll()
        with self._lock:
            for ev in reversed(self._events):
                if ev.end is None:
                    return ev
                break
        return None


def _sync_count() -> int:
    return int(_xla.counter_value("MarkStep") or 0) if _xla.is_imported() else 0


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
            _LOGS[key] = CompileLog(path)
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


def event_count() -> int:
    """Number of compile events read so far (after polling); use with ``events_since``."""
    lg = log()
    lg.poll()
    return len(lg.events)
