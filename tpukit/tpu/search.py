"""``tpukit.largest_batch``: the largest batch that fits on a target, by the TPU compiler's answers.

The search (:func:`_sizes`) is arithmetic over a function that compiles one size: the HBM per row guides the
next size, only a refusal bounds the answer (the compiler's HBM is not monotonic in the batch). Each size is
traced (:mod:`.trace`) and compiled through the one seam (:func:`.ask.ask`); the answer is a :class:`BatchFit`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from . import progress as _progress
from .ask import ask, begin, check, fsdp_chips, resolve
from .compiler.pins import Compiler
from .compiler.worker import BudgetSpent
from .compiler.targets import Target
from .outcome import TpuEstimate, gb
from .trace import Traced, trace


@dataclass(frozen=True)
class BatchFit:
    """The largest batch that fits on a target, its estimate, every batch size tried (size, fits), the
    compiler that answered, and whether the search stopped at its limit.

    The answer is bounded by a refusal (:attr:`refused`: the smallest size tried above it that the
    compiler refused), unless the search reached its limit with that size fitting (``at_limit``): then
    a larger batch may fit too.
    """

    target: str
    batch: int  # 0 when not even the smallest batch fits
    estimate: TpuEstimate | None
    tried: tuple[tuple[int, bool], ...]
    compiler: str = ""  # the TPU compiler that answered, as its estimates name it: "libtpu 0.0.17 (jax 0.7.2)"
    at_limit: bool = False  # the search reached its limit (``batch``) and that size fits: a lower bound
    stopped: str = ""  # what ended the search before its answer was bounded (a time budget): the best so far

    @property
    def refused(self) -> int | None:
        """The smallest size tried above ``batch`` that the compiler refused; None if none was.

        Without one the answer is a lower bound: the compiler's HBM is not monotonic in the batch (near a
        full chip it recomputes to save memory), so only a refusal bounds the largest batch from above.
        """
        return min((b for b, fits in self.tried if not fits and b > self.batch), default=None)

    def __str__(self) -> str:
        by = f" by {self.compiler}" if self.compiler else ""
        if not self.batch:
            return f"{self.target}: no batch fits (tried {', '.join(str(b) for b, _ in self.tried)}){by}"
        e = self.estimate
        if self.at_limit:
            bound = f"the search stopped at its limit {self.batch}: a larger batch may fit too"
        elif self.refused:
            bound = f"{self.refused} refused"
        else:
            bound = "none larger refused: a larger batch may fit too"
        if self.stopped:
            bound = f"{self.stopped}: the best answer so far" + (f" ({self.refused} refused)" if self.refused else "")
        return (f"{self.target}: batch {self.batch} fits ({gb(e.hbm_bytes)} of {gb(e.hbm_limit_bytes)} per chip, "
                f"step at best {e.step_s_min * 1e3:.1f} ms); {len(self.tried)} compiles{by}, {bound}")


def search(make: Callable[[int], Traced], tgt: Target, comp: Compiler, name: str, below: int | None = None,
           start: int = 1, limit: int = 1 << 20, steps: int | None = None, precision: float = 1 / 32,
           fsdp: bool = False) -> BatchFit:
    """The largest size that fits on ``tgt``: :func:`_sizes`, each size traced by ``make`` and compiled."""
    def at(b: int) -> TpuEstimate:
        traced = make(b)
        return ask(traced, tgt, comp, name, fsdp_chips(traced, tgt, fsdp), what=f"batch {b}")

    return _sizes(at, tgt.name, tgt.chips if fsdp else 1, below=below, start=start, limit=limit, steps=steps,
                  precision=precision)


def _sizes(at: Callable[[int], TpuEstimate], target: str, chips: int = 1, below: int | None = None,
           start: int = 1, limit: int = 1 << 20, steps: int | None = None, precision: float = 1 / 32) -> BatchFit:
    """The largest size that fits, bounded by a refused size above it, or the limit when that size fits.

    ``at(b)`` is the compiler's answer for ``b`` rows. A size that fits (``start``, or half of ``below``,
    halved while refused) comes first. Each next size
    follows the HBM: where it reaches the chip's limit by the slope between the two largest sizes that
    fit, else in proportion to the size (which falls short: it counts fixed costs as rows). While the
    chip is less than a quarter full the search goes to half the chip, 16 times the size at most (at a
    few rows, padding and fixed costs hide what a row adds); then just past that edge, so the size is
    likely refused and bounds the answer closely, then just short of it (the two sizes ``precision``
    apart). The HBM only guides: it is not monotonic in the batch (the same graph took 15.58 GB at 56
    rows and 13.74 GB at 64), so a size that fits never ends the search, however full the chip: one that
    fits where the HBM says the chip is full steps a sixteenth further, twice as far each time, and after
    two guesses the HBM got wrong the search doubles until refused and bisects. Once a size is refused
    (``below`` counts as one), it stops when the gap between the largest size that fits and the smallest
    refused above it is within ``precision`` of the size that fits (or one step of sizes), or after
    ``steps`` compiles when given, once the refused size is at most twice the one that fits (a wider gap
    is narrowed further whatever ``steps`` says: BERT-large's fp32 step fit at 8 rows and was refused at
    184, both of the HBM's guesses wrong, and "8 fits" said nothing of the 64 that fit); a guess outside
    the gap gives way to their geometric mean while it is
    wider than 4x, the middle otherwise. Reaching ``limit`` (``below - 1``) with a size that fits stops
    the search there (``at_limit``). Sizes above 8 are multiples of 8. With ``chips`` (FSDP) the batch is
    split over that many chips: sizes are multiples of the chip count too, and the search starts at 8 rows
    per chip (fewer are padded to a tile, and their HBM would say nothing of a row).
    """
    tried: list[tuple[int, bool]] = []
    job = _progress.current()

    def found(batch: int, est: TpuEstimate | None, at_limit: bool, stopped: str = "") -> BatchFit:
        return BatchFit(target, batch, est, tuple(tried), label[0], at_limit, stopped)
    unit = math.lcm(8, chips)
    top = below - 1 if below else max(limit, start)
    label = [""]

    def compiled(b: int) -> TpuEstimate:
        est = at(b)
        tried.append((b, est.fits))
        label[0] = est.compiler or label[0]
        if est.fits and job is not None and b >= max((s for s, ok in tried if ok), default=0):
            job.best(f"batch {b} fits ({gb(est.hbm_bytes)} of {gb(est.hbm_limit_bytes)})")
        return est

    def rounded(b: float) -> int:
        b = int(b)
        return b - b % unit if b > unit else chips * math.ceil(max(b, 1) / chips)

    fitting: list[tuple[int, TpuEstimate]] = []  # sizes that fit, ascending
    try:
        first = max(1, below // 2) if below else min(max(start, 8 * chips) if chips > 1 else start, top)
        hi, b = below, min(rounded(first), top)
        while not (est := compiled(b)).fits:
            if b <= chips:
                return found(0, None, False)
            hi, b = b, rounded(b // 2)
        fitting.append((b, est))
        stride = 1 / 16  # the step up from a size that fits where the HBM says the chip is full
        narrowed = misses = 0  # compiles since a refused size bounded the answer; guesses the HBM got wrong
        while True:
            lo, best = fitting[-1]
            if hi is None and lo >= top:
                return found(lo, best, True)  # the limit fits: a larger size may fit too
            spent = steps is not None and narrowed >= steps and hi is not None and hi <= 2 * lo
            if hi is not None and (hi - lo <= max(unit, lo * precision) or spent):
                break
            full = best.hbm_bytes / best.hbm_limit_bytes if best.hbm_limit_bytes and (best.hbm_bytes or 0) > 0 else None
            edge, guess, aimed = None, None, 0  # where the HBM says the chip fills; the next size; its expected side
            if full is not None:
                room = best.hbm_limit_bytes - best.hbm_bytes
                slope = (best.hbm_bytes - fitting[-2][1].hbm_bytes) / (lo - fitting[-2][0]) if len(fitting) > 1 else 0
                # By the slope between the two largest sizes that fit, else in proportion to the size (which
                # counts the fixed costs as rows: it falls short).
                edge = lo + room / slope if slope > 0 else lo / full
            if edge is None or misses >= 2:
                pass  # the HBM says nothing, or was wrong twice: bisect
            elif full < 0.25:  # a slope taken where the chip is nearly empty may be far off: half the chip, 16x at most
                guess = min(lo + (best.hbm_limit_bytes / 2 - best.hbm_bytes) / slope if slope > 0 else lo / 2 / full,
                            16.0 * lo)
            elif edge > lo:
                half = 0.4 * precision * edge  # the two sizes either side of the edge: within the precision
                if hi is None or hi > edge + half:
                    guess, aimed = edge + half, -1  # just past the edge: refused, it bounds the answer closely
                elif lo < edge - half:
                    guess, aimed = edge - half, 1
            elif hi is None:  # it fits where the HBM says the chip is full (it is not monotonic): step further
                guess, stride = lo * (1 + stride), min(2 * stride, 1.0)
            if guess is None:
                guess = 2.0 * lo if hi is None else math.sqrt(lo * hi) if hi > 4 * lo else (lo + hi) / 2
            guess = min(rounded(max(guess, lo + unit if lo >= unit else lo + 1)), top)
            if hi is not None and not lo < guess < hi:
                guess = rounded(math.sqrt(lo * hi) if hi > 4 * lo else (lo + hi) / 2)
                if not lo < guess < hi:
                    break  # no size between them: they are one step of sizes apart
            narrowed += hi is not None
            got = compiled(guess)
            misses += (aimed == -1 and got.fits) or (aimed == 1 and not got.fits)
            if got.fits:
                fitting.append((guess, got))
            else:
                hi = guess
        lo, best = fitting[-1]
        return found(lo, best, False)
    except BudgetSpent as spent:  # the time budget ran out: the best answer so far, said so
        if not fitting:
            raise BudgetSpent(f"{spent}: no batch size was answered yet (tried {tried or 'none'}); give "
                              "largest_batch a larger budget=") from None
        why = f"stopped by the time budget ({job.budget_s:g} s)" if job is not None and job.budget_s else "stopped"
        if job is not None:
            job.note = f"{why} after {len(tried)} compiles: the best answer so far"
        lo, best = fitting[-1]
        return found(lo, best, False, why)


def largest_batch(step: Callable, make_batch: Callable[[int], Any], target: str | Target | None = None, *,
                  start: int = 8, limit: int = 1 << 20, bisect: int | None = None, precision: float = 1 / 32,
                  fsdp: bool = False, compiler: str | Compiler | None = None, budget: float | None = None,
                  progress: bool = True) -> BatchFit:
    """The largest batch size at which ``step(make_batch(b))`` fits on ``target``, by TPU compiles.

    ``make_batch(b)`` returns the step's arguments for a batch of ``b`` rows (a tuple is unpacked, a
    dict passed as keywords, anything else as the one argument), on the XLA device. The search compiles
    ``start`` (halved while refused), then goes up, guided by the HBM per row so far, until the compiler
    refuses a size, and narrows the gap between the largest size that fits and the smallest refused
    above it until it is within ``precision`` of the answer (a fraction of it; 8 rows at least), or
    after ``bisect`` compiles when given (0: the first refusal ends it) once the refused size is at most twice
    the answer (a wider gap is narrowed further). The compiler's HBM is not
    monotonic in the batch, so only a refusal bounds the answer: :attr:`BatchFit.refused` is that size.
    At ``limit`` the search stops with that size fitting (:attr:`BatchFit.at_limit`: a larger one may
    fit too). Sizes above 8 are multiples of 8. ``fsdp=True``: as under ``tpukit.fsdp`` over the
    target's chips (see :func:`estimate`). Every compile is cached, so asking again is instant.
    ``compiler``: which TPU compiler answers, as for :func:`estimate`; :attr:`BatchFit.compiler` names it.
    ``budget``: seconds the search may take; when they run out (a compile under way is stopped) it ends with
    the largest size that fitted so far, and :attr:`BatchFit.stopped` says so. ``progress``: show what is
    compiling, for how long, and the best so far while it runs (:mod:`.progress`).
    """
    tgt, comp = resolve(target, compiler)
    name = begin(step, (), {}, comp, "tpukit.largest_batch")
    with _progress.job(f"tpukit.largest_batch({name}) for {tgt.name}", budget, progress):
        return _largest(step, make_batch, tgt, comp, name, start, limit, bisect, precision, fsdp)


def _largest(step: Callable, make_batch: Callable[[int], Any], tgt: Target, comp: Compiler, name: str, start: int,
             limit: int, bisect: int | None, precision: float, fsdp: bool) -> BatchFit:
    """:func:`largest_batch`'s search, inside its job."""
    checked: list[bool] = []

    def make(b: int) -> Traced:
        batch = make_batch(b)
        args, kwargs = (batch, {}) if isinstance(batch, tuple) else ((), batch) if isinstance(batch, dict) else \
            ((batch,), {})
        traced = trace(step, args, kwargs)
        if not checked:  # said once, of the first size
            checked.append(True)
            check(traced, name, "tpukit.largest_batch")
        return traced

    return search(make, tgt, comp, name, start=start, limit=limit, steps=bisect, precision=precision, fsdp=fsdp)
