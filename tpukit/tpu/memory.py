"""Why a step needs the HBM it does: the buffers at the peak, by kind and by the source line that made them.

``tpukit.estimate(step, batch, target=..., memory=True)`` compiles the step with
a dump of the compiler's buffer assignment (:mod:`.dump`) and keeps, as
``est.memory``, a :class:`MemoryBreakdown`: every buffer in HBM at the program's
peak (the step's parameters and outputs, and its temporaries when they add up
to most), each with a kind and where it comes from. The kind of a parameter or
output of the graph is what the trace found it to be (:mod:`.trace`: a model's
parameter, a gradient, optimizer state, the batch); a temporary's comes from its
operation's metadata: traced in the forward and still live once the backward
began is an activation kept for backward; made by the backward with a
parameter's shape is a gradient; the rest are temporaries. Where is the Python
line that traced the operation (the user's, or a library's: ``torch/nn/...``) and
the module whose forward ran it.

A step the compiler refused gets one too, without a dump: its refusal lists the
program's largest allocations (:mod:`.refusal`), mapped to the same kinds and
lines (``source`` says which). The record is plain data with a text and an HTML
table and a matplotlib bar chart (:meth:`MemoryBreakdown.plot`); advice, each
piece checked by a compile where it can be, is in :mod:`.advice` (on the estimate: ``est.advice``).
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .. import _text
from .._hlo_text import dims
from . import dump as _dump
from .compiler.refusal import Refusal, short
from .outcome import gb
from .trace import ACTIVATIONS, FROZEN, GRADIENTS, INPUTS, OPTIMIZER, OUTPUTS, PARAMETERS, TEMPORARIES, Traced

KINDS = (FROZEN, PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES, INPUTS, OUTPUTS)
CODE = "program code"
DUMP = "compiler dump"  # MemoryBreakdown.source: the dump of this very compile
REFUSAL = "compiler refusal"  # the refusal's list of the program's largest allocations
_STATE = (FROZEN, PARAMETERS, GRADIENTS, OPTIMIZER, INPUTS, OUTPUTS, CODE)  # grouped by kind alone in rows()
# Why the kinds have no row of gradients when none shows: the optimizer's update reads each gradient as it is
# made, so the compiler rarely keeps them all at once (zero_grad(set_to_none=True) frees them in the graph).
NO_GRADIENTS = ("no gradients row: the compiler consumed each gradient in the update as the backward made it, "
                "so none was live at the peak")


@dataclass(frozen=True)
class Buffer:
    """One buffer in HBM at the peak: its size, what it holds and where it comes from."""

    bytes: int
    kind: str  # one of KINDS, or CODE
    name: str  # a parameter's name ("layers.0.qkv.weight"), else the HLO value ("fusion.72{1}")
    shape: str = ""
    source: str | None = None  # "file:line" of the Python that traced it
    module: str | None = None  # the module whose forward traced it ("layers.0")
    op: str | None = None  # torch_xla's op name ("aten__softmax")
    backward: bool = False  # made by the backward pass (autograd traces it without a Python line)

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape's dimensions (``f32[8,1024,32000]{2,1,0}``: 8, 1024, 32000); () when it is unknown."""
        return dims(self.shape)

    @property
    def where(self) -> str:
        """Where it comes from, for people: its source line (a notebook cell as ``[N]:line``), else its op
        (``aten__mm in the backward``)."""
        if self.source:
            return short(self.source)
        return f"{self.op} in the backward" if self.op and self.backward else self.op or ""


@dataclass(frozen=True)
class MemoryRow:
    """Buffers of one kind from one place, added up."""

    kind: str
    where: str  # the source line, op or "" (the step's parameters, optimizer state, ... as a whole)
    bytes: int
    count: int
    shapes: tuple[str, ...]  # the largest buffers' shapes (three at most)
    modules: tuple[str, ...] = ()  # the modules whose forward made them
    names: tuple[str, ...] = ()  # the largest buffers' names (three at most)


@dataclass(frozen=True)
class MemoryBreakdown:
    """The HBM of a step at its peak, buffer by buffer (per chip): ``rows()`` groups them, largest first."""

    total_bytes: int  # what the buffers add up to
    buffers: tuple[Buffer, ...]
    source: str  # DUMP, REFUSAL, or "compiler dump of batch N" (a smaller batch than the step's)
    peak_bytes: int | None = None  # the estimate's HBM figure the buffers account for (None: not known)
    note: str | None = None

    def by_kind(self) -> dict[str, int]:
        """Bytes per kind, largest first."""
        out: dict[str, int] = defaultdict(int)
        for b in self.buffers:
            out[b.kind] += b.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def rows(self, share: float = 0.9, most: int = 12) -> list[MemoryRow]:
        """Buffers grouped by (kind, where), largest first, until they cover ``share`` of the total (at most
        ``most`` rows). Parameters, gradients, optimizer state, inputs and outputs group by kind alone."""
        groups: dict[tuple[str, str], list[Buffer]] = defaultdict(list)
        for b in self.buffers:
            groups[(b.kind, "" if b.kind in _STATE else b.where)].append(b)
        rows = []
        for (kind, where), bs in groups.items():
            bs = sorted(bs, key=lambda b: -b.bytes)
            state = kind in _STATE
            rows.append(MemoryRow(kind, where, sum(b.bytes for b in bs), len(bs), _first(b.shape for b in bs),
                                  () if state else tuple(sorted({b.module for b in bs if b.module})),
                                  _first(b.name for b in bs) if state else ()))
        rows.sort(key=lambda r: -r.bytes)
        whole = self.total_bytes or sum(r.bytes for r in rows) or 1
        out, covered = [], 0
        for r in rows:
            if len(out) >= most or covered >= share * whole:
                break
            out.append(r)
            covered += r.bytes
        return out

    def covered(self, share: float = 0.9) -> float:
        """The part of the total that :meth:`rows` (``share``) shows."""
        return sum(r.bytes for r in self.rows(share)) / (self.total_bytes or 1)

    def table(self, size=gb) -> list[tuple[str, str, str, str]]:
        """(size, share, kind, where and what) per row of :meth:`rows`, as both reprs show them."""
        out = []
        for r in self.rows():
            what = r.where or ", ".join(r.names)
            detail = ", ".join(x for x in (f"{r.count} x " + " / ".join(r.shapes) if r.shapes else "",
                                           "in " + ", ".join(r.modules) if r.modules else "") if x)
            out.append((size(r.bytes), f"{r.bytes / (self.total_bytes or 1):.0%}", r.kind,
                        f"{what} ({detail})" if detail and what else what or detail))
        return out

    def lines(self, size=gb) -> list[str]:
        """The rows as short lines: ``1.07 GB (65%) activations kept for backward: test.py:42 (...)``."""
        return [f"{s} ({p}) {k}" + (f": {w}" if w else "") for s, p, k, w in self.table(size)]

    def summary(self) -> list[tuple[str, str]]:
        """The (label, value) rows :class:`~.outcome.TpuEstimate`'s table adds: the kinds, then (from a dump:
        a refusal's own list is already there) the largest rows."""
        out = [("why: HBM at the peak", f"{gb(self.total_bytes)} from the {self.source}: " +
                ", ".join(f"{k} {gb(v)}" for k, v in self.by_kind().items()))]
        if self.source != REFUSAL:
            out += [("", line) for line in self.lines()]
        for note in (self.note, self._gradients_note()):
            if note:
                out.append(("  note", note))
        return out

    def _gradients_note(self) -> str | None:
        """Why a training step's breakdown has no gradients row (from a dump, with optimizer state in it)."""
        kinds = self.by_kind()
        return NO_GRADIENTS if self.source != REFUSAL and OPTIMIZER in kinds and GRADIENTS not in kinds else None

    def _title(self) -> str:
        peak = f" (the estimate's figure: {gb(self.peak_bytes)})" if self.peak_bytes else ""
        kinds = ", ".join(f"{k} {gb(v)}" for k, v in self.by_kind().items())
        return f"HBM at the peak: {gb(self.total_bytes)}{peak}, from the {self.source}. By kind: {kinds}"

    def __str__(self) -> str:
        text = _text.table_text(self.table(), title=self._title())
        return "\n".join([text] + [f"  note: {n}" for n in (self.note, self._gradients_note()) if n])

    def _repr_html_(self) -> str:
        page = _text.table_html(self.table(), title=self._title(), head=("HBM", "share", "kind", "where"))
        return page + "".join(f"<p>{html.escape(n)}</p>" for n in (self.note, self._gradients_note()) if n)

    def plot(self, ax: Any = None) -> Any:
        """A horizontal bar chart of :meth:`rows` (GB, coloured by kind) on ``ax`` (a new figure without one);
        returns the axes. Needs matplotlib."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("MemoryBreakdown.plot needs matplotlib: pip install matplotlib") from exc
        rows = self.rows()[::-1]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
        colours = {k: plt.get_cmap("tab10")(i) for i, k in enumerate(KINDS + (CODE,))}
        ax.barh([f"{r.kind}: {r.where or ', '.join(r.names)}"[:70] for r in rows], [r.bytes / 1e9 for r in rows],
                color=[colours.get(r.kind, "grey") for r in rows])
        ax.set_xlabel("GB at the peak (per chip)")
        ax.set_title(f"HBM at the peak: {gb(self.total_bytes)} ({self.source})", fontsize=10)
        return ax


def _first(items: Any, n: int = 3) -> tuple[str, ...]:
    out: list[str] = []
    for x in items:
        if x and x not in out:
            out.append(x)
        if len(out) >= n:
            break
    return tuple(out)


def _state_kind(kind: str, name: str) -> tuple[str, str]:
    return kind, name or ("scalars the step reads (learning rate, step count, ...)" if kind == INPUTS else name)


def from_dump(found: _dump.Dump, traced: Traced, reply: dict | None = None, source: str = DUMP) -> MemoryBreakdown:
    """The breakdown of a compile's dump: each buffer's kind from the trace (its graph's parameters and
    outputs) and from its operation's metadata (temporaries). ``reply``: the compiler's figures of the same
    compile, for its code and the part of its temporaries the dump does not place."""
    params = {i: k for i, k in enumerate(traced.inputs)}
    results = {i: k for i, k in enumerate(traced.results)}
    weights = {h.shape for h in found.held if h.role == _dump.PARAMETER and params.get(h.index, ("",))[0] == PARAMETERS}
    out: list[Buffer] = []
    for h in found.held:
        if h.role == _dump.PARAMETER:
            kind, name = _state_kind(*params.get(h.index, (INPUTS, "")))
        elif h.role == _dump.OUTPUT:
            kind, name = results.get(h.index, (OUTPUTS, "")) if h.index is not None else (OUTPUTS, "")
            name = name or h.instruction
        elif h.origin is not None:  # a copy of a parameter of the graph
            kind, name = params.get(h.origin, (INPUTS, ""))
            name = f"copy of {name or 'an input'}"
        elif h.role == _dump.TEMPORARY and h.phase == _dump.FORWARD and h.kept and traced.trains is not False:
            kind, name = ACTIVATIONS, h.instruction
        elif h.role == _dump.TEMPORARY and h.phase == _dump.BACKWARD and h.shape in weights:
            kind, name = GRADIENTS, h.instruction
        else:
            kind, name = TEMPORARIES, h.instruction
        out.append(Buffer(h.bytes, kind, name, h.shape, h.source, h.module, h.op_name, h.phase == _dump.BACKWARD))
    note = None
    if reply:
        total = sum(b.bytes for b in out)
        whole = (reply["arguments_bytes"] + reply["outputs_bytes"] + reply["temp_bytes"] - reply["aliased_bytes"])
        if whole > total:  # temporaries the compiler counts that the buffer assignment does not place
            out.append(Buffer(whole - total, TEMPORARIES, "the compiler's scratch (not placed in its dump)"))
        if reply.get("code_bytes"):
            out.append(Buffer(int(reply["code_bytes"]), CODE, "the program's code"))
        peak = reply.get("peak_bytes")
        if peak and peak < sum(b.bytes for b in out):
            note = (f"the compiler reports a peak of {gb(peak)}, below these buffers' {gb(sum(b.bytes for b in out))}:"
                    " not all of them are live at once")
    return MemoryBreakdown(sum(b.bytes for b in out), tuple(out), source, note=note)


def from_refusal(refusal: Refusal, traced: Traced | None = None) -> MemoryBreakdown:
    """The breakdown the compiler's refusal gives: its largest allocations (most of the program, not all:
    ``total_bytes`` is the program's need, so the rows' shares say how much the list covers)."""
    params = dict(enumerate(traced.inputs)) if traced else {}
    trains = traced.trains if traced else None
    out = []
    for a in refusal.allocations:
        phase = _dump.phase_of(a.op_name, a.source)
        if a.parameter is not None:
            kind, name = _state_kind(*params.get(a.parameter, (INPUTS, "")))
        elif "output" in a.kind.lower():
            kind, name = OUTPUTS, a.instruction
        elif phase == _dump.FORWARD and trains is not False:
            # The refusal gives no live ranges: a forward buffer this large in a training step is one the
            # backward needs (one that did not outlive the forward would not be among the largest at the peak).
            kind, name = ACTIVATIONS, a.instruction
        else:
            kind, name = TEMPORARIES, a.instruction
        op = a.op_name.rsplit("/", 1)[-1] if a.op_name else None
        out.append(Buffer(a.bytes, kind, name, a.shape, a.source, _dump.module_of(a.op_name), op,
                          phase == _dump.BACKWARD))
    whole = refusal.program_bytes or refusal.used_bytes or sum(b.bytes for b in out)
    listed = sum(b.bytes for b in out)
    note = (f"the refusal lists the program's largest allocations: {gb(listed)} of its {gb(whole)}"
            if listed < 0.999 * whole else None)
    return MemoryBreakdown(whole, tuple(out), REFUSAL, peak_bytes=refusal.used_bytes, note=note)


def attention_like(buffer: Buffer) -> bool:
    """A buffer shaped as attention scores or probabilities: [..., L, L] with L >= 128, rank 3 or more."""
    dims = buffer.dims
    return len(dims) >= 3 and dims[-1] == dims[-2] >= 128
