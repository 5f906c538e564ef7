"""Capturing a profile: ``with tpukit.profile() as prof:``, or the next N steps of a tracked loop.

The capture is torch_xla's profiler session (through the adapter) over the ``with``
block, or with ``steps=N`` over the next N steps of a :func:`~tpukit.track` loop,
counted by a listener on the events registry: the loop's start arms the trace,
its steps are counted, the Nth (or the loop's end) stops it. The trace is written
where TensorBoard and XProf look: ``<logdir>/plugins/profile/<run>/<host>.xplane.pb``.
:meth:`Profile.summary` reads it (:mod:`.trace`) and judges the bottleneck: from the
loop's step records when a tracked loop ran, from the trace alone otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

from .. import _xla, events
from .._text import plural
from ..errors import TpukitError
from ..steps import StepRecord
from ..verdict import Verdict, bottleneck
from .trace import ProfileSummary, TraceStats, _dur, read_trace, trace_stats

DEFAULT_ROOT = "tpukit-profiles"


def default_logdir() -> Path:
    """``./tpukit-profiles/<date>-<time>`` under the working directory (a new folder each time)."""
    base = Path.cwd() / DEFAULT_ROOT / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


_ELSEWHERE = ("Give a directory you can write to (it is created when missing), e.g. one under your home "
              "folder or /tmp, or leave logdir out for ./tpukit-profiles/<time> under a writable working directory.")


def _checked(logdir: Path) -> Path:
    """``logdir`` made absolute, when it is (or can become) a directory we may write to; it is created
    when tracing starts (:func:`_create`)."""
    try:
        logdir = logdir.expanduser().resolve()
        found = next(p for p in (logdir, *logdir.parents) if p.exists())
    except OSError as exc:  # a folder on the way that cannot be entered
        raise TpukitError(f"tpukit.profile(logdir={str(logdir)!r}): the path cannot be reached "
                          f"({exc.strerror or type(exc).__name__}: {exc.filename}). {_ELSEWHERE}") from None
    if not found.is_dir():
        raise TpukitError(f"tpukit.profile(logdir={str(logdir)!r}): {'that path' if found == logdir else found} is a "
                          f"file, not a directory, so the trace cannot be written there. {_ELSEWHERE}")
    if not os.access(found, os.W_OK | os.X_OK):
        what = "that directory is" if found == logdir else f"{found}, where it would be created, is"
        raise TpukitError(f"tpukit.profile(logdir={str(logdir)!r}): {what} not writable (read-only, or owned by "
                          f"another user), so the trace cannot be written there. {_ELSEWHERE}")
    return logdir


def _create(logdir: Path) -> None:
    """Make ``logdir`` (and its parents), or say in one sentence why it cannot be made and what to do."""
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        probe = logdir / f".tpukit-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise TpukitError(f"tpukit.profile(logdir={str(logdir)!r}): the trace directory cannot be created or written "
                          f"({exc.strerror or type(exc).__name__}{f': {exc.filename}' if exc.filename else ''}). "
                          f"{_ELSEWHERE}") from None


class _Listener:
    """The profile's hooks on the events registry (the Profile itself is not a listener)."""

    def __init__(self, prof: "Profile"):
        # A profile of N steps stops before step N + 1 is launched: it needs each record at once.
        self.exact_steps = prof.steps is not None
        self.on_track_start = lambda tracker: prof._loop_started()
        self.on_step = prof._step
        self.on_track_end = lambda tracker: prof._loop_ended()


class Profile:
    """A profiler capture: a context manager (or :meth:`start`/:meth:`stop`); see :func:`profile`."""

    def __init__(self, logdir: str | os.PathLike | None = None, steps: int | None = None):
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"tpukit.profile(steps=...) takes a positive number of tracked-loop steps to profile, "
                             f"not {steps!r}; leave it out to profile the whole block.")
        self.logdir = _checked(Path(logdir) if logdir is not None else default_logdir())
        self.steps = steps
        self.state = "new"  # new -> armed (waiting for a tracked loop) -> tracing -> done
        self.records: list[StepRecord] = []
        self.trace_file: str | None = None
        self.started: float | None = None
        self.finished: float | None = None
        self._tail_wait = 0.0
        self._error: str | None = None
        self._lock = threading.RLock()
        self._listener = _Listener(self)
        self._read: tuple[TraceStats, str] | None = None

    # -- lifecycle
    def start(self) -> "Profile":
        """Begin: trace now, or with ``steps`` wait for the next tracked loop (or the running one's next step)."""
        with self._lock:
            if self.state != "new":
                raise TpukitError("this profile has already been started; make a new tpukit.profile() for each capture.")
            if self.steps is None:
                self._begin()  # first: if the profiler cannot start, nothing is left registered
            else:
                self.state = "armed"
            events.add_listener(self._listener)
        return self

    def stop(self) -> "Profile":
        """End the capture (waiting for the device first) and write the trace; idempotent."""
        with self._lock:
            if self.state == "done":
                return self
            events.remove_listener(self._listener)
            tracing, self.state = self.state == "tracing", "done"
            if tracing:
                t = time.perf_counter()
                if _xla.runtime_initialized():
                    _xla.wait_device_ops()  # the last step's execution belongs to the profile
                self._tail_wait = time.perf_counter() - t
                self.finished = time.time()
                _xla.profiler_stop()
                self.trace_file = self._find_trace()
        return self

    def __enter__(self) -> "Profile":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def done(self) -> bool:
        """True once the capture ended (the trace is written, if anything was traced)."""
        return self.state == "done"

    def _begin(self, armed: bool = False) -> None:
        try:
            _create(self.logdir)
            _xla.profiler_start(str(self.logdir))
        except (TpukitError, OSError) as exc:
            if not armed:
                raise
            self._error = str(exc)  # from a listener hook: end the profile, say why in summary()
            self.stop()
            return
        self.started, self.state = time.time(), "tracing"

    def _find_trace(self) -> str | None:
        found = [p for p in self.logdir.glob("plugins/profile/*/*.xplane.pb")
                 if p.stat().st_mtime >= (self.started or 0) - 1]
        return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None

    # -- the listener's side
    def _loop_started(self) -> None:
        with self._lock:
            if self.state == "armed":
                self._begin(armed=True)

    def _step(self, record: StepRecord) -> None:
        if record.input_time is None:
            return  # a sync outside a tracked loop: no step to count
        with self._lock:
            if self.state == "armed":  # a tracked loop is running: trace from its next step
                self._begin(armed=True)
            # A step is the profile's when it was launched (synced) after the trace began; records
            # arrive in order, some in a burst, so those of steps launched before are left out.
            elif self.state == "tracing" and record.end > (self.started or 0.0):
                self.records.append(record)
                if self.steps is not None and len(self.records) >= self.steps:
                    self.stop()

    def _loop_ended(self) -> None:
        with self._lock:
            if self.steps is not None and self.state == "tracing":
                self.stop()

    # -- results
    def summary(self, top: int = 10) -> ProfileSummary:
        """Read the trace (with XProf) and return what it shows: a :class:`ProfileSummary`."""
        if not isinstance(top, int) or top < 1:
            raise ValueError(f"summary(top=...) takes a positive number of ops to list, not {top!r}.")
        if self.state != "done":
            raise TpukitError(f"this profile is still {'waiting for a tracked loop' if self.state == 'armed' else 'running'}"
                              "; read its summary after the `with` block (or prof.stop()).")
        if self.trace_file is None:
            raise TpukitError(f"the profile could not start: {self._error}" if self._error else
                              f"no tracked loop ran while this profile waited for {plural(self.steps or 0, 'step')}, so "
                              "nothing was traced; run a tpukit.track() loop inside it." if self.started is None else
                              f"the profiler wrote no .xplane.pb under {self.logdir}/plugins/profile; profile again.")
        if self._read is None:
            trace_events, reader = read_trace(self.trace_file)
            self._read = trace_stats(trace_events), reader
        return self._summarize(*self._read, top)

    def _summarize(self, st: TraceStats, reader: str, top: int) -> ProfileSummary:
        window = max(0.0, (self.finished or time.time()) - (self.started or time.time()))
        recs = [r for r in self.records if r.input_time is not None]
        if recs:
            compiled = [r.step for r in recs if r.compiles]
            settled = compiled[-1] if compiled else recs[0].step - 1
            verdict, source = bottleneck(recs, settled, tail_wait=self._tail_wait), "steps"
            tracing = sum(r.tracing_time or 0.0 for r in recs)
        else:
            verdict, source, tracing = _trace_verdict(st, window), "trace", None
        return ProfileSummary(logdir=str(self.logdir), trace_file=self.trace_file or "", window_s=window,
                              stats=st, top=top, steps=len(recs), tracing_s=tracing, verdict=verdict,
                              verdict_from=source, reader=reader)

    def __repr__(self) -> str:
        what = f", {plural(len(self.records), 'step')}" if self.records else ""
        return f"<tpukit.profile {self.state}{what}, logdir {self.logdir}>"


def _trace_verdict(st: TraceStats, window: float) -> Verdict | None:
    """The bottleneck rule of :func:`tpukit.verdict.bottleneck` over the trace alone (no step
    records): compiling and device busy time are measured; the rest is host time."""
    host = max(0.0, window - st.compile_s - st.busy_s)
    whole = StepRecord(step=1, start=0.0, end=window, compile_time=st.compile_s, input_time=0.0,
                       tracing_time=host, wait_time=0.0, device_time=st.busy_s)
    v = bottleneck([whole])
    if v is None:
        return None
    pct = ", ".join(f"{k} {v.shares[k]:.0%}" for k in ("compile", "tracing", "device"))
    sentence = (f"{v.bottleneck}-bound over the profiled {_dur(window)} (from the trace: {pct} of the wall "
                "time; profile a tpukit.track() loop to measure waiting for input too)")
    return dataclasses.replace(v, sentence=sentence, settled=False)


def profile(logdir: str | os.PathLike | None = None, steps: int | None = None) -> Profile:
    """Capture a profiler trace of a block: ``with tpukit.profile() as prof: ...``, then ``prof.summary()``.

    ``logdir``: where the trace goes (created when missing; default
    ``./tpukit-profiles/<date>-<time>``), readable by TensorBoard's Profile tab and XProf.
    ``steps=N``: trace only the next N steps of a :func:`~tpukit.track` loop, the one that
    starts inside the block or the one running when :meth:`Profile.start` is called
    (``%xla_profile N`` arms this from a cell). Without a tracked loop, the whole block is
    traced; the summary then judges the bottleneck from the trace alone.
    """
    return Profile(logdir, steps)
