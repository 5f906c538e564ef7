"""The PJRT runtime: devices, the sync that cuts the lazy graph, the replica topology.

Thin wrappers over the current API (``torch_xla.device()``, ``torch_xla.sync()``,
``torch_xla.runtime``), not the deprecated ``xm.xla_device`` / ``xm.mark_step``.
The runtime starts the first time a device is used and cannot be reconfigured
after that, so the functions that only ask (:func:`runtime_initialized`) never
start it.
"""

from __future__ import annotations

import sys
from typing import Any

from .loader import is_imported, runtime, torch_xla, xm


def runtime_initialized() -> bool:
    """True when the PJRT runtime has started (a device was used). Never starts it."""
    if not is_imported():
        return False
    mod = sys.modules["torch_xla"]
    try:
        return bool(mod._XLAC._xla_runtime_is_initialized())
    except AttributeError:  # torch_xla partially imported
        return False


def device(index: int | None = None) -> Any:
    """The default XLA device (``torch_xla.device()``); starts the runtime."""
    return torch_xla().device(index)


def sync(wait: bool = False) -> None:
    """Cut the lazy graph and launch it (``torch_xla.sync``); runs step closures."""
    torch_xla().sync(wait=wait)


def wait_device_ops() -> None:
    """Block until every launched execution finished."""
    xm().wait_device_ops()


def device_type() -> str | None:
    """The PJRT device type: 'TPU', 'CPU', 'CUDA' (torch_xla 2.8 only), ..."""
    return runtime().device_type()


def device_count() -> int:
    """Number of devices of the whole runtime (virtual SPMD device aside)."""
    return int(runtime().global_runtime_device_count())


def world_size() -> int:
    """Number of replicas (processes x threads) taking part."""
    return int(runtime().world_size())


def process_count() -> int:
    """Number of processes in the job."""
    return int(runtime().process_count())


def global_ordinal() -> int:
    """This replica's global ordinal (0 is the master)."""
    return int(runtime().global_ordinal())


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Enable torch_xla's persistent compilation cache at ``path``."""
    runtime().initialize_cache(path, readonly=readonly)


def accelerator_type() -> str | None:
    """The accelerator model as the runtime names it (e.g. 'v5litepod-8'), or None."""
    try:
        attrs = runtime().global_runtime_device_attributes()
    except Exception:
        attrs = []
    for attr in attrs or []:
        for key in ("accelerator_type", "device_kind", "name"):
            if attr.get(key):
                return str(attr[key])
    return None


def version() -> str:
    """torch_xla's version string."""
    return str(getattr(torch_xla(), "__version__", "unknown"))


def memory_info(dev: Any = None) -> dict | None:
    """Device memory use in bytes, or None where the device does not report it.

    XLA:CPU raises ``UNIMPLEMENTED: GetAllocatorStats``; that, like any failure to
    read the figures, gives None, so callers degrade instead of failing. Older
    runtimes report kilobytes (``kb_total``/``kb_free``): converted to bytes.
    """
    try:
        info = xm().get_memory_info(dev if dev is not None else device())
    except Exception:
        return None
    if not info:
        return None
    used = info.get("bytes_used", info.get("kb_total", 0) and None)
    limit = info.get("bytes_limit")
    if used is None and "kb_total" in info:  # older key layout
        used = (info["kb_total"] - info["kb_free"]) * 1024
        limit = info["kb_total"] * 1024
    return {"bytes_used": int(used or 0), "bytes_limit": int(limit or 0)}
