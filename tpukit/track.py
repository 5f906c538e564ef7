"""``track()``: a data loader wrapped so each step is synced once, timed and recorded.

All of one loop's state lives in its :class:`Tracker` (its clock, history,
guard, progress bar), so loops in several threads (``launch()`` runs one
thread per device) never share anything but the listener registry.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Iterable, Iterator

from . import _tree, _xla, compiles, events, steps
from .guards import StepGuard
from .spmd import device_loader
from .steps import StepRecord, Verdict

_END = object()


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (nested dicts/lists/tuples), or None."""
    for _, leaf in _tree.tree_leaves(batch, lambda x: hasattr(x, "shape")):
        if len(leaf.shape) > 0:
            return int(leaf.shape[0])
    return None


def input_signature(batch: Any) -> tuple:
    """``((path, shape, dtype), ...)`` of a batch's tensors: what the classifier compares."""
    return tuple((path, tuple(t.shape), str(t.dtype))
                 for path, t in _tree.tree_leaves(batch, lambda x: hasattr(x, "shape") and hasattr(x, "dtype")))


def declared_shapes(iterable: Any, shapes: Any) -> frozenset:
    """The shapes (tuples) or lengths (ints) a loop declares: ``track(shapes=...)`` or a
    ``BucketBatcher``'s bucket lengths."""
    found = list(shapes or ())
    found += list(getattr(iterable, "buckets", None) or ())
    return frozenset(tuple(s) if isinstance(s, (tuple, list)) else int(s) for s in found)


def to_device(batch: Any, device: Any) -> Any:
    """Move every tensor of a (nested) batch to ``device``; Mappings such as
    transformers' BatchEncoding become plain dicts when they cannot be rebuilt."""
    def move(t: Any, _path: str) -> Any:
        return t if t.device == device else t.to(device)

    return _tree.tree_map(move, batch, lambda x: hasattr(x, "to") and hasattr(x, "device"))


class Tracker:
    """Iterable returned by :func:`track`; holds the step history of the loop."""

    def __init__(self, iterable: Iterable, total: int | None, device: Any, mesh: Any, progress: bool,
                 desc: str | None, guard: StepGuard | None, dashboard: bool, batch_size: int | None,
                 shapes: Any = None):
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.device = device
        self.mesh = mesh
        self.progress = progress
        self.desc = desc
        self.guard = guard
        self.batch_size = batch_size
        self.history: list[StepRecord] = []
        self.dashboard = None
        self._want_dashboard = dashboard
        self.declared = declared_shapes(iterable, shapes)
        self.started: float | None = None
        self.finished: float | None = None
        self.tail_wait = 0.0    # seconds waiting for the device after the last step
        self.tail_device = 0.0  # device busy seconds in that wait

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this tracker wraps an iterable without a length")
        return self.total

    def _source(self) -> tuple[Iterator, bool]:
        """The batch iterator and whether it syncs by itself (torch_xla's device loader does)."""
        from torch.utils.data import DataLoader

        if isinstance(self.iterable, DataLoader) or self.mesh is not None:
            # Background copies, but the sync stays ours, so waiting for data is measured apart.
            return iter(device_loader(self.iterable, mesh=self.mesh, device=self.device, sync=False)), True
        return iter(self.iterable), False

    def __iter__(self) -> Iterator:
        if self.device is None:
            self.device = _xla.device()
        if self._want_dashboard and self.dashboard is None:
            self.dashboard = dashboard(batch_size=self.batch_size)
        source, on_device = self._source()
        bar = _progress_bar(self.total, self.desc) if self.progress else None
        steps.loop_started()  # first, so the flush below is not a free-standing step
        _xla.sync()  # flush work queued before the loop so step 1 measures only itself
        clock = steps.Clock()
        steps.ensure_hook()
        compiles.declare_shapes(self.declared)
        self.started = time.time()
        events.call("on_track_start", self)
        completed = False
        clk = time.perf_counter
        try:
            # A step's logged values are read, and its record published, once the
            # *next* step has been traced and just before that step's sync: the
            # host never waits for the device while it could be tracing, and the
            # sync would have waited for the previous execution anyway.
            held: tuple[StepRecord, list] | None = None
            while True:
                t0 = clk()
                batch = next(source, _END)  # waiting for data, and nothing else
                if batch is _END:
                    break
                if not on_device:
                    batch = to_device(batch, self.device)
                t1 = clk()
                compiles.note_inputs(input_signature(batch))
                n = self.batch_size or batch_size_of(batch)
                yield batch
                t2 = clk()
                if held is not None:
                    self._record(*held, bar, wait=2.5)
                    held = None
                t3 = clk()
                _xla.sync()
                t4 = clk()
                times = {"input_time": t1 - t0, "tracing_time": (t2 - t1) + (t4 - t3), "wait_time": t3 - t2}
                held = (clock.tick({}, n, **times), steps.take_synced())
            if held is not None:
                a = clk()
                _xla.wait_device_ops()  # the loop is done when the device is
                self.tail_wait = clk() - a
                self.tail_device = clock.drain()
                self._record(*held, bar, wait=3.0)
            completed = True
        finally:
            steps.loop_ended()
            compiles.declare_shapes(())
            compiles.note_inputs(None)
            self.finished = time.time()
            if bar is not None:
                bar.close()
            events.call("on_track_end", self)
            if completed and self.dashboard is not None:
                self.dashboard.report()

    def _record(self, rec: StepRecord, values: list, bar: Any, wait: float = 0.0) -> None:
        if values:
            rec = dataclasses.replace(rec, scalars=steps.read_values(values))
        if rec.compile_events:  # classified since the step was ticked (their HLO arrives after the sync)
            rec = dataclasses.replace(rec, compile_events=compiles.current(rec.compile_events, wait))
        self.history.append(rec)
        events.call("on_step", rec)
        if bar is not None:
            bar.update(1)
            if rec.scalars:
                bar.set_postfix({k: f"{v:.4g}" for k, v in list(rec.scalars.items())[:3]}, refresh=False)
        if self.guard is not None:
            self.guard.check(rec)

    def step_times(self) -> list[float]:
        """Wall seconds of each step."""
        return [r.wall for r in self.history]

    def settled_after(self) -> int | None:
        """The last step that compiled, when the loop then ran at least 2 steps (and a fifth
        of the loop) without compiling; None when it never settled. 0: it never compiled."""
        h = self.history
        compiled = [r.step for r in h if r.compiles]
        if not compiled:
            return 0 if h else None
        last = compiled[-1]
        quiet = sum(1 for r in h if r.step > last)
        return last if quiet >= max(2, len(h) // 5) else None

    def verdict(self) -> Verdict | None:
        """Where the time went: the bottleneck over the steady steps (or all, if it never settled)."""
        return steps.bottleneck(self.history, self.settled_after(), self.tail_wait, self.tail_device)

    def summary(self) -> dict:
        """Steps, compiles by kind (eager mode's per-op compiles among them, also counted apart with
        their ops and lines), when the loop settled, median step time, the bottleneck with its
        measured shares, and the last scalars of the loop."""
        h = self.history
        steady = [r.wall for r in h if r.compiles == 0] or [r.wall for r in h]
        kinds = [e.kind for r in h for e in r.compile_events]
        v = self.verdict()
        eager = sum(r.eager_compiles for r in h)
        places = list(dict.fromkeys(f"{e.cause} at {e.where}" for r in h for e in r.compile_events if e.eager))
        return {
            "steps": len(h),
            "compiles": sum(r.compiles for r in h),
            "recompilations": sum(len(r.recompilations) for r in h),
            "new_graphs": kinds.count("new graph"),
            "expected_compiles": kinds.count("expected"),
            "eager_compiles": eager,
            "eager_note": f"{eager} of the compiles: {compiles.EAGER_NOTE}: {', '.join(places)}" if eager else None,
            "settled_after": self.settled_after(),
            "median_step_s": statistics.median(steady) if steady else math.nan,
            "total_s": (self.finished or time.time()) - (self.started or time.time()),
            "bottleneck": v.bottleneck if v else None,
            "shares": dict(v.shares) if v else {},
            "verdict": f"{v.sentence}; {v.suggestion}" if v else None,
            "last_scalars": dict(h[-1].scalars) if h else {},
        }


def _progress_bar(total: int | None, desc: str | None):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but never let progress break training
        return None
    return tqdm(total=total, desc=desc or "steps", unit="step", leave=True)


def track(iterable: Iterable, *, total: int | None = None, device: Any = None, mesh: Any = None,
          progress: bool = True, desc: str | None = None, guard: StepGuard | None = None,
          dashboard: bool = False, batch_size: int | None = None, shapes: Any = None) -> Tracker:
    """Wrap a data loader: batches arrive on the device, each step is synced once and recorded.

    Use it as a plain ``for`` loop. A ``torch.utils.data.DataLoader`` (or any
    loader when ``mesh`` is given) goes through torch_xla's parallel loader, which
    overlaps host-to-device copies with compute; other iterables are moved batch
    by batch. Progress shows with tqdm.auto unless ``progress=False``. ``guard``
    takes :func:`~tpukit.no_recompile_after`; ``dashboard=True`` opens the live
    dashboard and renders its static report at the end. ``shapes``: the input
    shapes (tuples) or sequence lengths (ints) the loop is meant to compile for
    (a ``BucketBatcher``'s buckets are taken by themselves): their first compile
    is *expected*, not a recompilation. The returned :class:`Tracker` keeps
    ``history`` (one :class:`StepRecord` per step), ``summary()`` and ``verdict()``.
    """
    return Tracker(iterable, total, device, mesh, progress, desc, guard, dashboard, batch_size, shapes)


def dashboard(**options: Any) -> Any:
    """Open the live compile/execute dashboard (``tpukit.widgets.Dashboard``) and return it.

    Widgets in a notebook front end, a periodic text summary elsewhere.
    """
    return events.open_dashboard(**options)
