"""The torch_xla adapter: the only module of tpukit that imports torch_xla.

torch_xla is imported lazily, on first use, so that ``import tpukit`` is cheap
and so that tpukit can set environment variables (device kind, virtual CPU
devices, compile tracing) *before* the runtime reads them. Every function here
is a thin wrapper over the current torch_xla API; when torch_xla changes (or is
replaced by a native backend) this is the one file to edit.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Sequence

from .errors import RuntimeStateError, TorchXlaMissingError, VersionMismatchError

_MODULES: dict[str, Any] = {}


def is_imported() -> bool:
    """True when torch_xla has been imported in this process (by anyone)."""
    return "torch_xla" in sys.modules


def _module(name: str = "torch_xla"):
    mod = _MODULES.get(name)
    if mod is None:
        mod = _MODULES[name] = _import(name)
    return mod


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        text = str(exc)
        if "undefined symbol" in text or "torch_xla/_XLAC" in text:
            from . import environment

            v = environment.versions()
            raise VersionMismatchError(
                f"torch_xla {v.get('torch_xla')} cannot load with torch {v.get('torch')}: "
                f"its C extension was built for another torch release ({text.splitlines()[0][:160]}). "
                f"Install a matching pair: {environment.install_command()}"
            ) from None
        if exc.name and exc.name.split(".")[0] == "torch_xla":
            from . import environment

            raise TorchXlaMissingError(
                "torch_xla is not installed in this Python environment. "
                f"Install it with: {environment.install_command()}"
            ) from None
        raise


def torch_xla():
    """The imported ``torch_xla`` module (imports it on first call)."""
    return _module("torch_xla")


def runtime():
    """The ``torch_xla.runtime`` module."""
    return _module("torch_xla.runtime")


def _xm():
    return _module("torch_xla.core.xla_model")


def _met():
    return _module("torch_xla.debug.metrics")


# --------------------------------------------------------------------------- runtime

def runtime_initialized() -> bool:
    """True when the PJRT runtime has started (a device was used). Never starts it."""
    if not is_imported():
        return False
    mod = sys.modules["torch_xla"]
    try:
        return bool(mod._XLAC._xla_runtime_is_initialized())
    except AttributeError:  # torch_xla partially imported
        return False


def device(index: int | None = None):
    """The default XLA device (``torch_xla.device()``); starts the runtime."""
    return torch_xla().device(index)


def devices() -> list:
    """All devices addressable by this process."""
    return list(torch_xla().devices())


def sync(wait: bool = False) -> None:
    """Cut the lazy graph and launch it (``torch_xla.sync``); runs step closures."""
    torch_xla().sync(wait=wait)


def wait_device_ops() -> None:
    """Block until every launched execution finished."""
    _xm().wait_device_ops()


def device_type() -> str | None:
    """The PJRT device type: 'TPU', 'CPU', 'CUDA', ..."""
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


def is_master() -> bool:
    """True on the replica that writes files (global ordinal 0)."""
    return global_ordinal() == 0


def use_spmd() -> None:
    """Switch the runtime to SPMD mode (call before creating device tensors)."""
    runtime().use_spmd()


def is_spmd() -> bool:
    """True when SPMD mode is on. Does not import torch_xla when it is not loaded."""
    if not is_imported():
        return os.environ.get("XLA_USE_SPMD", "") in ("1", "true", "True")
    return bool(runtime().is_spmd())


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


def memory_info(dev=None) -> dict | None:
    """Device memory use in bytes, or None where the device does not report it (CPU)."""
    try:
        info = _xm().get_memory_info(dev if dev is not None else device())
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


# --------------------------------------------------------------------------- metrics

def metric_names() -> list[str]:
    """Names of torch_xla's metrics (timings and sizes with samples)."""
    return list(_met().metric_names())


def metric_data(name: str):
    """``(count, accumulator, samples)`` of one metric, or None if never recorded."""
    return _met().metric_data(name)


def counter_names() -> list[str]:
    """Names of torch_xla's counters (plain event counts)."""
    return list(_met().counter_names())


def counter_value(name: str) -> int | None:
    """Value of one counter, or None if it was never incremented."""
    return _met().counter_value(name)


def metrics_report() -> str:
    """torch_xla's full text report (for the rare user who wants the raw wall)."""
    return _met().metrics_report()


def clear_metrics() -> None:
    """Reset every torch_xla counter and metric."""
    _met().clear_all()


# --------------------------------------------------------------------------- tensors

def add_step_closure(fn: Callable[..., Any], args: Sequence[Any] = (), run_async: bool = False) -> None:
    """Run ``fn(*args)`` right after the next sync, when tensor values are on hand."""
    _xm().add_step_closure(fn, args=tuple(args), run_async=run_async)


def is_xla_tensor(t: Any) -> bool:
    """True for a torch tensor that lives on an XLA device."""
    dev = getattr(t, "device", None)
    return dev is not None and getattr(dev, "type", None) == "xla"


def pending_ir(tensors: Sequence[Any]) -> str:
    """The lazy IR text that would compute ``tensors``."""
    return torch_xla()._XLAC._get_xla_tensors_text(list(tensors))


def pending_hlo(tensors: Sequence[Any]) -> str:
    """The HLO text that would compute ``tensors``."""
    return torch_xla()._XLAC._get_xla_tensors_hlo(list(tensors))


def is_materialized(t: Any) -> bool:
    """True when a tensor is backed by device data (no pending computation)."""
    info = torch_xla()._XLAC._get_xla_tensor_debug_info(t)
    return "Device Data: " in info and "XLAData: None" not in info or "IR: None" in info


def to_cpu_tensors(tensors: Sequence[Any]) -> list:
    """Copy device tensors to CPU in one transfer (no graph execution for device data)."""
    tensors = list(tensors)
    if not tensors:
        return []
    return list(torch_xla()._XLAC._xla_get_cpu_tensors(tensors))
