"""A step as it would run with a change the kit can make for it: each layer checkpointed, a language model's
loss chunked, the state and batch in bf16, a batch cut to its first rows.

The TPU room's advice (:mod:`tpukit.tpu.advice`) traces a step again inside one of these and compiles it, so
a suggestion carries the HBM the compiler gives for it. :func:`checkpointed` also trains: it is the XLA-safe
form of per-layer gradient checkpointing (torch_xla's checkpoint around each layer), where transformers'
``gradient_checkpointing_enable()`` fails on XLA tensors in torch 2.8. Each context manager gives every
module, head and tensor its own forward, loss and data back when it ends, even on an error. They take the
models (and optimizers) a step holds, not the step: finding those is the tracer's job (:mod:`tpukit.tpu.trace`).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from . import _tree, _xla
from ._xla import hlo as _hlo

_LM_LOSSES = ("ForCausalLMLoss", "ForMaskedLMLoss")  # transformers' losses over a head's logits
_NONE = object()


def layers(models: list) -> tuple[str, list]:
    """The models' repeated layers: the ``ModuleList``/``Sequential`` of two or more modules of one class
    (each with modules inside) holding the most parameters, as (its path, its layers); ("", []) if none."""
    import torch

    best: tuple[int, str, list] = (0, "", [])
    for model in models:
        for path, sub in model.named_modules():
            if not isinstance(sub, (torch.nn.ModuleList, torch.nn.Sequential)):
                continue
            kids = list(sub.children())
            if len(kids) < 2 or len({type(k) for k in kids}) != 1 or not any(True for _ in kids[0].children()):
                continue
            size = sum(p.numel() for k in kids for p in k.parameters())
            if size > best[0]:
                best = (size, path, kids)
    return best[1], best[2]


_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")  # what transformers' layers call their cache


@contextmanager
def checkpointed(modules: list) -> Iterator[None]:
    """Within it, each module's forward runs under torch_xla's gradient checkpointing (its activations are
    recomputed in the backward). An input must require grad for the checkpoint to make gradients: when none
    does (the first layer's, from the batch), the first floating-point one is given ``requires_grad``.

    A key/value cache handed to a layer (transformers' ``past_key_values``, ``cache`` in 5.24's layers: a
    decoder in training mode still makes one unless ``use_cache=False``) is not: the recompute would append
    the layer's keys to it a second time, and eager attention then adds a mask of the sequence to scores twice
    as long (transformers' own ``gradient_checkpointing_enable()`` turns the cache off for the same reason)."""
    import torch

    saved = []
    for m in modules:
        saved.append((m, m.__dict__.get("forward")))

        def forward(*a: Any, _forward: Callable = m.forward, **kw: Any) -> Any:
            kw = {k: None if k in _CACHES else False if k == "use_cache" else v for k, v in kw.items()}
            fn = functools.partial(_forward, **kw) if kw else _forward
            tensors = [x for x in a if isinstance(x, torch.Tensor)]
            if torch.is_grad_enabled() and not any(t.requires_grad for t in tensors):
                first = next((i for i, x in enumerate(a) if isinstance(x, torch.Tensor) and x.is_floating_point()),
                             None)
                if first is not None:
                    a = a[:first] + (a[first].detach().requires_grad_(),) + a[first + 1:]
            return _hlo.checkpoint(fn, *a)

        m.forward = forward
    try:
        yield
    finally:
        for m, own in saved:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


def heads(models: list) -> list[tuple[Any, str, Any]]:
    """The Hugging Face models (of ``models``) whose loss comes from their output embeddings' logits, each as (model,
    the head's module path, the head): a model with ``get_output_embeddings()`` whose forward calls its
    ``loss_function``, a causal or masked LM's (transformers' ``ForCausalLMLoss``, ``ForMaskedLMLoss``)."""
    found = []
    for model in models:
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        loss = getattr(model, "loss_function", None) if head is not None else None
        if getattr(loss, "__name__", "") not in _LM_LOSSES or not _calls_its_loss_function(model):
            continue
        path = next((p for p, m in model.named_modules() if m is head), None)
        if path:
            found.append((model, path, head))
    return found


def _calls_its_loss_function(model: Any) -> bool:
    """Whether the model's forward computes its loss with ``self.loss_function`` (some of transformers'
    models, BERT's masked LM among them, still make their own ``CrossEntropyLoss``)."""
    try:
        return "self.loss_function(" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False


def _chunked(project: Callable, hidden: Any, labels: Any, shift: bool, chunks: int,
             num_items_in_batch: Any = None, ignore_index: int = -100, shift_labels: Any = None) -> Any:
    """A language model's loss from its hidden states, ``chunks`` slices of rows at a time: each slice
    projected by ``project`` (the head) and scored under gradient checkpointing, so one slice's logits are
    live at a time; the labels shifted as a causal LM's loss shifts them (``shift``)."""
    import torch

    if shift:
        labels = shift_labels if shift_labels is not None else \
            torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    size = -(-h.shape[0] // chunks)

    def piece(hc: Any, yc: Any) -> Any:
        return torch.nn.functional.cross_entropy(project(hc).float(), yc, ignore_index=ignore_index,
                                                 reduction="sum")

    total = sum(_hlo.checkpoint(piece, h[i:i + size], y[i:i + size]) for i in range(0, h.shape[0], size))
    return total / (num_items_in_batch if num_items_in_batch is not None else (y != ignore_index).sum())


@contextmanager
def chunked_loss(found: list[tuple[Any, str, Any]], chunks: int = 8) -> Iterator[None]:
    """Within it, each model of :func:`heads` computes its loss as a chunked loss does: its head returns
    the hidden states, and its ``loss_function`` projects them with the head and scores them ``chunks``
    slices of rows at a time (:func:`_chunked`). The model's own forward is unchanged, so what it does to the
    logits before its loss (a soft cap) is done to the hidden states instead: the check is of the memory, not
    of the values. Leaving, even on an error, gives each head its forward and each model its loss back."""
    saved = []
    try:
        for model, _path, head in found:
            shift = model.loss_function.__name__ == "ForCausalLMLoss"
            saved.append((model, head, head.__dict__.get("forward"), model.__dict__.get("_loss_function", _NONE)))
            project = head.forward

            def loss(logits: Any, labels: Any, vocab_size: int | None = None, num_items_in_batch: Any = None,
                     ignore_index: int = -100, shift_labels: Any = None, _project: Callable = project,
                     _shift: bool = shift, **_: Any) -> Any:
                return _chunked(_project, logits, labels, _shift, chunks, num_items_in_batch, ignore_index,
                                shift_labels)

            head.forward = lambda hidden: hidden
            model.loss_function = loss
        yield
    finally:
        for model, head, forward, loss_fn in reversed(saved):
            if forward is None:
                head.__dict__.pop("forward", None)
            else:
                head.forward = forward
            if loss_fn is _NONE:
                model.__dict__.pop("_loss_function", None)
            else:
                model._loss_function = loss_fn


def _to_bf16(t: Any) -> Any:
    """New bfloat16 data of ``t``'s shape on its device: on an XLA device, device data sent from the host
    (a graph's parameter, as the real weights are; its values are never read: the graph is only compiled),
    elsewhere ``t`` cast."""
    import torch

    if _xla.is_xla_tensor(t):
        return torch.empty(tuple(t.shape), dtype=torch.bfloat16).to(t.device)
    return t.detach().to(torch.bfloat16)


def _castable(t: Any) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.bfloat16


@contextmanager
def in_bf16(modules: list, optimizers: list = ()) -> Iterator[int]:
    """Within it, the state is as ``model.to(torch.bfloat16)`` leaves it: each floating-point parameter and
    buffer of ``modules`` and each parameter ``optimizers`` hold, with its gradient, holds bfloat16 data, and
    so does each floating optimizer state tensor of one dimension or more (Adam's moments; not its ``step``
    counter). As ``Module.to`` does, each tensor's ``.data`` is swapped: the tensor objects stay the ones the
    model and the optimizer hold, with their ``requires_grad``. The bfloat16 data is new device data whose
    values are not set (for a trace that is compiled, never run); while it lasts it takes half the cast
    tensors' size in the device's memory (XLA:CPU's: the host's). Leaving, even on an error, gives every
    tensor its own data object back: the same dtype, values, ``requires_grad`` and ``.grad`` as before.
    Yields how many tensors were cast."""
    import torch

    seen: set[int] = set()
    order: list = []  # parameters before their gradients: a gradient's dtype follows its parameter's

    def add(t: Any) -> None:
        if _castable(t) and id(t) not in seen:
            seen.add(id(t))
            order.append(t)

    params = [p for m in modules for p in m.parameters()] + \
        [p for o in optimizers for g in o.param_groups for p in g["params"]]
    for p in params:
        add(p)
        add(p.grad)
    for m in modules:
        for b in m.buffers():
            add(b)
    for o in optimizers:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    add(v)
    swapped: list = []
    try:
        with torch.no_grad():
            for t in order:
                data = t.data
                t.data = _to_bf16(t)
                swapped.append((t, data))
        yield len(swapped)
    finally:
        with torch.no_grad():
            for t, data in reversed(swapped):  # gradients first, then their parameters
                t.data = data


def batch_in_bf16(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The step's arguments with their floating tensors in bfloat16 (new tensors; the caller's are not
    touched): a model in bf16 takes its batch in bf16."""
    def cast(t: Any, _path: str) -> Any:
        return _to_bf16(t) if _castable(t) else t

    return _tree.tree_map(cast, (args, kwargs), _tree.is_tensor)


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """The leading size the step's tensor arguments share (the batch), when they share one."""
    import torch

    sizes = set()
    stack = list(args) + list(kwargs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            sizes.add(int(x.shape[0]))
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sizes.pop() if len(sizes) == 1 else None


def first_rows(x: Any, n: int) -> Any:
    """``x`` (a tensor, or a dict/list/tuple of them) with only its first ``n`` rows."""
    import torch

    if isinstance(x, torch.Tensor):
        return x[:n] if x.dim() >= 1 else x
    if isinstance(x, dict):
        return type(x)({k: first_rows(v, n) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return type(x)(first_rows(v, n) for v in x)
    return x
