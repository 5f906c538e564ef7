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
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import _tree, _xla, metrics
from ..errors import TpukitError
from .._xla import hlo as _hlo

# What a buffer of the step holds (tpukit.tpu.memory groups the HBM at the peak by these).
PARAMETERS = "parameters"  # the models' parameters that train (LoRA: the adapters), and their buffers
FROZEN = "frozen weights"  # the models' parameters that do not train (requires_grad=False: a LoRA's base)
GRADIENTS = "gradients"
OPTIMIZER = "optimizer state"
ACTIVATIONS = "activations kept for backward"
TEMPORARIES = "temporaries"
INPUTS = "inputs"  # the batch, and any other data the step reads
OUTPUTS = "outputs"  # what the step returns (its loss)
SCOPE = "module."  # the prefix of a module's op-name scope in the HLO's metadata: "module.layers.0.3/..."


@dataclass(frozen=True)
class Traced:
    """A step's graph: the HLO module, the (parameter, output) pairs torch_xla donates, its partitions, and
    what each parameter and output of the graph is: (kind, name), e.g. ("parameters", "layers.0.qkv.weight"),
    ("optimizer state", "exp_avg of layers.0.qkv.weight"), ("inputs", "x")."""

    hlo: bytes
    aliases: tuple[tuple[int, int], ...]
    num_partitions: int
    outputs: int
    reads: int = 0  # values the step read from the device while traced (.item(), print, a Python if on one)
    trains: bool | None = None  # it made a gradient or updated a parameter (None: no model or optimizer found)
    train_mode: bool = False  # a model it uses is in training mode (model.train())
    inputs: tuple[tuple[str, str], ...] = ()  # (kind, name) of each parameter of the HLO module, in order
    results: tuple[tuple[str, str], ...] = ()  # (kind, name) of each output
    first_step: bool = False  # an optimizer without state made it in this step (AdamW's first: not a later one's)


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


def _named(mods: list, opts: list) -> dict[int, tuple[str, str]]:
    """id(tensor) -> (kind, name) for every tensor of the state: parameters (frozen ones apart) and buffers
    (by their module path), their gradients, the optimizer's per-parameter state ("exp_avg of 0.weight")."""
    import torch

    found: dict[int, tuple[str, str]] = {}
    names: dict[int, str] = {}
    for m in mods:
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            names.setdefault(id(t), n)
            frozen = isinstance(t, torch.nn.Parameter) and not t.requires_grad
            found.setdefault(id(t), (FROZEN if frozen else PARAMETERS, n))
            if t.grad is not None:
                found.setdefault(id(t.grad), (GRADIENTS, n))
    for o in opts:
        for g in o.param_groups:
            for p in g["params"]:
                found.setdefault(id(p), (PARAMETERS, names.get(id(p), "")))
                if p.grad is not None:
                    found.setdefault(id(p.grad), (GRADIENTS, names.get(id(p), "")))
        for p, st in o.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    found.setdefault(id(v), (OPTIMIZER, f"{k} of {names.get(id(p), 'a parameter')}"))
    return found


def _arguments(step: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, str]]:
    """The step's tensor arguments with their names (the step's own parameter names when it has a signature)."""
    try:
        bound = inspect.signature(step).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"argument {i}": a for i, a in enumerate(args)}, **kwargs}
    out, stack = [], [(v, k) for k, v in bound.items()]
    while stack:
        x, n = stack.pop()
        if _xla.is_xla_tensor(x):
            out.append((x, n))
        elif isinstance(x, dict):
            stack.extend((v, f"{n}[{k!r}]") for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{n}[{i}]") for i, v in enumerate(x))
    return out


@contextmanager
def _module_scopes(mods: list) -> Iterator[None]:
    """While tracing, each module's forward is an op-name scope of its path ("module.layers.0"): the HLO's
    metadata then says which module made an operation that library code (nn.Linear's forward) traced."""
    import torch

    paths = {id(sub): path for m in mods for path, sub in m.named_modules() if path}
    if not paths:
        yield
        return
    open_scopes: list = []
    tracing = threading.get_ident()  # the hooks are global: another thread's forwards are not this trace's

    def enter(mod: Any, _args: Any) -> None:
        if id(mod) in paths and threading.get_ident() == tracing:
            open_scopes.append(_hlo.scope(SCOPE + paths[id(mod)]))

    def leave(mod: Any, _args: Any, _out: Any) -> None:
        if id(mod) in paths and open_scopes and threading.get_ident() == tracing:
            open_scopes.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        open_scopes.clear()  # a forward that raised leaves its scopes: deleting them closes them


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
        pending = _xla.has_pending(self.xla)
        self.pending = {id(t) for t, p in zip(self.xla, pending) if p}  # what the step did not update
        for t, p in zip(self.xla, pending):
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


def retie(step: Callable, args: tuple, kwargs: dict, by: str) -> None:
    """Tie again the weights the step's models declare tied but lost on their way to the device
    (a TpukitWarning, at the caller of ``by``, names them): a tied parameter is then one argument of the
    graph, counted once. (Called by :func:`tpukit.tpu.ask.begin`, itself called by the public call.)"""
    for m in _owners(step, args, kwargs)[0]:
        _xla.ties.retie(m, by, stacklevel=5)


def trace(step: Callable, args: tuple, kwargs: dict) -> Traced:
    """Run ``step(*args, **kwargs)`` lazily, take the graph of what it updates and returns, undo it all.

    Tensors of the batch still on the host are moved to the device first, as ``tpukit.track`` does.
    """
    mods, opts, scheds = _owners(step, args, kwargs)
    args, kwargs = _tree.to_device((args, kwargs), _xla.device(), _tree.is_tensor)
    # Launched executions must finish first: until then a tensor's buffer is a placeholder whose handle
    # changes when it is filled, and donation is matched by handle. (Runs nothing new.)
    _xla.wait_device_ops()
    named = _named(mods, opts)
    batch = _arguments(step, args, kwargs)
    saved = _Saved(mods, opts, scheds)
    try:
        before = metrics.snapshot()
        # Each operation's Python source line and module in the HLO's metadata (the compiler's dump and
        # refusal name them: tpukit.tpu.memory).
        with _hlo.source_metadata():
            with _module_scopes(mods):
                try:
                    out = step(*args, **kwargs)
                except Exception as exc:  # a known failure of the stack on XLA tensors: what, why, the fix
                    why = _xla.traps.explain(exc)
                    if why is None:
                        raise
                    raise TpukitError(why) from exc
            read = metrics.snapshot() - before
            after = _state_tensors(mods, opts)
            outs: dict[int, Any] = {}
            for t in after + _output_tensors(out):
                if _xla.is_xla_tensor(t):
                    outs.setdefault(id(t), t)
            tensors = [t for t, p in zip(outs.values(), _xla.has_pending(list(outs.values()))) if p]
            if not tensors:
                raise ValueError("the step computed nothing on the XLA device: it updates no parameter and "
                                 "returns no XLA tensor (move the model and the batch to tpukit's device first).")
            hlo = _hlo.stable_metadata(_hlo.hlo_module_proto(tensors))  # the same bytes for the same step
        params = _hlo.parameter_handles(tensors)
        by_handle = {saved.handles[i]: kind for i, kind in named.items() if i in saved.handles}
        for t, n in batch:
            if not _xla.has_pending([t])[0]:
                by_handle.update({h: (INPUTS, n) for h in _hlo.parameter_handles([t])})
        ended = _named(mods, opts)  # after the step: its new optimizer state, the gradients it kept
        results = tuple(ended.get(id(t), (OUTPUTS, "")) for t in tensors)
        where = {h: i for i, h in enumerate(params)}
        aliases = tuple((where[saved.handles[id(t)]], i) for i, t in enumerate(tensors)
                        if id(t) in saved.handles and saved.handles[id(t)] in where)
        parts = _xla.device_count() if _xla.is_spmd() else 1
        updated = {id(t) for t in tensors} - saved.pending
        trains = (any(id(p) in updated or (p.grad is not None and (p.grad is not g or id(p.grad) in updated))
                      for p, g in saved.grads) if saved.grads else None)
        first = any(not state and o.state for o, state, _, _ in saved.opt_state)
        return Traced(hlo, aliases, parts, len(tensors), max(read.item_reads, read.to_host), trains,
                      any(m.training for m in mods), tuple(by_handle.get(h, (INPUTS, "")) for h in params), results,
                      first)
    finally:
        saved.restore()
