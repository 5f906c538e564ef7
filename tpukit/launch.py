"""``launch()``: run multi-process (``xmp.spawn`` / ``torch_xla.launch`` style) code from a notebook.

Plans, start methods, output forwarding with ``[rank N]`` prefixes, and forwarding of rank 0's
step records and compile events to this process's listeners. Prefer SPMD (:mod:`tpukit.spmd`).
"""

from __future__ import annotations

import io
import logging
import multiprocessing.connection
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from . import _ipython, _xla, environment, events, runtime
from .errors import LaunchError, TpukitWarning

log = logging.getLogger("tpukit")

_TERMINATE_GRACE = 5.0  # seconds a replica gets to exit after SIGTERM before SIGKILL
_EXIT_GRACE = 10.0  # seconds a replica that already returned gets to exit on its own
_DRAIN_GRACE = 2.0  # seconds to collect output after the last replica exited


@dataclass(frozen=True)
class _Plan:
    """How ``launch`` starts replicas (decided before anything starts)."""

    mode: str  # "in-process" | "single" | "replicated" | "independent"
    nprocs: int
    start_method: str | None
    device_type: str


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


# --------------------------------------------------------------------------- launcher: child side

_INHERITED_STREAMS: list = []
_OWN_FILES = {os.path.abspath(__file__).rstrip("c"), os.path.abspath(_xla.__file__).rstrip("c")}


def _redirect_output(out_w: Any, err_w: Any) -> None:
    """Point fds 1/2 and sys.stdout/sys.stderr of this child at the parent's pipes."""
    # Keep the inherited stream objects alive: collecting them could flush the
    # parent's buffered output (or a notebook's zmq stream) into our pipes.
    _INHERITED_STREAMS.append((sys.stdout, sys.stderr))
    for fd, conn in ((1, out_w), (2, err_w)):
        os.dup2(conn.fileno(), fd)
        conn.close()

    def stream(fd: int):
        return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                line_buffering=True, write_through=True)

    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = stream(1), stream(2)
    # Logging handlers created in the parent (e.g. a notebook's logging.basicConfig())
    # hold the parent's stream objects: point them at ours so their lines get the prefix.
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if handler.stream is old_err:
                handler.setStream(sys.stderr)
            elif handler.stream is old_out:
                handler.setStream(sys.stdout)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child when the launching process dies (best effort)."""
    try:
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_PLUMBING = (os.sep + os.path.join("torch_xla", "_internal") + os.sep,
             os.sep + os.path.join("concurrent", "futures") + os.sep,
             os.sep + "threading.py")


def _user_traceback(exc: BaseException) -> str:
    """The exception's traceback without the launcher's own leading frames (tpukit, torch_xla's
    replica set-up, thread pools), so it starts where the user's function does."""
    tb = exc.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if path not in _OWN_FILES and not any(p in path for p in _PLUMBING):
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _replica_main(rank_: int, plan: _Plan, fn: Callable[..., Any], args: tuple, out_w: Any, err_w: Any,
                  res_w: Any, parent_pid: int) -> None:
    """Entry point of one replica process; sends ('ok', has_rank0, value) or ('error', ...) back."""
    _redirect_output(out_w, err_w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    _die_with_parent()
    if plan.start_method != "forkserver" and os.getppid() != parent_pid:  # parent died before prctl
        os._exit(1)
    forwarder = events.add_listener(_RecordForwarder(res_w)) if rank_ == 0 else None
    try:
        if plan.mode == "independent":
            os.environ[runtime.RANK_ENV] = str(rank_)
            values = {rank_: fn(rank_, *args)}
        elif plan.mode == "single":
            values = {0: _xla.run_single_process(fn, args)}
        else:
            values = _xla.run_replica_process(rank_, plan.nprocs, fn, args)
        low = min(values) if values else None
        msg: tuple = ("ok", low == 0, values.get(0)) if low == 0 else ("ok", False, None)
    except SystemExit as exc:
        if exc.code in (None, 0):
            msg = ("ok", rank_ == 0, None)
        else:
            msg = ("error", f"SystemExit({exc.code!r})", _user_traceback(exc))
    except BaseException as exc:  # report everything, including KeyboardInterrupt in the child
        msg = ("error", f"{type(exc).__name__}: {exc}", _user_traceback(exc))
    if forwarder is not None:
        events.remove_listener(forwarder)
    try:
        res_w.send(msg)
    except Exception as exc:  # an unpicklable return value
        res_w.send(("error", None,
                    f"it returned a {type(msg[2]).__name__} that cannot be sent back to the launching process "
                    f"({type(exc).__name__}: {exc}); return plain Python data or CPU tensors (t.cpu())."))
    finally:
        res_w.close()
        sys.stdout.flush()
        sys.stderr.flush()


class _RecordForwarder:
    """Listener in replica rank 0 that sends its step records and compile events to the launching
    process's listeners (e.g. the notebook's dashboard); with one thread per device, only ordinal 0's."""

    def __init__(self, conn: Any):
        self.conn, self.lock = conn, threading.Lock()

    def _send(self, kind: str, record: Any) -> None:
        if runtime.rank() == 0:
            with self.lock:
                self.conn.send(("record", kind, record))

    def on_step(self, record: Any) -> None:
        self._send("on_step", record)

    def on_compile(self, event: Any) -> None:
        self._send("on_compile", event)


# --------------------------------------------------------------------------- launcher: parent side

_LINE = re.compile(r"(\r\n|\n|\r)")


class _Launcher:
    """Starts the replicas, forwards their output, collects results, cleans up."""

    def __init__(self, plan: _Plan, fn: Callable[..., Any], args: tuple):
        self.plan, self.fn, self.args = plan, fn, args
        self.procs: list = []
        self.streams: dict[int, tuple[int, Any]] = {}  # fd -> (rank, target stream name)
        self.partial: dict[int, str] = {}
        self.results: dict[int, Any] = {}  # rank -> result connection (until it answers)

    # output forwarding ---------------------------------------------------
    def _emit(self, fd: int, text: str, final: bool = False) -> None:
        rank_, name = self.streams[fd]
        text = self.partial.pop(fd, "") + text
        parts = _LINE.split(text)
        out = []
        for i in range(0, len(parts) - 1, 2):
            term = "\n" if parts[i + 1] == "\r\n" else parts[i + 1]
            out.append(f"[rank {rank_}] {parts[i]}{term}")
        rest = parts[-1]
        if rest and final:
            out.append(f"[rank {rank_}] {rest}\n")
        elif rest:
            self.partial[fd] = rest
        if out:
            target = getattr(sys, name)
            target.write("".join(out))
            target.flush()

    def _read_stream(self, fd: int) -> bool:
        """Forward what is available on ``fd``; False at end of file."""
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            self._emit(fd, "", final=True)
            del self.streams[fd]
            os.close(fd)
            return False
        self._emit(fd, data.decode("utf-8", errors="replace"))
        return True

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.streams and (left := deadline - time.monotonic()) > 0:
            for fd in multiprocessing.connection.wait(list(self.streams), timeout=left):
                self._read_stream(fd)
        for fd in list(self.streams):
            self._emit(fd, "", final=True)
            del self.streams[fd]
            os.close(fd)

    # start and stop --------------------------------------------------------
    def _start(self) -> None:
        ctx = multiprocessing.get_context(self.plan.start_method)
        sys.stdout.flush()
        sys.stderr.flush()
        for r in range(self.plan.nprocs):
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_replica_main, name=f"tpukit-replica-{r}",
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

    # supervision -----------------------------------------------------------
    def _failure(self, r: int, summary: str | None, detail: str) -> LaunchError:
        others = "; the other replicas were stopped" if self.plan.nprocs > 1 else ""
        if summary is None:  # not an exception in fn: detail says what went wrong
            stopped = " The other replicas were stopped." if others else ""
            return LaunchError(f"replica rank {r} failed: {detail}{stopped}")
        return LaunchError(f"replica rank {r} failed with {summary}{others}. Its traceback:\n\n{detail.rstrip()}")

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
        if msg is not None and msg[0] == "record":  # rank 0's step record / compile event
            events.call(msg[1], msg[2])
            return None
        self.results.pop(r)
        conn.close()
        if msg is None:
            self.procs[r].join(_TERMINATE_GRACE)
            return self._died(r)
        if msg[0] == "error":
            return self._failure(r, msg[1], msg[2])
        if msg[1]:
            self.value = msg[2]
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
