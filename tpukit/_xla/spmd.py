"""SPMD: the mode switch, meshes, sharding annotations, sharded loading and checkpoints.

In SPMD mode one process drives every device as one virtual device, and a
tensor's ``mark_sharding`` annotation says how XLA splits it over a mesh of
devices. This is the multi-core path that also runs on XLA:CPU with virtual
devices (``CPU_NUM_DEVICES`` set before the runtime starts). ``tpukit.spmd``
builds its public API (mesh, shard_batch, device_loader, fsdp) on these.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Sequence

from . import loader as _loader
from .loader import is_imported, runtime, xlac, xm, xs
from .runtime import device, device_count
from .tensors import is_xla_tensor


def use_spmd() -> None:
    """Switch the runtime to SPMD mode (call before creating device tensors)."""
    runtime().use_spmd()


def is_spmd() -> bool:
    """True when SPMD mode is on. Does not import torch_xla when it is not loaded."""
    if not is_imported():
        return os.environ.get("XLA_USE_SPMD", "") in ("1", "true", "True")
    return bool(runtime().is_spmd())


# --------------------------------------------------------------------------- meshes

def make_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> Any:
    """A ``torch_xla.distributed.spmd.Mesh`` over every global device, in device-id order."""
    return xs().Mesh(list(range(device_count())), tuple(int(s) for s in shape), tuple(axis_names))


def rename_mesh_axes(mesh: Any, axis_names: Sequence[str]) -> Any:
    """A mesh with the same devices and shape as ``mesh`` under other axis names."""
    return xs().Mesh(mesh.device_ids, tuple(mesh.mesh_shape), tuple(axis_names))


def mesh_axes(mesh: Any) -> dict[str, int]:
    """``{axis name: number of devices}`` of a mesh, in axis order."""
    return {str(name): int(size) for name, size in mesh.shape().items()}


def is_mesh(obj: Any) -> bool:
    """True for a ``torch_xla.distributed.spmd.Mesh`` (never imports torch_xla)."""
    return is_imported() and isinstance(obj, xs().Mesh)


# --------------------------------------------------------------------------- shardings

def mark_sharding(t: Any, mesh: Any, partition_spec: Sequence[Any]) -> None:
    """Annotate an XLA tensor's sharding in place; ``t`` stays a plain ``torch.Tensor``."""
    xs().mark_sharding(t, mesh, tuple(partition_spec))


def to_device_sharded(t: Any, mesh: Any, partition_spec: Sequence[Any]) -> Any:
    """Copy a CPU tensor to the SPMD device, each shard straight to its own device."""
    spec = xs().ShardingSpec(mesh, tuple(partition_spec))
    return xm().send_cpu_data_to_device(t, device(), spec)[0]


def sharding_spec(t: Any) -> str:
    """The XLA sharding of a device tensor as text (e.g. '{devices=[4,1]0,1,2,3}'); '' if none."""
    return str(xlac()._get_xla_sharding_spec(t))


def is_sharded(t: Any) -> bool:
    """True for an XLA tensor split over several devices (a sharding that is not replicated)."""
    spec = sharding_spec(getattr(t, "global_tensor", t)) if is_xla_tensor(t) else ""
    return bool(spec) and "replicated" not in spec and "maximal" not in spec


class _FirstDimSharding:
    """``input_sharding`` for torch_xla's loaders: split dim 0 of every tensor over one mesh axis.

    torch_xla's ``ShardingSpec`` only applies to tensors of one rank; a batch mixes
    ranks (inputs, labels), so this keeps one spec per rank. Scalars stay replicated.
    ``check(t)`` runs first and may raise (e.g. an indivisible batch).
    """

    minibatch = False

    def __init__(self, mesh: Any, axis: str, check: Callable[[Any], None] | None = None):
        self._mesh, self._axis, self._check = mesh, axis, check
        self._specs: dict[int, Any] = {}

    def can_apply(self, t: Any) -> bool:
        return t.dim() >= 1

    def xla_spec(self, t: Any):
        if t.dim() == 0:
            return None
        if self._check is not None:
            self._check(t)
        spec = self._specs.get(t.dim())
        if spec is None:
            spec = self._specs[t.dim()] = xs().ShardingSpec(self._mesh, (self._axis,) + (None,) * (t.dim() - 1))
        return spec.xla_spec(t)


def first_dim_sharding(mesh: Any, axis: str, check: Callable[[Any], None] | None = None) -> _FirstDimSharding:
    """An ``input_sharding`` for ``MpDeviceLoader`` that splits every batch tensor's dim 0 over ``axis``."""
    return _FirstDimSharding(mesh, axis, check)


# --------------------------------------------------------------------------- loading, FSDP, checkpoints

def mp_device_loader(loader: Any, dev: Any, input_sharding: Any = None, sync_each_batch: bool = True) -> Any:
    """``MpDeviceLoader``: background host-to-device copies; syncs before yielding each batch
    unless ``sync_each_batch`` is False (then only when the loader is exhausted)."""
    pl = _loader.module("torch_xla.distributed.parallel_loader")
    kwargs = {} if input_sharding is None else {"input_sharding": input_sharding}
    if not sync_each_batch:
        kwargs["batches_per_execution"] = sys.maxsize  # its next() never syncs: the caller does
    return pl.MpDeviceLoader(loader, dev, **kwargs)


INNER_PREFIX = "_orig_module."  # where torch_xla's FSDP wrapper keeps the module it wraps


def _fsdpv2() -> Any:
    return _loader.module("torch_xla.experimental.spmd_fully_sharded_data_parallel").SpmdFullyShardedDataParallel


def spmd_fsdp(module: Any, mesh: Any, shard_output: Callable[[Any, Any], None], layer_classes: Sequence[type] = (),
              checkpoint: bool = False) -> Any:
    """Wrap ``module`` in torch_xla's ``SpmdFullyShardedDataParallel`` (mesh needs an 'fsdp' axis).

    ``layer_classes``: each submodule of these classes is wrapped in its own wrapper first (torch_xla's
    ``transformer_auto_wrap_policy``), its forward checkpointed with torch_xla's ``checkpoint_module`` when
    ``checkpoint`` (what transformers' Trainer does for ``xla_fsdp_grad_ckpt``). The wrapped layers keep
    their ``state_dict()`` keys and load their own (``plain_keys``); only the outer wrapper adds its prefix.
    """
    wrapper_cls = _fsdpv2()
    policy = callable_ = None
    if layer_classes:
        wrap = _loader.module("torch_xla.distributed.fsdp.wrap")
        policy = functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls=set(layer_classes))

        def callable_(m: Any, *args: Any, **kwargs: Any) -> Any:
            if checkpoint:
                m = _loader.module("torch_xla.distributed.fsdp").checkpoint_module(m)
            return plain_keys(wrapper_cls(m, *args, **kwargs))

    return wrapper_cls(module, mesh=mesh, shard_output=shard_output, auto_wrap_policy=policy,
                       auto_wrapper_callable=callable_)


def fsdp_wrappers(module: Any) -> list[tuple[str, Any]]:
    """``(name, wrapper)`` of every torch_xla FSDP wrapper in ``module`` (itself included), in module order."""
    if not is_imported():
        return []
    cls = _fsdpv2()
    return [(name, m) for name, m in module.named_modules() if isinstance(m, cls)]


def is_checkpointed(module: Any) -> bool:
    """True when torch_xla's ``checkpoint_module`` replaced ``module``'s own forward (not a wrapper's)."""
    return "_xla_checkpointed_forward_original" in vars(module)


def _drop_inner(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    inner = prefix + INNER_PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:  # the wrapper's own keys, last and in order
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        for key in [k for k in meta if k == inner[:-1] or k.startswith(inner)]:
            meta[prefix + key[len(inner):]] = meta.pop(key)


def _add_inner(module: Any, state_dict: Any, prefix: str, *_: Any) -> None:
    inner = prefix + INNER_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def plain_keys(wrapper: Any) -> Any:
    """Make a wrapper's ``state_dict()`` keys its module's own (no ``_orig_module.``), and load them back."""
    wrapper.register_state_dict_post_hook(_drop_inner)
    wrapper.register_load_state_dict_pre_hook(_add_inner)
    return wrapper


def spmd_checkpoint_planners() -> tuple[Any, Any]:
    """torch_xla's (save, load) planners for ``torch.distributed.checkpoint`` with sharded tensors."""
    dc = _loader.module("torch_xla.experimental.distributed_checkpoint")
    return dc.SPMDSavePlanner(), dc.SPMDLoadPlanner()


def prime_optimizer(optimizer: Any) -> None:
    """Create an optimizer's state (a zero-gradient step) so a sharded checkpoint can load into it."""
    _loader.module("torch_xla.experimental.distributed_checkpoint").prime_optimizer(optimizer)
