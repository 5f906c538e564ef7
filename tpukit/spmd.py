"""SPMD on several cores from a notebook: one process drives every device.

You write a single-device training loop and say how tensors are split.
Works in any notebook. ``tpukit.setup(spmd=True)`` first, then ``mesh()``,
``shard_batch()`` (or ``device_loader(loader, mesh)``) and optionally ``fsdp()``::

    tpukit.setup(spmd=True)            # cpu_devices=4 to try it on a laptop
    m = tpukit.mesh()                  # all devices on the 'data' axis
    for batch in tpukit.device_loader(loader, m):   # batches arrive sharded
        loss = model(batch["x"]).loss ...

Checkpoints: sharded tensors stay ordinary ``torch.Tensor`` objects (nothing
here wraps them), so ``tensor.cpu()`` and ``tpukit.checkpoint.save`` gather the
full values from the shards; in SPMD the one process writes. For existing
multi-process (``xmp.spawn``-style) code see :mod:`tpukit.launch`.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from . import _xla, runtime
from ._tree import is_tensor, tree_map
from .errors import RuntimeStateError, ShardingError

FSDP_HOOK_NOTICE = "Full backward hook is firing when gradients are computed with respect to module outputs"
# The same hook on a model whose forward returns a transformers ModelOutput: torch skips it (it is of no use
# there: the batch needs no gradient) and says so once.
FSDP_OUTPUT_NOTICE = ("For backward hooks to be called, module output should be a Tensor or a tuple of Tensors but "
                      r"received <class 'transformers\.")


def _require_spmd(what: str) -> None:
    if _xla.is_spmd():
        return
    if _xla.runtime_initialized() or runtime.current() is not None:
        raise RuntimeStateError(
            f"{what} needs SPMD, but the XLA runtime in this process already started without it and SPMD "
            "cannot be switched on once the device is in use. Restart the kernel and call "
            "tpukit.setup(spmd=True) before anything touches the device.")
    raise RuntimeStateError(
        f"{what} needs SPMD mode, which is off. Call tpukit.setup(spmd=True) before using the device "
        "(add cpu_devices=N on a machine without TPU to get N virtual devices).")


def mesh(axes: Sequence[str] = ("data",), shape: Sequence[int] | None = None):
    """A device mesh over all devices of the SPMD runtime, for ``shard_batch``/``fsdp``.

    axes: names of the mesh axes; the first is the data axis by convention.
    shape: devices per axis (one entry may be -1: inferred); default puts every
    device on the first axis. Returns a ``torch_xla.distributed.spmd.Mesh``, so it
    also works with torch_xla's own sharding API.
    """
    _require_spmd("tpukit.mesh()")
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(axes)
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axes={axes!r} must be one or more distinct, non-empty names, "
                         "e.g. ('data',) or ('data', 'model').")
    n = _xla.device_count()
    if shape is None:
        dims = (n,) + (1,) * (len(axes) - 1)
    else:
        dims = tuple(int(s) for s in shape)
        example = (n,) + (1,) * (len(axes) - 1)
        hint = f"their product must be {n}, the number of devices (e.g. {example}, or -1 for one axis)"
        if len(dims) != len(axes):
            raise ValueError(f"shape={dims} has {len(dims)} entries but axes={axes} has {len(axes)}; "
                             "give one size per axis.")
        if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
            raise ValueError(f"shape={dims} is not valid: sizes must be positive (at most one -1); {hint}.")
        known = 1
        for d in dims:
            known *= d if d != -1 else 1
        if -1 in dims:
            if n % known:
                raise ValueError(f"shape={dims} cannot be completed: {n} devices are not divisible by {known}; {hint}.")
            dims = tuple(n // known if d == -1 else d for d in dims)
        elif known != n:
            raise ValueError(f"shape={dims} covers {known} devices but the runtime has {n}; {hint}.")
    return _xla.make_mesh(dims, axes)


def _axis_size(m: Any, axis: str) -> int:
    if not _xla.is_mesh(m):
        raise TypeError(f"expected a mesh from tpukit.mesh(), got {type(m).__name__}.")
    sizes = _xla.mesh_axes(m)
    if axis not in sizes:
        raise ValueError(f"the mesh has no axis {axis!r} (its axes are {tuple(sizes)}); pass axis= one of them.")
    return sizes[axis]


def _check_rows(t: Any, size: int, axis: str, where: str) -> None:
    rows = int(t.shape[0])
    if rows % size:
        lower, upper = rows // size * size, (rows // size + 1) * size
        example = f"{lower} or {upper}" if lower else f"{upper}"
        raise ShardingError(
            f"batch of {rows} ({where}) cannot be split over {size} devices on axis {axis!r}; use a batch size that "
            f"is a multiple of {size}, e.g. {example}, or drop_last=True in the DataLoader.")


def _is_array(obj: Any) -> bool:
    """A numpy array of numbers (what a ``collate_fn`` or a tokenizer with ``return_tensors='np'`` gives)."""
    return isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc"


def shard_batch(batch: Any, mesh: Any, axis: str = "data") -> Any:
    """Put a batch on the device, every tensor split along its first dimension over ``axis``.

    batch: a tensor or a nested dict/list/tuple of them; numpy arrays of numbers are
    converted to tensors first (``torch.from_numpy``: same dtype), other leaves (strings,
    arrays of objects) pass through. CPU tensors are copied shard by shard, XLA tensors
    are annotated in place. Scalars are replicated. Returns the same structure with plain
    XLA tensors; raises ``ShardingError`` when a first dimension is not a multiple of the
    axis size (every device must get the same number of rows).
    """
    size = _axis_size(mesh, axis)

    def one(t: Any, path: str) -> Any:
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        if t.dim() == 0:
            return t if _xla.is_xla_tensor(t) else t.to(_xla.device())
        _check_rows(t, size, axis, path)
        spec = (axis,) + (None,) * (t.dim() - 1)
        if _xla.is_xla_tensor(t):
            _xla.mark_sharding(t, mesh, spec)
            return t
        return _xla.to_device_sharded(t.detach().cpu() if t.device.type != "cpu" else t, mesh, spec)

    return tree_map(one, batch, lambda x: is_tensor(x) or _is_array(x), path="batch")


def sharding_spec(tensor: Any) -> str:
    """The XLA sharding of a device tensor, e.g. ``'{devices=[4,1]0,1,2,3}'``.

    ``''`` means no sharding annotation (replicated, or not yet propagated by a
    compile). Check it in notebooks and tests rather than assuming a layout.
    """
    if not _xla.is_xla_tensor(tensor):
        where = getattr(getattr(tensor, "device", None), "type", type(tensor).__name__)
        raise ShardingError(f"sharding_spec() needs a tensor on the XLA device, got a {where} tensor; "
                            "move it with tpukit.shard_batch(...) or .to(device) first.")
    return _xla.sharding_spec(tensor)


def device_loader(loader: Any, mesh: Any = None, device: Any = None, axis: str = "data",
                  sync: bool = True) -> Any:
    """Wrap a DataLoader (or any iterable of batches) so batches arrive on the device.

    Uses torch_xla's ``MpDeviceLoader``: a background thread copies the next
    batches while the device computes, and it syncs (``torch_xla.sync()``) before
    yielding each batch, so a loop over it needs no explicit sync. With a mesh,
    every tensor is split along dim 0 over ``axis`` as it is copied (use
    ``drop_last=True`` so every batch divides evenly; an indivisible batch raises
    ``ShardingError`` when the loader reaches it). ``sync=False`` keeps the
    background copies but leaves the per-step sync to the caller (``track`` does
    that, so waiting for data is measured apart from the sync).
    """
    dev = device if device is not None else _xla.device()
    if mesh is None:
        return _xla.mp_device_loader(loader, dev, sync_each_batch=sync)
    size = _axis_size(mesh, axis)
    sharding = _xla.first_dim_sharding(
        mesh, axis, check=lambda t: _check_rows(t, size, axis, f"a batch tensor of shape {tuple(t.shape)}"))
    return _xla.mp_device_loader(loader, dev, sharding, sync_each_batch=sync)


def _layer_classes(model: Any, layers: Any) -> tuple[type, ...]:
    """The classes of the submodules ``fsdp(layers=...)`` wraps one by one (see :func:`fsdp`)."""
    default = layers is None
    if default:  # a transformers model's own list (a peft model forwards it); a name it lists may be absent
        layers = getattr(model, "_no_split_modules", None) or ()
    elif layers is False:
        layers = ()
    if isinstance(layers, (str, type)):
        layers = (layers,)
    if not isinstance(layers, (list, tuple, set, frozenset)):
        raise TypeError(f"layers= takes a module class, a class name (e.g. 'LlamaDecoderLayer') or a list of them, "
                        f"or False for one wrapper; got {type(layers).__name__} {layers!r}.")
    present = {type(m).__name__: type(m) for m in model.modules()}
    found: list[type] = []
    for layer in layers:
        if isinstance(layer, type) and issubclass(layer, torch.nn.Module):
            cls = layer if any(isinstance(m, layer) for m in model.modules()) else None
            name = layer.__name__
        elif isinstance(layer, str):
            cls, name = present.get(layer), layer
        else:
            raise TypeError(f"layers= takes module classes or class names (e.g. 'LlamaDecoderLayer'), "
                            f"not {type(layer).__name__} {layer!r}.")
        if cls is None and default:
            continue
        if cls is None:
            counts: dict[str, int] = {}
            for m in model.modules():
                if any(True for _ in m.children()):
                    counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
            repeated = sorted(n for n, k in counts.items() if k > 1)  # the blocks a model repeats: its layers
            hint = f" (its repeated blocks: {', '.join(repeated)})" if repeated else ""
            raise ValueError(f"layers={name!r}: the model has no submodule of that class{hint}, so there is nothing "
                             "to wrap; pass the class of its decoder layer, or layers=False for one wrapper only.")
        if cls not in found:
            found.append(cls)
    return tuple(found)


def _prepare_checkpointing(model: Any) -> None:
    """What a transformers model needs for torch_xla's checkpointing of its layers (the Trainer does the same)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a recomputed layer would append its keys and values to the cache again
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    frozen = embeddings is not None and not any(p.requires_grad for p in embeddings.parameters())
    if frozen and hasattr(model, "enable_input_require_grads"):
        # torch_xla's checkpoint runs a layer plainly when none of its inputs needs a gradient: behind frozen
        # embeddings (peft's LoRA) the first layer would keep its activations.
        model.enable_input_require_grads()


def fsdp(model: Any, mesh: Any, axis: str = "data", *, layers: Any = None, checkpoint: bool = False) -> Any:
    """Shard a model's parameters over a mesh axis (FSDP-style), with SPMD doing the gathers.

    Wraps ``model`` in torch_xla's ``SpmdFullyShardedDataParallel`` (FSDPv2): each
    parameter, frozen ones included, is split along its largest dimension over ``axis``
    and each wrapped module's outputs are sharded along their batch dimension over the
    same axis (a transformers ``ModelOutput`` included). ``layers``: the submodule
    classes (or class names) wrapped one by one first, as the Trainer's FSDPv2 does:
    by default a transformers model's ``_no_split_modules`` (its decoder layer; through
    a peft model too), ``layers=False`` for one wrapper. ``checkpoint=True``
    recomputes each wrapped layer's activations in the backward (torch_xla's
    ``checkpoint_module``); for a transformers model it also turns ``config.use_cache``
    off (the recompute would grow the cache) and, behind frozen input embeddings (peft),
    makes their output need a gradient (``enable_input_require_grads``), without which
    torch_xla runs the first layer unchecked. Create the optimizer *after* wrapping
    (over the trainable parameters only, for LoRA). ``model`` is moved to the device in
    place and keeps its ``state_dict()`` keys, wrapped layers included (save and load
    ``model.state_dict()``; the returned wrapper's keys add an ``_orig_module.`` prefix).
    Feed it batches from ``track(loader, mesh=mesh)`` or ``shard_batch(..., mesh, axis)``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpukit.fsdp() wraps a torch.nn.Module (the model itself), not a "
                        f"{type(model).__name__}: pass the model object, e.g. tpukit.fsdp(model, mesh).")
    _require_spmd("tpukit.fsdp()")
    size = _axis_size(mesh, axis)
    sizes = _xla.mesh_axes(mesh)
    if axis != "fsdp" and "fsdp" in sizes:
        raise ValueError(f"the mesh already has an axis named 'fsdp' besides {axis!r}; rename it or pass axis='fsdp'.")
    if _xla.fsdp_wrappers(model):
        raise ValueError("the model is already wrapped by FSDP (tpukit.fsdp or torch_xla's wrapper); wrap the "
                         "original model once, e.g. tpukit.fsdp(model, mesh, layers=...).")
    classes = _layer_classes(model, layers)
    if checkpoint and not classes:
        why = "layers=False" if layers is False else "the model has no _no_split_modules"
        raise ValueError(f"checkpoint=True checkpoints each wrapped layer, but no layer is wrapped ({why}); pass "
                         "layers= the class of its repeated block, e.g. layers='LlamaDecoderLayer'.")
    fmesh = _xla.rename_mesh_axes(mesh, tuple("fsdp" if a == axis else a for a in sizes))

    def shard_output(output: Any, m: Any) -> None:
        def mark(t: Any, _path: str) -> Any:
            if _xla.is_xla_tensor(t) and t.dim() >= 1 and t.shape[0] % size == 0:
                _xla.mark_sharding(t, m, ("fsdp",) + (None,) * (t.dim() - 1))
            return t

        tree_map(mark, output if not hasattr(output, "to_tuple") else output.to_tuple(), is_tensor, path="output")

    if checkpoint:
        _prepare_checkpointing(model)
    # torch_xla's wrapper puts a full backward hook on a module whose inputs need no gradient (the
    # batch), and torch 2.8 then warns at every backward; it says nothing the user can act on.
    warnings.filterwarnings("ignore", message=FSDP_HOOK_NOTICE, category=UserWarning)
    warnings.filterwarnings("ignore", message=FSDP_OUTPUT_NOTICE, category=UserWarning)
    return _xla.spmd_fsdp(model, fmesh, shard_output, classes, checkpoint)
