"""The answer of the TPU compiler for one graph and one target: :class:`TpuEstimate`, and what to do.

Built from the worker's reply: the compiler's memory statistics (per chip),
its cost analysis, and the roofline floor from the target's public peak
FLOP/s and HBM bandwidth. Its text and HTML reprs are one short table.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from ..errors import TpukitError
from .compilers import describe, mismatch, role
from .refusal import Refusal, parse
from .targets import Target


class TpuCompileError(TpukitError):
    """The TPU compiler rejected a graph for a reason other than memory (its message and the graph's name)."""


@dataclass(frozen=True)
class Suggestion:
    """One way to make a step fit, with the per-chip HBM the compiler gives after the change (None: unknown)."""

    change: str  # e.g. "batch 16"
    how: str  # what to write
    hbm_bytes: int | None = None
    fits: bool | None = None


# Where ``TpuEstimate.hbm_bytes`` comes from.
PEAK = "compiler peak"  # the compiler's own peak of the program (its memory statistics)
SUM = "sum of buffers"  # arguments + outputs + temporaries + code - aliased: over-states a peak it did not report
NEED = "compiler refusal"  # what the compiler's refusal says the program needs
UNKNOWN = "not reported"


@dataclass(frozen=True)
class TpuEstimate:
    """What the TPU compiler says about one step on one target (bytes are per chip).

    ``fits`` is the compiler's verdict: True when it compiled the step, False when it refused it (for
    memory: ``status == "too big"``; for another reason: ``"does not compile"``). ``hbm_bytes`` is the
    compiler's peak when it reports one, else the sum of the buffers it lists (which can exceed the
    limit in a step that fits: the compiler weighs temporaries and arguments against it, not the outputs
    beside them); ``hbm_source`` says which.
    """

    target: str
    fits: bool  # the compiler's verdict: it compiled the step
    hbm_bytes: int  # per hbm_source: the compiler's peak, else the sum of buffers; refused: what it needs
    hbm_limit_bytes: int  # the HBM the compiler can use: from its refusal when it says so, else the chip's figure
    arguments_bytes: int
    outputs_bytes: int
    aliased_bytes: int
    temp_bytes: int
    code_bytes: int
    compile_s: float  # the TPU compiler's time here
    flops: float
    bytes_accessed: float
    step_s_min: float  # roofline floor: max(FLOPs / peak, bytes / bandwidth)
    bound: str  # "compute" or "memory" ("" when it did not compile)
    message: str | None = None  # the compiler's refusal
    suggestions: tuple[Suggestion, ...] = ()  # what to do when it does not fit
    note: str | None = None  # what the estimate is of, when it may not be what was meant (a forward only)
    refusal: Refusal | None = None  # why it does not fit: the compiler's totals and largest allocations
    compiler: str = ""  # the TPU compiler that answered: "libtpu 0.0.17 (jax 0.7.2)"
    compiler_name: str = ""  # the name it was asked by: "torch_xla 2.8", "newest", "libtpu 0.0.17", "installed"
    compiler_note: str | None = None  # set when it is not the libtpu the installed torch_xla's runtime runs
    hbm_source: str = SUM  # where hbm_bytes comes from: PEAK, SUM, NEED or UNKNOWN
    refused_for_memory: bool = False  # the compiler refused the step for lack of HBM
    memory: Any = None  # a tpukit.tpu.memory.MemoryBreakdown: the HBM at the peak by kind and source line

    @property
    def status(self) -> str:
        """``"fits"`` (it compiled), ``"too big"`` (refused for memory) or ``"does not compile"``."""
        if self.fits:
            return "fits"
        return "too big" if self.refused_for_memory else "does not compile"

    @property
    def answered_by(self) -> str:
        """Which compiler answered, short: ``"libtpu 0.0.17, torch_xla 2.8's compiler"`` (``""`` if unknown)."""
        libtpu = self.compiler.split(" (")[0]
        return ", ".join(p for p in (libtpu, role(self.compiler_name)) if p)

    @property
    def sum_bytes(self) -> int:
        """arguments + outputs + temporaries + code - aliased: the buffers the compiler lists, all at once."""
        return (self.arguments_bytes + self.outputs_bytes + self.temp_bytes + self.code_bytes
                - self.aliased_bytes)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the table both reprs show."""
        pct = f" ({self.hbm_bytes / self.hbm_limit_bytes:.0%})" if self.hbm_limit_bytes and self.hbm_bytes else ""
        rows = [("target", self.target),
                ("fits", "yes" if self.fits else f"NO ({self.status})"),
                ("HBM per chip", f"{gb(self.hbm_bytes)} of {gb(self.hbm_limit_bytes)}{pct}, {self.hbm_source}"
                 if self.hbm_source != UNKNOWN else f"? of {gb(self.hbm_limit_bytes)} (not reported)")]
        if self.fits and self.hbm_source in (SUM, PEAK) and self.hbm_bytes > self.hbm_limit_bytes:
            # libtpu 0.0.17 reports no peak (the sum is shown); 0.0.21.1 reports one equal to that sum. Either way
            # the compiler compiled the step: its own check weighs temporaries and arguments, outputs beside.
            rows.append(("  note", f"the {'sum of buffers' if self.hbm_source == SUM else 'reported peak'} exceeds "
                                   "the usable HBM, yet the compiler fits the step: it weighs temporaries and "
                                   "arguments against the limit, and lists outputs beside"))
        held = self.arguments_bytes + self.outputs_bytes - self.aliased_bytes
        if self.fits and held > self.hbm_limit_bytes:
            rows.append(("  warning", f"the arguments and outputs alone ({gb(held)}) exceed the usable HBM: "
                                      "the compiler accepted the program, but the chip cannot hold them at once"))
        if self.fits or self.arguments_bytes:
            rows.append(("  arguments / outputs / aliased", f"{gb(self.arguments_bytes)} / {gb(self.outputs_bytes)}"
                                                             f" / {gb(self.aliased_bytes)}"))
            rows.append(("  temporaries / code", f"{gb(self.temp_bytes)} / {gb(self.code_bytes)}"))
        by = f" by {self.compiler}" + (f", {role(self.compiler_name)}" if role(self.compiler_name) else "")
        rows.append(("TPU compile", f"{self.compile_s:.1f} s" + (by if self.compiler else "")))
        if self.compiler_note:
            rows.append(("  note", self.compiler_note))
        if self.fits:
            rows.append(("FLOPs / bytes accessed", f"{self.flops / 1e9:.1f} GFLOP / {gb(self.bytes_accessed)}"))
            rows.append(("step at best (roofline)", f"{self.step_s_min * 1e3:.2f} ms, {self.bound}-bound"))
        if self.message:
            rows.append(("compiler", self.message.splitlines()[0][:160]))
        if self.refusal and self.refusal.reserved_bytes is not None:
            r = self.refusal
            rows.append(("  program / arguments / reserved", f"{gb(r.program_bytes)} / {gb(r.arguments_bytes)} / "
                                                              f"{gb(r.reserved_bytes)}"))
        for i, line in enumerate(self.refusal.lines(gb) if self.refusal else ()):
            rows.append(("why: the largest buffers" if i == 0 else "", line))
        if self.memory is not None:
            rows.extend(self.memory.summary())
        if self.note:
            rows.append(("note", self.note))
        for s in self.suggestions:
            after = f" -> {gb(s.hbm_bytes)}{'' if s.fits is None else (' fits' if s.fits else ' still too big')}" \
                if s.hbm_bytes is not None else ""
            rows.append((f"try: {s.change}", f"{s.how}{after}"))
        return rows

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
                        f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in self.rows())
        return f"<table>{cells}</table>"


def gb(n: float | None) -> str:
    """Bytes as a short decimal size (GB/MB/kB)."""
    if n is None:
        return "?"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# The older refusal of one allocation: "Allocation (size=N) would exceed memory (size=M)", M the whole HBM.
_WHOLE_SPACE = "would exceed memory"


def from_reply(reply: dict, target: Target, name: str = "step") -> TpuEstimate:
    """A :class:`TpuEstimate` from the worker's reply; a non-memory refusal raises :class:`TpuCompileError`.

    The verdict is the compiler's: compiled is ``fits=True`` whatever the sum of its buffers. The limit is
    the usable HBM its refusal names, else the chip's figure of it (:attr:`~.targets.Chip.usable_hbm_bytes`).
    """
    have = reply.get("limit_bytes")
    if have and _WHOLE_SPACE in (reply.get("error") or ""):
        have = None  # that phrasing names the memory space's whole size (a v5e's 16 GiB), not what a program may use
    limit = int(have or target.usable_hbm_bytes)
    found = reply.get("compiler") or {}
    named = {"compiler": describe(found), "compiler_note": mismatch(found),
             "compiler_name": reply.get("compiler_name", "")}
    if "error" in reply:
        if not reply.get("memory"):
            raise TpuCompileError(f"the TPU compiler rejected graph {name!r} for {target.name}: {reply['error']}")
        need = int(reply.get("required_bytes") or 0)
        return TpuEstimate(target=target.name, fits=False, hbm_bytes=need, hbm_limit_bytes=limit,
                           arguments_bytes=0, outputs_bytes=0, aliased_bytes=0, temp_bytes=0, code_bytes=0,
                           compile_s=float(reply.get("compile_s", 0.0)), flops=0.0, bytes_accessed=0.0,
                           step_s_min=0.0, bound="", message=reply["error"], refusal=parse(reply["error"]),
                           hbm_source=NEED if need else UNKNOWN, refused_for_memory=True, **named)
    total = (reply["arguments_bytes"] + reply["outputs_bytes"] + reply["temp_bytes"] + reply["code_bytes"]
             - reply["aliased_bytes"])
    peak = reply.get("peak_bytes")  # None from a compiler (or a cached answer) that did not report one
    chip = target.chip
    compute_s = reply["flops"] / chip.peak_bf16_flops
    memory_s = reply["bytes_accessed"] / chip.hbm_bytes_per_s
    return TpuEstimate(target=target.name, fits=True, hbm_bytes=int(peak or total), hbm_limit_bytes=limit,
                       arguments_bytes=reply["arguments_bytes"], outputs_bytes=reply["outputs_bytes"],
                       aliased_bytes=reply["aliased_bytes"], temp_bytes=reply["temp_bytes"],
                       code_bytes=reply["code_bytes"], compile_s=float(reply["compile_s"]),
                       flops=float(reply["flops"]), bytes_accessed=float(reply["bytes_accessed"]),
                       step_s_min=max(compute_s, memory_s), bound="compute" if compute_s >= memory_s else "memory",
                       hbm_source=PEAK if peak else SUM, **named)


def refused(target: Target, message: str) -> TpuEstimate:
    """A record for a graph that could not be compiled at all (``fits=False``, ``status`` "does not compile",
    the reason in ``message``)."""
    return TpuEstimate(target=target.name, fits=False, hbm_bytes=0, hbm_limit_bytes=target.usable_hbm_bytes,
                       arguments_bytes=0, outputs_bytes=0, aliased_bytes=0, temp_bytes=0, code_bytes=0,
                       compile_s=0.0, flops=0.0, bytes_accessed=0.0, step_s_min=0.0, bound="", message=message,
                       hbm_source=UNKNOWN)
