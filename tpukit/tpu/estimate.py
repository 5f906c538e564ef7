"""``tpukit.estimate``: will this step fit on the target TPU, how long does it compile, how fast can it be.

The step is traced lazily on the XLA device and never run (:mod:`.trace`); its
graph goes to the TPU compiler through the one seam (:func:`.ask.ask`); a step
that does not fit gets advice, each piece compiled again where it can be
(:mod:`.advice`). The largest batch that fits is :mod:`.search`'s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from . import advice as _advice
from .ask import ask, begin, check, fsdp_chips, resolve
from .compiler.pins import Compiler
from .compiler.targets import Target
from .outcome import REJECTED, TpuCompileError, TpuEstimate
from .trace import trace

def estimate(step: Callable, *args: Any, target: str | Target | None = None, suggest: bool = True,
             fsdp: bool = False, compiler: str | Compiler | None = None, memory: bool = False,
             **kwargs: Any) -> TpuEstimate:
    """Compile ``step(*args, **kwargs)`` for a TPU with the real TPU compiler, without running it here.

    The step is traced lazily on the XLA device (model and batch already there),
    its graph (everything it updates and returns) is compiled for ``target``
    (e.g. ``"v5e-1"``; default: ``tpukit.setup(target=...)``'s, else ``$TPUKIT_TARGET``) in the TPU compiler's worker
    process, and the model, optimizer state, gradients, LR schedulers and random
    seeds are put back exactly as they were: the update is discarded. Buffer
    donation is carried (``aliased_bytes``); under SPMD the graph is compiled for
    the target's chips with the tensors' shardings. When it does not fit,
    ``advice`` says what would, each compiled again (``suggest=False`` skips
    them). ``fsdp=True`` asks about a one-device step as if it ran under
    ``tpukit.fsdp`` over all the target's chips (every parameter, optimizer state
    and batch tensor split over them; the batch is the global one). Batch tensors
    still on the host are moved to the device, as ``tpukit.track`` does; weights a
    model declares tied but lost on its way to the device are tied again (a
    warning names them). The step must not read values from the device (no
    ``.item()``, ``print(tensor)``, ``torch_xla.sync()``): a read is warned about.
    A step without a backward pass or optimizer update is estimated as a forward
    pass (``note`` says so; a warning when its model is in training mode); one whose optimizer has no state
    yet is its first step (``note`` says so).
    ``compiler``: which TPU compiler answers (``"torch_xla 2.8"``, ``"libtpu 0.0.17"``, ``"newest"``;
    default: ``tpukit.setup(compiler=...)``'s, else the libtpu the installed torch_xla's runtime loads);
    a pair not installed here runs in its own environment, built on first use. The estimate names it.
    ``memory``: also say why (``est.memory``, :class:`~.memory.MemoryBreakdown`): the buffers in HBM at the
    peak by kind and source line, from the compiler's dump of this compile, with advice each checked by a
    compile (:mod:`.advice`). A refused step always gets the breakdown its refusal gives. A graph the compiler
    rejects for another reason than memory raises :class:`TpuCompileError`.
    """
    tgt, comp = resolve(target, compiler)
    name = begin(step, args, kwargs, comp, "tpukit.estimate")
    traced = trace(step, args, kwargs)
    note = check(traced, name, "tpukit.estimate")
    est = replace(ask(traced, tgt, comp, name, fsdp_chips(traced, tgt, fsdp), dump=memory), note=note)
    if est.status == REJECTED:
        raise TpuCompileError(f"{est.message} (for {tgt.name})")
    tips = _advice.suggest(est, step, args, kwargs, traced, tgt, comp, name) if (
        not est.fits and suggest and not fsdp) else ()
    if not est.fits and est.memory is None and memory:
        est = replace(est, memory=_advice.smaller_batch_breakdown(est, tips, step, args, kwargs, tgt, comp, name))
    if memory and est.memory is not None:
        tips += tuple(t for t in _advice.advise(est.memory, step, args, kwargs, traced, tgt, name, comp)
                      if t.change not in {s.change for s in tips})
    return replace(est, advice=tips) if tips else est
