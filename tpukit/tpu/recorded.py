"""Compile graphs the kit recorded (HLO module protos) for the target, off the training thread.

The target's follower (:mod:`.follow`) calls :func:`compile_graph_async` for every
graph it hears of, with the HLO module proto of the compile; the answer (a
:class:`TpuEstimate`) arrives on a future, computed by the worker process, so the
training thread never waits for the TPU compiler. Neither function raises for
what the compiler says: a refusal is a record with its status, a dead worker one
with status ``failed``, the reason in ``message``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from .ask import ask, graph, resolve
from .compiler import worker
from .compiler.pins import Compiler
from .compiler.targets import Target
from .outcome import FAILED, TpuEstimate

log = logging.getLogger("tpukit")
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def compile_graph(hlo_module_proto: bytes, target: str | Target, num_partitions: int = 1,
                  name: str = "graph", compiler: str | Compiler | None = None) -> TpuEstimate:
    """Compile one HLO module (``HloModuleProto`` bytes) for ``target``; the compiler's answer as a record.

    Thread-safe and cached (graph hash + target + versions). Raises only for a
    bad call (an unknown target: ``TargetError``; no TPU compiler installed:
    ``TpuCompilerMissingError``, check :func:`tpukit.tpu.available` first);
    anything the compiler or its worker says comes back as ``fits=False`` with
    the reason in ``message``. Donation is not known from a bare module, so
    ``aliased_bytes`` is what the module itself declares. ``compiler``: which TPU compiler answers (see
    :func:`tpukit.estimate`; default: the runtime's).
    """
    tgt, comp = resolve(target, compiler)
    worker.require(comp)
    try:
        return ask(graph(hlo_module_proto, num_partitions), tgt, comp, name)
    except worker.TpuCompilerMissingError:
        raise
    except Exception as exc:  # a dead worker or a broken module: a record, never an exception in the caller
        log.warning("tpukit: TPU estimate of graph %r for %s failed: %s", name, tgt.name, exc)
        return TpuEstimate(tgt.name, FAILED, tgt.usable_hbm_bytes, message=f"{type(exc).__name__}: {exc}",
                           compiler_name=comp.name)


def compile_graph_async(hlo_module_proto: bytes, target: str | Target, num_partitions: int = 1,
                        name: str = "graph", compiler: str | Compiler | None = None) -> Future:
    """:func:`compile_graph` on the background thread: returns a ``Future`` of the :class:`TpuEstimate`.

    One background thread feeds the one worker process, so graphs are compiled in the order they come.
    Call ``future.add_done_callback(fn)`` to publish the answer; ``future.result()`` never raises for
    what the compiler said (only for an unknown target or a missing TPU compiler, as compile_graph does).
    """
    global _POOL
    if not isinstance(target, Target) or not isinstance(compiler, Compiler):  # names fail here, not on the thread
        target, compiler = resolve(target, compiler)
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpukit-tpu")
    return _POOL.submit(compile_graph, hlo_module_proto, target, num_partitions, name, compiler)


def bucket_costs(step_for_length: Callable[[int], object], lengths: Iterable[int],
                 target: str | Target | None = None) -> dict:
    """Costs for ``tpukit.data.suggest_buckets`` from the target's TPU compiler instead of this CPU.

    ``step_for_length(n)`` returns a :class:`TpuEstimate` for one step at sequence
    length ``n`` (e.g. ``lambda n: tpukit.estimate(step, make_batch(n), target=t)``).
    Returns ``{"compile_s": ..., "step_time": {length: seconds}}``: the mean TPU
    compile time and each length's roofline floor, to pass as
    ``suggest_buckets(lengths, batch_size, **bucket_costs(...))``.
    """
    tgt, _ = resolve(target)
    times, compiles = {}, []
    for n in sorted(set(int(x) for x in lengths)):
        est = step_for_length(n)
        if not isinstance(est, TpuEstimate):
            raise TypeError(f"step_for_length({n}) returned {type(est).__name__}, not a TpuEstimate.")
        if not est.fits:
            raise ValueError(f"a step at length {n} does not fit on {tgt.name}: {est.message or 'HBM exceeded'}")
        times[n] = est.step_s_min
        compiles.append(est.compile_s)
    if not times:
        raise ValueError("bucket_costs needs at least one length.")
    return {"compile_s": sum(compiles) / len(compiles), "step_time": times}
