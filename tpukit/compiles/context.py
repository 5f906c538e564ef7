"""What the classifier needs from a running loop (the batch of the step being traced, the
shapes the loop declared), held by the loop and found per thread.

A tracked loop opens a :class:`LoopContext` on its thread (``with ctx:``); the reader
attributes each compile to the loop it belongs to and classifies it with *that* loop's
batch, so loops running in parallel threads (``tpukit.launch`` runs one thread per
device on XLA:CPU) never see each other's inputs. How a compile is attributed:

- the loop's own sync runs through :meth:`LoopContext.sync`, whose frame is named
  ``tpukit_loop_<id>``; torch_xla writes that frame into the compile's trace block,
  so the graphs a loop's sync compiles name their loop exactly;
- a compile without that frame (a value read mid-step, ``torch_xla.compile``, a
  library's own sync such as the Trainer's) belongs to the one loop running, when
  exactly one runs; with several running it belongs to none (its evidence then comes
  from the graphs alone, never from another loop's batch).

The batch noted for a step is kept with the trace file's size at that moment, so a
compile is judged with the batch of the step that traced it even when the reader
reads its block after the loop has moved on.
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import types
from collections import deque
from typing import Any, Callable

from . import config

Signature = tuple  # ((path, shape, dtype), ...) of a step's input tensors

TAG = re.compile(r"^tpukit_loop_(\d+)$")
OWN = "tpukit_own_graph"  # the frame name of graphs tpukit compiles for itself (see own())
FLUSH = "tpukit_flush_earlier_work"  # the frame name of the sync that runs work queued before tpukit's (see flush())
_IDS = itertools.count(1)
_LOCK = threading.Lock()
_KNOWN: dict[int, "LoopContext"] = {}  # open loops and the last ended ones (late blocks still find them)
_KEEP_ENDED = 16
_LOCAL = threading.local()


def _run(fn: Callable[[], Any]) -> Any:
    return fn()


def _size() -> int:
    """The trace file's size now: every compile started before this call has its block before it."""
    path = config.trace_file()
    if not path:
        return 0
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _renamed(name: str) -> Callable[[Callable[[], Any]], Any]:
    code = _run.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, _run.__globals__, name)


_own = _renamed(OWN)
_flush = _renamed(FLUSH)


def own(fn: Callable[[], Any]) -> Any:
    """Call ``fn`` under a frame named :data:`OWN`: a graph it compiles is tpukit's own work (a
    checkpoint's chunked copy from the device), never an alarm of the user's loop."""
    return _own(fn)


def flush(fn: Callable[[], Any]) -> Any:
    """Call ``fn`` (the sync tpukit makes before work of its own: a tracked loop as it begins,
    ``%%xla`` before the cell runs) under a frame named :data:`FLUSH`: what it compiles is the work
    earlier code queued (a model evaluated before the loop, another cell's tensors), placed apart
    from the graphs of the loop or cell that follows, which would otherwise be compared with it."""
    return _flush(fn)


class LoopContext:
    """One loop's classifier context: its declared shapes, the batch of each step it traces,
    ``hint``: what to change in *this* loop when its batches change shape (None: the generic hint),
    and ``place``: how the loop names where a compile happened, when its own terms say more than
    the user's line (the Trainer: "the Trainer's training step"; None: the user's line).

    ``thread_key`` keys the classifier's history of places: None on the main thread (so a
    notebook's loops compare with each other, as they run one after the other), the thread's
    ident elsewhere (parallel replicas each have their own history).
    """

    def __init__(self, declared: frozenset = frozenset(), hint: str | None = None,
                 place: Callable[[Any], str | None] | None = None):
        self.id = next(_IDS)
        self.declared = frozenset(declared)
        self.hint = hint  # the loop's own fix for a batch-shape recompilation (e.g. the Trainer's collator)
        self.place = place  # CompileEvent -> the place in the loop's terms (called on the reader's thread)
        thread = threading.current_thread()
        self.thread_key = None if thread is threading.main_thread() else thread.ident
        self._inputs: deque[tuple[int, Signature | None]] = deque(maxlen=32)
        self.opened_at: int | None = None  # trace-file offsets while the loop was open
        self.closed_at: int | None = None
        self._tagged = _renamed(f"tpukit_loop_{self.id}")

    def note_inputs(self, signature: Signature | None) -> None:
        """The batch of the step about to be traced (``((path, shape, dtype), ...)``)."""
        self._inputs.append((_size(), signature))

    def inputs_at(self, offset: int) -> Signature | None:
        """The batch noted last before the trace file reached ``offset`` (the compile's block)."""
        found = None
        for at, sig in list(self._inputs):
            if at > offset:
                break
            found = sig
        return found

    def sync(self, fn: Callable[[], Any]) -> Any:
        """Call ``fn`` (the loop's sync) under a frame named after this loop (see the module doc)."""
        return self._tagged(fn)

    def __enter__(self) -> "LoopContext":
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self)
        self.opened_at, self.closed_at = _size(), None
        with _LOCK:
            _KNOWN[self.id] = self
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = getattr(_LOCAL, "stack", [])
        if self in stack:
            stack.remove(self)
        self.closed_at = _size()
        with _LOCK:
            ended = [k for k, c in _KNOWN.items() if c.closed_at is not None]
            for k in ended[:max(0, len(ended) - _KEEP_ENDED)]:
                del _KNOWN[k]

    def open_at(self, offset: int) -> bool:
        """True when the loop was open when the trace file reached ``offset``."""
        return (self.opened_at is not None and self.opened_at <= offset
                and (self.closed_at is None or offset < self.closed_at))

    def __repr__(self) -> str:
        return f"<LoopContext {self.id} declared={sorted(map(str, self.declared))}>"


def current() -> LoopContext | None:
    """The innermost loop context open on this thread, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def find(function_names: list[str], offset: int) -> LoopContext | None:
    """The loop a compile whose block starts at ``offset`` belongs to: the one its frames name,
    else the only loop open at that moment (see the module doc)."""
    with _LOCK:
        for name in function_names:
            m = TAG.match(name)
            if m and int(m.group(1)) in _KNOWN:
                return _KNOWN[int(m.group(1))]
        found = [c for c in _KNOWN.values() if c.open_at(offset)]
    return found[0] if len(found) == 1 else None
