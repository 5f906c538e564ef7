"""Why the TPU compiler refused a step: its own account of the HBM, read from its refusal.

libtpu's out-of-memory refusal goes on past its first line. It splits the
usage ("Total hbm usage >= 27.25G: reserved 258.00M, program 27.00G, arguments
0B"), gives the outputs ("Output size 6.00G; shares 2.00G with arguments") and
the program's parts ("Program hbm requirement 30.00G: HLO temp 30.00G (...)"),
and lists the program's largest allocations, each with its size, shape,
the HLO instruction that made it, the allocation's type and, when the graph's
metadata carries one, the source file and line of the operation::

    1. Size: 16.00G
       Operator: source_file="-" source_line=82
       Shape: f32[524288,8192]{1,0:T(8,128)}
       Unpadded size: 16.00G
       XLA label: convolution_add_fusion.remat2 = fusion(...), kind=kOutput, ...
       Allocation type: HLO temp

Older phrasings name a single allocation instead ("Allocation (size=N) would
exceed memory (size=M) :: ... [shape = 'f32[...]', ... tag = 'output of X']").
:func:`parse` reads both into a :class:`Refusal`: plain data, kept on the
:class:`~tpukit.tpu.outcome.TpuEstimate` of a refused step and shown in its text.
Sizes in the compiler's text are binary (``G`` is GiB).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ... import _ipython
from ..._hlo_text import strip_layout

_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# The older refusal of one allocation: "Allocation (size=N) would exceed memory (size=M)", M the whole HBM.
_WHOLE_SPACE = "would exceed memory"


def _bytes(number: str, unit: str = "") -> int:
    return int(float(number) * _UNITS[(unit or "").upper()[:1]])


def memory_figures(message: str) -> tuple[int | None, int | None]:
    """(bytes required, bytes available) from a TPU compiler out-of-memory message, when it says them."""
    patterns = [  # the phrasings libtpu 0.0.42 and 0.0.21 use
        (rf"required for [^(]*\({_SIZE}\) exceeds available HBM \({_SIZE}\)", 0, 2),
        (rf"Used {_SIZE} of {_SIZE} hbm", 0, 2),
        (r"Allocation \(size=(\d+)\)() would exceed memory \(size=(\d+)\)()", 0, 2),
    ]
    for pattern, need_at, have_at in patterns:
        m = re.search(pattern, message)
        if m:
            g = m.groups()
            return _bytes(g[need_at], g[need_at + 1]), _bytes(g[have_at], g[have_at + 1])
    return None, None


def is_memory_refusal(message: str | None) -> bool:
    """True when the compiler refused for lack of HBM (not for another reason)."""
    message = message or ""
    return "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message or "exceed memory" in message


@dataclass(frozen=True)
class Allocation:
    """One buffer of the refused program, as the compiler lists it (largest first)."""

    bytes: int
    shape: str  # the HLO shape without its TPU layout, e.g. "f32[524288,8192]"
    instruction: str  # the HLO instruction that holds it, e.g. "convolution_add_fusion.remat2"
    kind: str  # the compiler's allocation type: "HLO temp", "Parameter", "Output", ...
    source: str | None = None  # "file:line" of the operation, when the graph's metadata names one
    op_name: str | None = None  # the framework's name of the operation, when the metadata has one
    unpadded_bytes: int | None = None  # its size without the TPU layout's padding
    parameter: int | None = None  # the entry parameter it holds ("XLA label: Arg_5.6 = parameter(5)")


@dataclass(frozen=True)
class Refusal:
    """The compiler's account of a step that does not fit: the totals it gives and its largest allocations."""

    used_bytes: int | None  # what the program needs ("Used 27.00G of 15.75G hbm")
    limit_bytes: int | None  # the HBM the compiler names: what a program can use, or (``whole_space``) the chip's
    reserved_bytes: int | None = None  # kept by the runtime beside the program
    program_bytes: int | None = None
    arguments_bytes: int | None = None
    allocations: tuple[Allocation, ...] = ()
    outputs_bytes: int | None = None  # "Output size 6.00G; shares 2.00G with arguments"
    outputs_shared_bytes: int | None = None  # the part of the outputs that reuses the arguments' buffers
    exceeded_bytes: int | None = None  # "Exceeded hbm capacity by 14.25G"
    program_parts: tuple[tuple[str, int], ...] = ()  # "Program hbm requirement": ("HLO temp", bytes), ...
    whole_space: bool = False  # the older phrasing: limit_bytes is the memory space's whole size (a v5e's 16 GiB)

    @property
    def usable_bytes(self) -> int | None:
        """The HBM a program may use, as the compiler says it (None when its phrasing names the whole space)."""
        return None if self.whole_space else self.limit_bytes

    def largest(self, share: float = 0.9, most: int = 5) -> tuple[Allocation, ...]:
        """The largest allocations, until they cover ``share`` of the listed bytes (at most ``most``)."""
        total = sum(a.bytes for a in self.allocations)
        out, covered = [], 0
        for a in sorted(self.allocations, key=lambda a: -a.bytes):
            if len(out) >= most or (total and covered >= share * total):
                break
            out.append(a)
            covered += a.bytes
        return tuple(out)

    def lines(self, size: Callable[[int], str] = lambda n: f"{n} B") -> list[str]:
        """One line per large allocation: its size (written by ``size``: the estimate's own unit), its share
        of the program, its shape, type and where it comes from."""
        whole = self.program_bytes or self.used_bytes or sum(a.bytes for a in self.allocations) or 0
        rows = []
        for a in self.largest():
            share = f" ({a.bytes / whole:.0%} of the program)" if whole else ""
            where = short(a.source) if a.source else a.op_name or a.instruction
            rows.append(f"{size(a.bytes)}{share}: {a.shape}, {a.kind}, made by {where}")
        return rows


def short(source: str) -> str:
    """A source line for people: a library file from ``site-packages/`` on, a notebook cell as ``[N]:line``."""
    path, _, line = source.rpartition(":")
    cell = _ipython.cell_label(path)
    if cell:
        return f"{cell}:{line}"
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1] + ":" + line
    return source


def _total(text: str, name: str) -> int | None:
    m = re.search(rf"^\s*{name}\s+{_SIZE}\s*$", text, re.M)
    return _bytes(m.group(1), m.group(2)) if m else None


def _parts(text: str) -> tuple[tuple[str, int], ...]:
    """The lines under "Program hbm requirement X:" (``HLO temp 30.00G (...)``, ...), up to the blank line."""
    m = re.search(r"Program hbm requirement[^\n]*\n((?:[ \t]+\S[^\n]*\n?)+)", text)
    if not m:
        return ()
    out = []
    for line in m.group(1).splitlines():
        part = re.match(rf"\s*(.+?)\s+{_SIZE}(?:\s|$)", line)
        if part:
            out.append((part.group(1), _bytes(part.group(2), part.group(3))))
    return tuple(out)


def _listed(text: str) -> tuple[Allocation, ...]:
    """The entries of "Largest program allocations in hbm" (each up to its "=====" line)."""
    start = text.find("Largest program allocations")
    if start < 0:
        return ()
    out = []
    for block in re.split(r"\n\s*\d+\.\s+Size:", text[start:])[1:]:
        size = re.match(rf"\s*{_SIZE}", block)
        shape = re.search(r"^\s*Shape:\s*(.+)$", block, re.M)
        label = re.search(r"^\s*XLA label:\s*([^\s=]+)", block, re.M)
        unpadded = re.search(rf"^\s*Unpadded size:\s*{_SIZE}", block, re.M)
        param = re.search(r"^\s*XLA label:[^\n]*=\s*parameter\((\d+)\)", block, re.M)
        kind = re.search(r"^\s*Allocation type:\s*(.+?)\s*$", block, re.M)
        operator = re.search(r"^\s*Operator:\s*(.+)$", block, re.M)
        if not (size and shape):
            continue
        source = op_name = None
        if operator:
            f = re.search(r'source_file="([^"]*)"', operator.group(1))
            line = re.search(r"source_line=(\d+)", operator.group(1))
            if f and f.group(1) not in ("", "-") and line:
                source = f"{f.group(1)}:{line.group(1)}"
            name = re.search(r'op_name="([^"]*)"', operator.group(1))
            op_name = name.group(1) if name and name.group(1) else None
        out.append(Allocation(_bytes(size.group(1), size.group(2)), strip_layout(shape.group(1)),
                              label.group(1) if label else "?", kind.group(1) if kind else "?", source, op_name,
                              _bytes(unpadded.group(1), unpadded.group(2)) if unpadded else None,
                              int(param.group(1)) if param else None))
    return tuple(out)


def _single(message: str) -> tuple[Allocation, ...]:
    """The one allocation of the older phrasing (``Allocation (size=N) would exceed memory``), if it is that."""
    single = re.search(r"Allocation \(size=(\d+)\) would exceed memory", message)
    if not single:
        return ()
    shape = re.search(r"shape = '([^']+)'", message)
    tag = re.search(r"tag = '(?:output of )?([^'@]+)", message)
    return (Allocation(int(single.group(1)), strip_layout(shape.group(1)) if shape else "?",
                       tag.group(1) if tag else "?", "HLO temp"),)


def parse(message: str | None) -> Refusal | None:
    """The compiler's account of an out-of-memory refusal, or None when ``message`` is not one it can read.

    What it needs and has come from :func:`memory_figures` (every phrasing it knows); the totals and
    allocations from the rest of the message. The one reading of a refusal: the worker sends its text."""
    if not message:
        return None
    need, have = memory_figures(message)
    if need is None:
        return None
    out = re.search(rf"Output size {_SIZE}; shares {_SIZE} with arguments", message)
    over = re.search(rf"Exceeded hbm capacity by {_SIZE}", message)
    return Refusal(need, have, _total(message, "reserved"), _total(message, "program"),
                   _total(message, "arguments"), _listed(message) or _single(message),
                   _bytes(out.group(1), out.group(2)) if out else None,
                   _bytes(out.group(3), out.group(4)) if out else None,
                   _bytes(over.group(1), over.group(2)) if over else None, _parts(message),
                   _WHOLE_SPACE in message)
