"""Arguments of the checkpoint API checked up front, each refusal saying what to pass instead.

Steps are whole numbers >= 0 (a float such as 1.5 would be truncated into another
step's file, a negative one named outside the pattern the manager lists), counts
are ints, devices are ones a checkpoint can be placed on, ``restore`` gets the
objects themselves rather than their state dicts, and an optimizer state is
matched against the optimizer it is loaded into before ``load_state_dict``
(which accepts another optimizer's state and fails only at the next ``step()``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..errors import CheckpointError

VALID_DEVICES = "'cpu', 'xla', 'xla:N', a torch.device, or tpukit.setup().device"


class MismatchError(CheckpointError):
    """A sound checkpoint that does not fit what it is loaded into: raised as it is, never skipped as damage."""


def check_step(step: Any) -> int:
    """``step`` as an int >= 0; TypeError for a non-integer (1.5 must not become 1), ValueError below 0."""
    if isinstance(step, bool):
        raise TypeError(f"step={step!r} is a bool; pass the training step as an int, e.g. save(100, ...).")
    try:
        value = operator.index(step)  # int, numpy integer, integer tensor of one element
    except TypeError:
        raise TypeError(
            f"step={step!r} is a {type(step).__name__}, not a whole number: checkpoints are numbered by integer "
            "steps, and 1.5 and 1.9 would both become step 1. Pass the step counter as an int."
        ) from None
    if value < 0:
        raise ValueError(
            f"step={value} is negative; checkpoint steps count from 0 (pass the number of steps done so far)."
        )
    return value


def check_count(name: str, value: Any, meaning: str) -> int | None:
    """``value`` if it is None or an int; TypeError naming ``name`` and what it means otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; pass an int ({meaning}) or None.")
    return value


def check_flag(name: str, value: Any, allow_none: bool = False) -> None:
    """Raise TypeError unless ``value`` is a bool (or None when allowed)."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        choices = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}; pass {choices}.")


def check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device a checkpoint can be placed on (None: leave tensors on the CPU)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CheckpointError(
            f"device={device!r} is not a device ({str(exc).splitlines()[0]}). Pass {VALID_DEVICES}; "
            "on a TPU the device is 'xla'."
        ) from None
    if dev.type not in ("cpu", "xla"):
        backend = getattr(torch, dev.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise CheckpointError(
                f"device={device!r}: no {dev.type} device is available in this process. Pass {VALID_DEVICES}."
            )
    return dev


def check_target(name: str, obj: Any) -> None:
    """Raise TypeError unless ``obj`` is None or an object with ``load_state_dict`` (a model, not its state)."""
    if obj is None or callable(getattr(obj, "load_state_dict", None)):
        return
    if isinstance(obj, dict):
        raise TypeError(
            f"restore({name}=...) got a dict: pass the {name} object itself (e.g. restore(model, optimizer)), "
            f"not its state_dict(); restore loads the checkpoint into it. For the saved dict, use latest()."
        )
    raise TypeError(
        f"restore({name}=...) got a {type(obj).__name__}, which has no load_state_dict(); pass the {name} "
        "object itself (an nn.Module, an optimizer, an LR scheduler)."
    )


def check_optimizer_state(optimizer: Any, saved: Any, where: str) -> None:
    """Raise CheckpointError when ``saved`` is another kind of optimizer's state than ``optimizer``'s.

    Compares each parameter group's hyperparameter names (SGD has ``momentum``,
    Adam ``betas``) and the per-parameter state names the optimizer already has.
    Names only one side has are fine alone (another torch version adds a new
    option); names missing on both sides mean two different optimizers.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(
            f"The optimizer entry of checkpoint {where} is not an optimizer state_dict (it is a "
            f"{type(saved).__name__}); save it with manager.save(step, optimizer=optimizer.state_dict())."
        )
    own = optimizer.state_dict()
    kind = type(optimizer).__name__
    for i, (mine, theirs) in enumerate(zip(own["param_groups"], saved["param_groups"])):
        missing, extra = set(mine) - set(theirs), set(theirs) - set(mine)
        if missing and extra:
            raise CheckpointError(
                f"The optimizer state of checkpoint {where} was saved by another kind of optimizer than this "
                f"{kind}: its parameter group {i} has {sorted(extra)} where {kind} needs {sorted(missing)}. "
                f"Build the same optimizer class the run that saved it used (or restore without optimizer= and "
                "start the optimizer fresh)."
            )
    mine_keys = {k for state in own.get("state", {}).values() if isinstance(state, dict) for k in state}
    theirs_keys = {k for state in (saved.get("state") or {}).values() if isinstance(state, dict) for k in state}
    if mine_keys and theirs_keys and not (mine_keys & theirs_keys):
        raise CheckpointError(
            f"The optimizer state of checkpoint {where} holds {sorted(theirs_keys)} per parameter, this {kind} "
            f"keeps {sorted(mine_keys)}: it was saved by another kind of optimizer. Build the optimizer class the "
            "run that saved it used (or restore without optimizer= and start the optimizer fresh)."
        )
