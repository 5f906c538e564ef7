"""``run_on_slice()``: run a notebook's training function on every host of a TPU slice, through Ray.

The kit does not manage a cluster: Ray does (``ray.util.tpu``: a ``SlicePlacementGroup`` reserves
every host of one slice, ``run_on_slice`` starts one task per host, pinned to it). This module
checks everything that can be checked before anything starts (the function pickles, the topology
exists, and through :mod:`~tpukit.parallel.raycluster` a cluster is reachable and has a whole idle slice),
reserves the slice, starts :func:`~tpukit.parallel.hosts.slice_host` on each host, and supervises: each
host's output reaches the cell prefixed ``[host N]``, its step records and compile events reach
this process's listeners (the dashboard), host 0's return value comes back (all of it as
:class:`~tpukit.parallel.remote.Message` objects). A failing host, a crash or Ctrl-C cancels every task at
once (before anything else is asked of the cluster, such as a dead host's last output) and releases
the slice; nothing is left running on the cluster. Nothing runs before the hosts' tasks start but
the reservation: a small task would need a new Ray worker, which a busy host may take minutes to
start. Ray is imported lazily.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

from .. import events
from ..errors import SliceError
from . import hosts, raycluster, remote

log = logging.getLogger("tpukit")

_WAIT_S = 0.5          # longest wait for a host's next message (Ctrl-C is seen at least this often)
_CANCEL_GRACE_S = 30.0  # how long cancelled tasks get to end before the slice is released anyway
_IDENTIFY_S = 60.0     # how long Ray's task table may take to record which node a task that died ran on (15 s was too
                      # short once, in CI under two test lanes: the error said "a host")
_NODE_TASK_S = 120.0   # how long a small task on one host may take (a dead host's last output, which host a
                       # dead task ran on): a new Ray worker on a busy host takes that long. Asked only after
                       # the other hosts' tasks were cancelled.
_REMOTE: dict[str, Any] = {}  # the Ray remote function, made once per process


def _pickle(ray: Any, fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return ray.cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise SliceError(f"{name} or its arguments cannot be pickled, so they cannot be sent to the hosts "
                         f"({type(exc).__name__}: {exc}). Pass data, not open files, locks, threads or device tensors, "
                         "and create those inside the function (it runs on each host).") from None


def _remote(ray: Any, fn: Callable, **options: Any) -> Any:
    """``fn`` as a Ray task, made once per process. Every one runs in a fresh worker process that exits
    after it (max_calls=1: a host's runtime starts with this run's environment and releases the TPU
    when it exits) and is never retried."""
    task = _REMOTE.get(fn.__name__)
    if task is None:
        task = _REMOTE[fn.__name__] = ray.remote(max_calls=1, max_retries=0, **options)(fn)
    return task


class _Run:
    """One run_on_slice call: reserve, start, supervise, clean up."""

    def __init__(self, ray: Any, payload: bytes, topology: str, version: str, count: int, timeout: float):
        self.ray, self.payload, self.topology, self.version = ray, payload, topology, version
        self.count, self.timeout = count, timeout
        self.pending: dict[Any, int | None] = {}  # task generator -> host index (None until it said hello)
        self.cancelled: set = set()  # generators cancelled (they stay pending until their stream ends)
        self.finished: set = set()  # generators whose host sent its result
        self.hello: dict[Any, tuple] = {}  # generator -> (host, pid, node id)
        self.sent: dict[tuple[int, str], int] = {}  # (host, stream) -> bytes of output received
        self.lines = remote.Prefixer("host")
        self.value: Any = None

    def run(self, dashboard: bool) -> Any:
        from ray.util import tpu

        view = None
        run = uuid.uuid4().hex  # host 0 publishes the group's port under it (hosts.GROUP_PORT_KEY)
        handle = raycluster.reserve(self.ray, self.topology, self.version, self.timeout)
        try:
            plan = dict(raycluster.slice_plan(self.ray, handle, self.count), run=run)
            if dashboard:
                view = events.open_dashboard(hosts=self.count)
            try:
                gens = tpu.run_on_slice(_remote(self.ray, hosts.slice_host, num_returns="streaming"), self.payload,
                                        plan, tpu_slice=handle, pg_ready_timeout_s=self.timeout)
            except Exception as exc:
                raise SliceError(f"the {self.topology} slice's hosts did not become ready within {self.timeout:g} s: "
                                 f"{type(exc).__name__}: {exc}") from None
            self.pending = dict.fromkeys(gens)
            try:
                self._supervise()
            except KeyboardInterrupt:
                raise KeyboardInterrupt(f"run_on_slice was interrupted: the tasks on the {self.count} hosts were "
                                        "cancelled and the slice was released") from None
            return self.value
        finally:
            try:
                self._stop()
            finally:
                raycluster.release(handle)
                self._forget(run)
                self.lines.flush()
                if view is not None:
                    view.close()

    def _supervise(self) -> None:
        ray = self.ray
        while self.pending:
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=_WAIT_S)
            if ready and len(self.pending) > 1:
                ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
            for gen in ready:
                self._receive(gen)

    def _receive(self, gen: Any) -> None:
        finished = gen in self.finished
        try:
            ref = next(gen)
        except StopIteration:
            host = self.pending.pop(gen)
            if finished:
                return
            raise SliceError(f"host {host}'s task ended without a result{self._others()}.")
        try:
            msg = self.ray.get(ref)
        except Exception as exc:  # the task itself failed: its process died, or the node is no slice host
            host = self.pending.pop(gen)
            if finished:  # its process exited (max_calls=1) as Ray recorded the end: the result is in
                return
            others = self._others()
            self._cancel()  # the others at once: which host it was and its last words may take a while
            if host is None:  # it died before its hello reached the notebook: Ray's task table knows it
                host = self._identify(gen)
            who = f"host {host}" if host is not None else "a host"
            cause = getattr(exc, "cause", None)  # a RayTaskError: the task's own code raised
            if isinstance(cause, BaseException):
                raise SliceError(f"{who}'s task failed: {type(cause).__name__}: {cause}{others}.") from None
            self._last_words(gen)
            raise SliceError(f"{who}'s task died without a result ({type(exc).__name__}: {str(exc).strip()}): a "
                             f"crash, os._exit or out of memory; its output above may say why{others}.") from None
        if msg.kind == remote.HELLO:
            self.pending[gen] = msg.source
            self.hello[gen] = (msg.source, msg.pid, msg.node)
        elif msg.kind == remote.OUTPUT:
            self.lines.write(msg.source, msg.stream, msg.text)
            self.sent[(msg.source, msg.stream)] = msg.sent
        elif msg.kind in (remote.STEP, remote.COMPILE):
            remote.publish(msg)
        elif msg.kind == remote.RESULT:  # the task still has to end: it stays pending until its stream does
            self.finished.add(gen)
            if msg.primary:
                self.value = self.ray.cloudpickle.loads(msg.value)
        elif msg.kind == remote.ERROR:  # its task ends with its stream; _stop waits for that
            self.lines.flush()
            detail = f". Its traceback:\n\n{remote.with_sources(msg.traceback).rstrip()}" if msg.traceback else "."
            raise SliceError(f"host {msg.source} failed: {msg.summary}{self._others(gen)}{detail}")

    def _identify(self, gen: Any) -> int | None:
        """The host index, pid and node of a task whose hello never arrived (its process died at once,
        before Ray delivered what it had yielded), from Ray's task table and the node's worker-id label;
        kept as its hello so its last words can be read. None when Ray cannot say."""
        try:
            from ray.util.state import get_task

            # Ray records a task's events a moment after they happen (later on a busy machine): until
            # then its table has no entry for it, or one without its node.
            deadline = time.monotonic() + _IDENTIFY_S
            while True:
                task = get_task(gen.completed(), timeout=int(_NODE_TASK_S))
                if (task is not None and task.node_id) or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
            labels = next(n.get("Labels") or {} for n in self.ray.nodes() if n.get("NodeID") == task.node_id)
            host = int(labels[hosts.WORKER_ID_LABEL])
        except Exception as exc:  # no state API, the node is gone, no label: the message says "a host"
            log.debug("tpukit.run_on_slice: could not tell which host a dead task ran on: %s", exc)
            return None
        self.hello[gen] = (host, task.worker_pid, task.node_id)
        return host

    def _on_node(self, fn: Callable, node: str, *args: Any, timeout: float = _NODE_TASK_S) -> Any:
        """``fn(*args)`` run by Ray on node ``node`` (no CPU reserved: the slice holds them); its value."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = _remote(self.ray, fn, num_cpus=0)
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
        try:
            return self.ray.get(ref, timeout=timeout)
        except Exception:
            try:
                self.ray.cancel(ref, force=True)  # nothing left running on the node
            except Exception:
                pass
            raise

    def _last_words(self, gen: Any) -> None:
        """Show what a host that died wrote but could not send: read on its node from its output files."""
        if gen not in self.hello:
            return
        host, pid, node = self.hello[gen]
        offsets = {stream: self.sent.get((host, stream), 0) for stream in ("stdout", "stderr")}
        try:
            for stream, text in self._on_node(hosts.read_output, node, pid, offsets).items():
                self.lines.write(host, stream, text)
        except Exception as exc:  # the node itself may be gone
            log.debug("tpukit.run_on_slice: could not read host %s's last output: %s", host, exc)
        self.lines.flush()

    def _others(self, failed: Any = None) -> str:
        running = [g for g in self.pending if g is not failed and g not in self.finished]
        return "; the other hosts' tasks were cancelled" if running else ""

    def _cancel(self) -> None:
        """Cancel every task still running, without waiting (force: a host stuck in a collective cannot be
        asked nicely)."""
        for gen in self.pending:
            if gen not in self.cancelled:
                self.cancelled.add(gen)
                try:
                    self.ray.cancel(gen, force=True)
                except Exception as exc:
                    log.debug("tpukit.run_on_slice: cancelling a host task failed: %s", exc)

    def _stop(self) -> None:
        """Cancel every task still running and wait until each has ended, so that nothing is left
        running when this returns (force-cancelled tasks end within a second or so)."""
        ray = self.ray
        self._cancel()
        left = list(self.pending)
        self.pending = {}
        deadline = time.monotonic() + _CANCEL_GRACE_S
        while left and time.monotonic() < deadline:
            ready, _ = ray.wait(left, num_returns=1, timeout=1.0)
            for gen in ready:
                try:
                    ray.get(next(gen))  # a message sent before the cancel took effect: drop it
                except StopIteration:
                    left.remove(gen)
                except Exception:  # TaskCancelledError / WorkerCrashedError: the task is over
                    left.remove(gen)
        if left:
            log.warning("tpukit.run_on_slice: %d host task(s) had not ended %.0f s after being cancelled",
                        len(left), _CANCEL_GRACE_S)

    def _forget(self, run: str) -> None:
        """Remove the group's port host 0 published for this run (if it started)."""
        try:
            raycluster.unpublish(hosts.GROUP_PORT_KEY.format(run=run))
        except Exception as exc:
            log.debug("tpukit.run_on_slice: could not remove the run's group port from Ray: %s", exc)


def run_on_slice(fn: Callable[..., Any], *args: Any, topology: str = "4x4", accelerator_version: str = "v5e",
                 address: str | None = None, dashboard: bool = False, timeout: float = 120.0, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on every host of a TPU slice of a Ray cluster; return host 0's value.

    The notebook connects first (``ray.init(address="HOST0:6379")``, or pass ``address=``; a
    connection made here is closed at the end). Before anything starts, a clear
    :class:`~tpukit.SliceError` says what to do when ``fn`` or its arguments do not pickle, when
    ``topology`` does not exist for ``accelerator_version`` (``"v5e"``, ``"v6e"``, ``"v5p"``, ...),
    when no cluster is reachable, or when it has no complete idle slice of that shape.

    Each host runs ``fn`` in a fresh process with the environment multi-host SPMD needs
    (``tpukit.hosts.host_env``): ``tpukit.hosts.current()`` tells it its host index and count,
    ``tpukit.rank()`` is its host index, torch_xla's ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES`` and
    ``MASTER_ADDR`` are set where the host lacks them. So ``fn`` is the ordinary SPMD program
    (``tpukit.setup(spmd=True)``, ``tpukit.mesh()``, ...), run once per host.

    While it runs, each host's output appears here prefixed ``[host N]``, and its step records and
    compile events (``HostStepRecord`` / ``HostCompileEvent``, with ``.host``) reach this process's
    listeners; ``dashboard=True`` shows the per-host view (step times, the slowest host, compiles
    per host). A host that raises ends the run with a SliceError carrying its traceback; every
    other host's task is cancelled; Ctrl-C cancels them all. Either way the slice is released
    and nothing is left running. ``timeout``: seconds to wait for the slice to be reserved.
    """
    if not callable(fn):
        raise TypeError(f"run_on_slice(fn, ...) needs a function, got {type(fn).__name__}.")
    ray = raycluster.import_ray()
    version = hosts.ray_version(accelerator_version)
    pod_type, count, chips = hosts.slice_shape(topology, accelerator_version)
    topology = str(topology).strip().lower()
    payload = _pickle(ray, fn, args, kwargs)
    connected_here = raycluster.connect(ray, address)
    try:
        raycluster.check_capacity(ray, pod_type, topology, count, chips)
        return _Run(ray, payload, topology, version, count, timeout).run(dashboard)
    finally:
        if connected_here:
            ray.shutdown()
