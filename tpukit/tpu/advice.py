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
batch's floating tensors, in bfloat16, :func:`tpukit.rewrites.in_bf16`, and compiled). When the
logits of a loss dominate (a loss's log-softmax, or what a Hugging Face model's
output embeddings made: its ``lm_head``): a chunked loss, checked where the model
is one whose loss transformers computes from those logits (a causal or masked
LM's ``loss_function``): the step is traced again with the head's projection and
the loss done slice by slice (:func:`tpukit.rewrites.chunked_loss`) and compiled; for another
step it is a change to its code the kit cannot make. Otherwise: a smaller batch
(``tpukit.largest_batch`` finds it).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any, Callable

from ..rewrites import batch_in_bf16, batch_rows, checkpointed, chunked_loss, first_rows, heads, in_bf16, layers
from .ask import ask
from .compiler.pins import Compiler
from .compiler.targets import TARGETS, Target
from .compiler.worker import BudgetSpent
from .memory import MemoryBreakdown, attention_like
from .outcome import REJECTED, Suggestion, TpuEstimate, gb
from .search import search
from .trace import ACTIVATIONS, FROZEN, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Traced, _owners, trace

CHECKPOINT = "checkpoint each layer"
BF16 = "bf16 weights"
CHUNKED_LOSS = "chunked loss"
OUT_OF_TIME = "the time budget ran out before it was checked"
_LOGITS = re.compile(r"log_softmax|cross_entropy|nll_loss")
DOMINANT = 0.3  # a part of the peak this large is what the advice is about


def shares(why: MemoryBreakdown, found: list[tuple[Any, str, Any]] = ()) -> dict[str, float]:
    """The parts of the peak the advice weighs: ``activations``, ``attention`` (activations shaped as scores,
    ``[..., L, L]``), ``state`` (parameters, frozen weights, gradients, optimizer state), ``logits`` (a loss's log-softmax, or,
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
            "state": sum(b.bytes for b in why.buffers if b.kind in (FROZEN, PARAMETERS, GRADIENTS, OPTIMIZER)) / whole,
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
    a16, kw16 = batch_in_bf16(args, kwargs)
    try:
        with in_bf16(mods, opts):
            cast = trace(step, a16, kw16)
    except Exception as exc:  # the step may not run in bf16 as written (an fp32 tensor it makes itself)
        return None, None, f"tracing the step in bf16 raised {type(exc).__name__}: {_gist(exc)}"
    try:
        est = ask(cast, tgt, compiler, name, what=BF16)
    except BudgetSpent:
        return None, None, OUT_OF_TIME
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


def _checked(traced: Traced, tgt: Target, name: str, compiler: Compiler, what: str, shard_over: int = 1
             ) -> tuple[int | None, bool | None, str | None]:
    """(HBM, fits, None) of ``traced`` compiled as the change ``what``; (None, None, why) when the time budget
    ran out first."""
    try:
        est = ask(traced, tgt, compiler, name, shard_over, what=what)
    except BudgetSpent:
        return None, None, OUT_OF_TIME
    return est.hbm_bytes, est.fits, None


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
    change, hbm, fits, why_not = f"FSDP over {wide.chips} chips", None, None, None
    if check:
        hbm, fits, why_not = _checked(traced, wide, name, compiler, change, wide.chips)
    return Suggestion(change, how.format(wide=wide), hbm, fits, unchecked=why_not)


def suggest(est: TpuEstimate, step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target,
            comp: Compiler, name: str) -> tuple[Suggestion, ...]:
    """For a step the compiler refused: compile it again with each change, and say the per-chip HBM each gives
    (a smaller batch, gradient accumulation at that batch, bf16 autocast, FSDP over a slice's chips)."""
    import torch

    out: list[Suggestion] = []
    rows = batch_rows(args, kwargs)
    fit = None
    if rows and rows > 1:
        try:
            fit = search(lambda b: trace(step, first_rows(args, b), first_rows(kwargs, b)), tgt, comp, name,
                         below=rows, steps=2)
        except BudgetSpent:  # not one smaller batch was answered in time
            out.append(Suggestion("smaller batch", "the largest batch that fits: tpukit.largest_batch finds it",
                                  unchecked=OUT_OF_TIME))
        if fit is not None and fit.batch:
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
            bf = ask(trace(step, args, kwargs), tgt, comp, name, what="bf16 autocast")
        out.append(Suggestion("bf16 autocast", "torch.autocast('xla', dtype=torch.bfloat16) around the forward "
                              "(checked as that; model.to(torch.bfloat16) halves the weights too, not checked)",
                              bf.hbm_bytes if bf.status != REJECTED else None, bf.fits if bf.status != REJECTED
                              else None, unchecked=None if bf.status != REJECTED else _gist(bf.message)))
    except BudgetSpent:
        out.append(Suggestion("bf16 autocast", "torch.autocast('xla', dtype=torch.bfloat16) around the forward",
                              unchecked=OUT_OF_TIME))
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
    try:
        smaller = ask(trace(step, first_rows(args, b), first_rows(kwargs, b)), tgt, comp, name, dump=True,
                      what=f"batch {b}'s breakdown")
    except BudgetSpent:
        return None
    if smaller.memory is None or not smaller.fits:
        return None
    return replace(smaller.memory, source=f"compiler dump of batch {b}, the largest that fits",
                   note=f"the refusal of the step lists no allocations: this is batch {b}'s peak "
                        f"({gb(smaller.hbm_bytes)}), which fits; the refused batch needs {gb(est.hbm_bytes)}")


def advise(why: MemoryBreakdown, step: Callable, args: tuple, kwargs: dict, traced: Traced, tgt: Target,
           name: str = "step", compiler: Compiler | None = None, check: bool = True) -> tuple[Suggestion, ...]:
    """What to change, from what dominates the peak in ``why``, each change compiled when it can be (``check``;
    ``hbm_bytes``/``fits`` stay None when it was not)."""
    lm_heads = heads(_owners(step, args, kwargs)[0]) if step is not None else []
    part = shares(why, lm_heads)
    # The logits kept for backward are activations too: they are weighed against the other activations (the
    # layers' checkpointing does not reach a loss's logits), and win a tie.
    top = max(("logits", "activations", "state"), key=lambda k: part["layers" if k == "activations" else k])
    out: list[Suggestion] = []
    if top == "activations" and part["activations"] >= DOMINANT:
        path, found = layers(_owners(step, args, kwargs)[0])
        what = "attention scores and probabilities" if part["attention"] >= part["activations"] / 2 else "activations"
        layers_of = f"the {len(found)} layers of {path}" if found else "the model's layers"
        how = (f"the {what} kept for backward are {part['activations']:.0%} of the peak: run each of {layers_of} "
               "as out = torch_xla.utils.checkpoint.checkpoint(layer, x, use_reentrant=True, "
               "preserve_rng_state=False) (x must require grad; torch_xla's checkpoint re-applies autocast in "
               "the backward; torch.utils.checkpoint raises on XLA tensors in torch 2.8 and 2.9)")
        hbm = fits = None
        why_not = None if found else "no repeated layers were found to check it with"
        if check and found:
            with checkpointed(found):
                hbm, fits, why_not = _checked(trace(step, args, kwargs), tgt, name, compiler, CHECKPOINT)
        out.append(Suggestion(CHECKPOINT, how, hbm, fits, unchecked=why_not))
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
                hbm, fits, why_not = _checked(chunked, tgt, name, compiler, CHUNKED_LOSS)
        out.append(Suggestion(CHUNKED_LOSS, how, hbm, fits, unchecked=why_not))
    else:
        out.append(Suggestion("smaller batch", "neither the layers' activations, the logits nor the model's state "
                                               f"is {DOMINANT:.0%} of the peak: tpukit.largest_batch(step, "
                                               "make_batch, target) finds the largest batch that fits, and "
                                               "gradient accumulation keeps the effective batch"))
    return tuple(out)
