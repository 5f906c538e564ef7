"""Reading a profile: the ``.xplane.pb`` as trace events, reduced to what the device did.

XProf (``pip install 'tpukit[profile]'``) reads the XSpace protobuf the profiler
wrote; its ``trace_viewer`` tool converts it to Chrome-format trace events
(:func:`read_trace`). Its aggregated tools (``hlo_stats``, ``op_profile``) read
accelerator planes only and are empty on XLA:CPU, so tpukit reduces the events
itself (:func:`trace_stats`): on XLA:CPU each HLO op is an event with
``hlo_op``/``hlo_module`` and each execution a ``ThunkExecutor::Execute`` span; on
a TPU they are the device plane's "XLA Ops" and "XLA Modules" lines. Op times
are self times (a fusion nested in a ``call`` op counts once), executions are
merged into busy intervals, and host time in torch_xla's sync paths is counted
apart from compiling.

:class:`ProfileSummary` is what a capture shows: these figures, the verdict,
and where the trace is; it renders as text and as HTML in a notebook.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable

from .._text import plural, seconds, table_html, table_text
from ..errors import TpukitError
from ..verdict import Verdict

log = logging.getLogger("tpukit")

INSTALL = "pip install 'tpukit[profile]' (or: pip install xprof)"
# Event names in torch_xla's and XLA:CPU's trace (host plane).
EXECUTE_EVENT = "ThunkExecutor::Execute"          # one execution of a compiled graph on XLA:CPU
COMPILE_EVENT = "XLAGraphExecutor::Compile"       # torch_xla compiling a graph
SYNC_EVENTS = ("StepMarker", "SyncTensorsGraph", "SyncLiveTensorsGraph")  # torch_xla's sync paths
LAUNCH_EVENTS = ("PjRtComputationClient::ExecuteComputation", "PjRtComputationClient::ExecuteReplicated")
OP_LINE, MODULE_LINE = "XLA Ops", "XLA Modules"   # a device plane's lines (TPU, GPU)
OP_HEAD = ("op", "graph", "calls", "time", "share")


def _shown(path: str) -> str:
    """``path`` as the report shows it: relative to the working directory when it is under it (a
    notebook's own folder: no machine path in a saved notebook), else whole."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return rel if not rel.startswith(os.pardir) else path


@dataclass(frozen=True)
class OpTime:
    """One device op (as XLA names it, e.g. ``dot.93``) and the time it took over the profile."""

    name: str
    graph: str
    calls: int
    total_s: float                   # self time: nested ops' time is theirs


@dataclass(frozen=True)
class TraceStats:
    """What the trace events say (seconds): device ops, executions, compiles, host sync time."""

    ops: tuple[OpTime, ...]          # every op, longest total first
    op_time_s: float
    executions: int
    busy_s: float                    # time covered by at least one execution
    idle_s: float                    # gaps between the first execution's start and the last one's end
    compile_s: float
    sync_s: float                    # host time in torch_xla's sync paths, compiles excluded


@dataclass(frozen=True)
class ProfileSummary:
    """What a profile shows: where the device time went, how busy the device was, the host's
    share, and the verdict. Renders as text (``repr``) and HTML in a notebook."""

    logdir: str
    trace_file: str
    window_s: float                  # wall time the trace covered
    stats: TraceStats
    top: int
    steps: int                       # tracked-loop steps seen (0: no tracked loop)
    tracing_s: float | None          # host tracing time from the step records
    verdict: Verdict | None
    verdict_from: str                # "steps" or "trace"
    reader: str

    @property
    def top_ops(self) -> tuple[OpTime, ...]:
        """The ``top`` longest device ops."""
        return self.stats.ops[: self.top]

    @property
    def open_hint(self) -> str:
        """How to open the full trace (TensorBoard's Profile tab, in Colab and Jupyter)."""
        logdir = _shown(self.logdir)
        return (f"%load_ext tensorboard  then  %tensorboard --logdir {logdir}  "
                f"(Profile tab; needs tensorboard and xprof), or in a terminal: xprof --logdir {logdir}")

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, text) rows, the top ops aside."""
        st, v = self.stats, self.verdict
        busy = f"; busy {st.busy_s / self.window_s:.0%} of the profile" if self.window_s > 0 else ""
        host = ([f"tracing {_dur(self.tracing_s)} (loop body + sync, from the step records)"]
                if self.tracing_s is not None else [])
        host += [f"in torch_xla's sync {_dur(st.sync_s)} (graph capture, lowering, dispatch)",
                 f"compiling {_dur(st.compile_s) if st.compile_s else 'nothing'}"]
        return [("profiled", (f"{plural(self.steps, 'step')} of a tracked loop, " if self.steps else "")
                 + _dur(self.window_s)),
                ("device", f"busy {_dur(st.busy_s)} in {plural(st.executions, 'execution')}, idle "
                 f"{_dur(st.idle_s)} between them{busy}" if st.executions else "no execution in the trace"),
                ("host", "; ".join(host)),
                ("verdict", f"{v.sentence}. {v.suggestion[0].upper()}{v.suggestion[1:]}" if v else "none (nothing ran)"),
                ("trace", _shown(self.trace_file)), ("open it", self.open_hint), ("read by", self.reader)]

    def _ops(self) -> tuple[list[tuple[str, ...]], str]:
        total = self.stats.op_time_s
        rows = [(op.name, op.graph or "–", str(op.calls), _dur(op.total_s),
                 f"{op.total_s / total:.0%}" if total > 0 else "–") for op in self.top_ops]
        return rows, (f"top {len(rows)} of {plural(len(self.stats.ops), 'device op')} by self time "
                      f"({_dur(total)} in all)")

    def text(self) -> str:
        """The summary as plain text."""
        rows, title = self._ops()
        ops = table_text(rows, title=title, head=OP_HEAD) if rows else "  no device op in the trace"
        return table_text(self.rows(), title="tpukit profile") + "\n" + ops

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        rows = [(k, html.escape(v) if k != "open it" else
                 f"<code>%load_ext tensorboard</code> then <code>%tensorboard --logdir {html.escape(_shown(self.logdir))}"
                 f"</code> (Profile tab; needs tensorboard and xprof)") for k, v in self.rows()]
        ops, title = self._ops()
        return table_html(rows, title="tpukit profile", raw=True) + (
            table_html(ops, title=title, head=OP_HEAD) if ops else "<p>no device op in the trace</p>")


def _dur(x: float | None) -> str:
    """``412 µs``, ``3.25 ms``, ``1.20 s`` (op times are often below a millisecond)."""
    if x is None or x >= 0.01:
        return seconds(x)
    return f"{x * 1e6:.0f} µs" if x < 1e-3 else f"{x * 1e3:.2f} ms"


# ---------------------------------------------------------------------------- reading the trace

def _merge(spans: Iterable[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(merged: list[list[float]]) -> float:
    return sum(b - a for a, b in merged)


def _overlap(x: list[list[float]], y: list[list[float]]) -> float:
    return _length(_merge((max(a, c), min(b, d)) for a, b in x for c, d in y if min(b, d) > max(a, c)))


def _self_times(spans: list[tuple[float, float, tuple]]) -> list[tuple[tuple, float]]:
    """(key, self time) of nested spans on one thread: a span's time minus its children's
    (XLA:CPU runs a fusion inside a ``call`` op, for one)."""
    out, stack = [], []  # stack: [end, key, self time]
    for a, b, key in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1][0] <= a:
            out.append((stack[-1][1], stack.pop()[2]))
        if stack:
            stack[-1][2] -= min(b, stack[-1][0]) - a
        stack.append([b, key, b - a])
    return out + [(k, t) for _, k, t in stack]


def trace_stats(trace_events: list[dict]) -> TraceStats:
    """Reduce Chrome-format trace events (``ts``/``dur`` in microseconds, as XProf's
    ``trace_viewer`` tool writes them) to :class:`TraceStats`; op times are self times."""
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in trace_events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread: dict[Any, list] = {}
    executions, compiles_, syncs, launches = [], [], [], 0
    for e in trace_events:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        line = threads.get((e.get("pid"), e.get("tid")), "")
        span = (e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6)
        name = e.get("name", "")
        if "hlo_op" in args or line == OP_LINE:
            key = (str(args.get("hlo_op") or name), str(args.get("hlo_module") or ""))
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((*span, key))
        elif name == EXECUTE_EVENT or line == MODULE_LINE:
            executions.append(span)
        elif name == COMPILE_EVENT:
            compiles_.append(span)
        elif name in SYNC_EVENTS:
            syncs.append(span)
        launches += name in LAUNCH_EVENTS
    ops: dict[tuple[str, str], tuple[int, float]] = {}
    for spans in by_thread.values():
        for key, took in _self_times(spans):
            calls, total = ops.get(key, (0, 0.0))
            ops[key] = (calls + 1, total + max(0.0, took))
    # XLA:CPU runs parts of one execution in executors on other threads: count torch_xla's launches.
    busy = _merge(executions or [(a, b) for spans in by_thread.values() for a, b, _ in spans])
    compiled, synced = _merge(compiles_), _merge(syncs)
    table = sorted((OpTime(n, g, c, t) for (n, g), (c, t) in ops.items()), key=lambda o: (-o.total_s, o.name))
    return TraceStats(ops=tuple(table), op_time_s=sum(o.total_s for o in table), executions=launches or len(busy),
                      busy_s=_length(busy), idle_s=(busy[-1][1] - busy[0][0] - _length(busy)) if busy else 0.0,
                      compile_s=_length(compiled), sync_s=max(0.0, _length(synced) - _overlap(synced, compiled)))


@contextlib.contextmanager
def _stderr_to_log():
    """XProf's C++ code logs to file descriptor 2 (shown in a notebook cell by ipykernel);
    send it to tpukit's logger instead."""
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            log.debug("xprof: %s", sink.read().decode(errors="replace").strip())


def read_trace(path: str | os.PathLike) -> tuple[list[dict], str]:
    """The trace events of an ``.xplane.pb``, converted by XProf's ``trace_viewer`` tool, and
    the reader's name. Raises TpukitError when XProf is missing or cannot read the file."""
    try:
        from xprof import version as xprof_version
        from xprof.convert import raw_to_tool_data
    except ImportError as exc:
        raise TpukitError(f"reading a profile needs XProf, which is not installed ({exc}). Install it with "
                          f"{INSTALL}; the trace itself is written and opens in TensorBoard.") from None
    with _stderr_to_log():
        data, _ = raw_to_tool_data.xspace_to_tool_data([str(path)], "trace_viewer", {})
    if not data:
        raise TpukitError(f"XProf could not convert {path} (an empty or damaged trace file?). "
                          "Profile again; set logging.getLogger('tpukit') to DEBUG to see XProf's log.")
    doc = json.loads(data)
    reader = f"XProf {getattr(xprof_version, '__version__', '?')} (trace_viewer events of the .xplane.pb)"
    return list(doc.get("traceEvents", [])), reader
