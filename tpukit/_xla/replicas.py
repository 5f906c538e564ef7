"""Replicas: how many processes torch_xla's launcher starts, and the body of each.

``tpukit.launch`` supervises the replica processes itself (notebook-safe start,
output, failures); what runs inside one of them is torch_xla's own set-up of
its chips, reached here through torch_xla's private ``pjrt`` helpers so that
the topology is exactly the one ``torch_xla.launch`` / ``xmp.spawn`` builds.
Those helpers have the same signatures in torch_xla 2.8 and 2.9; which
devices get processes differs (:data:`~tpukit._xla.versions.CUDA_REMOVED`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from . import versions
from .loader import module
from .runtime import device_type, global_ordinal


def local_process_count() -> int:
    """Processes torch_xla's launcher starts on this host: one per chip on TPU, 1 on CPU.

    Mirrors ``torch_xla._internal.pjrt.run_multiprocess``; does not start the runtime.
    torch_xla 2.8 also starts one per GPU under ``PJRT_DEVICE=CUDA``; 2.9 has no CUDA device.
    """
    plugins = module("torch_xla.experimental.plugins")
    if plugins.using_dynamic_plugins():
        return int(plugins.default().physical_chip_count())
    kind = device_type()
    if kind == "TPU":
        return int(module("torch_xla._internal.tpu").num_local_processes())
    if kind == "CUDA" and not versions.at_least(versions.CUDA_REMOVED):
        return int(module("torch_xla._internal.gpu").num_local_processes())
    if kind == "NEURON":
        return int(module("torch_xla._internal.neuron").num_local_processes())
    return 1


class _IndexedCall:
    """``fn(global ordinal, *args)`` returning its value (torch_xla's ``_SpawnFn`` drops it)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any]):
        self.fn, self.args = fn, tuple(args)

    def __call__(self) -> Any:
        return self.fn(global_ordinal(), *self.args)


def run_replica_process(local_rank: int, local_world_size: int, fn: Callable[..., Any],
                        args: Sequence[Any]) -> dict[int, Any]:
    """Body of one ``xmp.spawn`` process: set up this process's chips, then run ``fn``
    in one thread per addressable device. Returns ``{global ordinal: fn's value}``.

    Uses torch_xla's private ``pjrt`` helpers (the same in 2.8 and 2.9) so the topology
    set-up is exactly the one ``torch_xla.launch`` does; call it in a fresh process only.
    """
    pjrt = module("torch_xla._internal.pjrt")
    return dict(pjrt._run_thread_per_device(local_rank, local_world_size, fn=_IndexedCall(fn, args),
                                            initializer_fn=pjrt.initialize_multiprocess))


def run_single_process(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """``xmp.spawn(nprocs=1)``: one replica on one chip in this process; returns ``fn(0, *args)``."""
    pjrt = module("torch_xla._internal.pjrt")
    return pjrt._run_singleprocess(_IndexedCall(fn, args))
