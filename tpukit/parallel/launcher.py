"""``launch()``: run multi-process (``xmp.spawn`` / ``torch_xla.launch`` style) code from a notebook.

This module is the launching process's side: the plan (modes, start methods), the refusals,
and the supervision of the replicas (their output to the cell with ``[rank N]`` prefixes, rank
0's step records and compile events to this process's listeners, results, failures, clean-up).
What runs in each replica is :mod:`tpukit.parallel._replica`; what both sides share (messages,
capture, prefixing, tracebacks) is :mod:`tpukit.parallel.remote`. Prefer SPMD (:mod:`tpukit.spmd`).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import sys
import time
import warnings
from typing import Any, Callable

from .. import _ipython, _xla, environment, runtime
from ..errors import LaunchError, TpukitWarning
from . import _replica, remote

log = logging.getLogger("tpukit")

_TERMINATE_GRACE = 5.0  # seconds a replica gets to exit after SIGTERM before SIGKILL
_EXIT_GRACE = 10.0  # seconds a replica that already returned gets to exit on its own
_DRAIN_GRACE = 2.0  # seconds to collect output after the last replica exited
_Plan = _replica.Plan  # what the replicas are told too


def _device_kind() -> str:
    """The PJRT device type the runtime will use ('CPU', 'TPU', ...); never starts it."""
    return runtime.resolve_device(runtime.Request(), environment.inspect())


def _default_start_method() -> str:
    """'fork' in notebooks and interactive sessions (their functions cannot be pickled by
    reference), 'spawn' in scripts (a clean interpreter per replica)."""
    main = sys.modules.get("__main__")
    return "fork" if _ipython.in_kernel() or not getattr(main, "__file__", None) else "spawn"


def _plan(nprocs: int | None, debug_single_process: bool, start_method: str | None) -> _Plan:
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ValueError(f"nprocs={nprocs!r} must be None (one replica per chip) or a positive int.")
    if start_method not in (None, "fork", "spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r} must be None (automatic), 'fork', 'spawn' or 'forkserver'.")
    kind = _device_kind()
    if debug_single_process:
        return _Plan("in-process", 1, None, kind)
    method = start_method or _default_start_method()
    if nprocs == 1 or (kind == "CPU" and nprocs is None):
        return _Plan("single", 1, method, kind)
    if kind == "CPU":
        return _Plan("independent", nprocs, method, kind)
    if nprocs is None:
        return _Plan("replicated", _xla.local_process_count(), method, kind)
    raise ValueError(
        f"nprocs={nprocs} is not supported on {kind}: torch_xla runs one process per chip (nprocs=None) or a single "
        f"replica (nprocs=1). To use fewer chips, limit the visible chips in the environment before launching.")


def _refuse_if_unsafe(plan: _Plan) -> None:
    # SPMD first: with SPMD on, no launch mode can work, so do not suggest one.
    if _xla.is_spmd():
        raise LaunchError(
            "tpukit.launch() runs multi-process (xmp.spawn-style) code, but SPMD mode is on in this process "
            "(tpukit.setup(spmd=True) or XLA_USE_SPMD=1) and the two cannot be combined. Use tpukit.mesh() and "
            "shard_batch() to train on all cores with SPMD, or restart the kernel without spmd=True to use launch().")
    if plan.mode != "in-process" and _xla.runtime_initialized():
        who = ("tpukit.setup() started it" if runtime.current() is not None
               else "something already used the device, e.g. torch_xla.device() or .to('xla')")
        raise LaunchError(
            f"tpukit.launch() cannot start replicas: the XLA runtime is already running in this kernel ({who}), "
            "and child processes cannot use a device their parent holds. Restart the kernel and call "
            "tpukit.launch(...) before anything touches the device (or pass debug_single_process=True).")


def launch(fn: Callable[..., Any], *args: Any, nprocs: int | None = None, debug_single_process: bool = False,
           start_method: str | None = None) -> Any:
    """Run ``fn(index, *args)`` once per replica, like ``torch_xla.launch``; return rank 0's value.

    Call it before anything in the kernel touches the device: the parent never starts the XLA
    runtime (each replica starts its own), and ``launch`` refuses, starting nothing, when the
    runtime is already running here.

    * Children are forked in notebooks and interactive sessions (``fn`` may be defined in a
      cell) and spawned in scripts (``fn`` must be importable; guard the script with
      ``if __name__ == "__main__":``); ``start_method`` overrides.
    * Each replica's stdout/stderr (including C-level output) is streamed to the cell, prefixed
      ``[rank N]`` (N = process index on this host; threads of one process share it). A
      replica's exception is re-raised here as ``LaunchError`` carrying its traceback; the other
      replicas are stopped. On error or KeyboardInterrupt every child is terminated, killed if
      needed, and reaped; children also die if this process dies.
    * On TPU, ``nprocs=None`` starts one process per chip with torch_xla's own topology set-up
      and one thread per device (``xmp.spawn`` semantics: ``fn(global_ordinal, *args)``);
      ``nprocs=1`` runs one replica on one chip.
    * XLA:CPU limitation: collectives across replicas are not supported on CPU (they hang, then
      abort). ``nprocs=None``/``1`` runs one real replica in a child; ``nprocs=N>1`` starts N
      *independent* single-device processes (``fn(i, *args)``, ``rank()`` = i) with no
      collectives between them, to exercise the plumbing; it warns. Use SPMD (``tpukit.mesh``)
      for multi-core training on CPU.
    * ``debug_single_process=True`` runs one replica (index 0) in this process, without prefixes
      or wrapping, so debuggers and ``%debug`` work; it starts the runtime here, so later
      launches in this kernel are refused.

    Only rank 0 should write files (``tpukit.checkpoint.save`` does so); guard your own writes
    with ``if tpukit.rank() == 0``. The return value must be picklable (return CPU data, e.g.
    ``t.cpu()``). On a multi-host pod, each host's call returns its lowest local rank's value.
    """
    plan = _plan(nprocs, debug_single_process, start_method)
    _refuse_if_unsafe(plan)
    if plan.mode == "in-process":
        return _xla.run_single_process(fn, args)
    if plan.mode == "independent":
        warnings.warn(
            f"launch(nprocs={plan.nprocs}) on XLA:CPU starts {plan.nprocs} independent single-device processes: "
            "collectives between replicas do not work on CPU, so they do not train together. Use tpukit.mesh() "
            "(SPMD) for multi-core training on CPU.", TpukitWarning, stacklevel=2)
    return _Launcher(plan, fn, args).run()


# --------------------------------------------------------------------------- launcher: parent side

class _Launcher:
    """Starts the replicas, forwards their output, collects results, cleans up."""

    def __init__(self, plan: _Plan, fn: Callable[..., Any], args: tuple):
        self.plan, self.fn, self.args = plan, fn, args
        self.procs: list = []
        self.streams: dict[int, tuple[int, str]] = {}  # fd -> (rank, target stream name)
        self.lines = remote.Prefixer("rank")
        self.results: dict[int, Any] = {}  # rank -> result connection (until it answers)

    # output forwarding ---------------------------------------------------
    def _end_stream(self, fd: int) -> None:
        rank_, name = self.streams.pop(fd)
        self.lines.write(rank_, name, b"", final=True)
        os.close(fd)

    def _read_stream(self, fd: int) -> bool:
        """Forward what is available on ``fd``; False at end of file."""
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._end_stream(fd)
            return False
        self.lines.write(*self.streams[fd], data)
        return True

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.streams and (left := deadline - time.monotonic()) > 0:
            for fd in multiprocessing.connection.wait(list(self.streams), timeout=left):
                self._read_stream(fd)
        for fd in list(self.streams):
            self._end_stream(fd)

    # start and stop --------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context(self.plan.start_method)
        sys.stdout.flush()
        sys.stderr.flush()
        for r in range(self.plan.nprocs):
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_replica.main, name=f"tpukit-replica-{r}",
                               args=(r, self.plan, self.fn, self.args, out_w, err_w, res_w, os.getpid()))
            try:
                with warnings.catch_warnings():
                    # Python >= 3.12 warns about forking a multi-threaded process; a
                    # notebook kernel always has threads and the child starts clean.
                    warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
                    proc.start()
            except Exception as exc:
                for conn in (out_r, err_r, res_r):
                    conn.close()
                how = ("define it at the top level of an importable module, or use start_method='fork'"
                       if self.plan.start_method != "fork" else "see the error above")
                raise LaunchError(f"could not start replica {r} with start_method={self.plan.start_method!r}: "
                                  f"{type(exc).__name__}: {exc}. For 'spawn' the function and its arguments must be "
                                  f"picklable; {how}.") from None
            finally:
                for conn in (out_w, err_w, res_w):
                    conn.close()
            self.procs.append(proc)
            for conn, name in ((out_r, "stdout"), (err_r, "stderr")):
                fd = os.dup(conn.fileno())
                conn.close()
                self.streams[fd] = (r, name)
            self.results[r] = res_r

    def _stop(self) -> None:
        """Terminate, then kill, then reap every child still running; safe to call twice."""
        try:
            live = [p for p in self.procs if p.is_alive()]
            for p in live:
                p.terminate()
            deadline = time.monotonic() + _TERMINATE_GRACE
            for p in live:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:  # even if interrupted again: no child may survive
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            for p in self.procs:
                p.join(5)

    def _close(self) -> None:
        for conn in self.results.values():
            conn.close()
        self.results.clear()
        for fd in list(self.streams):
            os.close(fd)
        self.streams.clear()
        self.lines.flush()  # an interrupted run: what its last lines began is still shown

    # supervision -----------------------------------------------------------
    def _failure(self, r: int, msg: remote.Message) -> LaunchError:
        others = "; the other replicas were stopped" if self.plan.nprocs > 1 else ""
        if not msg.traceback:  # not an exception in fn: the summary says what went wrong
            stopped = " The other replicas were stopped." if others else ""
            return LaunchError(f"replica rank {r} failed: {msg.summary}.{stopped}")
        return LaunchError(f"replica rank {r} failed with {msg.summary}{others}. Its traceback:\n\n"
                           f"{remote.with_sources(msg.traceback).rstrip()}")

    def _died(self, r: int) -> LaunchError:
        code = self.procs[r].exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        stopped = " The other replicas were stopped." if self.plan.nprocs > 1 else ""
        return LaunchError(f"replica rank {r} {how} without returning a result (a crash, os._exit or out of memory); "
                           f"its output above may say why.{stopped}")

    def _receive(self, r: int) -> LaunchError | None:
        conn = self.results[r]
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is not None and msg.kind in (remote.STEP, remote.COMPILE):  # rank 0's records
            remote.publish(msg)
            return None
        self.results.pop(r)
        conn.close()
        if msg is None:
            self.procs[r].join(_TERMINATE_GRACE)
            return self._died(r)
        if msg.kind == remote.ERROR:
            return self._failure(r, msg)
        if msg.primary:
            self.value = msg.value
        return None

    def run(self) -> Any:
        self.value = None
        try:
            self._start()
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
            failure: LaunchError | None = None
            while self.results and failure is None:
                waiting = list(self.streams) + list(self.results.values()) + list(sentinels)
                for obj in multiprocessing.connection.wait(waiting, timeout=1.0):
                    if isinstance(obj, int) and obj in self.streams:
                        self._read_stream(obj)
                    elif isinstance(obj, int) and obj in sentinels:
                        r = sentinels.pop(obj)
                        if r in self.results and not self.results[r].poll(0):
                            self.results.pop(r).close()
                            self.procs[r].join()
                            failure = failure or self._died(r)
                    else:
                        r = next(k for k, c in self.results.items() if c is obj)
                        failure = self._receive(r) or failure
                    if failure is not None:
                        break
            if failure is not None:
                self._stop()
                self._drain(_DRAIN_GRACE)
                raise failure
            deadline = time.monotonic() + _EXIT_GRACE
            for p in self.procs:  # every replica answered; let them exit on their own
                while p.is_alive() and time.monotonic() < deadline and self.streams:
                    for fd in multiprocessing.connection.wait(list(self.streams) + [p.sentinel], timeout=0.2):
                        if fd in self.streams:
                            self._read_stream(fd)
                p.join(max(0.0, deadline - time.monotonic()))
            if any(p.is_alive() for p in self.procs):
                log.debug("tpukit.launch: replicas returned but did not exit within %.0fs; terminating them",
                          _EXIT_GRACE)
            self._stop()
            self._drain(_DRAIN_GRACE)
            return self.value
        finally:
            self._stop()
            self._close()
