"""Python frames of a compilation, as torch_xla's compile trace writes them, and the
parser of one "Compilation Analysis" block. Which frames are the user's and which
are machinery (torch, torch_xla, IPython, the standard library, tpukit itself).
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass

_FRAME_RE = re.compile(r"^\s*(?P<func>.+?) \((?P<file>.*):(?P<line>\d+)\)\s*$")
# Installed packages (torch, torch_xla, IPython, decorator, ...) and tpukit itself
# are machinery; the user's code is everything else.
_HIDDEN_PARTS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
                 os.sep + "torch" + os.sep, os.sep + "torch_xla" + os.sep, os.sep + "IPython" + os.sep,
                 os.sep + "ipykernel" + os.sep)
_MACHINERY_PARTS = _HIDDEN_PARTS[2:]
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


