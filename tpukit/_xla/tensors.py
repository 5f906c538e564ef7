"""XLA tensors: step closures, identity, copies to the host, and the device's random seed.

What checkpoints, logged values and the loop need to know about a tensor on an
XLA device, without running more graphs than necessary: whether it is an XLA
tensor at all, which data it holds (:func:`tensor_id`), and its value on the
CPU (:func:`to_cpu`, one batched copy). The running random seed of the device
is saved and restored with a checkpoint, so that a resumed run draws the same
numbers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .loader import xlac, xm


def add_step_closure(fn: Callable[..., Any], args: Sequence[Any] = (), run_async: bool = False) -> None:
    """Run ``fn(*args)`` right after the next sync, when tensor values are on hand."""
    xm().add_step_closure(fn, args=tuple(args), run_async=run_async)


def is_xla_tensor(t: Any) -> bool:
    """True for a torch tensor that lives on an XLA device."""
    dev = getattr(t, "device", None)
    return dev is not None and getattr(dev, "type", None) == "xla"


def tensor_id(t: Any) -> int:
    """torch_xla's id of an XLA tensor; equal ids mean the same data seen through
    different tensor objects (tied weights, ``state_dict()`` detaches)."""
    return int(xlac()._xla_get_tensor_id(getattr(t, "global_tensor", t)))


def to_cpu(tensors: Sequence[Any], sync: bool = True) -> list:
    """Copy XLA tensors to new CPU tensors in one batch, computing pending values first.

    SPMD-sharded tensors come back whole (gathered from their shards). Like
    ``xm.save``'s conversion, but it also accepts ``nn.Parameter`` and
    ``XLAShardedTensor`` (``xm`` only converts exact ``torch.Tensor``). ``sync=False``
    skips the sync (and its wait for every pending execution) for tensors whose value
    is already device data.
    """
    tensors = [getattr(t, "global_tensor", t) for t in tensors]
    if not tensors:
        return []
    c = xlac()
    if sync:  # tensors already synced (e.g. logged values) need no graph run, only the copy
        c._xla_sync_multi(tensors, devices=[], wait=True, sync_xla_data=False)
    return list(c._xla_get_cpu_tensors(tensors))


# --------------------------------------------------------------------------- the device's random seed

def rng_seed() -> int:
    """The default XLA device's running random-number seed (advanced by every random op traced)."""
    c = xlac()
    return int(c._xla_get_rng_seed(str(c._xla_get_default_device())))


def set_rng_seed(seed: int) -> None:
    """Set the default XLA device's running random-number seed (``xm.set_rng_state``)."""
    c = xlac()
    c._xla_set_rng_seed(int(seed), str(c._xla_get_default_device()))


def placeholders(module: Any) -> Any:
    """Give ``module`` (built on the ``meta`` device, or anywhere) XLA tensors that hold no buffer in place of
    its parameters and buffers, in place; returns it.

    The shapes, dtypes, ``requires_grad`` and ties (a parameter shared by two modules stays one) are kept, and
    a step traced on them is the same program as on real weights (the same HLO: they are its parameters), so
    the TPU compiler can be asked about a model that the host could not hold. Reading a value (``.item()``,
    a copy to the CPU, running the step) fails: it is for tracing only.
    """
    import torch

    from .loader import torch_xla

    torch_xla()
    from torch_xla.core import xla_builder

    made: dict[int, Any] = {}

    def empty(t: Any, parameter: bool) -> Any:
        if id(t) not in made:
            e = xla_builder.create_placeholder_tensor(tuple(t.shape), t.dtype)
            made[id(t)] = torch.nn.Parameter(e, requires_grad=t.requires_grad) if parameter else e
        return made[id(t)]

    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = empty(p, True)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = empty(b, False)
    return module
