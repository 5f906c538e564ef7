"""``run_on_slice()``: run a notebook's training function on every host of a TPU slice, through Ray.

The kit does not manage a cluster: Ray does (``ray.util.tpu``: a ``SlicePlacementGroup`` reserves
every host of one slice, ``run_on_slice`` starts one task per host, pinned to it). This module
checks everything that can be checked before anything starts (the function pickles, the topology
exists, a cluster is reachable and has a whole idle slice), reserves the slice, starts
:func:`tpukit.hosts.slice_host` on each host, and supervises: each host's output reaches the cell
prefixed ``[host N]``, its step records and compile events reach this process's listeners (the
dashboard), host 0's return value comes back. A failing host, a crash or Ctrl-C cancels every
task and releases the slice; nothing is left running on the cluster. Ray is imported lazily.
"""

from __future__ import annotations

import linecache
import logging
import re
import socket
import sys
import time
from typing import Any, Callable

from . import _ipython, events, hosts
from .errors import SliceError

log = logging.getLogger("tpukit")

_WAIT_S = 0.5          # longest wait for a host's next message (Ctrl-C is seen at least this often)
_CANCEL_GRACE_S = 30.0  # how long cancelled tasks get to end before the slice is released anyway
_RELEASE_S = 30.0      # how long to wait for Ray to confirm the slice's placement groups are gone
_FREE_WAIT_S = 5.0     # how long a busy-looking slice gets to show as free (Ray reports releases late)
_LAST_WORDS_S = 30.0   # how long to wait for a dead host's last output
_LINE = re.compile(r"(\r\n|\n|\r)")
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>, in .*)$')
_REMOTE: dict[str, Any] = {}  # the Ray remote function, made once per process


def _import_ray() -> Any:
    try:
        import ray
        import ray.util.tpu  # noqa: F401  (Ray >= 2.60: SlicePlacementGroup, run_on_slice)
    except ImportError as exc:
        raise SliceError(f"run_on_slice needs Ray ({exc}). Install it with: pip install 'tpukit[pod]' "
                         "(Ray 2.60 with ray.util.tpu), on this machine and on every host of the slice.") from None
    return ray


def _pickle(ray: Any, fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return ray.cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise SliceError(f"{name} or its arguments cannot be pickled, so they cannot be sent to the hosts "
                         f"({type(exc).__name__}: {exc}). Pass data, not open files, locks, threads or device tensors, "
                         "and create those inside the function (it runs on each host).") from None


def _reachable(address: str) -> None:
    """SliceError when nothing listens at ``address`` (``host:port`` or ``ray://host:port``)."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray resolves them
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise SliceError(f"no Ray cluster is reachable at {address} ({exc.strerror or exc}). Start one on the slice "
                         "(`ray start --head` on host 0, `ray start --address=HOST0:6379` on the others; README, "
                         "'When one machine is not enough') and check the address and the firewall.") from None


def _connect(ray: Any, address: str | None) -> bool:
    """Make sure this process is connected to a Ray cluster; True when this call connected it."""
    if ray.is_initialized():
        return False
    if address is None:
        raise SliceError("this process is not connected to a Ray cluster: call ray.init(address='HOST:6379') first "
                         "(the address `ray start --head` printed on the slice's host 0), or pass "
                         "run_on_slice(..., address='HOST:6379'). ray.init() without an address would start a "
                         "cluster of this machine alone, which has no TPU slice.")
    _reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:
        raise SliceError(f"could not connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}") from None
    return True


def _tpu_hosts(nodes: list[dict]) -> str:
    """What TPU hosts a cluster has, in words."""
    groups: dict[tuple, int] = {}
    for node in nodes:
        if node.get("Alive") and (node.get("Resources") or {}).get("TPU"):
            labels = node.get("Labels") or {}
            key = (labels.get("ray.io/tpu-slice-name") or "(no slice name)",
                   labels.get("ray.io/tpu-pod-type") or "(no pod type)", labels.get("ray.io/tpu-topology") or "?")
            groups[key] = groups.get(key, 0) + 1
    if not groups:
        return "no TPU host at all (no alive node has a TPU resource)"
    return "; ".join(f"slice {name!r}: {n} host{'s' if n != 1 else ''} of a {pod} ({topo})"
                     for (name, pod, topo), n in sorted(groups.items()))


def _check_capacity(ray: Any, pod_type: str, topology: str, count: int, chips: int) -> None:
    """SliceError unless the cluster has a complete slice of this shape (``count`` alive hosts of its pod
    type with all their chips, host 0 among them), and one whose TPUs are all free."""
    from ray._private.state import available_resources_per_node  # what ray.util.tpu reads too

    slices: dict[str, list[dict]] = {}
    for node in ray.nodes():
        labels = node.get("Labels") or {}
        if node.get("Alive") and labels.get("ray.io/tpu-pod-type") == pod_type:
            slices.setdefault(labels.get("ray.io/tpu-slice-name") or node["NodeID"], []).append(node)
    whole = [nodes for nodes in slices.values()
             if sum((n.get("Resources") or {}).get("TPU", 0) for n in nodes) == count * chips
             and any((n.get("Labels") or {}).get(hosts.WORKER_ID_LABEL) == "0" for n in nodes)]
    if not whole:
        raise SliceError(f"the Ray cluster has no complete {pod_type} slice (topology {topology}, {count} hosts with "
                         f"their TPU chips and slice labels): it has {_tpu_hosts(ray.nodes())}. Start Ray on every "
                         "host of the slice, or ask for the topology the cluster has.")

    def idle(node: dict, free: dict) -> bool:
        total = (node.get("Resources") or {}).get("TPU", 0)
        return free.get(node["NodeID"], {"TPU": total}).get("TPU", 0) >= total  # in full use: absent, 0 free

    deadline = time.monotonic() + _FREE_WAIT_S  # TPUs released a moment ago are reported free a little later
    while not any(all(idle(n, available_resources_per_node()) for n in nodes) for nodes in whole):
        if time.monotonic() > deadline:
            raise SliceError(f"all {len(whole)} {pod_type} slice(s) of the Ray cluster are busy: other tasks hold "
                             "their TPUs. Wait for them to end or cancel them (`ray list tasks`), then call "
                             "run_on_slice again.")
        time.sleep(0.25)


def _plan(ray: Any, handle: Any, count: int) -> dict:
    """What every host is told: the host count, the slice name, every host's address in worker order."""
    from ray.util.tpu import get_tpu_nodes_for_slice

    name = next((sel.get("ray.io/tpu-slice-name") for sel in handle.bundle_label_selector
                 if sel.get("ray.io/tpu-slice-name")), None)
    addresses: dict[int, str] = {}
    for node in (get_tpu_nodes_for_slice(name) if name else []):
        worker = (node.get("Labels") or {}).get(hosts.WORKER_ID_LABEL)
        if worker is not None:
            addresses[int(worker)] = node.get("NodeManagerAddress")
    names = [addresses[i] for i in sorted(addresses)] if len(addresses) == count else []
    return {"count": count, "slice": name, "hostnames": names}


def _release(handle: Any) -> None:
    """Remove the slice's placement groups and wait until Ray says they are gone: the slice's TPUs are
    free for the next run when this returns."""
    from ray.util import placement_group_table

    groups = [g for g in (handle.slice_placement_group, *handle.head_placement_groups) if g is not None]
    handle.shutdown()
    deadline = time.monotonic() + _RELEASE_S
    for group in groups:
        while placement_group_table(group).get("state", "REMOVED") != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.1)


def _with_sources(text: str) -> str:
    """A host's traceback as this notebook shows its own: a frame in one of this kernel's cells reads
    ``Cell In[8], line 3``, and a frame whose source the host lacked gets it from here (a function
    defined in the notebook travels by value: the hosts have its code, not its text)."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if not m:
            out.append(line)
            continue
        label = _ipython.cell_label(m["file"])
        out.append(f"  Cell In{label}, line {m['line']}{m['rest']}" if label else line)
        if not (i + 1 < len(lines) and lines[i + 1].startswith("    ")):
            source = linecache.getline(m["file"], int(m["line"])).strip()
            if source:
                out.append(f"    {source}")
    return "\n".join(out)


def _remote(ray: Any, fn: Callable, **options: Any) -> Any:
    """``fn`` as a Ray task, made once per process. Every one runs in a fresh worker process that exits
    after it (max_calls=1: a host's runtime starts with this run's environment and releases the TPU
    when it exits) and is never retried."""
    task = _REMOTE.get(fn.__name__)
    if task is None:
        task = _REMOTE[fn.__name__] = ray.remote(max_calls=1, max_retries=0, **options)(fn)
    return task


class _Lines:
    """Host output to this cell, line by line, each line prefixed ``[host N]``."""

    def __init__(self) -> None:
        self.partial: dict[tuple[int, str], str] = {}

    def write(self, host: int, stream: str, text: str, final: bool = False) -> None:
        text = self.partial.pop((host, stream), "") + text
        parts = _LINE.split(text)
        ends = ["\n" if end == "\r\n" else end for end in parts[1::2]]
        out = [f"[host {host}] {line}{end}" for line, end in zip(parts[0::2], ends)]
        rest = parts[-1]
        if rest and final:
            out.append(f"[host {host}] {rest}\n")
        elif rest:
            self.partial[(host, stream)] = rest
        if out:
            target = getattr(sys, stream)
            target.write("".join(out))
            target.flush()

    def flush(self) -> None:
        for host, stream in list(self.partial):
            self.write(host, stream, "", final=True)


class _Run:
    """One run_on_slice call: reserve, start, supervise, clean up."""

    def __init__(self, ray: Any, payload: bytes, topology: str, version: str, count: int, timeout: float):
        self.ray, self.payload, self.topology, self.version = ray, payload, topology, version
        self.count, self.timeout = count, timeout
        self.pending: dict[Any, int | None] = {}  # task generator -> host index (None until it said hello)
        self.finished: set = set()  # generators whose host sent its result
        self.hello: dict[Any, tuple] = {}  # generator -> (host, pid, node id)
        self.sent: dict[tuple[int, str], int] = {}  # (host, stream) -> bytes of output received
        self.lines = _Lines()
        self.value: Any = None

    def run(self, dashboard: bool) -> Any:
        from ray.util import tpu

        view = None
        try:
            handle = tpu.slice_placement_group(self.topology, self.version, head_reservation_timeout_s=self.timeout)
        except Exception as exc:
            raise SliceError(f"could not reserve a {self.topology} slice within {self.timeout:g} s: "
                             f"{type(exc).__name__}: {exc}") from None
        try:
            plan = _plan(self.ray, handle, self.count)
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
                _release(handle)
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
            who = f"host {host}" if host is not None else "a host"
            cause = getattr(exc, "cause", None)  # a RayTaskError: the task's own code raised
            if isinstance(cause, BaseException):
                raise SliceError(f"{who}'s task failed: {type(cause).__name__}: {cause}{self._others()}.") from None
            self._last_words(gen)
            raise SliceError(f"{who}'s task died without a result ({type(exc).__name__}: {str(exc).strip()}): a "
                             f"crash, os._exit or out of memory; its output above may say why{self._others()}.") from None
        kind = msg[0]
        if kind == "hello":
            self.pending[gen] = msg[1]
            self.hello[gen] = (msg[1], msg[3], msg[4])
        elif kind == "out":
            self.lines.write(msg[1], msg[2], msg[3])
            self.sent[(msg[1], msg[2])] = msg[4]
        elif kind == "step":
            events.call("on_step", msg[1])
        elif kind == "compile":
            events.call("on_compile", msg[1])
        elif kind == "done":  # the task still has to end: it stays pending until its stream does
            self.finished.add(gen)
            if msg[1] == 0:
                self.value = self.ray.cloudpickle.loads(msg[2])
        elif kind == "error":  # its task ends with its stream; _stop waits for that
            self.lines.flush()
            detail = f". Its traceback:\n\n{_with_sources(msg[3]).rstrip()}" if msg[3] else "."
            raise SliceError(f"host {msg[1]} failed: {msg[2]}{self._others(gen)}{detail}")

    def _last_words(self, gen: Any) -> None:
        """Show what a host that died wrote but could not send: read on its node from its output files."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if gen not in self.hello:
            return
        host, pid, node = self.hello[gen]
        offsets = {stream: self.sent.get((host, stream), 0) for stream in ("stdout", "stderr")}
        task = _remote(self.ray, hosts.read_output, num_cpus=0)
        try:
            ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(pid, offsets)
            for stream, text in self.ray.get(ref, timeout=_LAST_WORDS_S).items():
                self.lines.write(host, stream, text)
        except Exception as exc:  # the node itself may be gone
            log.debug("tpukit.run_on_slice: could not read host %s's last output: %s", host, exc)
        self.lines.flush()

    def _others(self, failed: Any = None) -> str:
        running = [g for g in self.pending if g is not failed and g not in self.finished]
        return "; the other hosts' tasks were cancelled" if running else ""

    def _stop(self) -> None:
        """Cancel every task still running (force: a host stuck in a collective cannot be asked nicely)
        and wait until each has ended, so that nothing is left running when this returns."""
        ray = self.ray
        left = list(self.pending)
        self.pending = {}
        for gen in left:
            try:
                ray.cancel(gen, force=True)
            except Exception as exc:
                log.debug("tpukit.run_on_slice: cancelling a host task failed: %s", exc)
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
    ray = _import_ray()
    version = hosts.ray_version(accelerator_version)
    pod_type, count, chips = hosts.slice_shape(topology, accelerator_version)
    topology = str(topology).strip().lower()
    payload = _pickle(ray, fn, args, kwargs)
    connected_here = _connect(ray, address)
    try:
        _check_capacity(ray, pod_type, topology, count, chips)
        return _Run(ray, payload, topology, version, count, timeout).run(dashboard)
    finally:
        if connected_here:
            ray.shutdown()
