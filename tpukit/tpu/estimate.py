"""``tpukit.estimate``: will this step fit on the target TPU, how long does it compile, how fast can it be.

The step is traced lazily on the XLA device and never run (:mod:`.trace`); its
graph goes to the TPU compiler through the one seam (:func:`.ask.ask`); a step
that does not fit gets advice, each piece compiled again where it can be
(:mod:`.advice`). The largest batch that fits is :mod:`.search`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from . import advice as _advice, progress as _progress
from .ask import ask, begin, check, fsdp_chips, resolve
from .compiler.pins import Compiler
from .compiler.targets import Target
from .outcome import REJECTED, TpuCompileError, TpuEstimate
from .trace import trace

NEAR_LIMIT = 0.8  # a fitting step using this much of its chip's usable HBM or more gets advice


def near_limit(est: TpuEstimate) -> bool:
    """Whether a fitting step uses :data:`NEAR_LIMIT` of its chip's usable HBM or more (a refused one: True)."""
    if not est.fits:
        return True
    return bool(est.hbm_bytes and est.hbm_limit_bytes and est.hbm_bytes >= NEAR_LIMIT * est.hbm_limit_bytes)

def estimate(step: Callable, *args: Any, target: str | Target | None = None, suggest: bool | str = True,
             fsdp: bool = False, compiler: str | Compiler | None = None, memory: bool = False,
             budget: float | None = None, progress: bool = True, **kwargs: Any) -> TpuEstimate:
    """Compile ``step(*args, **kwargs)`` for a TPU with the real TPU compiler, without running it here.

    The step is traced lazily on the XLA device (model and batch already there), its graph (everything it
    updates and returns) is compiled for ``target`` (e.g. ``"v5e-1"``; default: ``tpukit.setup(target=...)``'s,
    else ``$TPUKIT_TARGET``) in the TPU compiler's worker process, and the model, optimizer state, gradients,
    LR schedulers and random seeds are put back exactly as they were: the update is discarded. Buffer
    donation is carried (``aliased_bytes``); under SPMD the graph is compiled for the target's chips with the
    tensors' shardings.

    When it does not fit, ``advice`` says what would, each compiled again (``suggest=False`` skips them).
    With ``memory=True`` a step that fits gets advice only near the chip's limit (:data:`NEAR_LIMIT` of its
    usable HBM or more): at a few percent of the chip there is nothing to fix, and ``suggest="always"`` asks
    for it anyway (what the breakdown says dominates, each change checked).

    ``fsdp=True`` asks about a one-device step as if it ran under ``tpukit.fsdp`` over all the target's chips
    (every parameter, optimizer state and batch tensor split over them; the batch is the global one). Batch
    tensors still on the host are moved to the device, as ``tpukit.track`` does; weights a model declares
    tied but lost on its way to the device are tied again (a warning names them). The step must not read
    values from the device (no ``.item()``, ``print(tensor)``, ``torch_xla.sync()``): a read is warned about.
    A step without a backward pass or optimizer update is estimated as a forward pass (``note`` says so; a
    warning when its model is in training mode); one whose optimizer has no state yet is its first step
    (``note`` says so).

    ``compiler``: which TPU compiler answers (``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``; default:
    ``tpukit.setup(compiler=...)``'s, else the libtpu the installed torch_xla's runtime loads); a pair not
    installed here runs in its own environment, built on first use. The estimate names it.

    ``memory``: also say why (``est.memory``, :class:`~.memory.MemoryBreakdown`): the buffers in HBM at the
    peak by kind and source line, from the compiler's dump of this compile, with advice each checked by a
    compile (:mod:`.advice`). A refused step always gets the breakdown its refusal gives. A graph the compiler
    rejects for another reason than memory raises :class:`TpuCompileError`.

    ``budget``: seconds the whole call may take. The step's own compile is the estimate: when the budget runs
    out before it answers, :class:`~.compiler.worker.BudgetSpent` says so; advice the budget left no time to
    check says so (``not checked: the time budget ran out``). ``progress``: show what is compiling, for how
    long and what is done while it runs (:mod:`.progress`). (``budget`` and ``progress`` are this call's: the
    step cannot take arguments of those names through it.)
    """
    tgt, comp = resolve(target, compiler)
    name = begin(step, args, kwargs, comp, "tpukit.estimate")
    with _progress.job(f"tpukit.estimate({name}) for {tgt.name}", budget, progress):
        return _estimate(step, args, kwargs, tgt, comp, name, suggest, fsdp, memory)


def _estimate(step: Callable, args: tuple, kwargs: dict, tgt: Target, comp: Compiler, name: str, suggest: bool | str,
              fsdp: bool, memory: bool) -> TpuEstimate:
    """:func:`estimate`'s work, inside its job: the step's compile, then the advice."""
    traced = trace(step, args, kwargs)
    note = check(traced, name, "tpukit.estimate")
    est = replace(ask(traced, tgt, comp, name, fsdp_chips(traced, tgt, fsdp), dump=memory, what="the step"), note=note)
    if est.status == REJECTED:
        raise TpuCompileError(f"{est.message} (for {tgt.name})")
    tips = _advice.suggest(est, step, args, kwargs, traced, tgt, comp, name) if (
        not est.fits and suggest and not fsdp) else ()
    if not est.fits and est.memory is None and memory:
        est = replace(est, memory=_advice.smaller_batch_breakdown(est, tips, step, args, kwargs, tgt, comp, name))
    if memory and est.memory is not None and suggest and (suggest == "always" or near_limit(est)):
        tips += tuple(t for t in _advice.advise(est.memory, step, args, kwargs, traced, tgt, name, comp)
                      if t.change not in {s.change for s in tips})
    return replace(est, advice=tips) if tips else est
