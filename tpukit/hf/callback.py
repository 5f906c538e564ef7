"""``tpukit.hf.Callback``: the kit inside a ``transformers.Trainer`` (``callbacks=[tpukit.hf.Callback()]``).

The Trainer owns its loop, so the callback drives a :class:`tpukit.Tracker` through its
manual-step API: ``begin()`` at ``on_train_begin`` (after the checks of
:mod:`tpukit.hf.checks`, before anything compiles), ``before_step(batch)`` from a forward
pre-hook on the model (the batch the collator produced, by its keys: ``input_ids: (8, 38)
-> (8, 42)``), ``after_step(sync=False)`` when the next optimizer step begins, and
``end()`` at ``on_train_end``. The Trainer syncs by itself (its XLA data loader when it
fetches the next batch, its logging, its evaluation), so one record per optimizer step
(``state.global_step``) holds all the syncs of that step. The loop's hint for a batch
that changed shape names the Trainer's collator and the fix.

``Callback`` is a plain class, not a subclass of ``transformers.TrainerCallback``: importing
transformers' ``TrainerCallback`` imports accelerate, which imports torch_xla, and a torch_xla
loaded before ``tpukit.setup()`` leaves compile tracing off for the process (no causes, no
recompilation alarms, no TPU rows). The Trainer calls each callback's events by name
(``on_train_begin``, ``on_step_begin``, ...), so the events tpukit does not use are answered
as ``TrainerCallback`` answers them: by doing nothing. Neither ``tpukit.hf.Callback`` nor
``Callback()`` imports transformers or torch_xla.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import compiles, runtime, tpu
from ..guards import StepGuard
from ..track import Tracker
from . import checks

# Callbacks whose training is running, per thread: a train() that raised (an interrupted cell, an
# out-of-memory error) never calls on_train_end, so the next one on that thread ends its loop first.
_RUNNING: dict[int, "Callback"] = {}
TRAIN_PLACE = "the Trainer's training step"
EVAL_PLACE = "the Trainer's evaluation"


class Callback:
    """The kit inside a ``transformers.Trainer``: ``Trainer(..., callbacks=[tpukit.hf.Callback()])``.

    ``dashboard``: open tpukit's live dashboard for the run (its report at the end).
    ``guard``: ``tpukit.no_recompile_after(k)``, raising on a recompilation after ``k`` steps.
    ``target``: a TPU (``"v5e-1"``): from the start of training every graph is also compiled for it by
    the TPU compiler, in its worker process, as ``tpukit.setup(target=...)`` does (the dashboard's TPU
    rows, ``summary()["tpu"]``); needs the ``tpu-estimate`` extra, checked when training starts.
    ``warmup``: the steps after which a value read mid-step counts in ``summary()["forced_reads"]``.
    After training: ``tracker`` (its ``history``: one StepRecord per optimizer step),
    ``summary()``, ``verdict()``, ``warnings`` (what the start-of-training checks found).
    """

    __module__ = "tpukit.hf"  # its public name

    def __init__(self, dashboard: bool = True, target: Any = None, guard: StepGuard | None = None,
                 warmup: int = 2):
        if guard is not None and not isinstance(guard, StepGuard):
            raise TypeError("Callback(guard=...) takes tpukit.no_recompile_after(k).")
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"Callback(warmup={warmup!r}) needs a non-negative int.")
        if target is not None:
            target = tpu.target(target)
        self.dashboard, self.target, self.guard, self.warmup = dashboard, target, guard, warmup
        self.tracker: Tracker | None = None
        self.collator: Any = None
        self.warnings: list[str] = []
        self._made: list[str] = []  # what on_init_end fixed in its Trainer (said again in warnings)
        self._followed: tuple | None = None  # (the follower before, the run's own) while a run follows its target
        self._hook: Any = None
        self._in_step = False
        self._logs: dict[str, float] = {}
        self._evals: list[list[Any]] = []  # [mark at the first eval forward, mark at on_evaluate]
        self._thread: int | None = None

    def __getattr__(self, name: str) -> Any:
        """An event of the Trainer that tpukit does not use (``on_save``, ``on_prediction_step``, ...,
        and any a later transformers adds): nothing to do, as ``TrainerCallback``'s own events do."""
        if name.startswith("on_"):
            return _nothing
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ the Trainer's events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer is built: refuse what cannot work on XLA now, before ``train()`` (an FSDPv2 Trainer's
        traps: :func:`~.checks.check_fsdp_v2`); an FSDP-XLA Trainer gets the optimizer its ``train()`` would
        not make (:func:`~.checks.fix_fsdp_xla_optimizer`)."""
        checks.refuse(args)
        trainer = checks.trainer_of(self)
        self._made = checks.check_fsdp_v2(args, kwargs.get("model", getattr(trainer, "model", None)))
        if trainer is not None and checks.fix_fsdp_xla_optimizer(trainer):
            self._made.append(checks.FSDP_XLA_OPTIMIZER)
            checks._warn(checks.FSDP_XLA_OPTIMIZER)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, eval_dataloader: Any = None, **kwargs: Any) -> None:
        """Check the setup (before anything compiles), then start the tracked loop and hook the model."""
        self.warnings = self._made + checks.check_training(args, optimizer, train_dataloader, eval_dataloader)
        stale = _RUNNING.pop(threading.get_ident(), None)
        if stale is not None:
            stale._abandon()
        self._followed = None
        if self.target is not None:
            before = tpu.follower()
            # before the first compile, so every graph is sent
            self._followed = (before, tpu.follow(runtime.tpu_target(self.target.name, ready=True)))
        self.collator = checks.collator_of(train_dataloader)
        batch = int(getattr(args, "per_device_train_batch_size", 0) or 0) or None
        self.tracker = Tracker((), state.max_steps or None, None, None, False, None, self.guard, self.dashboard,
                               batch, shapes=getattr(self.collator, "buckets", None),
                               hint=checks.shape_hint(self.collator), place=self.place)
        self._thread = threading.get_ident()
        if model is not None:
            self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._in_step, self._logs, self._evals = False, {}, []
        self.tracker.begin()
        _RUNNING[self._thread] = self

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The previous optimizer step is over: its syncs (the loader's fetch of this batch) are made."""
        self._step_over()
        self._in_step = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        """The Trainer's logged values (already on the host) go into the step's record."""
        for k, v in (logs or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._logs[k] = float(v)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An evaluation ended: its compiles are placed at the Trainer's evaluation."""
        if self._evals and self._evals[-1][1] is None:
            self._evals[-1][1] = compiles.mark()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer synced the epoch's last step: record it."""
        self._step_over()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the last step, end the loop (the dashboard's report), unhook the model."""
        if self.tracker is None:
            return
        try:
            self._step_over()
            self.tracker.end(completed=True)
        finally:
            self._unhook()
            _RUNNING.pop(self._thread, None)

    # ------------------------------------------------------------------ internals
    def _before_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.tracker is None or threading.get_ident() != self._thread:
            return
        if not module.training and (not self._evals or self._evals[-1][1] is not None):
            self._evals.append([compiles.mark(), None])
        self.tracker.before_step(kwargs if kwargs else args)

    def _step_over(self) -> None:
        if not self._in_step or self.tracker is None:
            return
        self._in_step = False
        logs, self._logs = self._logs, {}
        try:
            self.tracker.after_step(sync=False, scalars=logs)
        except BaseException:  # a guard's RecompilationError: close the loop, then let it out
            self._abandon()
            raise

    def _abandon(self) -> None:
        """End a training that will not reach on_train_end (an exception left train())."""
        if _RUNNING.get(self._thread) is self:
            del _RUNNING[self._thread]
        self._unhook()
        self._in_step = False
        if self.tracker is not None and self.tracker.finished is None:
            self.tracker.end(completed=False)

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._followed:  # the run's target ends with the run; the user's own comes back
            before, mine = self._followed
            self._followed = None
            if before is not mine:
                tpu.unfollow(mine)
                if before is not None:
                    tpu.follow(before)

    def place(self, event: Any) -> str:
        """Where a compile happened, in the Trainer's terms (its training step or its evaluation, then
        the user's ``trainer.train()`` line). The reader calls it as it classifies ``event``, so every
        surface (dashboard, report, guard, ``summary()``) shows the same place."""
        for start, stop in list(self._evals):
            if not start.before(event) and (stop is None or stop.before(event)):
                return f"{EVAL_PLACE} (trainer.train() at {event.line})"
        return f"{TRAIN_PLACE} (trainer.train() at {event.line})"

    # ------------------------------------------------------------------ results
    def verdict(self) -> Any:
        """Where the run's time went (see :meth:`tpukit.Tracker.verdict`); None before training."""
        return self.tracker.verdict() if self.tracker else None

    def summary(self, wait: float = 2.0) -> dict:
        """``Tracker.summary(wait)`` of the run plus ``alarms`` (one line per recompilation: place, evidence
        and hint), ``forced_reads`` (values read from the device mid-step after ``warmup`` steps),
        ``collator`` and ``warnings`` (the start-of-training checks)."""
        if self.tracker is None:
            raise RuntimeError("Callback.summary(): the Trainer has not started training with this callback yet.")
        out = self.tracker.summary(wait)
        h = self.tracker.history
        out["alarms"] = [compiles.describe(e) for r in h for e in r.recompilations]
        out["forced_reads"] = sum(r.item_reads for r in h if r.step > self.warmup)
        out["collator"] = checks.collator_name(self.collator)
        out["warnings"] = list(self.warnings)
        return out


def _nothing(*args: Any, **kwargs: Any) -> None:
    """A Trainer event tpukit does not use (it returns no control, as TrainerCallback's own do)."""
    return None
