"""A traced step's pending graph as an HLO module, without running it (for ``tpukit.tpu``).

``tpukit.estimate`` traces a step lazily, takes the graph that would compute the
tensors it updates as an ``HloModuleProto`` (the bytes the TPU compiler reads),
works out which of the graph's parameters are buffers the step updates in place
(torch_xla donates those: the compiled program aliases them to its outputs). The
step updates shadows (:func:`keep`) so the user's tensors are never touched.
Nothing here executes a graph.
"""

from __future__ import annotations

from typing import Any, Sequence

from .loader import xlac


def hlo_module_proto(tensors: Sequence[Any]) -> bytes:
    """The ``HloModuleProto`` (serialized) of the pending graph computing ``tensors``; runs nothing.

    The module's outputs are ``tensors`` in order; its parameters are the device data the graph reads.
    """
    return bytes(xlac()._get_xla_tensors_hlo_proto([getattr(t, "global_tensor", t) for t in tensors]))


def parameter_handles(tensors: Sequence[Any]) -> list[int]:
    """The buffer handle behind each parameter of :func:`hlo_module_proto` ``(tensors)``, in parameter order."""
    tensors = [getattr(t, "global_tensor", t) for t in tensors]
    _ids, data = xlac()._get_tensors_xla_device_data_node(tensors)
    return [int(h) for h in xlac()._get_tensors_handle(list(data))] if data else []


def keep(t: Any) -> Any:
    """A new XLA tensor holding ``t``'s present value (same buffer or same pending IR): no copy, no graph."""
    return getattr(t, "global_tensor", t).detach().clone()
