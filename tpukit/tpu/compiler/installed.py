"""The TPU compiler's versions, read from package metadata (imports nothing else).

Shared by the kernel's side (:mod:`.worker`) and the worker process (:mod:`._jax`), which
must not import tpukit's package (that would load torch into it).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

DISTRIBUTIONS = ("jax", "jaxlib", "libtpu")
# The last answer and the state of the import path it was read at: reading three packages' metadata scans
# every folder of sys.path (3.4 ms a call, six calls an estimate); an install or uninstall changes the
# modification time of the folder it writes into (a new or removed *.dist-info), and that is re-read.
_LAST: list = []


def _path_state() -> tuple:
    out = []
    for folder in sys.path:
        try:
            out.append((folder, os.stat(folder or ".").st_mtime_ns))
        except OSError:
            out.append((folder, None))
    return tuple(out)


def versions() -> dict[str, str]:
    """jax, jaxlib and libtpu versions installed here ("" for a missing one); part of every cache
    key, as another libtpu may compile differently. Read again once a folder of ``sys.path`` changed."""
    state = _path_state()
    if _LAST and _LAST[0] == state:
        return dict(_LAST[1])
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = ""
    _LAST[:] = [state, out]
    return dict(out)
