"""THE reader of compile evidence: the only code that reads torch_xla's compile-trace file and
XLA's HLO dump, classifies each compile and publishes it through ``tpukit.events``.

It runs in one small daemon thread (``tpukit-compiles``), started when tracing is on,
which wakes every :data:`PERIOD` seconds (or when asked) and reads only the bytes
appended since its last read. Each compile is published **at most twice**: when its
"Compilation Analysis" block appears (``end`` None, ``kind`` "compile": the dashboard's
"compiling now"), and once it has finished and been classified by
:mod:`tpukit.compiles.classify` against its loop's context
(:mod:`tpukit.compiles.context`) with its graph from the dump. ``index`` is the
event's stable identity; later consumers get the very objects the reader keeps.

Nobody else polls. A consumer that needs "every compile up to now, classified" (a
tracked loop's step record, a guard, ``%%xla``, a launcher's last words) calls
:meth:`Reader.settled`, which wakes the thread and waits for it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

from .. import _ipython, _xla, events, metrics
from . import classify, config, context, graphs
from .event import PENDING, CompileEvent, Mark
from .frames import Frame, parse_block
from .graphs import Graph

PERIOD = 0.1     # seconds between two reads of the trace file when nobody asks
HLO_PATIENCE = 2.0  # seconds an ended compile waits for its HLO file before it is classified without one
# While graphs keep their HLO for a TPU target (a follower, a %%xla --target cell), longer: a graph classified
# without its HLO never reaches the TPU compiler. 2 s was once too short in CI (two test lanes and a TPU compile
# on two cores: one graph of a tracked loop settled without its HLO and got no TPU answer). Only a late file
# is waited for.
HLO_PATIENCE_KEPT = 8.0


def _with_cell(frame: Frame) -> Frame:
    label = _ipython.cell_label(frame.filename)
    return dataclasses.replace(frame, cell=label) if label else frame


def _size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


class Reader:
    """Tails one compile-trace file and its HLO dump folder; see the module doc."""

    def __init__(self, path: str | None, hlo_dir: str | None = None):
        self.path = path
        self.hlo = graphs.HloDump(hlo_dir)
        self._proto_owners: set[str] = set()  # who wants each graph's HLO kept (keep_protos)
        self.classifier = classify.Classifier()
        self._cond = threading.Condition(threading.RLock())
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._offset = 0          # bytes of the file read so far
        self._partial = ""        # an incomplete last line
        self._block: list[str] | None = None
        self._block_at = 0        # offset of the block being read
        self._in_post = False
        self._events: list[CompileEvent] = []
        self._unsettled: set[int] = set()  # indices of events not classified yet
        self._announced: set[int] = set()  # started events already published
        self._loop: dict[int, context.LoopContext | None] = {}
        self._graph_of: dict[int, Graph] = {}
        self._next_graph = 0      # first graph of self.hlo.graphs not matched to an event yet
        self._ended_at: dict[int, float] = {}
        self._lazy: dict[int, int] = {}  # event index -> its rank among traced compiles (CompileTime's count)
        self._released = False
        self._seen = 0            # compiles tpukit saw itself (add_seen)

    # ------------------------------------------------------------------ the thread
    @property
    def enabled(self) -> bool:
        """True when there is a trace file to read (causes and frames available)."""
        return bool(self.path)

    def start(self) -> None:
        """Start the reading thread (once; again in a forked child, where threads do not survive)."""
        if not self.path or (self._thread is not None and self._thread.is_alive()):
            return
        self._thread = threading.Thread(target=self._run, name="tpukit-compiles", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(PERIOD)
            self._wake.clear()
            try:
                self.read()
            except Exception:  # a broken file must never take the reader down for good
                time.sleep(PERIOD)

    def read(self) -> None:
        """Read what was appended, classify what ended, publish the changes (the thread's work)."""
        with self._cond:
            changed = self._read_new()
            publish = []
            for i in sorted(changed):
                ev = self._events[i]
                if ev.settled:
                    publish.append(ev)
                    self._announced.add(i)
                elif i not in self._announced:
                    self._announced.add(i)
                    publish.append(ev)
            self._cond.notify_all()
        for ev in publish:  # outside the lock: listeners may ask for more
            events.call("on_compile", ev)

    def _ask(self, done, timeout: float) -> None:
        """Wake the thread until ``done()`` holds (under the lock) or ``timeout`` passes."""
        self.start()
        if self._thread is None:
            return
        if threading.current_thread() is self._thread:  # asked from a listener the reader is calling
            self.read()
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            while not done() and time.monotonic() < deadline:
                self._wake.set()
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------------ what consumers ask
    def mark(self) -> Mark:
        """A point in the stream of compiles: every compile started before this call is before it."""
        return Mark(_size(self.path), self._seen)

    @property
    def events(self) -> list[CompileEvent]:
        """All events read so far (copy of the list; the events are the reader's own)."""
        with self._cond:
            return list(self._events)

    def settled(self, upto: Mark | None = None, timeout: float = 3.0, since: Mark | None = None) -> list[CompileEvent]:
        """The compiles that started between ``since`` (the beginning by default) and ``upto`` (now by
        default), once each has finished and been classified, waiting at most ``timeout`` seconds."""
        if not self.path and not self._events:
            return []
        upto = self.mark() if upto is None else upto

        def between(e: CompileEvent) -> bool:
            return upto.before(e) and (since is None or not since.before(e))

        def done() -> bool:
            return self._offset >= upto.size and not any(between(self._events[i]) for i in self._unsettled)

        if not done():
            self._ask(done, timeout)
        with self._cond:
            return [e for e in self._events if between(e)]

    def compiling_now(self) -> CompileEvent | None:
        """The compilation running right now, once the thread has read the trace up to now."""
        upto = self.mark().size
        self._ask(lambda: self._offset >= upto, 0.25)
        with self._cond:
            for ev in reversed(self._events):
                return ev if ev.end is None else None
        return None

    def keep_protos(self, owner: str, on: bool = True) -> None:
        """From now on, keep each graph's ``HloModuleProto`` on its event (``event.graph.proto``) for
        ``owner``, a consumer that compiles it again (the TPU target's follower, a ``%%xla --target``
        cell); ``on=False``: no longer for it. They are kept while any owner wants them: each new one
        costs memory for the rest of the session, and a graph with its HLO counts as sent to a TPU
        compiler (a dashboard waits for its answer)."""
        with self._cond:
            (self._proto_owners.add if on else self._proto_owners.discard)(owner)
            self.hlo.protos = bool(self._proto_owners)

    def add_seen(self, cause: str, frames: tuple[Frame, ...], counts: tuple[int, int], place: tuple,
                 inputs: classify.Signature, start: float, end: float) -> CompileEvent:
        """Publish a finished compile tpukit saw itself (an eager-mode op), classified at once at
        ``place`` with ``inputs`` (the op's tensors) as its batch and this thread's loop's declared shapes."""
        loop = context.current()
        with self._cond:
            found = self.classifier.classify(place, None, inputs, counts, loop.declared if loop else frozenset())
            ev = CompileEvent(index=len(self._events), start=start, end=end, cause=cause, graph_hash="",
                              inputs=counts[0], outputs=counts[1], frames=frames, kind=found.kind,
                              evidence=found.evidence, hint=found.hint, seen=self._seen,
                              recompilation=found.kind == classify.RECOMPILATION,
                              loop=loop.id if loop else None)
            self._events.append(ev)
            self._seen += 1
            self._announced.add(ev.index)
        events.call("on_compile", ev)
        return ev

    # ------------------------------------------------------------------ reading (the thread, under the lock)
    def _read_new(self) -> set[int]:
        changed: set[int] = set()
        now = time.time()
        size = _size(self.path)
        if size < self._offset:  # file truncated / replaced: start over
            self._offset, self._partial, self._block = 0, "", None
        if size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(size - self._offset)
            at = self._offset - len(self._partial.encode())
            self._offset += len(chunk)
            lines = (self._partial + chunk.decode(errors="replace")).split("\n")
            self._partial = lines.pop()  # incomplete last line
            for line in lines:
                self._feed(line, at, now, changed)
                at += len(line.encode()) + 1
        self._end_by_count(now, changed)
        ended = [i for i in changed if self._events[i].end is not None]
        if ended:
            self._fix_times(sorted(ended))
        self._classify_ended(now, changed)
        return changed

    def _pending(self) -> list[CompileEvent]:
        """Events not classified yet (running, or ended and waiting for their HLO), oldest first."""
        return [self._events[i] for i in sorted(self._unsettled)]

    def _feed(self, line: str, at: int, now: float, changed: set[int]) -> None:
        if line.startswith("Compilation Analysis:"):
            self._in_post = False
            body = line[len("Compilation Analysis:"):]
            if self._block is None:
                self._block, self._block_at = [body], at
            else:
                self._block.append(body)
                if body.strip().startswith("===") and len(self._block) > 2:
                    changed.add(self._start_event(self._block, self._block_at, now))
                    self._block = None
        elif line.startswith("Post Compilation Analysis:"):
            if not self._in_post:  # the post block is written when the compilation has finished
                self._in_post = True
                for e in self._pending():
                    if e.end is None:
                        self._events[e.index] = dataclasses.replace(e, end=now)
                        changed.add(e.index)
                        break
        else:
            self._in_post = False

    def _start_event(self, block: list[str], at: int, now: float) -> int:
        fields = parse_block(block)
        frames = tuple(_with_cell(f) for f in fields["frames"])
        loop = context.find([f.function for f in frames], at)
        ev = CompileEvent(index=len(self._events), start=now, end=None, cause=fields["cause"],
                          graph_hash=fields["graph_hash"], inputs=fields["inputs"], outputs=fields["outputs"],
                          frames=frames, analysis="\n".join(block).strip(), offset=at,
                          loop=loop.id if loop else None)
        self._lazy[ev.index] = len(self._lazy)
        self._events.append(ev)
        self._unsettled.add(ev.index)
        self._loop[ev.index] = loop
        if not self._released:  # torch_xla has read its settings by now (and XLA its flags, at start)
            self._released = True
            config.release()
        return ev.index

    def _end_by_count(self, now: float, changed: set[int]) -> None:
        """End events the runtime counts as compiled even though no "Post Compilation" block
        reached the file (under SPMD torch_xla writes that block to stderr instead)."""
        running = [e for e in self._pending() if e.end is None]
        if not running:
            return
        done = _compile_count()
        for e in running:
            if self._lazy[e.index] < done:
                self._events[e.index] = dataclasses.replace(e, end=now)
                changed.add(e.index)

    def _fix_times(self, ended: list[int]) -> None:
        """Replace read-time estimates by the runtime's own compile timings (newest samples)."""
        fresh = [i for i in ended if i not in self._ended_at]
        samples = metrics.compile_samples()
        if not fresh or len(samples) < len(fresh):
            return
        for i, (end, seconds) in zip(fresh, samples[-len(fresh):]):
            self._events[i] = dataclasses.replace(self._events[i], start=end - seconds, end=end)
            self._ended_at[i] = time.time()

    def _match_graphs(self) -> None:
        """Pair events with the HLO modules XLA dumped, in compile order, checking the
        (inputs, outputs) counts so a module without an event never shifts the rest."""
        self.hlo.poll()
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

    def _classify_ended(self, now: float, changed: set[int]) -> None:
        """Classify events whose compilation ended (with their graph once XLA dumped it)."""
        if not any(e.end is not None for e in self._pending()):
            return
        self._match_graphs()
        for ev in self._pending():
            i = ev.index
            if ev.end is None:
                continue
            graph = self._graph_of.get(i)
            patience = HLO_PATIENCE_KEPT if self.hlo.protos else HLO_PATIENCE
            if graph is None and self.hlo.path and now - self._ended_at.setdefault(i, now) < patience:
                continue  # its HLO file may still be on its way
            loop = self._loop.pop(i, None)
            user, read = ev.user_frames, ev.read_frame
            place = (ev.cut,) + (tuple(f.key for f in (user or ev.frames)) or ("<unknown>",))
            place += (read.key,) if read is not None else ()
            if loop is not None and loop.thread_key is not None:
                place = (loop.thread_key,) + place  # a parallel replica compares with itself only
            if any(f.function == context.OWN for f in ev.frames):  # tpukit's own graph: never an alarm
                found = classify.Finding(classify.NEW, ("tpukit's own copy from the device (a checkpoint chunk)",))
            else:
                found = self.classifier.classify(place, graph, loop.inputs_at(ev.offset) if loop else None,
                                                 (ev.inputs, ev.outputs), loop.declared if loop else frozenset(),
                                                 loop.hint if loop else None)
            hint = classify.forced_hint(read) if ev.forced and found.kind == classify.NEW else found.hint
            self._events[i] = dataclasses.replace(ev, kind=found.kind, evidence=found.evidence, hint=hint,
                                                  graph=graph, recompilation=found.kind == classify.RECOMPILATION,
                                                  place=_place(loop, ev))
            self._unsettled.discard(i)
            changed.add(i)


def _place(loop: context.LoopContext | None, ev: CompileEvent) -> str | None:
    """The place of ``ev`` in its loop's terms (None: the user's line). A loop's ``place`` that fails
    must not stop the reader: the user's line is still right."""
    if loop is None or loop.place is None:
        return None
    try:
        return loop.place(ev)
    except Exception:  # noqa: BLE001 - a naming callback's bug costs the name, never the event
        return None


def _compile_count() -> int:
    data = _xla.metric_data("CompileTime") if _xla.is_imported() else None
    return int(data[0]) if data else 0


_READER: list[Reader] = []
_READER_LOCK = threading.Lock()


def reader() -> Reader:
    """The process's one Reader, of the trace file configured for this process (disabled if none);
    its thread runs once there is a file to read."""
    path = config.trace_file()
    with _READER_LOCK:
        if not _READER or _READER[0].path != path:
            _READER[:] = [Reader(path, config.hlo_dir())]
        r = _READER[0]
    r.start()
    return r


def _forget_in_child() -> None:
    """A forked child starts with no reader thread: it makes its own on first use."""
    _READER.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
