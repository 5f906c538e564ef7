"""The answer of the TPU compiler for one graph and one target: :class:`TpuEstimate`, and what to do.

Built from the worker's reply: the compiler's memory statistics (per chip),
its cost analysis, and the roofline floor from the target's public peak
FLOP/s and HBM bandwidth. Its text and HTML reprs are one short table.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..errors import TpukitError
from .compilers import describe, mismatch
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


@dataclass(frozen=True)
class TpuEstimate:
    """What the TPU compiler says about one step on one target (bytes are per chip)."""

    target: str
    fits: bool
    hbm_bytes: int  # arguments + outputs + temporaries + code - aliased
    hbm_limit_bytes: int  # from the compiler's refusal when it says so, else the chip's HBM
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
    compiler_note: str | None = None  # set when it is not the libtpu the installed torch_xla's runtime runs

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the table both reprs show."""
        pct = f" ({self.hbm_bytes / self.hbm_limit_bytes:.0%})" if self.hbm_limit_bytes and self.hbm_bytes else ""
        rows = [("target", self.target),
                ("fits", "yes" if self.fits else "NO"),
                ("HBM per chip", f"{gb(self.hbm_bytes)} of {gb(self.hbm_limit_bytes)}{pct}")]
        if self.fits or self.arguments_bytes:
            rows.append(("  arguments / outputs / aliased", f"{gb(self.arguments_bytes)} / {gb(self.outputs_bytes)}"
                                                             f" / {gb(self.aliased_bytes)}"))
            rows.append(("  temporaries / code", f"{gb(self.temp_bytes)} / {gb(self.code_bytes)}"))
        rows.append(("TPU compile", f"{self.compile_s:.1f} s" + (f" by {self.compiler}" if self.compiler else "")))
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


def from_reply(reply: dict, target: Target, name: str = "step") -> TpuEstimate:
    """A :class:`TpuEstimate` from the worker's reply; a non-memory refusal raises :class:`TpuCompileError`."""
    limit = int(reply.get("limit_bytes") or target.hbm_bytes)
    found = reply.get("compiler") or {}
    named = {"compiler": describe(found), "compiler_note": mismatch(found)}
    if "error" in reply:
        if not reply.get("memory"):
            raise TpuCompileError(f"the TPU compiler rejected graph {name!r} for {target.name}: {reply['error']}")
        need = int(reply.get("required_bytes") or 0)
        return TpuEstimate(target.name, False, need, limit, 0, 0, 0, 0, 0, float(reply.get("compile_s", 0.0)),
                           0.0, 0.0, 0.0, "", reply["error"], refusal=parse(reply["error"]), **named)
    hbm = (reply["arguments_bytes"] + reply["outputs_bytes"] + reply["temp_bytes"] + reply["code_bytes"]
           - reply["aliased_bytes"])
    chip = target.chip
    compute_s = reply["flops"] / chip.peak_bf16_flops
    memory_s = reply["bytes_accessed"] / chip.hbm_bytes_per_s
    return TpuEstimate(target.name, hbm <= limit, int(hbm), limit, reply["arguments_bytes"], reply["outputs_bytes"],
                       reply["aliased_bytes"], reply["temp_bytes"], reply["code_bytes"], float(reply["compile_s"]),
                       float(reply["flops"]), float(reply["bytes_accessed"]), max(compute_s, memory_s),
                       "compute" if compute_s >= memory_s else "memory", None, **named)


def refused(target: Target, message: str) -> TpuEstimate:
    """A record for a graph that could not be compiled at all (``fits=False``, the reason in ``message``)."""
    return TpuEstimate(target.name, False, 0, target.hbm_bytes, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, "", message)
