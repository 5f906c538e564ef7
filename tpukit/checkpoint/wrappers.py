"""The model inside its wrappers, and state-dict keys in the model's own names.

Training wraps a model: ``tpukit.fsdp`` (torch_xla's ``SpmdFullyShardedDataParallel``)
holds it as ``_orig_module`` and so prefixes every key with ``_orig_module.``;
wrapping each layer puts the segment inside the keys too
(``model.layers.0._orig_module.self_attn.q_proj.weight``); ``torch.compile`` adds
``_orig_mod.``, torch's checkpoint wrapper ``_checkpoint_wrapped_module.``. A
checkpoint keeps the model's own names (:func:`own_keys`), so a state saved from
one wrapping loads into another, or into the bare model on one device, and an
export writes the names ``from_pretrained`` expects.
"""

from __future__ import annotations

from typing import Any

# The attribute each wrapper holds the module it wraps under: the key segment it adds.
WRAPPER_ATTRS = ("_orig_module", "_orig_mod", "_checkpoint_wrapped_module")
_SEGMENTS = tuple(f"{a}." for a in WRAPPER_ATTRS)


def unwrap(model: Any) -> Any:
    """The module a chain of wrappers (FSDP, torch.compile, checkpoint wrappers) holds; ``model`` if none."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        children = getattr(model, "_modules", None) or {}
        inner = next((children[a] for a in WRAPPER_ATTRS if children.get(a) is not None), None)
        if inner is None:
            return model
        model = inner
    return model

def own_key(key: str) -> str:
    """``key`` without the segments wrappers add (``_orig_module.`` and the like), wherever they are."""
    if not any(s in key for s in _SEGMENTS):
        return key
    parts = key.split(".")
    return ".".join(p for p in parts if p not in WRAPPER_ATTRS)


def wrapped(keys: Any) -> bool:
    """True when any of the (string) ``keys`` carries a wrapper's segment."""
    return any(isinstance(k, str) and own_key(k) != k for k in keys)


def own_keys(state: dict) -> dict:
    """``state`` (a model's state dict) keyed by the model's own names; the same dict when none is wrapped.

    Raises ValueError when two keys would become one (a model holding a wrapper
    attribute of its own besides the wrapped copy).
    """
    if not wrapped(state):
        return state
    out: dict = {}
    for key, value in state.items():
        name = own_key(key) if isinstance(key, str) else key
        if name in out:
            raise ValueError(f"state-dict keys {key!r} and another both name {name!r} once their wrappers' segments "
                             "are dropped")
        out[name] = value
    return out


def match_keys(model_keys: Any, saved_keys: Any) -> dict[str, str]:
    """``{model key: saved key}`` for the model's keys whose own name a saved key has (either may be wrapped)."""
    saved = {own_key(k): k for k in saved_keys if isinstance(k, str)}
    return {k: saved[own_key(k)] for k in model_keys if own_key(k) in saved}
