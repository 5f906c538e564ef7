"""Tied weights that moving a module to an XLA device untied, found and tied again.

torch_xla gives every parameter a new tensor when a module moves to its device, so
weights a model shares (GPT-2's ``lm_head.weight is transformer.wte.weight``) become
two tensors: a hand-written loop then trains two copies, an estimate counts both,
an export keeps one. Only a model that declares its ties can be checked: Hugging
Face models do (``all_tied_weights_keys`` in transformers 5, the tied word
embeddings of their config before), and ``tie_weights()`` ties them again. An
optimizer made before that holds the copy the tie dropped: it is handed the tied
tensor in its place (:func:`repoint`), so it trains the model's own parameters and
its state dict fits one made after the tie (a resume loads either into the other).
"""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

from ..errors import TpukitWarning


def declared(model: Any) -> dict[str, str]:
    """``{parameter: the parameter it is tied to}`` as the model declares it ({} for a plain module)."""
    keys = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5, the config already applied
    if isinstance(keys, dict):
        return dict(keys)
    try:  # transformers 4: the word embeddings, when the config ties them
        tied = getattr(model.config, "tie_word_embeddings", False)
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return {}
    if not tied or inp is None or out is None:
        return {}
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if id(out.weight) in names and id(inp.weight) in names:
        return {names[id(out.weight)]: names[id(inp.weight)]}
    return {}


def untied(model: Any) -> list[tuple[str, str]]:
    """The ``(parameter, tied to)`` pairs the model declares tied but holds as two tensors."""
    found = []
    for target, source in declared(model).items():
        try:
            a, b = model.get_parameter(target), model.get_parameter(source)
        except AttributeError:  # a buffer, or a name this model does not have
            continue
        if a is not b:
            found.append((target, source))
    return found


def optimizers() -> list[Any]:
    """The live ``torch.optim.Optimizer`` objects of this process (none is registered anywhere: the
    collector's list of objects is the one place that has them all)."""
    from torch.optim import Optimizer

    return [o for o in gc.get_objects() if issubclass(type(o), Optimizer)]


def repoint(model: Any, before: list[tuple[str, Any]]) -> list[Any]:
    """Hand each optimizer that holds a parameter ``model`` no longer has (``before``: its named parameters,
    duplicates included, before it tied them) the tensor now at that name: dropped where the optimizer holds
    that tensor already, put in its place (with its state) otherwise. Returns the optimizers changed."""
    now = dict(model.named_parameters(remove_duplicate=False))
    kept = {id(p) for p in now.values()}
    swap = {id(p): now[name] for name, p in before if id(p) not in kept and name in now}
    if not swap:
        return []
    changed = []
    for opt in optimizers():
        groups = opt.param_groups
        if not any(id(p) in swap for g in groups for p in g["params"]):
            continue
        held = {id(p) for g in groups for p in g["params"]}
        for g in groups:
            params = []
            for p in g["params"]:
                tied = swap.get(id(p))
                if tied is None:
                    params.append(p)
                    continue
                state = opt.state.pop(p, None)
                if id(tied) not in held:  # the optimizer had the copy only: it trains the tied tensor now
                    params.append(tied)
                    held.add(id(tied))
                    if state is not None:
                        opt.state[tied] = state
            g["params"] = params
        changed.append(opt)
    return changed


def retie(model: Any, by: str, stacklevel: int = 3) -> list[tuple[str, str]]:
    """Tie again what the model declares tied but holds as two tensors (with its ``tie_weights()``), and
    :func:`repoint` the optimizers made before, with a :class:`~tpukit.TpukitWarning` naming the parameters,
    ``by`` (the call that found them) and the optimizers it changed; without ``tie_weights()`` the warning
    says how. Returns the pairs that were untied."""
    pairs = untied(model)
    if not pairs:
        return []
    named = ", ".join(f"{a} and {b}" for a, b in pairs)
    what = (f"{type(model).__name__} declares {named} tied but holds them as two tensors (moving a module to an "
            "XLA device gives every parameter a new tensor), so training would update two copies")
    if callable(getattr(model, "tie_weights", None)):
        before = list(model.named_parameters(remove_duplicate=False))
        model.tie_weights()
        if not untied(model):
            changed = repoint(model, before)
            held = ""
            if changed:
                names = ", ".join(dict.fromkeys(type(o).__name__ for o in changed))
                held = (f"; the optimizer made before ({names}) held the untied copy, and now holds the tied "
                        "tensor in its place")
            warnings.warn(f"{what}: {by} tied them again with model.tie_weights(){held}. Call it yourself right "
                          "after model.to(device), before you create the optimizer, and nothing needs fixing.",
                          TpukitWarning, stacklevel=stacklevel)
            return pairs
    a, b = pairs[0]
    warnings.warn(f"{what}, and {by} could not tie them again. Call model.tie_weights() right after "
                  f"model.to(device), or assign the one to the other (model.{a} = model.{b}).",
                  TpukitWarning, stacklevel=stacklevel)
    return pairs


class FirstStep:
    """While a loop's first step runs: each model that runs forward on the loop's thread is checked
    once with :func:`retie`, before its forward (a global forward pre-hook; :meth:`close` removes it)."""

    def __init__(self, by: str):
        from torch.nn.modules.module import register_module_forward_pre_hook

        self.by, self.thread, self.seen = by, threading.get_ident(), set()
        self.handle = register_module_forward_pre_hook(self._check)

    def _check(self, module: Any, _args: Any) -> None:
        if threading.get_ident() != self.thread or id(module) in self.seen:
            return
        self.seen.add(id(module))
        if hasattr(module, "all_tied_weights_keys") or hasattr(module, "config"):  # a model that may declare ties
            retie(module, self.by, stacklevel=6)  # the line that called the model

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
