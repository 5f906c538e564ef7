"""``track()``: a data loader wrapped so each step is synced once, timed and recorded.

All of one loop's state lives in its :class:`Tracker` (its clock, history,
guard, progress bar) and in the :class:`~tpukit.compiles.LoopContext` it opens on
its thread (the batch of each step and the declared shapes the compile classifier
judges its graphs by), so loops in several threads (``launch()`` runs one thread
per device) never share anything but the listener registry.
"""

from __future__ import annotations

import dataclasses
import dis
import gc
import logging
import math
import os
import statistics
import sys
import time
import types
import warnings
from collections.abc import Mapping
from typing import Any, Iterable, Iterator

from . import _tree, _xla, compiles, events, metrics, runtime, steps, tpu
from ._tree import to_device
from .errors import TpukitWarning
from .guards import StepGuard
from .spmd import device_loader
from .steps import StepRecord
from .tpu.compiler.targets import CHIPS, Chip
from .verdict import NOT_A_TPU, Verdict, bottleneck, model_flops, rate

_END = object()
_DROPS_ITERATOR = ("POP_TOP", "POP_ITER")  # how a frame drops its for loop's iterator (break, return)
log = logging.getLogger("tpukit")


@dataclasses.dataclass(frozen=True)
class Stopped:
    """How a tracked loop ended by an exception: the exception's type name, its message, and the step
    that was running (or whose batch was being fetched) when it was raised."""

    error: str
    message: str
    step: int
    hint: str | None = None  # what/why/fix when the exception is a known failure on XLA (tpukit._xla.traps)

    @classmethod
    def of(cls, exc: BaseException, step: int) -> "Stopped":
        """The record of ``exc`` raised at ``step``."""
        return cls(type(exc).__name__, str(exc), step, _xla.traps.explain(exc))

    def __str__(self) -> str:
        return f"stopped by {self.error} at step {self.step}"


def raised_in(frame: Any) -> BaseException | None:
    """The exception leaving ``frame`` now, or None when the frame left its loop itself (break, return).

    A generator closed while the frame that iterates it unwinds never sees the exception: the interpreter
    sets it aside while the generator runs its ``finally``. The traceback entry the interpreter already
    added for that frame is the one handle on it; one kept from an earlier step is told apart by the
    frame's own instruction, which drops the loop's iterator when it left by itself."""
    if frame is None:
        return None
    code = frame.f_code.co_code
    if 0 <= frame.f_lasti < len(code) and dis.opname[code[frame.f_lasti]] in _DROPS_ITERATOR:
        return None
    for tb in gc.get_referrers(frame):
        if isinstance(tb, types.TracebackType) and tb.tb_frame is frame:
            for exc in gc.get_referrers(tb):
                if isinstance(exc, BaseException) and exc.__traceback__ is tb:
                    return exc
    return None


def batch_size_of(batch: Any) -> int | None:
    """The first dimension of the first tensor in a batch (nested dicts/lists/tuples), or None."""
    for _, leaf in _tree.tree_leaves(batch, lambda x: hasattr(x, "shape")):
        if len(leaf.shape) > 0:
            return int(leaf.shape[0])
    return None


def tokens_of(batch: Any) -> int | None:
    """The tokens of a language model's batch: the element count of a dict batch's ``input_ids`` (its shape
    only: no device read, padding included), else None."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    return math.prod(ids.shape) if hasattr(ids, "shape") else None


# A TPU's name as the runtime or the VM gives it ("v5litepod-8", "TPU v5 lite", "v6e-8"), lower case with
# spaces and "tpu" dropped, by prefix -> its chip (tpukit.tpu.compiler.targets.CHIPS): the first match wins.
_CHIP_PREFIXES = (("v5litepod", "v5e"), ("v5lite", "v5e"), ("v5e", "v5e"), ("v6lite", "v6e"), ("v6e", "v6e"),
                  ("v5p", "v5p"), ("v5", "v5p"), ("v4", "v4"))


def chip_named(name: str | None) -> Chip | None:
    """The chip of a TPU named as the runtime or the TPU VM names it (``v5litepod-8``, ``TPU v5 lite``), or None."""
    key = (name or "").lower().replace(" ", "").replace("tpu", "")
    return next((CHIPS[chip] for prefix, chip in _CHIP_PREFIXES if key.startswith(prefix)), None)


def chip_peak(device_type: str | None, accelerator: str | None, chips: int = 1) -> tuple[float | None, str]:
    """The dense bf16 peak FLOP/s of ``chips`` chips of the TPU called ``accelerator`` and what it is of, or
    None and why there is none: ``"n/a: not a TPU"`` when ``device_type`` (the PJRT device's) is not TPU."""
    if device_type != "TPU":
        return None, NOT_A_TPU
    chip = chip_named(accelerator)
    if chip is None:
        return None, f"n/a: the TPU {accelerator!r} is none of the chips tpukit knows the peak of ({', '.join(CHIPS)})"
    each = chip.peak_bf16_flops
    return each * chips, f"{chips} × {chip.name} at {each / 1e12:g} TFLOP/s (dense bf16)"


def input_signature(batch: Any) -> tuple:
    """``((path, shape, dtype), ...)`` of a batch's tensors: what the classifier compares."""
    return tuple((path, tuple(t.shape), str(t.dtype))
                 for path, t in _tree.tree_leaves(batch, lambda x: hasattr(x, "shape") and hasattr(x, "dtype")))


def _positive(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def declared_shapes(iterable: Any, shapes: Any) -> frozenset:
    """The shapes (tuples) or lengths (ints) a loop declares: ``track(shapes=...)`` or a
    ``BucketBatcher``'s bucket lengths. Anything else is refused with what to pass."""
    usage = ("track(shapes=...) takes a list of sequence lengths (positive ints, e.g. [16, 32, 64]) or of "
             "input shapes (tuples of positive ints, e.g. [(8, 16), (8, 32)])")
    if shapes is not None and (isinstance(shapes, (str, bytes, dict)) or not hasattr(shapes, "__iter__")):
        raise TypeError(f"{usage}; got {shapes!r}.")
    found = list(shapes or ())
    for s in found:
        ok = _positive(s) or (isinstance(s, (tuple, list)) and len(s) > 0 and all(_positive(d) for d in s))
        if not ok:
            raise ValueError(f"{usage}; {s!r} is neither.")
    found += list(getattr(iterable, "buckets", None) or ())
    return frozenset(tuple(s) if isinstance(s, (tuple, list)) else int(s) for s in found)


class Tracker:
    """Iterable returned by :func:`track`; holds the step history of the loop."""

    def __init__(self, iterable: Iterable, total: int | None, device: Any, mesh: Any, progress: bool,
                 desc: str | None, guard: StepGuard | None, dashboard: bool, batch_size: int | None,
                 shapes: Any = None, hint: str | None = None, place: Any = None, alarms: bool = True,
                 model: Any = None):
        self.iterable = iterable
        self.model = model  # for 6·N·tokens where no TPU compiler counts the step's FLOPs (N: its parameters)
        self.alarms = alarms  # one logged line per recompilation (unless the loop's dashboard shows them)
        self.hint = hint  # the loop's own fix for a batch that changed shape (the classifier's hint)
        self.place = place  # CompileEvent -> where it happened in the loop's terms (LoopContext.place)
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.device = device
        self.mesh = mesh
        self.progress = progress
        self.desc = desc
        self.guard = _checked_guard(guard)
        self.batch_size = batch_size
        self.history: list[StepRecord] = []
        self.dashboard = None
        self._want_dashboard = dashboard
        self.declared = declared_shapes(iterable, shapes)
        self.started: float | None = None
        self.finished: float | None = None
        self.follower = None    # the target TPU's follower while the loop ran (None: no target)
        self.tail_wait = 0.0    # seconds waiting for the device after the last step
        self.tail_device = 0.0  # device busy seconds in that wait
        self.compiles_before = 0  # compiles of the work queued before the loop, which it flushed as it began
        self.stopped: Stopped | None = None  # the exception the loop ended by, and at which step

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
        self._open()
        source, on_device = self._source()
        self._start(_progress_bar(self.total, self.desc) if self.progress else None)
        completed = False
        clk = time.perf_counter
        step = 0  # the step running, or whose batch is being fetched
        try:
            with self._loop:
                # A step's logged values are read just before a later step's sync, several
                # steps' at once, and its record is published after that sync (see after_step):
                # the host seldom waits for the device while it could be tracing the next step.
                while True:
                    step += 1
                    t0 = clk()
                    batch = next(source, _END)  # waiting for data, and nothing else
                    if batch is _END:
                        step -= 1  # what is left is the last step's
                        break
                    if not on_device:
                        batch = to_device(batch, self.device)
                    self.before_step(batch, input_time=clk() - t0)
                    try:
                        yield batch
                    except GeneratorExit:  # the loop ended early (break, return, an exception)
                        exc = raised_in(sys._getframe(1))  # the frame of the for loop, unwinding if it raised
                        self.stopped = Stopped.of(exc, step) if exc is not None else None
                        completed = self._end_early()
                        raise
                    self.after_step()
                self._finish()
            completed = True
        except GeneratorExit:
            raise
        except BaseException as exc:  # the data, the sync or the guard raised: the loop ends by it
            self.stopped = self.stopped or Stopped.of(exc, step)  # the guard names the step it judged
            raise
        finally:
            self._close(completed)

    def _end_early(self) -> bool:
        """Close a loop left before its iterable ran out like one that ran out: its last step synced
        and recorded with its logged values, the device waited for, the report shown. The loop may
        have been left by an exception (a generator cannot tell), so nothing here raises."""
        try:
            self.after_step()
            self._finish()
            return True
        except Exception as exc:  # e.g. the step that raised left a graph that cannot run
            log.warning("tpukit: the tracked loop ended early and its last step could not be recorded: %s", exc)
            return False

    # ------------------------------------------------------------------ the manual-step API
    # ``for batch in tracker`` is begin(), before_step()/after_step() around each yielded
    # batch, end(). A loop that is not a for loop over batches (a Trainer callback) calls
    # them itself: begin() on the loop's thread, before_step(batch) before the step is
    # traced, after_step() once the step's work is queued (it syncs, or with sync=False
    # records the sync the loop made itself), end() after the last step.

    def begin(self) -> None:
        """Start the loop: the device, the dashboard, the flush of work queued before it, its clock
        and its :class:`~tpukit.compiles.LoopContext` (opened on this thread until :meth:`end`)."""
        self._open()
        self._start(_progress_bar(self.total, self.desc) if self.progress else None)
        self._loop.__enter__()

    def before_step(self, batch: Any, input_time: float = 0.0, train: bool = True) -> None:
        """The step about to be traced takes ``batch`` (its signature is what the classifier compares;
        ``input_time``: seconds spent waiting for it). Called again in the same step (gradient
        accumulation, an evaluation), it notes the new batch and keeps the step's timing; the tokens of its
        batches add up, but for those given with ``train=False`` (an evaluation's: not trained on)."""
        if self._t1 is None:  # the step's first batch (a step may take several: accumulation, evaluation)
            self._t1 = time.perf_counter()
            self._input_time = input_time
        signature = input_signature(batch)
        self._loop.note_inputs(signature)
        self._n = self.batch_size or batch_size_of(batch)
        self._sig += (signature,)
        tokens = tokens_of(batch) if train else None
        if tokens is not None:  # a step's batches (gradient accumulation's) add up
            self._tokens = (self._tokens or 0) + tokens

    def after_step(self, sync: bool = True, scalars: dict | None = None) -> None:
        """The step's work is queued: read the logged values of earlier steps if they have waited
        long enough (:data:`tpukit.steps.READ_AFTER_S`), sync this step (``sync=False``: the loop
        synced by itself, e.g. the Trainer's data loader), then publish, in order, the records of
        earlier steps whose values are read. A step's record is published after the next step's
        sync at the earliest, once its compiles are classified; while a listener wants exact steps
        (:func:`tpukit.events.wants_exact_steps`: a profile of N steps) every step is read and
        published before the next one is launched. ``scalars``: values already read on the host to
        add to the step's record."""
        clk = time.perf_counter
        t2 = clk()
        exact = events.wants_exact_steps()
        if self._unread.due(t2) or (exact and self._unread.pending):
            self._unread.read()  # waits for every execution launched so far: the loop's wait for the device
        if exact:
            self._publish_read(keep_last=False)  # before this step is launched
        t3, began = clk(), time.time()
        if sync:
            self._loop.sync(_xla.sync)  # named after the loop: its compiles are judged with its batches
        t4 = clk()
        self._ties.close()  # the first step's models are checked
        t1 = self._t1 if self._t1 is not None else t2
        times = {"input_time": self._input_time, "tracing_time": (t2 - t1) + (t4 - t3), "wait_time": t3 - t2}
        # The sync's wait for the previous step's execution is the device's time, not tracing.
        rec = self._clock.tick(dict(scalars or {}), self._n, settle=0, sync=(began, t4 - t3) if sync else None,
                               tokens=self._tokens, **times)
        self._unread.add(rec, steps.take_synced(), self._clock.span, t4)
        self._sigs[rec.step] = self._seen.setdefault(self._sig, self._sig)  # one copy of each signature
        self._t1, self._input_time, self._tokens, self._sig = None, 0.0, None, ()
        self._publish_read(keep_last=True)  # while the device runs this step

    def end(self, completed: bool = True) -> None:
        """End the loop: wait for the device, record the last step, close the loop context, and (when
        ``completed``) show the dashboard's report."""
        try:
            if completed:
                self._finish()
        finally:
            self._loop.__exit__(None, None, None)
            self._close(completed)

    def _open(self) -> None:
        if self.device is None:
            self.device = _xla.device()
        if self._want_dashboard and self.dashboard is None:
            self.dashboard = dashboard(batch_size=self.batch_size)

    def _start(self, bar: Any) -> None:
        self._bar = bar
        steps.loop_started()  # first, so the flush below is not a free-standing step
        before = metrics.snapshot()
        # Flush work queued before the loop (a model built or evaluated on the device) so step 1
        # measures only itself; its graphs are that earlier code's, placed apart from the steps'.
        compiles.flush(_xla.sync)
        self._clock = steps.Clock()
        self.compiles_before = (self._clock.last - before).compiles  # in no step: summary() says them apart
        steps.ensure_hook()
        self._loop = compiles.LoopContext(self.declared, self.hint, self.place)
        self._unread = steps.Unread()
        self._t1: float | None = None
        self._input_time = 0.0
        self._n: int | None = None
        self._tokens: int | None = None  # the step's tokens so far (tokens_of its batches)
        self._sig: tuple = ()  # the input signatures of the step's batches
        self._sigs: dict[int, tuple] = {}  # step -> its batches' signatures (which graphs it ran)
        self._seen: dict[tuple, tuple] = {}  # each distinct step signature, once
        self._graphs: dict[tuple, tuple] = {}  # signatures -> the graphs of the last step with them that compiled
        self._parameters: int | None = None
        self._chips = _xla.device_count() if _xla.is_spmd() else 1  # the chips one step runs on
        rt = runtime.current()
        names = [n for n in (rt.accelerator_type if rt else None, os.environ.get("TPU_ACCELERATOR_TYPE")) if n]
        accelerator = next((n for n in names if chip_named(n)), names[0] if names else None)  # the runtime's, or the VM's
        self.peak = chip_peak(_xla.device_type(), accelerator, self._chips)  # (FLOP/s or None, of what)
        self.started = time.time()
        self.stopped = None
        self.follower = tpu.follower()
        self._ties = _xla.ties.FirstStep("tpukit.track")  # weights the move to the device untied: tied again
        events.call("on_track_start", self)

    def _finish(self) -> None:
        if self._unread:
            a = time.perf_counter()
            _xla.wait_device_ops()  # the loop is done when the device is
            self.tail_wait = time.perf_counter() - a
            self.tail_device = self._clock.drain()
            self._unread.read()
            self._publish_read(keep_last=False)

    def _close(self, completed: bool) -> None:
        self._ties.close()
        steps.loop_ended()
        if self.stopped is not None and self.stopped.hint:  # said above the traceback it explains
            warnings.warn(f"tpukit.track: {self.stopped}: {self.stopped.hint}", TpukitWarning, stacklevel=3)
        self.finished = time.time()
        if self._bar is not None:
            self._bar.close()
        events.call("on_track_end", self)
        if completed and self.dashboard is not None:
            self.dashboard.report()

    def _publish_read(self, keep_last: bool) -> None:
        """Publish, oldest first, the steps whose logged values are read (``keep_last``: not the newest)."""
        for rec, span in self._unread.take_read(keep_last):
            self._publish(rec, span, self._bar)

    def _publish(self, rec: StepRecord, span: tuple, bar: Any) -> None:
        """Settle a step's record (its compiles classified), keep it and send it to the listeners."""
        rec = steps.Clock.settle(rec, span)  # classified by now (their HLO arrives after the sync)
        self._note_graphs(rec)
        rec = self.rated(rec)
        self.history.append(rec)
        events.call("on_step", rec)
        if self.alarms and self.dashboard is None:
            for ev in rec.recompilations:  # the alarms, said as they happen (the dashboard shows its own)
                log.warning("tpukit: %s", compiles.describe(ev, step=rec.step))
        if bar is not None:
            bar.update(1)
            if rec.scalars:
                bar.set_postfix({k: f"{v:.4g}" for k, v in list(rec.scalars.items())[:3]}, refresh=False)
        if self.guard is not None:
            try:
                self.guard.check(rec)
            except BaseException as exc:
                self.stopped = Stopped.of(exc, rec.step)
                raise

    def rated(self, rec: StepRecord) -> StepRecord:
        """``rec`` with its model FLOPs and the chips' peak: the TPU compiler's count for the target when it
        has answered for every graph the step ran (its per-chip count times the chips an SPMD graph is
        partitioned over: the step's total), else 6·N·tokens when the loop knows its model (``track(model=
        ...)``) and the step's tokens; None otherwise. A step that compiled nothing ran the graphs of the last
        step with the same batch shapes that compiled (:meth:`_note_graphs`)."""
        flops, source = self._compiler_flops(self._graphs.get(self._sigs.get(rec.step, ()), ()))
        if flops is None and rec.tokens and self.model is not None:
            if self._parameters is None:  # counted once, after the first step re-tied any tied weights
                self._parameters = sum(p.numel() for p in self.model.parameters())
            flops = model_flops(self._parameters, rec.tokens)
            source = f"6·N·tokens (N = {self._parameters:,} parameters, tokens = input_ids elements)" + source
        return dataclasses.replace(rec, flops=flops, flops_source=source if flops is not None else None,
                                   peak_flops=self.peak[0], peak_source=self.peak[1])

    def _note_graphs(self, rec: StepRecord) -> None:
        """A published step that compiled: its graphs are those its batch shapes run, until another compiles."""
        found = tuple(e for e in rec.compile_events if not e.eager)
        if found:
            self._graphs[self._sigs.get(rec.step, ())] = found

    def _compiler_flops(self, graphs: tuple) -> tuple[float | None, str]:
        """The TPU compiler's count of the FLOPs of ``graphs`` (all answered) and its source; else None and
        what to add to the fallback's source (the target's count still to come)."""
        if self.follower is None or not graphs:
            return None, ""
        answers = [(e, self.follower.estimate_of(e)) for e in graphs]
        if any(est is None or est.flops is None for _, est in answers):
            return None, f"; the TPU compiler's count for {self.follower.target.name} not in yet"
        parts = [e.graph.partitions if e.graph is not None else self._chips for e, _ in answers]
        total = sum(est.flops * p for (_, est), p in zip(answers, parts))
        each = "per chip" if max(parts) == 1 else f"per chip × the {max(parts)} chips of the SPMD graph"
        return total, f"the TPU compiler for {self.follower.target.name} ({each})"

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
        return bottleneck(self.history, self.settled_after(), self.tail_wait, self.tail_device)

    def summary(self, wait: float = 2.0) -> dict:
        """Steps, compiles by kind (``compiles``: those of the loop's steps, eager mode's per-op compiles
        among them, also counted apart with their ops and lines; ``compiles_before``: those of the work
        queued before the loop, which it ran as it began, in no step: a dashboard counts both), when the
        loop settled, median step time, the bottleneck with its measured shares, the last scalars of the
        loop, and with a target TPU (``setup(target=...)``) ``"tpu"``: per graph of the loop, what the TPU
        compiler said (None when no target is set). It waits at most ``wait`` seconds for the answers still
        on their way (a large graph takes the compiler minutes); a graph it has no answer for yet has
        ``"pending": True``: ask again later, or pass a longer ``wait``. ``"stopped"``: None when the loop ran
        out or was left by ``break``/``return``; when an exception ended it, ``{"error": its type's name,
        "message": ..., "step": the step it was raised in}``. How fast, over the steady steps (none
        compiled): ``tokens_per_s``, ``flops_per_step`` and ``flops_source`` (whose count: the TPU compiler's
        for the target once it answered, else 6·N·tokens), ``tflops`` (achieved), ``mfu`` (None off a TPU)
        and ``mfu_note`` (``38% of 1 × v5e at 197 TFLOP/s (dense bf16)``, or ``n/a: not a TPU``)."""
        h = self.history
        steady = [r.wall for r in h if r.compiles == 0] or [r.wall for r in h]
        kinds = [e.kind for r in h for e in r.compile_events]
        tpu_rows = _tpu_rows(self.follower, [e for r in h for e in r.compile_events], wait)
        # The steady steps again, now that the TPU compiler may have answered for their graphs.
        speed = rate([self.rated(r) for r in ([r for r in h if r.compiles == 0] or h)])
        v = self.verdict()
        eager = sum(r.eager_compiles for r in h)
        places = list(dict.fromkeys(f"{e.cause} at {e.where}" for r in h for e in r.compile_events if e.eager))
        return {
            "stopped": dataclasses.asdict(self.stopped) if self.stopped else None,
            "steps": len(h),
            "compiles": sum(r.compiles for r in h),
            "compiles_before": self.compiles_before,
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
            "tokens_per_s": speed.tokens_per_s,
            "flops_per_step": speed.flops_per_step,
            "flops_source": speed.flops_source,
            "tflops": speed.tflops,
            "mfu": speed.mfu,
            "mfu_note": speed.mfu_note,
            "tpu": tpu_rows,
        }


def _checked_guard(guard: Any) -> Any:
    """``guard`` if it is one (an object with ``check(record)``), refused before the loop starts otherwise."""
    if guard is None or callable(getattr(guard, "check", None)):
        return guard
    name = getattr(guard, "__name__", None)
    if name in ("no_recompile_after", "StepGuard"):
        raise TypeError(f"guard=tpukit.{name} must be called: guard=tpukit.no_recompile_after(2) "
                        "(the number of warm-up steps allowed to compile).")
    raise TypeError(f"guard={guard!r} is not a step guard; pass guard=tpukit.no_recompile_after(N), "
                    "which raises on a recompilation after N warm-up steps.")


def _tpu_rows(follower: Any, found: list, wait: float) -> list[dict] | None:
    """What the target TPU's compiler said about each graph of ``found`` (None: no target was set),
    waiting at most ``wait`` seconds for it."""
    if follower is None:
        return None
    rows = []
    for ev, est in follower.estimates_for(found, timeout=wait):
        row = {"graph": ev.name, "target": follower.target.name, "answered": est is not None,
               "pending": est is None}
        if est is not None:
            row.update(fits=est.fits, status=est.status, hbm_bytes=est.hbm_bytes, hbm_source=est.hbm_source,
                       hbm_limit_bytes=est.hbm_limit_bytes,
                       compile_s=est.compile_s, step_s_min=est.step_s_min, bound=est.bound, message=est.message,
                       compiler=est.compiler, compiler_name=est.compiler_name)
        rows.append(row)
    return rows


def _progress_bar(total: int | None, desc: str | None):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but never let progress break training
        return None
    return tqdm(total=total, desc=desc or "steps", unit="step", leave=True)


def track(iterable: Iterable, *, total: int | None = None, device: Any = None, mesh: Any = None,
          progress: bool = True, desc: str | None = None, guard: StepGuard | None = None,
          dashboard: bool = False, batch_size: int | None = None, shapes: Any = None,
          alarms: bool = True, model: Any = None) -> Tracker:
    """Wrap a data loader: batches arrive on the device, each step is synced once and recorded.

    Use it as a plain ``for`` loop. A ``torch.utils.data.DataLoader`` (or any
    loader when ``mesh`` is given) goes through torch_xla's parallel loader, which
    overlaps host-to-device copies with compute; other iterables are moved batch
    by batch. Progress shows with tqdm.auto unless ``progress=False``. ``guard``
    takes :func:`~tpukit.no_recompile_after`; ``dashboard=True`` opens the live
    dashboard and renders its static report at the end. ``shapes``: the input
    shapes (tuples) or sequence lengths (ints) the loop is meant to compile for
    (a ``BucketBatcher``'s buckets are taken by themselves): their first compile
    is *expected*, not a recompilation. Each recompilation (the alarm: the same computation
    compiled again for a changed shape or value) is said in one line as its step is recorded,
    through the ``tpukit`` logger (a warning: stderr unless logging is configured otherwise),
    with its step, cause and fix; ``alarms=False`` keeps quiet (``summary()`` still counts
    them), and with ``dashboard=True`` the dashboard shows them instead. ``model``: the model the loop
    trains, for its steps' model FLOPs by 6·N·tokens (a language model's dict batch with ``input_ids``) where
    no target TPU's compiler counted them: each record then has ``tokens``, ``flops``, ``flops_source`` and,
    on a TPU, the MFU against the chips' peak (see docs/dashboard.md). The returned
    :class:`Tracker` keeps ``history`` (one :class:`StepRecord` per step), ``summary()`` and
    ``verdict()``.
    """
    return Tracker(iterable, total, device, mesh, progress, desc, guard, dashboard, batch_size, shapes,
                   alarms=alarms, model=model)


def dashboard(**options: Any) -> Any:
    """Open the live compile/execute dashboard (``tpukit.widgets.Dashboard``) and return it.

    Widgets in a notebook front end, a periodic text summary elsewhere.
    """
    return events.open_dashboard(**options)
