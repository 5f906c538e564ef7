"""The TPU compiler's answer for one step and one target: :class:`TpuEstimate`, the advice, and their forms.

One record for every way the kit asks (``estimate``, ``compile_graph``, ``compare``,
the follower): a :attr:`~TpuEstimate.status` (it fits; too big for HBM; rejected by
the compiler for another reason; the ask failed: a dead worker) and the figures the
compiler gave, ``None`` where it gave none (a refusal has no cost analysis). The
roofline floor comes from the target's public peak FLOP/s and HBM bandwidth. Each
form is written once here: the table (:meth:`TpuEstimate.rows`, text and HTML), one
line (:func:`line`), and a comparison's columns (:func:`cells`).
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any

from ..errors import TpukitError
from .compiler.pins import role
from .compiler.refusal import Refusal

FITS = "fits"  # it compiled
TOO_BIG = "too big"  # refused for lack of HBM
REJECTED = "does not compile"  # refused for another reason
FAILED = "failed"  # no answer: the worker died or could not run
_BINARY = re.compile(r"\d[KMGT]\b")  # a size as the compiler writes it: "15.75G"

# Where ``TpuEstimate.hbm_bytes`` comes from.
PEAK = "compiler peak"  # the compiler's own peak of the program (its memory statistics)
SUM = "sum of buffers"  # arguments + outputs + temporaries + code - aliased: over-states a peak it did not report
NEED = "compiler refusal"  # what the compiler's refusal says the program needs
UNKNOWN = "not reported"
# The compiler's buffer assignment, read before its code generation ended (``ask(early=True)``): every HBM
# allocation of the program but its code; the verdict is that sum held against the usable HBM.
PLANNED = "buffer assignment"

# The step an estimate of a training step taken before training is of (AdamW's state is made in its graph).
FIRST_STEP = ("the optimizer's first step: its state (Adam's moments) is made inside this graph; a later step "
              "reads it as arguments instead (a few percent of HBM either way)")


class TpuCompileError(TpukitError):
    """The TPU compiler rejected a graph for a reason other than memory (its message and the graph's name)."""


@dataclass(frozen=True)
class Suggestion:
    """One change that may make a step fit, and what a compile said of it: the one kind of advice.

    ``hbm_bytes``/``fits`` are the compiler's per-chip answer after the change, None when it was not checked
    (``unchecked`` says why); ``batch``: the rows per step the change means, for the batch-size changes."""

    change: str  # e.g. "batch 16", "checkpoint each layer"
    how: str  # what to write
    hbm_bytes: int | None = None
    fits: bool | None = None
    batch: int | None = None  # the batch (per optimizer step: micro-batch rows) the change compiles
    unchecked: str | None = None  # why no compile checked it

    @property
    def checked(self) -> bool:
        """Whether a compile checked the change."""
        return self.hbm_bytes is not None

    def after(self) -> str:
        """What the check said: `` -> 2.01 GB, fits (checked by a compile)`` or why it was not checked."""
        if not self.checked:
            return f" (not checked: {self.unchecked})" if self.unchecked else " (not checked by a compile)"
        return f" -> {gb(self.hbm_bytes)}, " + ("fits" if self.fits else "still too big") + " (checked by a compile)"


@dataclass(frozen=True)
class TpuEstimate:
    """What the TPU compiler says about one step on one target (bytes are per chip; None: not given).

    ``status`` is the compiler's verdict (:data:`FITS`, :data:`TOO_BIG`, :data:`REJECTED`) or :data:`FAILED`.
    ``hbm_bytes`` is the compiler's peak when it reports one, else the sum of the buffers it lists (which can
    exceed the limit in a step that fits: the compiler weighs temporaries and arguments against it, not the
    outputs beside them), else what its refusal says the step needs; ``hbm_source`` says which.
    """

    target: str
    status: str
    hbm_limit_bytes: int  # the HBM the compiler can use: from its refusal when it says so, else the chip's figure
    hbm_bytes: int | None = None
    hbm_source: str = UNKNOWN  # where hbm_bytes comes from: PEAK, SUM, NEED or UNKNOWN
    arguments_bytes: int | None = None
    outputs_bytes: int | None = None
    aliased_bytes: int | None = None
    temp_bytes: int | None = None
    code_bytes: int | None = None
    compile_s: float | None = None  # the TPU compiler's time here
    flops: float | None = None
    bytes_accessed: float | None = None
    step_s_min: float | None = None  # roofline floor: max(FLOPs / peak, bytes / bandwidth)
    bound: str | None = None  # "compute" or "memory"
    message: str | None = None  # the compiler's refusal, or why there is no answer
    refusal: Refusal | None = None  # why it does not fit: the compiler's totals and largest allocations
    compiler: str = ""  # the TPU compiler that answered: "libtpu 0.0.17 (jax 0.7.2)"
    compiler_name: str = ""  # the name it was asked by: "torch_xla 2.8", "newest", "libtpu 0.0.17", "installed"
    compiler_note: str | None = None  # set when it is not the libtpu the installed torch_xla's runtime runs
    note: str | None = None  # what the estimate is of, when it may not be what was meant (a forward only)
    memory: Any = None  # a tpukit.tpu.memory.MemoryBreakdown: the HBM at the peak by kind and source line
    advice: tuple[Suggestion, ...] = ()  # what to change, each checked by a compile where it can be
    chip_note: str | None = None  # what the per-chip figure is of, where it is not plainly the chip's

    @property
    def fits(self) -> bool:
        """The compiler compiled the step."""
        return self.status == FITS

    @property
    def refused_for_memory(self) -> bool:
        """The compiler refused the step for lack of HBM."""
        return self.status == TOO_BIG

    @property
    def answered_by(self) -> str:
        """Which compiler answered, short: ``"libtpu 0.0.17, torch_xla 2.8's compiler"`` (``""`` if unknown)."""
        libtpu = self.compiler.split(" (")[0]
        return ", ".join(p for p in (libtpu, role(self.compiler_name)) if p)

    @property
    def sum_bytes(self) -> int | None:
        """arguments + outputs + temporaries + code - aliased: the buffers the compiler lists, all at once."""
        parts = (self.arguments_bytes, self.outputs_bytes, self.temp_bytes, self.code_bytes, self.aliased_bytes)
        if any(p is None for p in parts):
            return None
        return self.arguments_bytes + self.outputs_bytes + self.temp_bytes + self.code_bytes - self.aliased_bytes

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the table both reprs show."""
        rows = [("target", self.target), ("fits", "yes" if self.fits else f"NO ({self.status})"),
                ("HBM per chip", hbm_text(self))]
        if self.chip_note:
            rows.append(("  per chip", self.chip_note))
        if self.fits and self.hbm_source in (SUM, PEAK) and self.hbm_bytes > self.hbm_limit_bytes:
            # libtpu 0.0.17 reports no peak (the sum is shown); 0.0.21.1 reports one equal to that sum. Either way
            # the compiler compiled the step: its own check weighs temporaries and arguments, outputs beside.
            rows.append(("  note", f"the {'sum of buffers' if self.hbm_source == SUM else 'reported peak'} exceeds "
                                   "the usable HBM, yet the compiler fits the step: it weighs temporaries and "
                                   "arguments against the limit, and lists outputs beside"))
        if self.fits and self.arguments_bytes + self.outputs_bytes - self.aliased_bytes > self.hbm_limit_bytes:
            held = self.arguments_bytes + self.outputs_bytes - self.aliased_bytes
            rows.append(("  warning", f"the arguments and outputs alone ({gb(held)}) exceed the usable HBM: "
                                      "the compiler accepted the program, but the chip cannot hold them at once"))
        if self.arguments_bytes is not None:
            rows.append(("  arguments / outputs / aliased", f"{gb(self.arguments_bytes)} / {gb(self.outputs_bytes)}"
                                                             f" / {gb(self.aliased_bytes)}"))
            rows.append(("  temporaries / code", f"{gb(self.temp_bytes)} / {gb(self.code_bytes)}"))
        by = f" by {self.compiler}" + (f", {role(self.compiler_name)}" if role(self.compiler_name) else "")
        if self.compile_s is not None:
            rows.append(("TPU compile", f"{self.compile_s:.1f} s" + (by if self.compiler else "")))
        if self.compiler_note:
            rows.append(("  note", self.compiler_note))
        if self.fits:
            rows.append(("FLOPs / bytes accessed", f"{self.flops / 1e9:.1f} GFLOP / {gb(self.bytes_accessed)}"))
            rows.append(("step at best (roofline)", f"{self.step_s_min * 1e3:.2f} ms, {self.bound}-bound"))
        if self.message:  # the compiler's own words: its sizes are binary ("16.00G" is 16 GiB), the kit's decimal GB
            first = self.message.splitlines()[0][:160]
            rows.append(("compiler (G = GiB)" if _BINARY.search(first) else "compiler", first))
        r = self.refusal
        if r and r.reserved_bytes is not None:
            rows.append(("  the compiler's split: program / arguments / reserved",
                         f"{gb(r.program_bytes)} / {gb(r.arguments_bytes)} / {gb(r.reserved_bytes)}"))
        for i, text in enumerate(r.lines(gb) if r else ()):
            rows.append(("why: the largest buffers" if i == 0 else "", text))
        if self.memory is not None:
            rows.extend(self.memory.summary())
        if self.note:
            rows.append(("note", self.note))
        rows += [(f"try: {s.change}", s.how + s.after()) for s in self.advice]
        return rows

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _repr_html_(self) -> str:
        cells_ = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
                         f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in self.rows())
        return f"<table>{cells_}</table>"


def gb(n: float | None) -> str:
    """Bytes as a short decimal size (GB/MB/kB)."""
    if n is None:
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def hbm_text(est: TpuEstimate) -> str:
    """``0.27 GB of 16.91 GB (2%), compiler peak``; a refusal's need; ``? of 16.91 GB (not reported)``."""
    if est.hbm_bytes is None or est.hbm_source == UNKNOWN:
        return f"? of {gb(est.hbm_limit_bytes)} (not reported)"
    pct = f" ({est.hbm_bytes / est.hbm_limit_bytes:.0%})" if est.hbm_limit_bytes else ""
    need = "" if est.fits else "needs "
    return f"{need}{gb(est.hbm_bytes)} of {gb(est.hbm_limit_bytes)}{pct}, {est.hbm_source}"


def floor_text(est: TpuEstimate) -> str:
    """``0.83 ms, compute-bound``, or ``-`` where the step does not compile."""
    return f"{est.step_s_min * 1e3:.3g} ms, {est.bound}-bound" if est.fits else "-"


def line(est: TpuEstimate) -> str:
    """One line: ``v5e-1: fits, 0.27 GB of 16.91 GB HBM per chip (compiler peak), TPU compile 2.9 s, step >=
    0.8 ms (compute-bound) [libtpu 0.0.17, torch_xla 2.8's compiler]``, or the refusal (``does NOT fit (too
    big)``, ``does NOT fit (does not compile)``) with its largest buffer; the compiler that answered last."""
    by = f" [{est.answered_by}]" if est.answered_by else ""
    if not est.fits:
        reason = (est.message or "does not fit").splitlines()[0][:160]
        buffers = est.refusal.lines(gb) if est.refusal else []
        why = f"; largest buffer {buffers[0]}" if buffers else ""
        need = f"{gb(est.hbm_bytes)} of " if est.hbm_bytes else ""
        return (f"{est.target}: does NOT fit ({est.status}, {need}{gb(est.hbm_limit_bytes)} HBM per chip): "
                f"{reason}{why}{by}")
    return (f"{est.target}: fits, {gb(est.hbm_bytes)} of {gb(est.hbm_limit_bytes)} HBM per chip ({est.hbm_source}), "
            f"TPU compile {est.compile_s:.1f} s, step >= {est.step_s_min * 1e3:.3g} ms ({est.bound}-bound){by}")


def cells(est: TpuEstimate) -> tuple[str, str, str, str]:
    """A comparison's or a dashboard's columns of one estimate: fits, HBM per chip, TPU compile, step floor."""
    return ("yes" if est.fits else f"NO ({est.status})", hbm_text(est),
            f"{est.compile_s:.1f} s" if est.compile_s is not None else "-", floor_text(est))
