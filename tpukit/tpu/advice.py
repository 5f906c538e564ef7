"""What to change when a step's HBM is too much, read from its breakdown, and checked by a compile.

The breakdown (:mod:`.memory`) says what holds the HBM at the peak. When
activations kept for backward dominate (attention scores and probabilities,
``[..., L, L]``, in a long-sequence transformer), the advice is gradient
checkpointing per layer: the step is traced again with each layer's forward
under torch_xla's checkpoint (:func:`tpukit._xla.hlo.checkpoint`) and compiled,
and the advice carries the HBM that compile gives. When parameters, gradients
and optimizer state dominate: FSDP over the target's chips (compiled with every
argument split over them) and bf16 weights (not checked: that needs the weights
cast on the device, which an estimate never runs). When the logits of a loss
dominate: a chunked loss (not checked: it is a change to the step's code).
Otherwise: a smaller batch (``tpukit.largest_batch`` finds it).
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .._xla import hlo as _hlo
from . import worker
from .memory import MemoryBreakdown, attention_like
from .record import Suggestion, from_reply
from .targets import TARGETS, Target
from .trace import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Traced, _owners, trace

CHECKPOINT = "checkpoint each layer"
_LOGITS = re.compile(r"log_softmax|cross_entropy|nll_loss")
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


def shares(why: MemoryBreakdown) -> dict[str, float]:
    """The parts of the peak the advice weighs: ``activations``, ``attention`` (activations shaped as scores,
    ``[..., L, L]``), ``state`` (parameters, gradients, optimizer state), ``logits`` (a loss's log-softmax)."""
    whole = why.total_bytes or 1
    acts = [b for b in why.buffers if b.kind == ACTIVATIONS]
    return {"activations": sum(b.bytes for b in acts) / whole,
            "attention": sum(b.bytes for b in acts if attention_like(b)) / whole,
            "state": sum(b.bytes for b in why.buffers if b.kind in (PARAMETERS, GRADIENTS, OPTIMIZER)) / whole,
            "logits": sum(b.bytes for b in why.buffers if b.kind in (ACTIVATIONS, TEMPORARIES)
                          and _LOGITS.search(b.op or "")) / whole}


def _checked(traced: Traced, tgt: Target, name: str, compiler: Any, shard_over: int = 1) -> tuple[int, bool]:
    est = from_reply(worker.compile(worker.Request(traced.hlo, tgt, traced.num_partitions, traced.aliases,
                                                   shard_over, compiler)), tgt, name)
    return est.hbm_bytes, est.fits


def advise(why: MemoryBreakdown, step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target,
           name: str = "step", compiler: Any = None, check: bool = True) -> tuple[Suggestion, ...]:
    """What to change, from what dominates the peak in ``why``, each change compiled when it can be (``check``;
    ``hbm_bytes``/``fits`` stay None when it was not)."""
    part = shares(why)
    top = max(("activations", "state", "logits"), key=lambda k: part[k])
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
        elif not found:
            how += "; no repeated layers were found to check it with"
        out.append(Suggestion(CHECKPOINT, how, hbm, fits))
    elif top == "state" and part["state"] >= DOMINANT:
        wide = tgt if tgt.chips > 1 else TARGETS.get(f"{tgt.chip.name}-8", tgt)
        if wide.chips > 1 and traced.num_partitions == 1:
            hbm = fits = None
            if check:
                hbm, fits = _checked(traced, wide, name, compiler, wide.chips)
            out.append(Suggestion(f"FSDP over {wide.chips} chips",
                                  f"parameters, gradients and optimizer state are {part['state']:.0%} of the peak: "
                                  f"tpukit.fsdp(model, tpukit.mesh()) on {wide.name} splits them over its chips",
                                  hbm, fits))
        out.append(Suggestion("bf16 weights", "model.to(torch.bfloat16) halves parameters, gradients and optimizer "
                                              "state (keep an fp32 copy for the update if the loss needs it)"))
    elif top == "logits" and part["logits"] >= DOMINANT:
        out.append(Suggestion("chunked loss", f"the logits and their log-softmax are {part['logits']:.0%} of the "
                                              "peak: compute the loss over slices of the sequence (or vocabulary) "
                                              "so one slice's logits are live at a time"))
    else:
        out.append(Suggestion("smaller batch", "no one part dominates the peak: tpukit.largest_batch(step, "
                                               "make_batch, target) finds the largest batch that fits, and "
                                               "gradient accumulation keeps the effective batch"))
    return tuple(out)
