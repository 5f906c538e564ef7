"""Every graph the kit records, compiled for the target TPU in the background.

``tpukit.setup(target="v5e-1")`` (or ``TPUKIT_TARGET``) registers one :class:`Follower`
with ``tpukit.events`` (the runtime tells this module when its target changes:
:func:`tpukit.runtime.watch_target`). Each finished compile the compile reader publishes
carries its graph's ``HloModuleProto``; the follower hands it to the TPU compiler's
worker process (:func:`~tpukit.tpu.recorded.compile_graph_async`: never on the training
thread), publishes ``on_tpu_pending(event)`` when it sends a graph and
``on_tpu_estimate(event, estimate)`` when the answer comes, to whoever listens (the
dashboard, ``%%xla``, a tracked loop's summary), by one key per graph
(:attr:`tpukit.compiles.CompileEvent.graph_key`). The same graph is compiled once
per target. While a follower is registered the graphs keep their HLO.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .. import compiles, events, runtime
from .ask import resolve
from .compiler.pins import Compiler
from .compiler.targets import Target
from .compiler.worker import require
from .outcome import TpuEstimate
from .recorded import compile_graph_async


class Follower:
    """The listener that compiles each recorded graph for ``target`` with ``compiler`` (see the module doc;
    default: the runtime's, resolved once here)."""

    def __init__(self, target: str | Target, compiler: str | Compiler | None = None):
        self.target, self.compiler = resolve(target, compiler)
        self._lock = threading.Lock()
        self._by_graph: dict[str, TpuEstimate] = {}
        self._of_event: dict[int, TpuEstimate] = {}
        self._waiting: dict[str, list[Any]] = {}
        self._done_cond = threading.Condition(self._lock)

    def on_compile(self, event: Any) -> None:
        graph = getattr(event, "graph", None)
        if not event.settled or graph is None or graph.proto is None:
            return
        key = event.graph_key
        with self._lock:
            known = self._by_graph.get(key)
            if known is None:
                waiting = self._waiting.setdefault(key, [])
                waiting.append(event)
                if len(waiting) > 1:
                    return  # already on its way
        if known is not None:
            self._publish(event, known)
            return
        events.call("on_tpu_pending", event)
        future = compile_graph_async(graph.proto, self.target, graph.partitions, name=event.name,
                                     compiler=self.compiler)
        future.add_done_callback(lambda f, key=key: self._done(key, f))

    def _done(self, key: str, future: Any) -> None:
        try:
            est = future.result()
        except Exception:  # a missing compiler was checked when following; nothing else raises
            return
        with self._lock:
            self._by_graph[key] = est
            waiting = self._waiting.pop(key, [])
        for event in waiting:
            self._publish(event, est)
        with self._lock:
            self._done_cond.notify_all()

    def _publish(self, event: Any, est: TpuEstimate) -> None:
        with self._lock:
            self._of_event[event.index] = est
        events.call("on_tpu_estimate", event, est)

    def estimate_of(self, event: Any) -> TpuEstimate | None:
        """The estimate of ``event``'s graph once the TPU compiler answered, else None."""
        with self._lock:
            return self._of_event.get(event.index)

    def estimates_for(self, events_: list[Any], timeout: float = 2.0) -> list[tuple[Any, TpuEstimate | None]]:
        """``(event, estimate)`` for each distinct graph among ``events_`` that was sent to the TPU
        compiler, waiting at most ``timeout`` seconds for the answers still on their way (None then)."""
        sent = {}
        for ev in events_:
            graph = getattr(ev, "graph", None)
            if graph is not None and graph.proto is not None:
                sent.setdefault(ev.graph_key, ev)
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(k in self._waiting for k in sent) and time.monotonic() < deadline:
                self._done_cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            return [(ev, self._by_graph.get(k)) for k, ev in sent.items()]

    def pending(self) -> int:
        """Graphs sent to the TPU compiler that have not answered yet."""
        with self._lock:
            return len(self._waiting)


_FOLLOWER: list[Follower] = []
_LOCK = threading.Lock()


def _changed() -> None:
    """The graphs keep their HLO while a follower is registered (it compiles them); with none, no longer:
    nothing would compile them, and a dashboard would wait for their answers."""
    compiles.keep_hlo("tpu follower", bool(_FOLLOWER))


def follow(target: str | Target | Follower, compiler: str | Compiler | None = None) -> Follower:
    """Compile every graph recorded from now on for ``target`` with ``compiler`` (default: the runtime's);
    returns the (one) follower. A :class:`Follower` given back (one :func:`unfollow` stopped) resumes with the
    answers it has."""
    given = target if isinstance(target, Follower) else None
    tgt, comp = (given.target, given.compiler) if given is not None else resolve(target, compiler)
    require(comp)  # a clear error with the install line when the TPU compiler is missing
    with _LOCK:
        if _FOLLOWER and (_FOLLOWER[0] is given or (given is None and _FOLLOWER[0].target.name == tgt.name
                                                    and _FOLLOWER[0].compiler == comp)):
            return _FOLLOWER[0]
        for old in _FOLLOWER:
            events.remove_listener(old)
        _FOLLOWER[:] = [given or Follower(tgt, comp)]
        new = _FOLLOWER[0]
    _changed()  # the graphs recorded from now on keep their HLO, before the follower hears of any
    return events.add_listener(new)


def follower() -> Follower | None:
    """The follower ``setup(target=...)`` registered, or None when no target is set."""
    return _FOLLOWER[0] if _FOLLOWER else None


def unfollow(which: Follower | None = None) -> None:
    """Stop compiling new graphs for the target (``which``: only if it is still the follower). The
    follower keeps its answers, and those still on their way still arrive and are published."""
    with _LOCK:
        for old in list(_FOLLOWER):
            if which is None or old is which:
                events.remove_listener(old)
                _FOLLOWER.remove(old)
    _changed()


def _retarget(tgt: Target, compiler: str | None) -> None:
    """What ``tpukit.setup(target=..., compiler=...)`` set: follow that target with that compiler (None: the
    runtime's own)."""
    follow(tgt, compiler)


runtime.watch_target(_retarget)
