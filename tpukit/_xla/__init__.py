"""The torch_xla adapter: the only package of tpukit that imports torch_xla.

torch_xla is imported lazily, on first use, so that ``import tpukit`` is cheap
and so that tpukit can set environment variables (device kind, virtual CPU
devices, compile tracing) *before* the runtime reads them. Every function here
is a thin wrapper over the current torch_xla API (``torch_xla.device()``,
``torch_xla.sync()``, ``torch_xla.runtime``, not the deprecated
``xm.xla_device`` / ``xm.mark_step``) that turns torch_xla's low-level failures
into tpukit errors. When torch_xla changes (or is replaced by a native
backend) this package is the one place to edit.

The rest of tpukit calls the adapter through this package's names only
(``from tpukit import _xla; _xla.sync()``); the modules behind them split it
by concern:

- :mod:`.loader`    importing torch_xla lazily, import failures as tpukit errors
- :mod:`.versions`  the supported releases (2.8 on Kaggle, 2.9 on Colab) and named gates
- :mod:`.runtime`   the PJRT runtime: devices, sync, topology, memory, the compile cache
- :mod:`.metrics`   torch_xla's counters and metrics
- :mod:`.tensors`   step closures, tensor identity, copies to the host, the device's RNG seed, placeholders
- :mod:`.spmd`      SPMD mode, meshes, shardings, the sharded loader, FSDP, sharded checkpoints
- :mod:`.replicas`  the launcher's process count and the body of each replica
- :mod:`.profiler`  the profiler session
- :mod:`.lazy`      pending computations: which tensors hold them, their IR and HLO
- :mod:`.eager`     following the eager-mode switch (one follower, set with ``eager.follow``)
- :mod:`.ties`      tied weights the move to the device untied: found, and tied again
- :mod:`.traps`     known failures of the stack on XLA tensors, explained (what, why, the fix)
- :mod:`.kernels`   torch_xla's Pallas flash attention, traced for the TPU compiler on a host without a TPU
"""

from __future__ import annotations

from . import eager, kernels, ties, traps, versions
from .lazy import has_pending, pending_hlo, pending_ir
from .loader import imported_by, is_imported, torch_xla
from .metrics import counter_names, counter_value, fallback_ops, metric_data
from .profiler import profiler_start, profiler_stop
from .replicas import local_process_count, run_replica_process, run_single_process
from .runtime import (
    accelerator_type,
    device,
    device_count,
    device_type,
    global_ordinal,
    initialize_cache,
    memory_info,
    process_count,
    runtime_initialized,
    sync,
    version,
    wait_device_ops,
    world_size,
)
from .spmd import (
    first_dim_sharding,
    fsdp_wrappers,
    is_checkpointed,
    is_mesh,
    is_sharded,
    is_spmd,
    make_mesh,
    mark_sharding,
    mesh_axes,
    mp_device_loader,
    prime_optimizer,
    rename_mesh_axes,
    sharding_spec,
    spmd_checkpoint_planners,
    spmd_fsdp,
    to_device_sharded,
    use_spmd,
)
from .tensors import add_step_closure, is_xla_tensor, placeholders, rng_seed, set_rng_seed, tensor_id, to_cpu

__all__ = [
    "eager", "ties", "versions",
    "is_imported", "imported_by", "torch_xla",
    "runtime_initialized", "device", "sync", "wait_device_ops", "device_type", "device_count", "world_size",
    "process_count", "global_ordinal", "initialize_cache", "accelerator_type", "version", "memory_info",
    "metric_data", "counter_names", "counter_value", "fallback_ops",
    "add_step_closure", "is_xla_tensor", "placeholders", "tensor_id", "to_cpu", "rng_seed", "set_rng_seed",
    "use_spmd", "is_spmd", "make_mesh", "rename_mesh_axes", "mesh_axes", "is_mesh", "mark_sharding",
    "to_device_sharded", "sharding_spec", "is_sharded", "first_dim_sharding", "mp_device_loader", "spmd_fsdp",
    "fsdp_wrappers", "is_checkpointed",
    "spmd_checkpoint_planners", "prime_optimizer",
    "local_process_count", "run_replica_process", "run_single_process",
    "profiler_start", "profiler_stop",
    "has_pending", "pending_ir", "pending_hlo",
]
