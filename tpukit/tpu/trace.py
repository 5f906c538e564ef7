"""Trace a step lazily, take its graph as an HLO module without running it, and put everything back.

The step runs on the user's own model and optimizer, lazily: nothing executes.
Before it, every XLA tensor of the state (parameters, buffers, gradients,
optimizer state) is kept (a new tensor on the same buffer, no copy), CPU state
tensors are cloned, the optimizer's per-parameter state and hyper-parameters,
LR schedulers and both random seeds are saved; after the graph is taken they
are all restored, so the step's update is discarded and the user's next step
is the same graph it would have been.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from .. import _xla
from .._xla import hlo as _hlo


@dataclass(frozen=True)
class Traced:
    """A step's graph: the HLO module, the (parameter, output) pairs torch_xla donates, its partitions."""

    hlo: bytes
    aliases: tuple[tuple[int, int], ...]
    num_partitions: int
    outputs: int


def _owners(step: Callable, args: tuple, kwargs: dict) -> tuple[list, list, list]:
    """The modules, optimizers and LR schedulers the step can reach: its arguments, closure, globals, self."""
    import torch

    seen: dict[int, Any] = {}
    candidates = list(args) + list(kwargs.values())
    fn = step
    for _ in range(3):  # unwrap functools.partial / bound methods / decorators a little
        if hasattr(fn, "__self__"):
            candidates.append(fn.__self__)
        if hasattr(fn, "func"):
            candidates += [fn.func, *getattr(fn, "args", ()), *getattr(fn, "keywords", {}).values()]
            fn = fn.func
        fn = getattr(fn, "__wrapped__", fn)
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        cv = inspect.getclosurevars(fn)
        candidates += list(cv.nonlocals.values()) + list(cv.globals.values())
    elif hasattr(fn, "__dict__"):  # a callable object
        candidates += [fn] + list(vars(fn).values())
    for c in list(candidates):
        if isinstance(c, (list, tuple)) or (isinstance(c, dict) and len(c) < 64):
            candidates += list(c.values() if isinstance(c, dict) else c)
    for c in candidates:
        if isinstance(c, (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
            seen.setdefault(id(c), c)
    mods = [c for c in seen.values() if isinstance(c, torch.nn.Module)]
    opts = [c for c in seen.values() if isinstance(c, torch.optim.Optimizer)]
    scheds = [c for c in seen.values() if isinstance(c, torch.optim.lr_scheduler.LRScheduler)]
    for s in scheds:
        if all(s.optimizer is not o for o in opts):
            opts.append(s.optimizer)
    return mods, opts, scheds


def _state_tensors(mods: list, opts: list) -> list:
    """Every tensor of the state, once: parameters, buffers, their gradients, optimizer state."""
    import torch

    found: dict[int, Any] = {}
    for m in mods:
        for t in list(m.parameters()) + list(m.buffers()):
            found.setdefault(id(t), t)
            if t.grad is not None:
                found.setdefault(id(t.grad), t.grad)
    for o in opts:
        for g in o.param_groups:
            for p in g["params"]:
                found.setdefault(id(p), p)
                if p.grad is not None:
                    found.setdefault(id(p.grad), p.grad)
        for s in o.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    found.setdefault(id(v), v)
    return list(found.values())


def _output_tensors(out: Any) -> list:
    """The XLA tensors in a step's return value (tensors, tuples, lists, dicts, ModelOutput)."""
    import torch

    found, stack = [], [out]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if _xla.is_xla_tensor(x):
                found.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "to_tuple"):
            stack.extend(x.to_tuple())
    return found


class _Saved:
    """Everything a step may change, saved before it runs; :meth:`restore` puts it back."""

    def __init__(self, mods: list, opts: list, scheds: list):
        import torch

        self.mods, self.opts, self.scheds = mods, opts, scheds
        self.tensors = _state_tensors(mods, opts)
        self.xla = [t for t in self.tensors if _xla.is_xla_tensor(t)]
        # The step updates shadows: each XLA tensor's data is swapped for a new tensor on the same buffer
        # (no copy), and the untouched originals are swapped back afterwards.
        self.kept = [t.data for t in self.xla]
        for t in self.xla:
            t.data = _hlo.keep(t)
        self.cpu = [(t, t.detach().clone()) for t in self.tensors if not _xla.is_xla_tensor(t)]
        params = {id(p): p for m in mods for p in m.parameters()}
        params.update({id(p): p for o in opts for g in o.param_groups for p in g["params"]})
        self.grads = [(p, p.grad) for p in params.values()]
        self.opt_state = [(o, {p: dict(s) for p, s in o.state.items()},
                           [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups],
                           getattr(o, "_opt_called", None)) for o in opts]
        self.sched = [(s, s.state_dict()) for s in scheds]
        self.training = [(m, m.training) for m in mods]
        self.torch_rng = torch.get_rng_state()
        self.xla_seed = _xla.rng_seed()
        # Buffers the step can donate: state tensors holding device data (not pending IR) before it.
        # (Asked through a graph's parameters, as the step's graph will be, of the shadow on that buffer.)
        self.handles = {}
        for t, p in zip(self.xla, _xla.has_pending(self.xla)):
            found = [] if p else _hlo.parameter_handles([t])
            if len(found) == 1:
                self.handles[id(t)] = found[0]

    def restore(self) -> None:
        import torch

        for t, k in zip(self.xla, self.kept):
            t.data = k
        for t, c in self.cpu:
            with torch.no_grad():
                t.copy_(c)
        for p, g in self.grads:
            p.grad = g
        for o, state, groups, called in self.opt_state:
            o.state.clear()
            o.state.update({p: dict(s) for p, s in state.items()})
            for g, saved in zip(o.param_groups, groups):
                g.update(saved)
            if called is not None:
                o._opt_called = called
        for s, sd in self.sched:
            s.load_state_dict(sd)
        for m, training in self.training:
            m.train(training)
        torch.set_rng_state(self.torch_rng)
        _xla.set_rng_seed(self.xla_seed)


def trace(step: Callable, args: tuple, kwargs: dict) -> Traced:
    """Run ``step(*args, **kwargs)`` lazily, take the graph of what it updates and returns, undo it all."""
    mods, opts, scheds = _owners(step, args, kwargs)
    # Launched executions must finish first: until then a tensor's buffer is a placeholder whose handle
    # changes when it is filled, and donation is matched by handle. (Runs nothing new.)
    _xla.wait_device_ops()
    saved = _Saved(mods, opts, scheds)
    try:
        out = step(*args, **kwargs)
        after = _state_tensors(mods, opts)
        outs: dict[int, Any] = {}
        for t in after + _output_tensors(out):
            if _xla.is_xla_tensor(t):
                outs.setdefault(id(t), t)
        tensors = [t for t, p in zip(outs.values(), _xla.has_pending(list(outs.values()))) if p]
        if not tensors:
            raise ValueError("the step computed nothing on the XLA device: it updates no parameter and returns "
                             "no XLA tensor (move the model and the batch to tpukit's device first).")
        hlo = _hlo.hlo_module_proto(tensors)
        params = _hlo.parameter_handles(tensors)
        where = {h: i for i, h in enumerate(params)}
        aliases = tuple((where[saved.handles[id(t)]], i) for i, t in enumerate(tensors)
                        if id(t) in saved.handles and saved.handles[id(t)] in where)
        parts = _xla.device_count() if _xla.is_spmd() else 1
        return Traced(hlo, aliases, parts, len(tensors))
    finally:
        saved.restore()
