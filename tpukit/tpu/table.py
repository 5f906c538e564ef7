"""The planning table of :func:`tpukit.plan`: its records and its forms.

A :class:`Point` is one compile the plan made, a :class:`Cell` one answer of the table (the largest batch of a
mode at a length, or its longest sequence at batch 1) with who decided it, and :class:`Plan` the whole answer
with its forms: the text, the HTML of a notebook, a matplotlib chart, the prediction's measured error and
where the time went. Plain records: :mod:`.plan` makes them.
"""

from __future__ import annotations

import html
import statistics
from dataclasses import dataclass, field
from typing import Any

from .outcome import PLANNED, gb

DECIDED, PREDICTED = "compiler", "predicted"  # and PLANNED, the buffer assignment (.outcome)
FAILED = "failed"  # the mode's step could not be built, traced or compiled: Plan.failed says why
MARK = {DECIDED: "c", PLANNED: "b", PREDICTED: "p", FAILED: "x"}


@dataclass(frozen=True)
class Point:
    """One compile of the plan: a mode at (batch, length), its verdict, the HBM it gave (None: a refusal that
    named none), how it was answered (:data:`DECIDED`: a full compile; :data:`PLANNED`: the buffer
    assignment), the HBM the model predicted before it ran (None: too few points yet), its times."""

    mode: str
    batch: int
    length: int
    fits: bool
    hbm_bytes: int | None
    source: str
    predicted_bytes: int | None
    trace_s: float
    compile_s: float


@dataclass(frozen=True)
class Cell:
    """The largest batch of a mode at a length (``batch`` 0: none fits; for the longest sequence, ``length``
    is the answer at batch 1), who decided it, the size above it that did not fit (None: not tried, or the
    model's limit), what the kit predicted before any edge was searched."""

    mode: str
    length: int
    batch: int
    how: str
    refused: int | None
    predicted: int

    def text(self, longest: bool = False) -> str:
        """``4 c`` (decided), ``3 b`` (planned), ``~5 p`` (predicted), ``- x`` (the mode failed)."""
        if self.how == FAILED:
            return "- x"
        value = self.length if longest else self.batch
        return f"{'~' if self.how == PREDICTED else ''}{value} {MARK[self.how]}"


@dataclass(frozen=True)
class Plan:
    """The planning answer (see the module doc): the cells, the longest sequence per mode, every compile."""

    model: str
    target: str
    compiler: str
    hbm_limit_bytes: int
    lengths: tuple[int, ...]
    modes: tuple[str, ...]
    cells: tuple[Cell, ...]
    longest: tuple[Cell, ...]
    points: tuple[Point, ...]
    wall_s: float
    parameters: dict = field(default_factory=dict)  # mode -> (parameters, trained)
    stopped: str = ""  # what ended the plan early (a time budget): its cells are the best so far
    notes: tuple[str, ...] = ()
    failed: dict = field(default_factory=dict)  # mode -> why its step could not be built, traced or compiled

    def cell(self, mode: str, length: int) -> Cell:
        """The cell of ``mode`` at ``length``."""
        return next(c for c in self.cells if c.mode == mode and c.length == length)

    def longest_of(self, mode: str) -> Cell:
        """The longest sequence of ``mode`` at batch 1."""
        return next(c for c in self.longest if c.mode == mode)

    def errors(self) -> list[float]:
        """The prediction's relative errors, (predicted - compiled) / compiled HBM, on the compiles that had a
        prediction."""
        return [(p.predicted_bytes - p.hbm_bytes) / p.hbm_bytes for p in self.points
                if p.predicted_bytes is not None and p.hbm_bytes]

    def cell_hits(self) -> tuple[int, int]:
        """(cells whose first prediction, made from the design points alone, was the answer found; cells found
        by compiles)."""
        found = [c for c in self.cells + self.longest if c.how != PREDICTED]
        return sum(c.predicted == (c.length if c in self.longest else c.batch) for c in found), len(found)

    def error_text(self) -> str:
        """``HBM predicted within 3.1% (median) and 9.8% (largest) ... ; first predictions: 5 of 18 cells``."""
        errs = [abs(e) for e in self.errors()]
        if not errs:
            return "no compile had a prediction to hold it against yet"
        hit, of = self.cell_hits()
        return (f"HBM predicted within {statistics.median(errs):.1%} (median) and {max(errs):.1%} (largest) of "
                f"the compiler's on {len(errs)} compiles, each predicted before it ran; first predictions: {hit} "
                f"of {of} cells found were the answer")

    def times(self) -> dict[str, float]:
        """Where the plan's time went: tracing, compiles stopped at the buffer assignment, full compiles, the
        rest (building the models, the kit), in seconds."""
        trace_s = sum(p.trace_s for p in self.points)
        planned = sum(p.compile_s for p in self.points if p.source == PLANNED)
        full = sum(p.compile_s for p in self.points if p.source == DECIDED)
        return {"trace": trace_s, "buffer assignment": planned, "full compiles": full,
                "other": max(0.0, self.wall_s - trace_s - planned - full)}

    def rows(self) -> list[list[str]]:
        """The table: a header row, then one row per mode (its cells, then its longest sequence)."""
        head = ["mode"] + [str(n) for n in self.lengths] + ["longest at batch 1"]
        body = [[m] + [self.cell(m, n).text() for n in self.lengths] + [self.longest_of(m).text(longest=True)]
                for m in self.modes]
        return [head] + body

    def _head(self) -> str:
        n = len(self.points)
        return (f"tpukit.plan({self.model}) on {self.target} ({gb(self.hbm_limit_bytes)} usable per chip) by "
                f"{self.compiler or 'the TPU compiler'}: {n} compile{'s' if n != 1 else ''}, "
                f"{self.wall_s / 60:.1f} min")

    def legend(self) -> str:
        """What the marks mean."""
        return ("fits: compiled, with its arguments, outputs and temporaries within the usable HBM at once. "
                "c: the compiler decided it (a full compile fitted that size and not the next); b: the "
                "compiler's buffer assignment fits that size and not the next; p: predicted from the compiles "
                "made (~)" + ("; x: the mode's step failed (below)" if self.failed else ""))

    def _tail(self) -> list[str]:
        t = self.times()
        lines = [self.error_text(),
                 "time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items())]
        if self.stopped:
            lines.append(f"{self.stopped}: the best answer so far")
        return lines + [f"{m} failed: {why}" for m, why in self.failed.items()] + list(self.notes)

    def __str__(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([self._head(), "largest batch (rows) per sequence length (tokens):", *table,
                          self.legend(), *self._tail()])

    def _repr_html_(self) -> str:
        rows = self.rows()
        style = {DECIDED: "font-weight:bold", PLANNED: "", PREDICTED: "color:#888;font-style:italic",
                 FAILED: "color:#b00"}

        def td(mode: str, i: int, text: str) -> str:
            cell = (self.cell(mode, self.lengths[i - 1]) if 0 < i <= len(self.lengths)
                    else self.longest_of(mode) if i else None)
            css = style[cell.how] if cell is not None else ""
            return f'<td style="{css}">{html.escape(text)}</td>'

        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(td(r[0], i, c) for i, c in enumerate(r)) + "</tr>" for r in rows[1:])
        foot = "".join(f"<div>{html.escape(x)}</div>" for x in [self.legend(), *self._tail()])
        return (f"<div><b>{html.escape(self._head())}</b><div>largest batch (rows) per sequence length "
                f"(tokens)</div><table><tr>{head}</tr>{body}</table>{foot}</div>")

    def chart(self, ax: Any = None) -> Any:
        """A matplotlib chart of the largest batch against the sequence length, a line per mode; a cell the
        compiler decided or planned is a filled marker, a predicted one hollow. Returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            ax = plt.subplots(figsize=(6, 3.5))[1]
        for m in self.modes:
            if m in self.failed:
                continue
            cells = [self.cell(m, n) for n in self.lengths]
            line, = ax.plot(self.lengths, [c.batch for c in cells], label=m)
            for c in cells:
                ax.plot(c.length, c.batch, "o", color=line.get_color(),
                        fillstyle="none" if c.how == PREDICTED else "full")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(self.lengths), [str(n) for n in self.lengths])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("largest batch (rows)")
        ax.set_title(f"{self.model} on {self.target}", fontsize=10)
        ax.legend(fontsize=8)
        return ax


@dataclass(frozen=True)
class Fit:
    """The answer of :func:`tpukit.fit`: one step of a decoder LM's fine-tune (a mode at a batch and length) on
    a target, and what to change when it does not fit or is near the chip's limit, each change compiled and
    the list ordered by the HBM it saves (most first; a change that failed or was not checked last)."""

    model: str
    target: str
    compiler: str
    mode: str
    batch: int
    length: int
    fits: bool
    hbm_bytes: int | None  # what the chip must hold at once (None: a refusal that named none)
    hbm_limit_bytes: int
    advice: tuple = ()  # of outcome.Suggestion
    note: str = ""  # why there is no advice, or what stopped it

    @property
    def share(self) -> float | None:
        """The part of the usable HBM the step holds (None when the compiler named no figure)."""
        return self.hbm_bytes / self.hbm_limit_bytes if self.hbm_bytes else None

    def __str__(self) -> str:
        held = f"{gb(self.hbm_bytes)} of {gb(self.hbm_limit_bytes)}" if self.hbm_bytes else "no figure named"
        head = (f"tpukit.fit({self.model}) {self.mode} at {self.batch} x {self.length} tokens on {self.target} by "
                f"{self.compiler or 'the TPU compiler'}: {'fits' if self.fits else 'does not fit'} ({held}"
                f"{f', {self.share:.0%}' if self.share else ''})")
        lines = [head] + ([self.note] if self.note else [])
        lines += [f"  {i}. {s.change}: {s.how}{s.after()}" for i, s in enumerate(self.advice, 1)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return "<pre>" + html.escape(str(self)) + "</pre>"
