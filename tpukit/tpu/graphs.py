"""Compile graphs the kit already has (HLO module protos) for the target, off the training thread.

The compile pipeline calls :func:`compile_graph_async` for every graph it
records, with the HLO module proto of the compile; the answer (a
:class:`TpuEstimate`) arrives on a future, computed by the one worker process,
so the training thread never waits for the TPU compiler. Neither function
raises for what the compiler says: a refusal or a dead worker is a record with
``fits=False`` and the reason in ``message``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

from . import worker
from .compilers import Compiler, compiler as _compiler
from .estimate import _resolve
from .record import TpuEstimate, from_reply, refused
from .targets import Target, target as _target

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
    tgt = _target(target)
    comp = _compiler(compiler)
    worker.require(comp)
    try:
        reply = worker.compile(worker.Request(bytes(hlo_module_proto), tgt, int(num_partitions), compiler=comp))
        if "error" in reply and not reply.get("memory"):
            return refused(tgt, f"the TPU compiler rejected graph {name!r}: {reply['error']}")
        return from_reply(reply, tgt, name)
    except worker.TpuCompilerMissingError:
        raise
    except Exception as exc:  # a dead worker or a broken module: a record, never an exception in the caller
        log.warning("tpukit: TPU estimate of graph %r for %s failed: %s", name, tgt.name, exc)
        return refused(tgt, f"{type(exc).__name__}: {exc}")


def compile_graph_async(hlo_module_proto: bytes, target: str | Target, num_partitions: int = 1,
                        name: str = "graph", compiler: str | Compiler | None = None) -> Future:
    """:func:`compile_graph` on the background thread: returns a ``Future`` of the :class:`TpuEstimate`.

    One background thread feeds the one worker process, so graphs are compiled in the order they come.
    Call ``future.add_done_callback(fn)`` to publish the answer; ``future.result()`` never raises for
    what the compiler said (only for an unknown target or a missing TPU compiler, as compile_graph does).
    """
    global _POOL
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
    tgt = _resolve(target)
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
