"""The persistent compilation cache: on by default on a TPU, off (and why) elsewhere.

torch_xla can keep compiled executables on disk so that a restarted kernel does
not compile the same graphs again. tpukit turns it on for TPUs in a directory
keyed by the torch_xla and libtpu versions and the TPU topology, so a cache
written by another version or another slice shape is never read. On XLA:CPU
torch_xla writes executables but cannot read them back (FACTS: "Deserializing
serialized executable not supported"), so the cache stays off there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from . import _xla
from .environment import Environment, tpu_device_files

CACHE_DIR_ENV = "TPUKIT_CACHE_DIR"
CPU_REASON = ("off on XLA:CPU: torch_xla writes executables there but cannot read them back, "
              "so a cache would only cost time (it is on by default on a TPU)")


def default_base() -> str:
    """``$TPUKIT_CACHE_DIR``, else ``~/.cache/tpukit/xla`` (on Colab, point the variable at a mounted Drive)."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tpukit", "xla")


def topology(environ: dict | None = None) -> str:
    """The slice shape the cache is keyed by: ``TPU_ACCELERATOR_TYPE`` (e.g. v5litepod-8), else the
    number of TPU device files; never starts the runtime."""
    env = os.environ if environ is None else environ
    accel = env.get("TPU_ACCELERATOR_TYPE")
    if accel:
        return accel
    n = len(tpu_device_files())
    return f"{n}-chips" if n else "unknown-topology"


def cache_key(versions: dict, topo: str) -> str:
    """``torch_xla-2.9.0_libtpu-0.0.21.1_v5litepod-1``: a cache from another key is never read."""
    raw = f"torch_xla-{versions.get('torch_xla') or 'none'}_libtpu-{versions.get('libtpu') or 'none'}_{topo}"
    return re.sub(r"[^A-Za-z0-9_.+-]", "-", raw)


@dataclass(frozen=True)
class CachePlan:
    """Where the cache goes (None: off) and the sentence the report shows."""

    path: str | None
    note: str


def plan(kind: str, requested: str | bool | None, env: Environment, started: bool) -> CachePlan:
    """Decide the cache for a runtime of ``kind`` ('TPU', 'CPU', ...).

    requested: None (the default: on for a TPU), False (off), or a base directory.
    """
    if requested is False:
        return CachePlan(None, "off (compile_cache=False)")
    if kind != "TPU":
        return CachePlan(None, CPU_REASON if kind == "CPU" else f"off on {kind}: a TPU feature")
    if started:
        return CachePlan(None, "off: the runtime had already started; restart the kernel and call "
                               "tpukit.setup() first to use the cache")
    base = requested if isinstance(requested, str) and requested else default_base()
    path = os.path.join(base, cache_key(env.versions, topology()))
    return CachePlan(path, f"on: {path}")


def enable(path: str) -> None:
    """Create the directory and turn torch_xla's persistent cache on (before the runtime starts)."""
    os.makedirs(path, exist_ok=True)
    _xla.initialize_cache(path)


@dataclass(frozen=True)
class CacheStats:
    """Persistent-cache counters of this process: graphs read from disk (hits) and compiled anew (misses)."""

    hits: int
    misses: int

    def __str__(self) -> str:
        return f"{self.hits} hit(s), {self.misses} miss(es)"


def stats() -> CacheStats:
    """The cache's hit and miss counters so far (zero when it is off or nothing compiled)."""
    if not _xla.is_imported():
        return CacheStats(0, 0)
    return CacheStats(int(_xla.counter_value("PersistentCacheHit") or 0),
                      int(_xla.counter_value("PersistentCacheMiss") or 0))
