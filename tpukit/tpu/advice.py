"""What to change when a step's HBM is too much, each change checked by a compile: the one list of advice.

:func:`suggest` (a step the compiler refused): the largest batch that fits (:mod:`.search`), gradient
accumulation at that size, bf16 autocast, FSDP over the chips of a slice of its chip. :func:`advise` (a step
whose breakdown is known, ``memory=True``): what dominates the peak. Both give
:class:`~.outcome.Suggestion` records, one list on the estimate (``est.advice``).

The breakdown (:mod:`.memory`) says what holds the HBM at the peak. When
activations kept for backward dominate (attention scores and probabilities,
``[..., L, L]``, in a long-sequence transformer), the advice is gradient
checkpointing per layer: the step is traced again with each layer's forward
under torch_xla's checkpoint (:func:`tpukit._xla.hlo.checkpoint`) and compiled,
and the advice carries the HBM that compile gives. When parameters, gradients
and optimizer state dominate: FSDP over the target's chips (compiled with every
argument split over them) and bf16 weights (the step traced again with the
models' floating parameters, buffers, gradients and optimizer state, and the
batch's floating tensors, in bfloat16, :func:`in_bf16`, and compiled). When the
logits of a loss dominate (a loss's log-softmax, or what a Hugging Face model's
output embeddings made: its ``lm_head``): a chunked loss, checked where the model
is one whose loss transformers computes from those logits (a causal or masked
LM's ``loss_function``): the step is traced again with the head's projection and
the loss done slice by slice (:func:`chunked_loss`) and compiled; for another
step it is a change to its code the kit cannot make. Otherwise: a smaller batch
(``tpukit.largest_batch`` finds it).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

from .. import _tree, _xla
from .._xla import hlo as _hlo
from .ask import ask
from .compiler.pins import Compiler
from .compiler.targets import TARGETS, Target
from .memory import MemoryBreakdown, attention_like
from .outcome import REJECTED, Suggestion, TpuEstimate, gb
from .search import search
from .trace import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Traced, _owners, trace

CHECKPOINT = "checkpoint each layer"
BF16 = "bf16 weights"
CHUNKED_LOSS = "chunked loss"
_LOGITS = re.compile(r"log_softmax|cross_entropy|nll_loss")
_LM_LOSSES = ("ForCausalLMLoss", "ForMaskedLMLoss")  # transformers' losses over a head's logits
_NONE = object()
DOMINANT = 0.3  # a part of the peak this large is what the advice is about


def layers(step: Callable, args: tuple, kwargs: dict) -> tuple[str, list]:
    """The step's repeated layers: the ``ModuleList``/``Sequential`` of two or more modules of one class
    (each with modules inside) holding the most parameters, as (its path, its layers); ("", []) if none."""
    import torch

    best: tuple[int, str, list] = (0, "", [])
    for model in _owners(step, args, kwargs)[0]:
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


@contextmanager
def checkpointed(modules: list) -> Iterator[None]:
    """Within it, each module's forward runs under torch_xla's gradient checkpointing (its activations are
    recomputed in the backward). An input must require grad for the checkpoint to make gradients: when none
    does (the first layer's, from the batch), the first floating-point one is given ``requires_grad``."""
    import torch

    saved = []
    for m in modules:
        saved.append((m, m.__dict__.get("forward")))

        def forward(*a: Any, _forward: Callable = m.forward, **kw: Any) -> Any:
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


def heads(step: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, str, Any]]:
    """The step's Hugging Face models whose loss comes from their output embeddings' logits, each as (model,
    the head's module path, the head): a model with ``get_output_embeddings()`` whose forward calls its
    ``loss_function``, a causal or masked LM's (transformers' ``ForCausalLMLoss``, ``ForMaskedLMLoss``)."""
    found = []
    for model in _owners(step, args, kwargs)[0]:
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


def _batch_in_bf16(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The step's arguments with their floating tensors in bfloat16 (new tensors; the caller's are not
    touched): a model in bf16 takes its batch in bf16."""
    def cast(t: Any, _path: str) -> Any:
        return _to_bf16(t) if _castable(t) else t

    return _tree.tree_map(cast, (args, kwargs), _tree.is_tensor)


def shares(why: MemoryBreakdown, found: list[tuple[Any, str, Any]] = ()) -> dict[str, float]:
    """The parts of the peak the advice weighs: ``activations``, ``attention`` (activations shaped as scores,
    ``[..., L, L]``), ``state`` (parameters, gradients, optimizer state), ``logits`` (a loss's log-softmax, or,
    for the models ``found`` by :func:`heads`, what their output embeddings made or a buffer as wide as
    their vocabulary: a refusal names no module), and ``layers`` (the activations that are not logits: what
    checkpointing the layers can free)."""
    whole = why.total_bytes or 1
    paths = tuple(path for _, path, _ in found)
    vocab = {getattr(head, "out_features", None) for _, _, head in found} - {None}

    def logits(b: Any) -> bool:
        m = b.module or ""
        return (bool(_LOGITS.search(b.op or "")) or any(m == p or m.endswith("." + p) for p in paths)
                or (len(b.dims) >= 2 and b.dims[-1] in vocab))

    acts = [b for b in why.buffers if b.kind == ACTIVATIONS]
    return {"activations": sum(b.bytes for b in acts) / whole,
            "attention": sum(b.bytes for b in acts if attention_like(b)) / whole,
            "state": sum(b.bytes for b in why.buffers if b.kind in (PARAMETERS, GRADIENTS, OPTIMIZER)) / whole,
            "logits": sum(b.bytes for b in why.buffers if b.kind in (ACTIVATIONS, TEMPORARIES) and logits(b)) / whole,
            "layers": sum(b.bytes for b in acts if not logits(b)) / whole}


def _bf16_checked(step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target, name: str,
                  compiler: Any) -> tuple[int | None, bool | None, str]:
    """(HBM, fits, "") of the step compiled with its state and batch in bfloat16 (:func:`in_bf16`), or
    (None, None, why not) when it could not be traced so. Only the trace runs with the state cast: it is
    put back before the compile."""
    mods, opts, _ = _owners(step, args, kwargs)
    if not mods and not opts:
        return None, None, "no model or optimizer was found in the step to cast"
    if traced.num_partitions > 1:
        return None, None, (f"the step is split over {traced.num_partitions} devices (SPMD), and the bf16 "
                            "tensors would need their shardings again")
    a16, kw16 = _batch_in_bf16(args, kwargs)
    try:
        with in_bf16(mods, opts):
            cast = trace(step, a16, kw16)
    except Exception as exc:  # the step may not run in bf16 as written (an fp32 tensor it makes itself)
        return None, None, f"tracing the step in bf16 raised {type(exc).__name__}: {_gist(exc)}"
    est = ask(cast, tgt, compiler, name)
    if est.status == REJECTED:  # torch_xla traces an fp32 x bf16 matmul without complaint; the compiler not
        return None, None, (f"the TPU compiler rejected the step in bf16 ({_gist(est.message)}; a floating tensor "
                            "the step reads other than its arguments stays fp32 in the check)")
    return est.hbm_bytes, est.fits, ""


def _gist(exc: Exception | str) -> str:
    """The gist of an error: the compiler's ``error:`` line without its location, else the first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    err = next((line for line in lines if line.startswith("error:")), None)
    if err is not None:
        return err.rsplit("]: ", 1)[-1][:200]
    return lines[0][:200] if lines else (type(exc).__name__ if isinstance(exc, Exception) else "")


def _checked(traced: Traced, tgt: Target, name: str, compiler: Compiler, shard_over: int = 1) -> tuple[int, bool]:
    est = ask(traced, tgt, compiler, name, shard_over)
    return est.hbm_bytes, est.fits


def wide_target(tgt: Target) -> Target:
    """The slice FSDP advice is about: the target itself when it has several chips, else the eight-chip slice
    of its chip (a v5e-1's v5e-8), else the target."""
    return tgt if tgt.chips > 1 else TARGETS.get(f"{tgt.chip.name}-8", tgt)


def _fsdp(traced: Traced, tgt: Target, name: str, compiler: Compiler, how: str, check: bool = True
          ) -> Suggestion | None:
    """FSDP over the slice of :func:`wide_target`, compiled with every argument split over its chips."""
    wide = wide_target(tgt)
    if wide.chips < 2 or traced.num_partitions != 1:
        return None
    hbm = fits = None
    if check:
        hbm, fits = _checked(traced, wide, name, compiler, wide.chips)
    return Suggestion(f"FSDP over {wide.chips} chips", how.format(wide=wide), hbm, fits)


def _batch_rows(args: tuple, kwargs: dict) -> int | None:
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


def suggest(est: TpuEstimate, step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target,
            comp: Compiler, name: str) -> tuple[Suggestion, ...]:
    """For a step the compiler refused: compile it again with each change, and say the per-chip HBM each gives
    (a smaller batch, gradient accumulation at that batch, bf16 autocast, FSDP over a slice's chips)."""
    import torch

    out: list[Suggestion] = []
    rows = _batch_rows(args, kwargs)
    if rows and rows > 1:
        fit = search(lambda b: trace(step, first_rows(args, b), first_rows(kwargs, b)), tgt, comp, name,
                     below=rows, steps=2)
        if fit.batch:
            b, at_b = fit.batch, fit.estimate
            out.append(Suggestion(f"batch {b}", f"the largest batch that fits (of {rows})", at_b.hbm_bytes, True,
                                  batch=b))
            k = math.ceil(rows / b)
            micro = math.ceil(rows / k)  # k micro-batches of at most b rows that add up to the batch asked
            total = f"{k} x {micro} = {k * micro} rows" + ("" if k * micro == rows else f", for the {rows} asked")
            out.append(Suggestion(f"accumulate {k} x {micro}",
                                  f"gradient accumulation: {k} micro-batches of {micro} rows ({total}), one "
                                  f"optimizer step; checked at {b} rows, the largest batch that fits",
                                  at_b.hbm_bytes, True, batch=micro))
    try:
        with torch.autocast("xla", dtype=torch.bfloat16):
            bf = ask(trace(step, args, kwargs), tgt, comp, name)
        out.append(Suggestion("bf16 autocast", "torch.autocast('xla', dtype=torch.bfloat16) around the forward "
                              "(checked as that; model.to(torch.bfloat16) halves the weights too, not checked)",
                              bf.hbm_bytes if bf.status != REJECTED else None, bf.fits if bf.status != REJECTED
                              else None, unchecked=None if bf.status != REJECTED else _gist(bf.message)))
    except Exception as exc:  # autocast may not apply to this step: say so rather than fail the estimate
        out.append(Suggestion("bf16 autocast", f"could not be estimated ({type(exc).__name__})",
                              unchecked=_gist(exc)))
    fsdp = _fsdp(traced, tgt, name, comp, "tpukit.fsdp(model, tpukit.mesh()) on {wide.name}")
    return tuple(out) + ((fsdp,) if fsdp else ())


def smaller_batch_breakdown(est: TpuEstimate, tips: tuple[Suggestion, ...], step: Callable, args: tuple,
                            kwargs: dict, tgt: Target, comp: Compiler, name: str) -> MemoryBreakdown | None:
    """For a refused step whose refusal lists no allocations: the breakdown of the largest batch that fits
    (from ``tips``' batch), said so; None without one."""
    b = next((s.batch for s in tips if s.change.startswith("batch ") and s.fits), None)
    if b is None:
        return None
    smaller = ask(trace(step, first_rows(args, b), first_rows(kwargs, b)), tgt, comp, name, dump=True)
    if smaller.memory is None or not smaller.fits:
        return None
    return replace(smaller.memory, source=f"compiler dump of batch {b}, the largest that fits",
                   note=f"the refusal of the step lists no allocations: this is batch {b}'s peak "
                        f"({gb(smaller.hbm_bytes)}), which fits; the refused batch needs {gb(est.hbm_bytes)}")


def advise(why: MemoryBreakdown, step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target,
           name: str = "step", compiler: Compiler | None = None, check: bool = True) -> tuple[Suggestion, ...]:
    """What to change, from what dominates the peak in ``why``, each change compiled when it can be (``check``;
    ``hbm_bytes``/``fits`` stay None when it was not)."""
    lm_heads = heads(step, args, kwargs) if step is not None else []
    part = shares(why, lm_heads)
    # The logits kept for backward are activations too: they are weighed against the other activations (the
    # layers' checkpointing does not reach a loss's logits), and win a tie.
    top = max(("logits", "activations", "state"), key=lambda k: part["layers" if k == "activations" else k])
    out: list[Suggestion] = []
    if top == "activations" and part["activations"] >= DOMINANT:
        path, found = layers(step, args, kwargs)
        what = "attention scores and probabilities" if part["attention"] >= part["activations"] / 2 else "activations"
        layers_of = f"the {len(found)} layers of {path}" if found else "the model's layers"
        how = (f"the {what} kept for backward are {part['activations']:.0%} of the peak: run each of {layers_of} "
               "as out = torch_xla.utils.checkpoint.checkpoint(layer, x, use_reentrant=True, "
               "preserve_rng_state=False) (x must require grad; torch_xla's checkpoint re-applies autocast in "
               "the backward; torch.utils.checkpoint raises on XLA tensors in torch 2.8 and 2.9)")
        hbm = fits = None
        if check and found:
            with checkpointed(found):
                hbm, fits = _checked(trace(step, args, kwargs), tgt, name, compiler)
        out.append(Suggestion(CHECKPOINT, how, hbm, fits,
                              unchecked=None if found else "no repeated layers were found to check it with"))
    elif top == "state" and part["state"] >= DOMINANT:
        fsdp = _fsdp(traced, tgt, name, compiler, f"parameters, gradients and optimizer state are {part['state']:.0%} "
                     "of the peak: tpukit.fsdp(model, tpukit.mesh()) on {wide.name} splits them over its chips", check)
        if fsdp:
            out.append(fsdp)
        how = ("model.to(torch.bfloat16) (before the optimizer makes its state) and the batch's floating tensors "
               "in bf16 halve parameters, gradients and optimizer state (keep an fp32 copy for the update if the "
               "loss needs it)")
        hbm = fits = None
        if check:
            hbm, fits, why_not = _bf16_checked(step, args, kwargs, traced, tgt, name, compiler)
        out.append(Suggestion(BF16, how, hbm, fits, unchecked=why_not or None))
    elif top == "logits" and part["logits"] >= DOMINANT:
        how = (f"the logits and their log-softmax are {part['logits']:.0%} of the peak: compute the loss over "
               "slices of the rows (batch x sequence), the head's projection inside each slice and each slice under "
               "torch_xla.utils.checkpoint.checkpoint, so one slice's logits are live at a time")
        hbm = fits = why_not = None
        if not lm_heads:
            why_not = ("that rewrites the step's code (where the head ends and the loss begins), which the kit can "
                       "do only for a Hugging Face causal or masked LM's head and loss")
        elif check:
            try:
                with chunked_loss(lm_heads):
                    chunked = trace(step, args, kwargs)
            except Exception as exc:  # the model does to its logits what its hidden states cannot take
                why_not = f"tracing the step with a chunked loss raised {type(exc).__name__}: {_gist(exc)}"
            else:
                how += f" (checked as {', '.join(path for _, path, _ in lm_heads)} and the model's loss in 8 slices)"
                hbm, fits = _checked(chunked, tgt, name, compiler)
        out.append(Suggestion(CHUNKED_LOSS, how, hbm, fits, unchecked=why_not))
    else:
        out.append(Suggestion("smaller batch", "neither the layers' activations, the logits nor the model's state "
                                               f"is {DOMINANT:.0%} of the peak: tpukit.largest_batch(step, "
                                               "make_batch, target) finds the largest batch that fits, and "
                                               "gradient accumulation keeps the effective batch"))
    return tuple(out)
