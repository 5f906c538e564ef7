"""A traced step's pending graph as an HLO module, without running it (for ``tpukit.tpu``).

``tpukit.estimate`` traces a step lazily, takes the graph that would compute the
tensors it updates as an ``HloModuleProto`` (the bytes the TPU compiler reads),
works out which of the graph's parameters are buffers the step updates in place
(torch_xla donates those: the compiled program aliases them to its outputs). The
step updates shadows (:func:`keep`) so the user's tensors are never touched.
Nothing here executes a graph. For the HBM breakdown: each operation's Python
source and module scope in the HLO's metadata (:func:`source_metadata`,
:func:`scope`), and torch_xla's gradient checkpointing (:func:`checkpoint`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from .._hlo_text import encode_varint, varint
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


@contextmanager
def source_metadata() -> Iterator[None]:
    """Within it, every operation traced carries its Python source (file and line of the innermost frame)
    and its op name into the HLO's metadata, as with ``XLA_HLO_DEBUG=1`` (torch_xla 2.8 and 2.9: its IR
    debug switch, read both when an operation is traced and when the graph is lowered, so
    :func:`hlo_module_proto` must be called inside too). The switch is put back as it was."""
    c = xlac()
    before = bool(c._get_ir_debug())
    c._set_ir_debug(True)
    try:
        yield
    finally:
        c._set_ir_debug(before)


def scope(name: str) -> Any:
    """An op-name scope: operations traced while the returned object lives have ``name/`` (with a counter
    suffix, ``name.3/``) before their op name in the HLO's metadata. Delete the object to leave the scope."""
    return xlac().profiler.scope_pusher(name)


def checkpoint(function: Callable, *args: Any) -> Any:
    """``function(*args)`` under torch_xla's gradient checkpointing (its activations recomputed in the
    backward, behind an optimization barrier so the compiler cannot merge the recomputation back; autocast
    re-applied there): ``torch_xla.utils.checkpoint.checkpoint(function, *args, use_reentrant=True,
    preserve_rng_state=False)``. (On torch 2.8/2.9 ``torch.utils.checkpoint``'s backward raises on XLA:
    "torch has no module of `xla`".)"""
    from .loader import module

    return module("torch_xla.utils.checkpoint").checkpoint(function, *args, use_reentrant=True,
                                                           preserve_rng_state=False)


# What stable_metadata rewrites, by wire-format field number (xla/service/hlo.proto): HloModuleProto's
# computations (3) -> HloComputationProto's instructions (2) -> HloInstructionProto's metadata (7) -> OpMetadata's
# op_name (2): its scope counters removed; OpMetadata's stack_frame_id (15) and HloModuleProto's
# stack_frame_index (17): dropped (the whole Python stack of each op, which differs with the caller's line).
_SPEC: dict = {3: {2: {7: {2: "counters", 15: None}}}, 17: None}
_COUNTER = re.compile(rb"\.\d+(?=/)")  # a scope's counter: "module.layers.0.7/aten__addmm" -> "module.layers.0/..."


def _rewrite(data: bytes, spec: dict) -> bytes:
    """``data`` (a serialized message) rewritten as ``spec`` says per field number (a dict: the field's message,
    rewritten by it; ``"counters"``: a string without scope counters; None: dropped); the same object when
    nothing changed. Other fields are copied as they are, in spans."""
    out, i, kept, n = bytearray(), 0, 0, len(data)
    while i < n:
        start = i
        key = data[i]
        i += 1
        if key >= 0x80:
            key, i = varint(data, start)
        kind = key & 7
        if kind == 2:
            size = data[i]
            j = i + 1
            if size >= 0x80:
                size, j = varint(data, i)
            i = j + size
        elif kind == 0:
            while data[i] >= 0x80:
                i += 1
            i += 1
            j = None
        else:
            i += 8 if kind == 1 else 4
            j = None
        field = key >> 3
        if field not in spec:
            continue
        rule = spec[field]
        if rule is None:  # dropped
            out += data[kept:start]
            kept = i
            continue
        if j is None:
            continue
        body = data[j:i]
        new = _COUNTER.sub(b"", body) if rule == "counters" else _rewrite(body, rule)
        if new != body:
            out += data[kept:start]
            out += encode_varint(key) + encode_varint(len(new)) + new
            kept = i
    if not kept:
        return data
    out += data[kept:]
    return bytes(out)


def stable_metadata(proto: bytes) -> bytes:
    """The HLO module with its metadata made the same for the same step: torch_xla numbers every op-name
    scope it opens (its own, and :func:`scope`'s) with a counter that runs on until the next ``sync()``, and
    records each op's whole Python stack, which differs with the line the trace was called from. Without
    the counters and the stacks, two traces of one step are the same bytes (the compile cache's key), and
    keep each op's name and its own source file and line."""
    return _rewrite(proto, _SPEC)
