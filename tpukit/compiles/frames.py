"""Python frames of a compilation, as torch_xla's compile trace writes them, and the
parser of one "Compilation Analysis" block. Which frames are the user's and which
are machinery (torch, torch_xla, IPython, the standard library, tpukit itself), and
the block as a person reads it (:func:`explained`: the user's frames only).
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass

from .._text import plural

_FRAME_RE = re.compile(r"^\s*(?P<func>.+?) \((?P<file>.*):(?P<line>\d+)\)\s*$")
# Installed packages (torch, torch_xla, IPython, decorator, ...) and tpukit itself
# are machinery; the user's code is everything else.
_HIDDEN_PARTS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
                 os.sep + "torch" + os.sep, os.sep + "torch_xla" + os.sep, os.sep + "IPython" + os.sep,
                 os.sep + "ipykernel" + os.sep)
_MACHINERY_PARTS = _HIDDEN_PARTS[2:]
_RUN = re.compile(r"^<ipython-input-\d+-")  # IPython's cell name: <ipython-input-{execution count}-{hash of the code}>
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (tpukit/compiles/..)
_LIB_ROOTS = (os.path.join(_SRC, "tpukit") + os.sep, os.path.join(_SRC, "widgets") + os.sep,
              sysconfig.get_paths()["stdlib"] + os.sep)  # contextlib, threading, ...


@dataclass(frozen=True)
class Frame:
    """One Python frame of the stack that triggered a compilation."""

    function: str
    filename: str
    line: int
    cell: str | None = None  # "[7]" when the file is a notebook cell

    @property
    def is_library(self) -> bool:
        """True for frames inside torch, torch_xla, tpukit or IPython's machinery."""
        if self.cell:
            return False
        f = self.filename
        if f.startswith("<") and "ipython-input" not in f:
            return True
        return any(p in f for p in _HIDDEN_PARTS) or f.startswith(_LIB_ROOTS)

    @property
    def is_machinery(self) -> bool:
        """True for frames inside torch, torch_xla, tpukit or IPython (never worth showing)."""
        f = self.filename
        return not self.cell and (any(p in f for p in _MACHINERY_PARTS) or f.startswith(_LIB_ROOTS))

    @property
    def package_path(self) -> str | None:
        """``transformers/masking_utils.py`` for a file of an installed package; None otherwise."""
        for part in _HIDDEN_PARTS[:2]:
            if not self.cell and part in self.filename:
                return self.filename.rsplit(part, 1)[1]
        return None

    @property
    def key(self) -> tuple[str, int]:
        """The frame as a place is keyed (its file and line), a cell's file named by its code and not by its run:
        plain IPython (a terminal, IPython 7 without ipykernel's names) calls a cell's code
        ``<ipython-input-5-8a9d3c0b1e2f>`` (the execution count, then a hash of the source), so the same cell run
        again is ``<ipython-input-9-8a9d3c0b1e2f>``: the same code at the same place (ipykernel names it by the
        hash alone)."""
        return _RUN.sub("<ipython-input-", self.filename), self.line

    def __str__(self) -> str:
        if self.cell:
            return f"cell {self.cell} line {self.line}"
        return f"{self.package_path or os.path.basename(self.filename)}:{self.line} in {self.function}"


def parse_block(lines: list[str]) -> dict:
    """Fields of one "Compilation Analysis" block (lines without the prefix)."""
    out: dict = {"cause": "", "graph_hash": "", "inputs": 0, "outputs": 0, "frames": []}
    section = None
    for raw in lines:
        line = raw.rstrip("\n")
        s = line.strip()
        if s == "Compilation Cause":
            section = "cause"
        elif s.startswith("Graph Info"):
            section = "graph"
        elif s.startswith("Python Frame Triggered Execution"):
            section = "frames"
        elif s.startswith("---") or s.startswith("==="):
            section = None
        elif section == "cause" and s:
            out["cause"] = (out["cause"] + " " + s).strip()
        elif section == "graph":
            if s.startswith("Graph Hash:"):
                out["graph_hash"] = s.split(":", 1)[1].strip()
            elif s.startswith("Number of Graph Inputs:"):
                out["inputs"] = int(s.split(":", 1)[1])
            elif s.startswith("Number of Graph Outputs:"):
                out["outputs"] = int(s.split(":", 1)[1])
        elif section == "frames" and s:
            m = _FRAME_RE.match(line)
            if m:
                out["frames"].append(Frame(m["func"], m["file"], int(m["line"])))
    return out


def owner(frame: Frame) -> str:
    """Whose code a frame runs, in one word: the installed package (``IPython``, ``ipykernel``, ``torch_xla``),
    ``tpukit``, the standard library's module (``asyncio``, ``runpy``), else the file's name."""
    path = frame.package_path
    if path:
        return re.split(r"[\\/]", path, maxsplit=1)[0].removesuffix(".py")
    f = frame.filename
    if f.startswith(_LIB_ROOTS[:2]):
        return "tpukit"
    if f.startswith(_LIB_ROOTS[2]):
        return re.split(r"[\\/]", f[len(_LIB_ROOTS[2]):], maxsplit=1)[0].removesuffix(".py")
    if f.startswith("<frozen ") and f.endswith(">"):
        return f[len("<frozen "):-1].split(".")[0]
    for part in _MACHINERY_PARTS:
        if part in f:
            return part.strip(os.sep)
    return os.path.basename(f)


def explained(analysis: str, frames: tuple[Frame, ...] | list[Frame]) -> list[str]:
    """torch_xla's "Compilation Analysis" block (``CompileEvent.analysis``) as a person reads it: the separator
    rules dropped, and its Python frames cut to the user's (cells as ``<module> (cell [5] line 2)``, files as
    torch_xla writes them), then one line with how many library frames were left out and whose (IPython's,
    ipykernel's, asyncio's: a notebook kernel's thirty frames). ``frames``: the block's frames as parsed and
    named (``CompileEvent.frames``). When none is the user's (torch_xla kept only library frames), the
    innermost one outside torch, torch_xla and tpukit is shown (a line inside transformers)."""
    out: list[str] = []
    in_frames = listed = False
    for line in analysis.splitlines():
        if not line.strip().strip("=-"):
            continue
        if in_frames and _FRAME_RE.match(line):
            if not listed:
                indent = line[:len(line) - len(line.lstrip())]
                out += [indent + text for text in _frame_lines(list(frames))]
                listed = True
            continue
        in_frames = line.strip().startswith("Python Frame Triggered Execution")
        out.append(line.rstrip())
    return out


def _frame_lines(frames: list[Frame]) -> list[str]:
    """The user's frames, one line each, innermost first, then ``(27 library frames left out: ...)``."""
    shown = [k for k, f in enumerate(frames) if not f.is_library]
    if not shown:
        shown = [k for k, f in enumerate(frames) if not f.is_machinery][:1]
    lines = [f"{f.function} ({f if f.cell else f'{f.filename}:{f.line}'})" for f in (frames[k] for k in shown)]
    hidden = [f for k, f in enumerate(frames) if k not in shown]
    if hidden:
        whose = list(dict.fromkeys(owner(f) for f in hidden))
        lines.append(f"({plural(len(hidden), 'library frame')} left out: {', '.join(whose)})")
    return lines
