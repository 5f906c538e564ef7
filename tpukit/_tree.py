"""One map and one walk over nested containers (dicts and other Mappings, lists,
tuples, namedtuples), like accelerate's ``recursively_apply``.

Every module that touches "a tensor or a nested dict/list/tuple of them"
(batches, state dicts, optimizer states) goes through these two functions.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable, Iterator


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _rebuild_mapping(obj: Mapping, items: dict) -> Any:
    try:
        return type(obj)(items)
    except Exception:  # a Mapping whose constructor takes something else (e.g. BatchEncoding subclasses)
        return items


def tree_map(fn: Callable[[Any, str], Any], obj: Any, is_leaf: Callable[[Any], bool], path: str = "") -> Any:
    """Return ``obj`` with every leaf ``x`` (``is_leaf(x)`` true) replaced by ``fn(x, path)``.

    ``path`` names the leaf as Python would index it (``['model']['w']``, ``[0]``,
    ``.field``) so errors can say which entry is wrong. Containers keep their
    type; other values pass through unchanged.
    """
    if is_leaf(obj):
        return fn(obj, path)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: tree_map(fn, v, is_leaf, f"{path}[{k!r}]") for k, v in obj.items()})
    if _is_namedtuple(obj):
        return type(obj)(*(tree_map(fn, v, is_leaf, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(fn, v, is_leaf, f"{path}[{i}]") for i, v in enumerate(obj))
    return obj


def tree_leaves(obj: Any, is_leaf: Callable[[Any], bool], path: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of ``obj`` in container order (see :func:`tree_map`)."""
    if is_leaf(obj):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tree_leaves(v, is_leaf, f"{path}[{k!r}]")
    elif _is_namedtuple(obj):
        for f, v in zip(obj._fields, obj):
            yield from tree_leaves(v, is_leaf, f"{path}.{f}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tree_leaves(v, is_leaf, f"{path}[{i}]")


def is_tensor(obj: Any) -> bool:
    """True for a torch.Tensor (checked without importing torch when it is not loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def to_device(batch: Any, device: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Move every tensor of a (nested) batch to ``device`` (what ``tpukit.track`` does to a batch from
    the host); Mappings such as transformers' BatchEncoding become plain dicts when they cannot be
    rebuilt. ``is_leaf``: which values to move (default: anything with ``.to`` and ``.device``)."""
    def move(t: Any, _path: str) -> Any:
        return t if t.device == device else t.to(device)

    return tree_map(move, batch, is_leaf or (lambda x: hasattr(x, "to") and hasattr(x, "device")))
