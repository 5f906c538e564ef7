"""The TPU compiler's versions, read from package metadata (imports nothing else).

Shared by the kernel's side (:mod:`.worker`) and the worker process (:mod:`._jax`), which
must not import tpukit's package (that would load torch into it).
"""

from __future__ import annotations

import importlib.metadata as md

DISTRIBUTIONS = ("jax", "jaxlib", "libtpu")


def versions() -> dict[str, str]:
    """jax, jaxlib and libtpu versions installed here ("" for a missing one); part of every cache
    key, as another libtpu may compile differently."""
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = ""
    return out
