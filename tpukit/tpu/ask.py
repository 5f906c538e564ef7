"""The one way from a traced step to the TPU compiler's answer, and where names become objects.

- :func:`resolve`: the target and the compiler a public call means, once, at its edge: the names given,
  else ``tpukit.setup(target=..., compiler=...)``'s, else ``$TPUKIT_TARGET`` / ``$TPUKIT_COMPILER`` (the
  runtime owns those: :func:`tpukit.runtime.tpu_target`), else the runtime's own compiler (the libtpu the
  installed torch_xla's runtime loads). Everything below takes the objects.
- :func:`ask`: a :class:`~.trace.Traced` step, a target, a compiler and the options (an FSDP layout over
  ``shard_over`` chips, the compiler's dump for the HBM breakdown) -> one :class:`~.outcome.TpuEstimate`.
  ``estimate``, the batch search, ``compare``, the advice checks and the follower all call it; nobody else
  builds a compile request or reads a reply.
- :func:`begin` and :func:`check`: what each public call does around its trace (the compiler checked and
  warmed, lost weight ties tied again; what the traced step does that its estimate cannot show).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import replace
from typing import Callable

from .. import runtime
from ..errors import TpukitWarning
from . import dump as _dump, memory as _memory, progress as _progress
from .compiler import cache, pins, worker
from .compiler.pins import Compiler, describe, mismatch
from .compiler.refusal import is_memory_refusal, parse
from .compiler.targets import TARGETS, Target, TargetError
from .outcome import (FIRST_STEP, FITS, NEED, PEAK, PLANNED, REJECTED, SUM, TOO_BIG, UNKNOWN, TpuEstimate,
                      hbm_text)
from .trace import Traced, retie


def resolve(target: "str | Target | None" = None, compiler: "str | Compiler | None" = None,
            need_target: bool = True) -> tuple[Target | None, Compiler]:
    """(the :class:`Target`, the :class:`Compiler`) a call means (see the module doc). Without a target
    anywhere, :class:`TargetError` says how to name one (``need_target=False``: None instead)."""
    tgt = runtime.tpu_target(target)
    if tgt is None and need_target:
        raise TargetError("no TPU target: pass target= (e.g. target='v5e-1'), or name it once with "
                          "tpukit.setup(target='v5e-1') (or $TPUKIT_TARGET) for every estimate. "
                          f"Known targets: {', '.join(TARGETS)}.")
    return tgt, pins.resolve(compiler if compiler is not None else runtime.tpu_compiler())


def graph(hlo: bytes, num_partitions: int = 1) -> Traced:
    """A graph the kit already has (an ``HloModuleProto``'s bytes) as :func:`ask` takes it: no donation known
    beyond what the module declares, no kinds of its buffers."""
    return Traced(bytes(hlo), (), int(num_partitions), 0)


def ask(traced: Traced, tgt: Target, comp: Compiler, name: str = "step", shard_over: int = 1,
        dump: bool = False, what: str = "", early: bool = False) -> TpuEstimate:
    """Compile ``traced`` for ``tgt`` with ``comp`` (an FSDP layout over ``shard_over`` chips; 1: its own
    shardings) and return the outcome: fits, too big (with the refusal's breakdown), or rejected (the
    compiler's message). ``dump``: with the compiler's dump, the fitting step's ``memory`` breakdown by kind
    and source line (kept with its answer). ``early``: stop the compile once its buffer assignment is written
    (:func:`_planned`): the HBM it allocates, before code generation (most of the time), is the answer
    (``hbm_source`` :data:`~.outcome.PLANNED`); a compile that ends first answers as it ends. Inside a public
    call's job (:mod:`.progress`) the compile is reported as ``what`` (default: the step's name) and bounded by the job's budget
    (:class:`~.compiler.worker.BudgetSpent`). Raises only when no compiler can answer (the worker died, the
    compiler is missing) or the budget ran out."""
    parts = traced.num_partitions
    if parts > 1 and parts != tgt.chips:
        raise ValueError(f"the step is partitioned over {parts} devices (SPMD) but {tgt.name} has {tgt.chips} "
                         f"chips: build the mesh over {tgt.chips} devices, or pick a {parts}-chip target.")
    request = worker.Request(traced.hlo, tgt, parts, traced.aliases, shard_over, comp)
    job, what = _progress.current(), what or name
    if job is not None:
        job.check(what)
        job.compiling(what)
    deadline = job.deadline if job is not None else None
    if early:
        reply = _planned(request, deadline)
        est = outcome(reply, tgt, name, traced) if "planned_bytes" not in reply else planned(reply, tgt, name)
    elif not dump:
        est = outcome(worker.compile(request, deadline), tgt, name, traced)
    else:
        reply, found = _dumped(request, deadline)
        est = outcome(reply, tgt, name, traced)
        if est.fits and found is not None:
            est = replace(est, memory=replace(_memory.from_dump(found, traced, reply), peak_bytes=est.hbm_bytes))
    if job is not None:
        job.answered(what, f"{est.status}, {hbm_text(est)}" if est.status != REJECTED else est.status)
    return est


def _dumped(request: worker.Request, deadline: float | None = None) -> tuple[dict, "_dump.Dump | None"]:
    """The compiler's reply for ``request`` compiled with a dump, and the dump read (None when it wrote none),
    kept beside the plain answers by the same key."""
    key = request.key()
    kept = cache.get_dump(key)
    if kept is not None:
        try:
            return (worker._named(kept["reply"], request.compiler),
                    _dump.Dump.from_json(kept["dump"]) if kept.get("dump") else None)
        except (KeyError, TypeError, ValueError):
            pass
    with tempfile.TemporaryDirectory(prefix="tpukit-dump-") as folder:
        reply = worker.compile_dump(request, folder, deadline)
        try:
            found = _dump.read(folder)
        except FileNotFoundError:
            found = None
    if "error" not in reply or is_memory_refusal(reply["error"]):  # a passing fault of the install is asked again
        cache.put_dump(key, {"reply": reply, "dump": found.to_json() if found else None})
    return reply, found


def _planned(request: worker.Request, deadline: float | None = None) -> dict:
    """The reply for ``request`` compiled only as far as its buffer assignment: ``planned_bytes`` (what it
    allocates in HBM) and ``until_s`` (the time to it), or the compile's own reply when it ended first (a
    refusal made before it). Kept by the request's key, beside its full answer."""
    key = request.key() + "-planned"
    kept = cache.get(key)
    if kept is not None:
        cache.count(hit=True)
        return worker._named(kept, request.compiler)
    sizes: dict = {}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpukit-plan-") as folder:
        reply = worker.compile_dump(request, folder, deadline, until=lambda: _dump.planned(folder, sizes))
    if "early" in reply:
        reply = worker._named({"planned_bytes": int(reply["early"]), "until_s": time.monotonic() - began},
                              request.compiler)
    if "error" not in reply or is_memory_refusal(reply["error"]):
        cache.put(key, reply)
    return reply


def planned(reply: dict, target: Target, name: str = "step") -> TpuEstimate:
    """The :class:`TpuEstimate` of a compile stopped at its buffer assignment: the HBM it allocates held
    against the usable HBM (fits when within it; the code, a few tens of MB, is not counted yet)."""
    need, limit = int(reply["planned_bytes"]), int(target.usable_hbm_bytes)
    return TpuEstimate(target.name, FITS if need <= limit else TOO_BIG, limit, need, PLANNED,
                       compile_s=float(reply.get("until_s", 0.0)), **_answered_by(reply, target),
                       note=(f"{name}: the compiler's buffer assignment (the compile stopped there, before its "
                             "code generation): every HBM allocation but the program's code"))


def outcome(reply: dict, target: Target, name: str = "step", traced: Traced | None = None) -> TpuEstimate:
    """The :class:`TpuEstimate` of a worker's reply: the compiler's verdict (compiled is FITS whatever the sum
    of its buffers), the usable HBM its refusal names (else the chip's figure of it), the refusal read once
    (with its breakdown by kind and line), the compiler that answered."""
    named = _answered_by(reply, target)
    error = reply.get("error")
    if error is not None:
        refusal = parse(error) if is_memory_refusal(error) else None
        limit = (refusal.usable_bytes if refusal else None) or target.usable_hbm_bytes
        if refusal is None and not is_memory_refusal(error):
            return TpuEstimate(target.name, REJECTED, limit, compile_s=reply.get("compile_s"),
                               message=f"the TPU compiler rejected graph {name!r}: {error}", **named)
        need = refusal.used_bytes if refusal else None
        est = TpuEstimate(target.name, TOO_BIG, limit, need, NEED if need else UNKNOWN,
                          compile_s=float(reply.get("compile_s", 0.0)), message=error, refusal=refusal, **named)
        if refusal is not None and refusal.allocations:
            est = replace(est, memory=_memory.from_refusal(refusal, traced))
        return est
    total = (reply["arguments_bytes"] + reply["outputs_bytes"] + reply["temp_bytes"] + reply["code_bytes"]
             - reply["aliased_bytes"])
    peak = reply.get("peak_bytes")  # None from a compiler (or a cached answer) that did not report one
    chip = target.chip
    compute_s = reply["flops"] / chip.peak_bf16_flops
    memory_s = reply["bytes_accessed"] / chip.hbm_bytes_per_s
    return TpuEstimate(target.name, FITS, int(target.usable_hbm_bytes), int(peak or total), PEAK if peak else SUM,
                       reply["arguments_bytes"], reply["outputs_bytes"], reply["aliased_bytes"], reply["temp_bytes"],
                       reply["code_bytes"], float(reply["compile_s"]), float(reply["flops"]),
                       float(reply["bytes_accessed"]), max(compute_s, memory_s),
                       "compute" if compute_s >= memory_s else "memory", **named)


def _answered_by(reply: dict, target: Target) -> dict:
    """The fields of a :class:`TpuEstimate` that say who answered: the compiler, its note, the name it was
    asked by, and the chip's note."""
    found = reply.get("compiler") or {}
    return {"compiler": describe(found), "compiler_note": mismatch(found),
            "compiler_name": reply.get("compiler_name", ""), "chip_note": chip_note(target)}


def chip_note(target: Target) -> str | None:
    """What the per-chip figure is of where it is not plainly the chip's HBM (a v4's compile-only topology
    keeps half of each chip's 32 GiB back)."""
    usable, whole = target.usable_hbm_bytes, target.hbm_bytes
    if usable >= 0.9 * whole:
        return None
    return (f"the compiler's usable HBM on {target.name}'s compile-only topology is {usable / 2**30:.2f} GiB of "
            f"the chip's {whole / 2**30:.0f} GiB (it keeps the rest back here); a real {target.chip.name} may "
            "let a program use more")


FORWARD_ONLY = ("forward only: the step made no gradient and updated no parameter, so gradients and optimizer "
                "state are not counted (a training step needs loss.backward() and optimizer.step() inside it)")


def check(traced: Traced, name: str, by: str) -> str | None:
    """Say what the traced step does that its estimate cannot show: a read from the device (a warning), no
    backward or update (a warning when its model is in training mode). Returns the estimate's note: a
    forward only, or the optimizer's first step (its state made inside the graph)."""
    if traced.reads:
        warnings.warn(
            f"{by}: the step {name!r} read {traced.reads} value(s) from the device while it was traced (.item(), "
            "print(tensor), a Python if on a tensor): each read compiles and runs a graph of its own and waits for "
            "it, here and at every step on the TPU; the estimate is of the graph left at the end and counts "
            "none of that. Move the reads out of the step (tpukit.log(...) logs values without a sync).",
            TpukitWarning, stacklevel=3)
    if traced.trains is not False:
        return FIRST_STEP if traced.first_step else None
    if traced.train_mode:
        warnings.warn(f"{by}: the step {name!r} has no backward pass and no optimizer update (no parameter got a "
                      "gradient or changed) although its model is in training mode: it is estimated as a forward "
                      "pass, which needs far less HBM than training. Put loss.backward() and optimizer.step() "
                      "in the step, or call model.eval() to estimate inference.", TpukitWarning, stacklevel=3)
    return FORWARD_ONLY


def fsdp_chips(traced: Traced, tgt: Target, fsdp: bool) -> int:
    """How many chips to impose an FSDP layout over (1: none)."""
    if fsdp and traced.num_partitions > 1:
        raise ValueError("fsdp=True is for a one-device step; this one is already SPMD-partitioned (its own "
                         "shardings are compiled as they are): drop fsdp=True.")
    return tgt.chips if fsdp else 1


def name_of(step: Callable) -> str:
    """The step's name in the kit's answers: its qualified name."""
    return getattr(step, "__qualname__", None) or type(step).__name__


def begin(step: Callable, args: tuple, kwargs: dict, comp: Compiler, by: str) -> str:
    """What every public call does before it traces: the compiler checked (a clear error when it is
    missing) and its worker started (it loads jax and libtpu while the step is traced here), the step's lost
    weight ties tied again (a warning names them). Returns the step's name."""
    worker.require(comp)
    worker.warm(comp)
    retie(step, args, kwargs, by)
    return name_of(step)
