"""``tpukit.estimate``: will this step fit on the target TPU, how long does it compile, how fast can it be.

The step is traced lazily on the XLA device and never run (:mod:`.trace`); its
graph is compiled for the target by libtpu's TPU compiler in the worker
process (:mod:`.worker`); the compiler's answer becomes a :class:`TpuEstimate`.
When it does not fit, the kit compiles again to say what would: a smaller
batch, bf16 autocast, FSDP over the slice's chips, gradient accumulation.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..errors import TpukitWarning
from . import advice as _advice, memory as _memory, worker
from .compilers import Compiler, compiler as _compiler
from .record import Suggestion, TpuEstimate, from_reply, gb
from .targets import TARGETS, Target, TargetError, default_target, target as _target
from .trace import Traced, retie, trace

FORWARD_ONLY = ("forward only: the step made no gradient and updated no parameter, so gradients and optimizer "
                "state are not counted (a training step needs loss.backward() and optimizer.step() inside it)")


def _check(traced: Traced, name: str, by: str) -> str | None:
    """Say what the traced step does that its estimate cannot show: a read from the device (a warning), no
    backward or update (a warning when its model is in training mode). Returns the estimate's note."""
    if traced.reads:
        warnings.warn(
            f"{by}: the step {name!r} read {traced.reads} value(s) from the device while it was traced (.item(), "
            "print(tensor), a Python if on a tensor): each read compiles and runs a graph of its own and waits for "
            "it, here and at every step on the TPU; the estimate is of the graph left at the end and counts "
            "none of that. Move the reads out of the step (tpukit.log(...) logs values without a sync).",
            TpukitWarning, stacklevel=3)
    if traced.trains is not False:
        return None
    if traced.train_mode:
        warnings.warn(f"{by}: the step {name!r} has no backward pass and no optimizer update (no parameter got a "
                      "gradient or changed) although its model is in training mode: it is estimated as a forward "
                      "pass, which needs far less HBM than training. Put loss.backward() and optimizer.step() "
                      "in the step, or call model.eval() to estimate inference.", TpukitWarning, stacklevel=3)
    return FORWARD_ONLY


def _resolve(target: str | Target | None) -> Target:
    if target is None:
        found = default_target()
        if found is None:
            raise TargetError("no TPU target: pass target= (e.g. target='v5e-1'), or name it once with "
                              "tpukit.setup(target='v5e-1') (or $TPUKIT_TARGET) for every estimate. "
                              f"Known targets: {', '.join(TARGETS)}.")
        return found
    return _target(target)


def _compile(traced: Traced, tgt: Target, name: str, shard_over: int = 1,
             compiler: Compiler | None = None, memory: bool = False) -> TpuEstimate:
    parts = traced.num_partitions
    if parts > 1 and parts != tgt.chips:
        raise ValueError(f"the step is partitioned over {parts} devices (SPMD) but {tgt.name} has {tgt.chips} "
                         f"chips: build the mesh over {tgt.chips} devices, or pick a {parts}-chip target.")
    if memory:  # one compile with the compiler's dump: the estimate and its breakdown
        return _memory.estimate_with_breakdown(traced, tgt, name, shard_over, compiler)
    reply = worker.compile(worker.Request(traced.hlo, tgt, parts, traced.aliases, shard_over, compiler))
    return from_reply(reply, tgt, name)


def _fsdp(traced: Traced, tgt: Target, fsdp: bool) -> int:
    """How many chips to impose an FSDP layout over (1: none)."""
    if fsdp and traced.num_partitions > 1:
        raise ValueError("fsdp=True is for a one-device step; this one is already SPMD-partitioned (its own "
                         "shardings are compiled as they are): drop fsdp=True.")
    return tgt.chips if fsdp else 1


def _name(step: Callable) -> str:
    return getattr(step, "__qualname__", None) or type(step).__name__


def _batch_rows(args: tuple, kwargs: dict) -> int | None:
    """The leading size the step's tensor arguments share (the batch), when they share one."""
    import torch

    sizes = set()
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            sizes.add(int(x.shape[0]))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sizes.pop() if len(sizes) == 1 else None


def _first_rows(x: Any, n: int) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x[:n] if x.dim() >= 1 else x
    if isinstance(x, dict):
        return type(x)({k: _first_rows(v, n) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return type(x)(_first_rows(v, n) for v in x)
    return x


def _suggest(step: Callable, args: tuple, kwargs: dict, tgt: Target, traced: Traced,
             name: str, compiler: Compiler | None = None) -> tuple[Suggestion, ...]:
    """Compile the step again with each change and say the per-chip HBM it gives."""
    import torch

    out: list[Suggestion] = []
    rows = _batch_rows(args, kwargs)
    if rows and rows > 1:
        fit = _search(lambda b: trace(step, _first_rows(args, b), _first_rows(kwargs, b)), tgt, name,
                      below=rows, steps=2, compiler=compiler)
        if fit.batch:
            b, est = fit.batch, fit.estimate
            out.append(Suggestion(change=f"batch {b}", how=f"the largest batch that fits (of {rows})",
                                  hbm_bytes=est.hbm_bytes, fits=True))
            k = math.ceil(rows / b)
            out.append(Suggestion(change=f"accumulate {k} x {b}",
                                  how=f"gradient accumulation: {k} micro-batches of {b} rows, one optimizer step "
                                      f"(about the HBM of batch {b})", hbm_bytes=est.hbm_bytes, fits=True))
    try:
        with torch.autocast("xla", dtype=torch.bfloat16):
            bf = _compile(trace(step, args, kwargs), tgt, name, compiler=compiler)
        out.append(Suggestion(change="bf16 autocast", how="torch.autocast('xla', dtype=torch.bfloat16) around the "
                              "forward, or model.to(torch.bfloat16)", hbm_bytes=bf.hbm_bytes or None, fits=bf.fits))
    except Exception as exc:  # autocast may not apply to this step: say so rather than fail the estimate
        out.append(Suggestion(change="bf16 autocast", how=f"could not be estimated ({type(exc).__name__})"))
    if traced.num_partitions == 1:
        wide = tgt if tgt.chips > 1 else TARGETS.get(f"{tgt.chip.name}-8", tgt)
        if wide.chips > 1:
            est = from_reply(worker.compile(worker.Request(traced.hlo, wide, 1, traced.aliases, wide.chips,
                                                           compiler)), wide, name)
            out.append(Suggestion(change=f"FSDP over {wide.chips} chips",
                                  how=f"tpukit.fsdp(model, tpukit.mesh()) on {wide.name}",
                                  hbm_bytes=est.hbm_bytes or None, fits=est.fits))
    return tuple(out)


def estimate(step: Callable, *args: Any, target: str | Target | None = None, suggest: bool = True,
             fsdp: bool = False, compiler: str | Compiler | None = None, memory: bool = False,
             **kwargs: Any) -> TpuEstimate:
    """Compile ``step(*args, **kwargs)`` for a TPU with the real TPU compiler, without running it here.

    The step is traced lazily on the XLA device (model and batch already there),
    its graph (everything it updates and returns) is compiled for ``target``
    (e.g. ``"v5e-1"``; default: ``tpukit.setup(target=...)``'s, else ``$TPUKIT_TARGET``) in the TPU compiler's worker
    process, and the model, optimizer state, gradients, LR schedulers and random
    seeds are put back exactly as they were: the update is discarded. Buffer
    donation is carried (``aliased_bytes``); under SPMD the graph is compiled for
    the target's chips with the tensors' shardings. When it does not fit,
    ``suggestions`` says what would, each compiled again (``suggest=False`` skips
    them). ``fsdp=True`` asks about a one-device step as if it ran under
    ``tpukit.fsdp`` over all the target's chips (every parameter, optimizer state
    and batch tensor split over them; the batch is the global one). Batch tensors
    still on the host are moved to the device, as ``tpukit.track`` does; weights a
    model declares tied but lost on its way to the device are tied again (a
    warning names them). The step must not read values from the device (no
    ``.item()``, ``print(tensor)``, ``torch_xla.sync()``): a read is warned about.
    A step without a backward pass or optimizer update is estimated as a forward
    pass (``note`` says so; a warning when its model is in training mode).
    ``compiler``: which TPU compiler answers (``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``;
    default: ``tpukit.setup(compiler=...)``'s, else the libtpu the installed torch_xla's runtime loads);
    a pair not installed here runs in its own environment, built on first use. The estimate names it.
    ``memory``: also say why (``est.memory``, :class:`~.memory.MemoryBreakdown`): the buffers in HBM at the
    peak by kind and source line, from the compiler's dump of this compile, with advice each checked by a
    compile (:mod:`.advice`). A refused step always gets the breakdown its refusal gives.
    """
    tgt = _resolve(target)
    comp = _compiler(compiler)
    worker.require(comp)
    worker.warm(comp)  # jax and libtpu load in the worker while the step is traced here
    name = _name(step)
    retie(step, args, kwargs, "tpukit.estimate")
    traced = trace(step, args, kwargs)
    note = _check(traced, name, "tpukit.estimate")
    est = replace(_compile(traced, tgt, name, _fsdp(traced, tgt, fsdp), comp, memory), note=note)
    if not est.fits and suggest and not fsdp:
        est = replace(est, suggestions=_suggest(step, args, kwargs, tgt, traced, name, comp))
    if not est.fits and est.memory is None:
        est = replace(est, memory=_why(est, traced, step, args, kwargs, tgt, name, comp, memory))
    if memory and est.memory is not None:
        est = replace(est, memory=replace(est.memory, advice=_advice.advise(
            est.memory, step, args, kwargs, traced, tgt, name, comp)))
    return est


def _why(est: TpuEstimate, traced: Traced, step: Callable, args: tuple, kwargs: dict, tgt: Target, name: str,
         comp: Compiler, dump: bool) -> Any:
    """A refused step's breakdown: its refusal's list; else (``dump``) the largest batch that fits's."""
    why = _memory.breakdown_of_refusal(est, traced)
    smaller = next((s for s in est.suggestions if s.change.startswith("batch ") and s.fits), None)
    if why is None and dump and smaller is not None:
        b = int(smaller.change.split()[1])
        why = _memory._of_smaller_batch(est, trace(step, _first_rows(args, b), _first_rows(kwargs, b)), b, tgt,
                                       name, comp)
    return why


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
        return (f"{self.target}: batch {self.batch} fits ({gb(e.hbm_bytes)} of {gb(e.hbm_limit_bytes)} per chip, "
                f"step at best {e.step_s_min * 1e3:.1f} ms); {len(self.tried)} compiles{by}, {bound}")


def _search(make: Callable[[int], Traced], tgt: Target, name: str, below: int | None = None,
            start: int = 1, limit: int = 1 << 20, steps: int | None = None, precision: float = 1 / 32,
            fsdp: bool = False, compiler: Compiler | None = None) -> BatchFit:
    """The largest size that fits on ``tgt``: :func:`_sizes`, each size traced by ``make`` and compiled."""
    def at(b: int) -> TpuEstimate:
        traced = make(b)
        return _compile(traced, tgt, name, _fsdp(traced, tgt, fsdp), compiler)

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

    def found(batch: int, est: TpuEstimate | None, at_limit: bool) -> BatchFit:
        return BatchFit(target, batch, est, tuple(tried), label[0], at_limit)
    unit = math.lcm(8, chips)
    top = below - 1 if below else max(limit, start)
    label = [""]

    def compiled(b: int) -> TpuEstimate:
        est = at(b)
        tried.append((b, est.fits))
        label[0] = est.compiler or label[0]
        return est

    def rounded(b: float) -> int:
        b = int(b)
        return b - b % unit if b > unit else chips * math.ceil(max(b, 1) / chips)

    first = max(1, below // 2) if below else min(max(start, 8 * chips) if chips > 1 else start, top)
    hi, b = below, min(rounded(first), top)
    while not (est := compiled(b)).fits:
        if b <= chips:
            return found(0, None, False)
        hi, b = b, rounded(b // 2)
    fitting = [(b, est)]  # sizes that fit, ascending
    stride = 1 / 16  # the step up from a size that fits where the HBM says the chip is full
    narrowed = misses = 0  # compiles since a refused size bounded the answer; guesses the HBM got wrong
    while True:
        lo, best = fitting[-1]
        if hi is None and lo >= top:
            return found(lo, best, True)  # the limit fits: a larger size may fit too
        spent = steps is not None and narrowed >= steps and hi is not None and hi <= 2 * lo
        if hi is not None and (hi - lo <= max(unit, lo * precision) or spent):
            break
        full = best.hbm_bytes / best.hbm_limit_bytes if best.hbm_limit_bytes and best.hbm_bytes > 0 else None
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


def largest_batch(step: Callable, make_batch: Callable[[int], Any], target: str | Target | None = None, *,
                  start: int = 8, limit: int = 1 << 20, bisect: int | None = None, precision: float = 1 / 32,
                  fsdp: bool = False, compiler: str | Compiler | None = None) -> BatchFit:
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
    """
    tgt = _resolve(target)
    comp = _compiler(compiler)
    worker.require(comp)
    worker.warm(comp)
    name = _name(step)
    retie(step, (), {}, "tpukit.largest_batch")
    checked: list[bool] = []

    def make(b: int) -> Traced:
        batch = make_batch(b)
        args, kwargs = (batch, {}) if isinstance(batch, tuple) else ((), batch) if isinstance(batch, dict) else \
            ((batch,), {})
        traced = trace(step, args, kwargs)
        if not checked:  # said once, of the first size
            checked.append(True)
            _check(traced, name, "tpukit.largest_batch")
        return traced

    return _search(make, tgt, name, start=start, limit=limit, steps=bisect, precision=precision, fsdp=fsdp,
                   compiler=comp)
