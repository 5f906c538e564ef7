"""The payload formats (torch pickle, safetensors) and the up-front check of what they can hold.

Payloads load with ``torch.load(weights_only=True)`` (no code runs while
unpickling), with numpy's array/scalar rebuilders allowed so numpy RNG states
load too. ``check_state`` rejects before any work what a format cannot store and
reload safely, naming the bad entry by its key path (``state['cfg']['fn']``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .chunks import COPY_CHUNK
from .stream import SAFETENSORS_DTYPES, read_torch, write_safetensors, write_torch

_STRUCTURE_KEY = "tpukit.structure"

# --------------------------------------------------------------------------- state checks

_PLAIN = (type(None), bool, int, float, str)
_TORCH_LEAVES = _PLAIN + (complex, bytes, torch.dtype, torch.device)
_NUMPY_KINDS = "biufcSU"  # numeric, bool, bytes and str arrays; their rebuilders are allowed at load


def check_state(obj: Any, path: str, weights_format: str, active: set[int] | None = None) -> None:
    """Reject, before any work, what the payload format cannot store and reload safely."""
    active = set() if active is None else active
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            raise CheckpointError(f"{path} is a meta tensor, which holds no data to save. Materialize it first.")
        if weights_format == "safetensors" and obj.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path} has dtype {obj.dtype}, which safetensors cannot store. Use weights_format='torch' "
                "or convert it."
            )
        return
    if type(obj) in _PLAIN or (weights_format == "torch" and type(obj) in _TORCH_LEAVES):
        return
    if weights_format == "safetensors" and type(obj) in (torch.dtype, torch.device):
        return
    if weights_format == "torch" and _is_numpy(obj):
        if obj.dtype.kind not in _NUMPY_KINDS:
            raise CheckpointError(
                f"{path} is a numpy value of dtype {obj.dtype}, which cannot be loaded safely. "
                "Convert it to a list or a numeric array."
            )
        return
    containers = (dict, OrderedDict, list, tuple, torch.Size) + ((set,) if weights_format == "torch" else ())
    if type(obj) not in containers:
        raise CheckpointError(_unsupported(obj, path, weights_format))
    if id(obj) in active:
        raise CheckpointError(f"{path} contains itself; a checkpoint must be a tree of values. Remove the cycle.")
    active.add(id(obj))
    if isinstance(obj, dict):
        for key, value in obj.items():
            if type(key) not in _PLAIN:
                raise CheckpointError(f"{path} has a key of type {type(key).__name__} ({key!r}); use str or int keys.")
            check_state(value, f"{path}[{key!r}]", weights_format, active)
    elif isinstance(obj, set):
        for value in obj:
            if type(value) not in _TORCH_LEAVES:
                raise CheckpointError(
                    f"{path} is a set holding a {type(value).__name__}; sets may hold plain values only."
                )
    else:
        for i, value in enumerate(obj):
            check_state(value, f"{path}[{i}]", weights_format, active)
    active.discard(id(obj))


def _unsupported(obj: Any, path: str, weights_format: str) -> str:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, torch.nn.Module) or callable(getattr(obj, "state_dict", None)):
        return (
            f"{path} is a {kind} object, not its state: a checkpoint stores values, and saving the object "
            f"itself can hang torch_xla and break loading. Pass {path}.state_dict() instead "
            "(e.g. model=model.state_dict())."
        )
    hint = (
        "use weights_format='torch' or convert it to numbers, strings, lists and dicts"
        if weights_format == "safetensors"
        else "convert it to plain values (dict, list, tuple, tensor, number, str)"
    )
    return f"{path} is a {kind}, which a {weights_format} checkpoint cannot store and reload safely; {hint}."


def _is_numpy(obj: Any) -> bool:
    if not type(obj).__module__.startswith("numpy"):
        return False
    import numpy as np

    return isinstance(obj, (np.ndarray, np.generic))


# --------------------------------------------------------------------------- payload formats

def write_payload(state: Any, tmp: Path, weights_format: str, copy_chunk: int = COPY_CHUNK) -> tuple[int, str]:
    """Write ``state`` to the file ``tmp`` in ``weights_format`` ("torch" or "safetensors").

    Tensors may live on XLA devices (already synced): they are copied to the host
    as their turn comes, in pieces of at most ``copy_chunk`` bytes, so the save
    never holds the whole state, nor the whole of a large tensor.
    Returns the file's byte size and sha256 (hashed as written; the file is fsynced).
    """
    if weights_format == "torch":
        return write_torch(state, tmp, copy_chunk)
    return write_safetensors(state, tmp, _STRUCTURE_KEY, copy_chunk)


def read_payload(path: Path, weights_format: str) -> Any:
    """Read the payload ``path`` written in ``weights_format``: its state with CPU tensors."""
    return (read_torch if weights_format == "torch" else _read_safetensors)(path)


def _read_safetensors(path: Path) -> Any:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        structure = json.loads((f.metadata() or {})[_STRUCTURE_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def decode(obj: Any) -> Any:
        if not isinstance(obj, dict):
            return obj
        (tag, value), = obj.items()
        if tag == "T":
            return tensors[value]
        if tag in "DO":
            return (dict if tag == "D" else OrderedDict)((k, decode(v)) for k, v in value)
        if tag in "LUS":
            return {"L": list, "U": tuple, "S": torch.Size}[tag](decode(v) for v in value)
        return getattr(torch, value) if tag == "dtype" else torch.device(value)

    return decode(structure)
