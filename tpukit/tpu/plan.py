"""``tpukit.plan``: will a decoder LM's fine-tune fit a target, at which batch per sequence length, per mode.

One call, one table: for each mode (:mod:`.modes`: full, LoRA, + per-layer checkpointing, + bf16, FSDP) the
largest batch at each sequence length and the longest sequence at batch 1, each cell saying who decided it:

- :data:`DECIDED`: the compiler (a full compile fitted that size and refused the next);
- :data:`PLANNED`: the compiler's buffer assignment (the compile stopped there, before code generation, most
  of its time: :func:`.ask.ask` with ``early=True``) allocates that size within the usable HBM and the next
  size beyond it;
- :data:`PREDICTED`: the kit, from the HBM the compiles made so far gave, fitted per mode as
  ``F + batch * (a * length + c * length**2)`` (weights, gradients and optimizer state; activations; the
  attention's scores).

The work is in three rounds, so the answer improves as it goes and a time budget ends it with the best so
far: a few design points per mode (every cell predicted), the edge of each cell by buffer assignments
(planned), then one cell per mode by full compiles (decided). Every compile records the HBM the model
predicted for it before it ran: :meth:`~.table.Plan.errors` is the prediction's measured error. The records
and their forms (text, HTML, chart) are :mod:`.table`'s.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

from .. import _xla
from . import progress as _progress
from .ask import ask, begin, resolve
from .compiler.pins import Compiler
from .compiler.targets import Target
from .compiler.worker import BudgetSpent
from .modes import Built, Mode, build, model_name
from .advice import OUT_OF_TIME, wide_target
from .estimate import NEAR_LIMIT
from .outcome import PLANNED, Suggestion, TpuEstimate
from .table import DECIDED, FAILED, PREDICTED, Cell, Fit, Plan, Point
from .trace import trace
LENGTHS = (512, 1024, 2048, 4096, 8192)
MODES = ("full", "lora", "lora+ckpt")


class _Grid:
    """The sizes tried along one axis: multiples of ``unit`` up to ``8 * unit`` then of ``8 * unit`` (batches),
    or of ``unit`` up to ``wide_from`` then of ``wide`` (lengths), between ``unit`` and ``top``."""

    def __init__(self, unit: int, wide_from: int, wide: int, top: int | None = None):
        self.unit, self.wide_from, self.wide, self.top = unit, wide_from, wide, top

    def step(self, n: int) -> int:
        return self.unit if n < self.wide_from else self.wide

    def floor(self, x: float) -> int:
        """The largest size at most ``x`` (0 when below the first)."""
        if x < self.unit:
            return 0
        x = min(x, self.top) if self.top else x
        s = self.step(int(x))
        return int(x) // s * s

    def next(self, n: int) -> int | None:
        up = n + self.step(n) if n else self.unit
        return None if self.top and up > self.top else up

    def prev(self, n: int) -> int:
        if n <= self.unit:
            return 0
        return n - self.step(n - 1)


def held_bytes(est: TpuEstimate) -> int | None:
    """What the chip must hold at once while the step runs: the buffer assignment's allocations (a compile
    stopped there), else the compiled program's arguments + outputs + temporaries + code - donated; None for a
    refusal (its need counts the program alone)."""
    if est.hbm_source == PLANNED:
        return est.hbm_bytes
    if not est.fits or est.temp_bytes is None:
        return None
    return est.arguments_bytes + est.outputs_bytes + est.temp_bytes + est.code_bytes - est.aliased_bytes


def holds(est: TpuEstimate) -> bool:
    """Whether the step fits, as the plan counts it: the compiler compiled it (or its buffer assignment) and
    what the chip must hold at once (:func:`held_bytes`) is within the usable HBM. The compile-only compiler
    weighs the program's temporaries against the limit and lists the outputs beside them (a Llama-3.2-1B step,
    1 x 2048 tokens: compiled with 9.4 GB of temporaries and 19.3 GB in all, over a v5e's 16 GiB); a real
    chip's runtime does not accept that (mT5-base, 8 x 1024: compiled here at 18.3 GB in all, refused on a
    v5e, "Used 19.22G of 15.75G": bench/oom_reports.py)."""
    held = held_bytes(est)
    return est.fits and held is not None and held <= est.hbm_limit_bytes


def _fit(points: Sequence[tuple[int, int, int]]) -> tuple[float, float, float] | None:
    """(F, a, c) of ``hbm = F + b * (a * n + c * n**2)`` by least squares over (batch, length, hbm) points: all
    three from three points or more, (F, a) with c = 0 from two, None from fewer. Terms that come out negative
    are dropped and the rest fitted again."""
    import numpy as np

    pts = [(b, n, y) for b, n, y in points if y]
    if len({(b * n, b * n * n) for b, n, _ in pts}) < 2:
        return None
    cols = [0, 1, 2] if len({(b * n, b * n * n) for b, n, _ in pts}) >= 3 else [0, 1]
    x_all = np.array([[1.0, b * n, b * n * n] for b, n, _ in pts])
    y = np.array([float(v) for *_, v in pts])
    while True:
        sol = np.linalg.lstsq(x_all[:, cols], y, rcond=None)[0]
        coef = dict(zip(cols, sol))
        bad = [k for k in cols if k and coef[k] < 0]
        if not bad:
            return coef.get(0, 0.0), coef.get(1, 0.0), coef.get(2, 0.0)
        cols = [k for k in cols if k not in bad]
        if cols == [0]:
            return None


def _hbm(model: tuple[float, float, float], b: int, n: int) -> float:
    f, a, c = model
    return f + b * (a * n + c * n * n)


def _largest_batch(model: tuple[float, float, float], n: int, limit: float) -> float:
    f, a, c = model
    per_row = a * n + c * n * n
    return (limit - f) / per_row if per_row > 0 else math.inf


def _longest(model: tuple[float, float, float], limit: float) -> float:
    f, a, c = model
    room = limit - f
    if room <= 0:
        return 0.0
    if c <= 0:
        return room / a if a > 0 else math.inf
    return (-a + math.sqrt(a * a + 4 * c * room)) / (2 * c)


def _edge(fits: Callable[[int], bool], predict: Callable[[], float], grid: _Grid) -> tuple[int, int | None]:
    """(the largest size that fits, the size above it that did not: None at the grid's top) along ``grid``,
    starting where ``predict()`` says the edge is and asking it again after each answer (it refits): while
    nothing was refused it climbs to the prediction (4x at most, one step at least), then it tries the
    prediction inside the gap, else the gap's middle."""
    lo, hi = 0, None
    b = max(grid.floor(_finite(predict(), grid.unit)), grid.unit)
    while True:
        if fits(b):
            lo = b
        else:
            hi = b
        up = grid.next(lo)
        if up is None or up == hi:
            return lo, hi
        g = grid.floor(_finite(predict(), 4 * max(lo, grid.unit)))
        if hi is None:
            b = grid.floor(min(g, 4 * lo))
            b = b if b > lo else up
        else:
            b = g if lo < g < hi else grid.floor((lo + hi) / 2)
            if not lo < b < hi:
                b = up if lo else grid.prev(hi)


def _finite(x: float, otherwise: float) -> float:
    return x if math.isfinite(x) else otherwise


def plan(model: Any, target: str | Target | None = None, *, lengths: Sequence[int] = LENGTHS,
         modes: Sequence[str] = MODES, compiler: str | Compiler | None = None, dtype: Any = None,
         lora: dict | None = None, optimizer: str = "adamw", verify: bool = True, budget: float | None = None,
         progress: bool = True) -> Plan:
    """Will a decoder LM's fine-tune fit ``target``: the largest batch per sequence length and the longest
    sequence at batch 1, per mode, by the TPU compiler, as one :class:`~.table.Plan` (text, HTML, ``.chart()``).

    ``model``: a transformers config (``AutoConfig.from_pretrained("meta-llama/Llama-3.2-1B")``) or a function
    that builds the model; it is built on the ``meta`` device with placeholders for its weights, so the host
    never holds them (see :mod:`.modes`). ``modes``: ``"full"``, ``"lora"`` and their options ``+ckpt``,
    ``+bf16``, ``+autocast``, ``+chunk`` (a chunked loss), ``+eager`` or ``+flash`` (the attention: transformers'
    eager, torch_xla's Pallas flash; default sdpa), ``+fsdp`` (over the target's chips; the batch is then the
    global one). A mode whose step fails (a trap of the stack, with the kit's what/why/fix) is marked ``x`` and
    said in ``Plan.failed``; the other modes go on. ``dtype``: the weights'
    (default: the config's, else float32). ``lora``: peft ``LoraConfig`` options (default r=16, alpha=32, peft's
    target modules for the model). ``optimizer``: ``"adamw"`` or ``"adafactor"`` (:func:`.modes.build`).
    ``verify``: decide one cell per mode by full compiles (the rest by the buffer assignment; False: none).
    ``budget``: seconds; when they run out the plan ends with the best answer so far and ``Plan.stopped`` says
    so. ``progress``: show what is compiling and the cells found so far.
    """
    tgt, comp = resolve(target, compiler)
    parsed = [Mode.parse(m) for m in modes]
    lengths = tuple(sorted({int(n) for n in lengths}))
    if not lengths or lengths[0] < 1:
        raise ValueError("lengths: positive sequence lengths, e.g. (512, 1024, 2048)")
    name = model_name(model)
    with _progress.job(f"tpukit.plan({name}) for {tgt.name}", budget, progress) as job:
        return _Planner(model, tgt, comp, parsed, lengths, dtype, lora, job, name, optimizer).run(verify)


class _Planner:
    """One plan's state: the built modes, the compiles so far, the cells."""

    def __init__(self, model: Any, tgt: Target, comp: Compiler, modes: list[Mode], lengths: tuple[int, ...],
                 dtype: Any, lora: dict | None, job: Any, name: str, optimizer: str = "adamw"):
        self.model, self.tgt, self.comp, self.modes, self.lengths = model, tgt, comp, modes, lengths
        self.dtype, self.lora, self.job, self.name, self.optimizer = dtype, lora, job, name, optimizer
        self.began = time.monotonic()
        self.points: list[Point] = []
        self.built: dict[str, Built] = {}
        self.cells: dict[tuple[str, int], Cell] = {}
        self.longest: dict[str, Cell] = {}
        self.first: dict[tuple[str, int], int] = {}  # the first prediction of each cell (length -1: longest)
        self.compiler = ""
        self.limit = int(tgt.usable_hbm_bytes)
        self.notes: list[str] = []
        self.failed: dict[str, str] = {}  # mode -> why its step failed (the other modes go on)
        self.mosaic: int | None = None  # the Mosaic version +flash's kernels are written at, once a compiler said
        self.kernels_checked = False  # a full compile of a +flash step has run (its kernels are compiled late)

    # -- compiles --------------------------------------------------------------------------------------------
    def _mode(self, mode: Mode) -> Built:
        if mode.name not in self.built:
            made = build(self.model, mode, self.dtype, self.lora, self.optimizer)
            made.mosaic = self.mosaic
            begin(made.step, (), {}, self.comp, "tpukit.plan")
            self.built[mode.name] = made
        return self.built[mode.name]

    def _at(self, mode: Mode, b: int, n: int, full: bool = False) -> Point:
        """The compile of ``mode`` at batch ``b`` and length ``n`` (planned, or ``full``), recorded; a size
        already answered the same way is not compiled again."""
        source = DECIDED if full else PLANNED
        for p in self.points:
            if (p.mode, p.batch, p.length, p.source) == (mode.name, b, n, source):
                return p
        made = self._mode(mode)
        import torch

        model = self._model(mode.name)
        predicted = int(_hbm(model, b, n)) if model is not None else None
        t0 = time.monotonic()
        # A Pallas kernel is compiled after the buffer assignment: the first +flash compile runs in full, to
        # learn whether this libtpu reads the kernels as written.
        if mode.flash and not self.kernels_checked:
            full, source = True, DECIDED
        while True:
            with made.tracing():
                traced = trace(made.step, (torch.randint(0, made.vocab, (b, n)),), {})
            traced_s = time.monotonic() - t0
            est: TpuEstimate = ask(traced, self.tgt, self.comp, made.step.__qualname__,
                                   self.tgt.chips if mode.fsdp else 1, what=f"{mode.name} batch {b} x {n}",
                                   early=not full)
            version = _xla.kernels.mosaic_version_wanted(est.message) if mode.flash else None
            if version is None or version == made.mosaic:
                break
            made.mosaic = self.mosaic = version  # this libtpu reads the kernels written at an older version
            self.notes.append(f"{mode.name}: the flash attention kernels are written at Mosaic version {version}, "
                              f"the newest {est.compiler or 'this compiler'} reads")
        self.kernels_checked = self.kernels_checked or mode.flash
        self.compiler = est.compiler or self.compiler
        if est.status not in ("fits", "too big"):
            raise RuntimeError(f"tpukit.plan: the TPU compiler did not answer {mode.name} at batch {b} x {n}: "
                               f"{est.message}")
        point = Point(mode.name, b, n, holds(est), held_bytes(est), source, predicted, traced_s,
                      float(est.compile_s or 0.0))
        self.points.append(point)
        return point

    def _model(self, mode: str) -> tuple[float, float, float] | None:
        return _fit([(p.batch, p.length, p.hbm_bytes) for p in self.points if p.mode == mode and p.hbm_bytes])

    # -- rounds ----------------------------------------------------------------------------------------------
    def run(self, verify: bool) -> Plan:
        stopped = ""
        try:
            for mode in self.modes:  # round 1: design points, every cell predicted
                self._guarded(mode, self._design)
                self._best()
            for mode in self.modes:  # round 2: each cell's edge by buffer assignments
                for n in self.lengths:
                    self._guarded(mode, lambda m: self._cell(m, n, full=False))
                    self._best()
                self._guarded(mode, lambda m: self._long(m, full=False))
                self._best()
            if verify:  # round 3: one cell per mode by full compiles
                for mode in self.modes:
                    self._guarded(mode, self._verify)
                    self._best()
        except BudgetSpent:
            why = f"stopped by the time budget ({self.job.budget_s:g} s)" if self.job.budget_s else "stopped"
            stopped = f"{why} after {len(self.points)} compiles"
            self.job.note = f"{stopped}: the best answer so far"
        for mode in self.modes:  # whatever was not reached is predicted
            if any(p.mode == mode.name for p in self.points) and mode.name not in self.failed:
                self._predict(mode)
        return self._plan(stopped)

    def _guarded(self, mode: Mode, work: Callable[[Mode], None]) -> None:
        """``work(mode)``, unless the mode already failed; a failure of its step (a model that cannot take the
        mode, a trap of the stack: the kit's what/why/fix, a compiler that does not answer) ends that mode,
        said in :attr:`failed`, and the other modes go on. The time budget ends them all."""
        if mode.name in self.failed:
            return
        try:
            work(mode)
        except BudgetSpent:
            raise
        except Exception as exc:  # this mode's step as the user would run it fails: the table says how
            self.failed[mode.name] = f"{type(exc).__name__}: {str(exc).strip()}"
            self.job.note = f"{mode.name} failed"

    def _design(self, mode: Mode) -> None:
        u = self._unit(mode)
        lo, mid, hi = self.lengths[0], self.lengths[len(self.lengths) // 2], self.lengths[-1]
        for b, n in ((u, lo), (u, hi), (2 * u, mid if mid != lo else hi)):
            self._at(mode, b, n)
        self._predict(mode)

    def _unit(self, mode: Mode) -> int:
        return self.tgt.chips if mode.fsdp else 1

    def _grids(self, mode: Mode) -> tuple[_Grid, _Grid]:
        made = self.built.get(mode.name)
        top = made.max_length if made is not None and made.max_length else None
        return _Grid(self._unit(mode), 8 * self._unit(mode), 8 * self._unit(mode)), _Grid(256, 8192, 1024, top)

    def _predict(self, mode: Mode) -> None:
        """Predict the cells of ``mode`` not yet searched (and remember each cell's first prediction)."""
        model = self._model(mode.name)
        batches, lengths = self._grids(mode)
        for n in self.lengths:
            guess = batches.floor(_largest_batch(model, n, self.limit)) if model else 0
            self.first.setdefault((mode.name, n), guess)
            if (mode.name, n) not in self.cells or self.cells[mode.name, n].how == PREDICTED:
                self.cells[mode.name, n] = Cell(mode.name, n, guess, PREDICTED, None, self.first[mode.name, n])
        guess = lengths.floor(_longest(model, self.limit)) if model else 0
        self.first.setdefault((mode.name, -1), guess)
        if mode.name not in self.longest or self.longest[mode.name].how == PREDICTED:
            self.longest[mode.name] = Cell(mode.name, guess, 1 if guess else 0, PREDICTED, None,
                                           self.first[mode.name, -1])

    def _near(self, mode: str, on: Callable[[Point], bool], x: Callable[[Point], int], otherwise: float) -> float:
        """Where the HBM reaches the limit along one axis (a length's batches, batch 1's lengths): the secant
        through the two compiles on it nearest the limit (the HBM bends near a full chip, where the compiler
        recomputes to save memory: the model of the whole mode does not see it), else ``otherwise``."""
        on_axis = {x(p): p.hbm_bytes for p in self.points if p.mode == mode and p.hbm_bytes and on(p)}
        if len(on_axis) < 2:
            return otherwise
        (x1, y1), (x2, y2) = sorted(sorted(on_axis.items(), key=lambda kv: abs(kv[1] - self.limit))[:2])
        if y2 <= y1:
            return otherwise
        return x1 + (self.limit - y1) * (x2 - x1) / (y2 - y1)

    def _cell(self, mode: Mode, n: int, full: bool) -> None:
        batches, _ = self._grids(mode)

        def predict() -> float:  # asked again after every answer
            model = self._model(mode.name)
            whole = _largest_batch(model, n, self.limit) if model else batches.unit
            return self._near(mode.name, lambda p: p.length == n, lambda p: p.batch, whole)

        lo, hi = _edge(lambda b: self._at(mode, b, n, full).fits, predict, batches)
        self.cells[mode.name, n] = Cell(mode.name, n, lo, DECIDED if full else PLANNED, hi,
                                        self.first.get((mode.name, n), lo))

    def _long(self, mode: Mode, full: bool) -> None:
        _, lengths = self._grids(mode)
        u = self._unit(mode)

        def predict() -> float:
            model = self._model(mode.name)
            whole = _longest(model, self.limit) if model else lengths.unit
            return self._near(mode.name, lambda p: p.batch == u, lambda p: p.length, whole)

        lo, hi = _edge(lambda n: self._at(mode, u, n, full).fits, predict, lengths)
        self.longest[mode.name] = Cell(mode.name, lo, u if lo else 0, DECIDED if full else PLANNED, hi,
                                       self.first.get((mode.name, -1), lo))

    def _verify(self, mode: Mode) -> None:
        """Decide one cell of ``mode`` by full compiles: the shortest length whose planned edge has a size that
        fits and one refused (their compiles are the cheapest). A full verdict that differs from the buffer
        assignment's is said in the notes, and the cell searched again by full compiles."""
        for n in self.lengths:
            c = self.cells.get((mode.name, n))
            if c is None or c.how != PLANNED or not c.batch or c.refused is None:
                continue
            lo, hi = self._at(mode, c.batch, n, True), self._at(mode, c.refused, n, True)
            if lo.fits and not hi.fits:
                self.cells[mode.name, n] = Cell(mode.name, n, c.batch, DECIDED, c.refused, c.predicted)
            else:
                size = c.refused if hi.fits else c.batch
                self.notes.append(f"{mode.name} at {n} tokens: batch {size} {'fits' if hi.fits else 'does not fit'} "
                                  f"by the full compile, where the buffer assignment said it "
                                  f"{'does not' if hi.fits else 'does'}: searched again by full compiles")
                self._cell(mode, n, full=True)
            return

    # -- the answer ------------------------------------------------------------------------------------------
    def _best(self) -> None:
        found = sum(c.how != PREDICTED for c in self.cells.values())
        self.job.best(f"{found} of {len(self.modes) * len(self.lengths)} cells found, {len(self.points)} compiles")

    def _plan(self, stopped: str) -> Plan:
        def failed(m: Mode, n: int) -> Cell | None:
            return Cell(m.name, n, 0, FAILED, None, 0) if m.name in self.failed else None

        cells = tuple(failed(m, n) or self.cells.get((m.name, n), Cell(m.name, n, 0, PREDICTED, None, 0))
                      for m in self.modes for n in self.lengths)
        longest = tuple(failed(m, 0) or self.longest.get(m.name, Cell(m.name, 0, 0, PREDICTED, None, 0))
                        for m in self.modes)
        params = {k: (b.parameters, b.trained) for k, b in self.built.items()}
        return Plan(self.name, self.tgt.name, self.compiler, self.limit, self.lengths,
                    tuple(m.name for m in self.modes), cells, longest, tuple(self.points),
                    time.monotonic() - self.began, params, stopped, tuple(self.notes), dict(self.failed))


# What each change is, in words a user writes (the change's mode option -> how).
_HOW = {
    "lora": "peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32)): only the adapters train, so the "
            "weights need no gradients and no optimizer state",
    "ckpt": "each decoder layer under torch_xla's checkpoint: `with tpukit.rewrites.checkpointed(list("
            "model.model.layers)):` around the forward (or the Trainer's fsdp_config={'xla_fsdp_grad_ckpt': True})",
    "bf16": "model.to(torch.bfloat16) before the optimizer is made: weights, gradients and optimizer state halve",
    "chunk": "the loss over slices of the tokens, the lm_head inside each slice (tpukit.rewrites.chunked_loss): "
             "one slice's logits live at a time",
    "flash": "torch_xla's Pallas flash attention (torch_xla.experimental.custom_kernel.flash_attention) in place "
             "of sdpa: the scores are never held whole",
    "fsdp": "tpukit.fsdp(model, tpukit.mesh()) (or the Trainer's FSDPv2): weights, gradients and optimizer state "
            "split over the chips",
}


def fit(model: Any, target: str | Target | None = None, *, mode: str = "full", batch: int = 1, length: int = 2048,
        compiler: str | Compiler | None = None, dtype: Any = None, lora: dict | None = None,
        optimizer: str = "adamw", budget: float | None = None, progress: bool = True) -> Fit:
    """Does one step of a decoder LM's fine-tune fit ``target`` (``mode`` at ``batch`` x ``length`` tokens), and
    if it does not, or holds :data:`~.estimate.NEAR_LIMIT` of the chip or more, what to change: LoRA,
    per-layer checkpointing, bf16 weights, a chunked loss, flash attention, FSDP over the target's chips (a
    one-chip target: the eight-chip slice of its chip), a shorter sequence. The step is decided by a full
    compile; each change is compiled too (to its buffer assignment) and the advice is ordered by the HBM it
    saves. A step well within the chip gets no advice (``note`` says so).

    ``model``, ``dtype``, ``lora``, ``optimizer``, ``compiler``: as for :func:`plan`. ``budget``: seconds; the
    changes not checked by then say so.
    """
    tgt, comp = resolve(target, compiler)
    asked = Mode.parse(mode)
    if batch < 1 or length < 1:
        raise ValueError(f"batch={batch}, length={length}: a step of at least one row of one token")
    name = model_name(model)
    with _progress.job(f"tpukit.fit({name}) for {tgt.name}", budget, progress) as job:
        planner = _Planner(model, tgt, comp, [asked], (length,), dtype, lora, job, name, optimizer)
        step = planner._at(asked, batch, length, full=True)
        near = step.fits and step.hbm_bytes is not None and step.hbm_bytes < NEAR_LIMIT * planner.limit
        answer = Fit(name, tgt.name, planner.compiler, asked.name, batch, length, step.fits, step.hbm_bytes,
                     planner.limit)
        if near:
            return replace(answer, note=f"no advice: the step holds {step.hbm_bytes / planner.limit:.0%} of the "
                                        f"chip, below the {NEAR_LIMIT:.0%} where a change is worth it")
        out = [_change(planner, asked, o, batch, length) for o in _changes(asked, tgt)]
        out.append(_shorter(planner, asked, batch, length))
        return replace(answer, advice=tuple(sorted(out, key=_saved)))


def _changes(asked: Mode, tgt: Target) -> list[str]:
    """The changes worth compiling for ``asked``: LoRA for a full fine-tune, then each option it lacks."""
    out = ["lora"] if asked.base == "full" else []
    for o in ("ckpt", "bf16", "chunk", "flash", "fsdp"):
        if getattr(asked, o) or (o == "flash" and (asked.eager or asked.fsdp)):
            continue
        if o == "fsdp" and (asked.flash or wide_target(tgt).chips < 2):
            continue
        out.append(o)
    return out


def _change(planner: "_Planner", asked: Mode, option: str, batch: int, length: int) -> Suggestion:
    """``asked`` with one change, compiled to its buffer assignment (FSDP: on the slice of :func:`wide_target`)."""
    parts = asked.name.split("+")
    name = "+".join(["lora", *parts[1:]] if option == "lora" else [*parts, option])
    change = Mode.parse(name)
    on = planner
    if option == "fsdp" and planner.tgt.chips < 2:  # a one-chip target: the slice of its chip
        wide = wide_target(planner.tgt)
        on = _Planner(planner.model, wide, planner.comp, [change], planner.lengths, planner.dtype, planner.lora,
                      planner.job, planner.name, planner.optimizer)
    label = f"{name} on {on.tgt.name}" if on is not planner else name
    try:
        p = on._at(change, batch, length)
    except BudgetSpent:
        return Suggestion(label, _HOW[option], unchecked=OUT_OF_TIME)
    except Exception as exc:  # the change's step fails as the user's would: said, not raised
        return Suggestion(label, _HOW[option], unchecked=f"{type(exc).__name__}: {str(exc).strip()[:300]}")
    if p.hbm_bytes is None:  # refused, and the refusal named no figure the chip could hold
        return Suggestion(label, _HOW[option], fits=False, unchecked="the compiler refused it")
    return Suggestion(label, _HOW[option], p.hbm_bytes, p.fits)


def _shorter(planner: "_Planner", asked: Mode, batch: int, length: int) -> Suggestion:
    """The longest sequence below ``length`` that fits at ``batch`` (the length grid's sizes, by buffer
    assignments), or that none of them does."""
    _, lengths = planner._grids(asked)
    grid = type(lengths)(lengths.unit, lengths.wide_from, lengths.wide, length - 1)
    try:
        lo, _hi = _edge(lambda n: planner._at(asked, batch, n).fits,
                        lambda: planner._near(asked.name, lambda p: p.batch == batch, lambda p: p.length, length / 2),
                        grid)
    except BudgetSpent:
        return Suggestion("a shorter sequence", "max_length of the tokenizer and the collator",
                          unchecked=OUT_OF_TIME)
    if not lo:
        return Suggestion("a shorter sequence", f"none of {grid.unit} tokens or more fits at batch {batch}",
                          fits=False, unchecked="even the shortest length tried did not fit")
    held = next(p.hbm_bytes for p in planner.points if p.length == lo and p.batch == batch and p.mode == asked.name)
    return Suggestion(f"sequence {lo}", f"the longest that fits at batch {batch}: max_length={lo} in the tokenizer "
                                        "and the collator", held, True)


def _saved(s: Suggestion) -> tuple[int, float]:
    """The sort key of a change: checked ones first, by the HBM they hold (least first, so most saved first)."""
    return (0, float(s.hbm_bytes)) if s.hbm_bytes else (1, 0.0)
