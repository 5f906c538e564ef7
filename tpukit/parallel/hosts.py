"""The hosts of a TPU slice: their shape, what each one is told, and what runs on each under
``tpukit.run_on_slice``.

One Ray task runs :func:`slice_host` on every host of the slice (:mod:`tpukit.parallel.pod` starts
them). It learns its host index from the node it landed on (the ``ray.io/tpu-worker-id`` label Ray
reads from the TPU metadata), sets the environment torch_xla's multi-host SPMD reads (:func:`host_env`),
captures the host's stdout and stderr at the file-descriptor level (XLA's C-level output too), tags
the host's step records and compile events with its index, and runs the user's function in a thread
while it yields all of that to the notebook as :class:`~tpukit.parallel.remote.Message` objects of a
Ray streaming generator (capture, messages, forwarding, tracebacks: shared with ``tpukit.launch``).

:func:`current` tells code running on a slice which host it is on (a checkpoint writer uses it
to decide who writes what); off a slice it is host 0 of 1. Ray is imported only inside functions:
it is an optional dependency (``pip install 'tpukit[pod]'``).
"""

from __future__ import annotations

import codecs
import dataclasses
import datetime
import os
import queue
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from .. import compiles, environment, events, runtime
from ..compiles import CompileEvent
from ..errors import SliceError
from ..steps import StepRecord
from . import raycluster, remote

INDEX_ENV = "TPUKIT_HOST_INDEX"  # this host's index in the slice, 0 .. count-1
COUNT_ENV = "TPUKIT_HOST_COUNT"  # the number of hosts in the slice
SLICE_ENV = "TPUKIT_SLICE_NAME"  # the slice's name (Ray's ray.io/tpu-slice-name label)
# What torch_xla reads for multi-host runs (torch_xla/core/xla_env_vars.py, _internal/tpu.py,
# _internal/rendezvous.py): set only where the host does not already have them (a TPU VM's
# metadata and GKE's webhook provide the same facts, and win).
TORCH_XLA_ENV = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "MASTER_ADDR")
WORKER_ID_LABEL = raycluster.WORKER_LABEL  # Ray's label of a host's index in its slice
GROUP_PORT_ENV, DEFAULT_GROUP_PORT = "TPUKIT_GROUP_PORT", 8479  # process_group()'s rendezvous port on host 0
# The run_on_slice call a host's task belongs to, and where (raycluster.publish) host 0 publishes its port for it.
RUN_ENV, GROUP_PORT_KEY = "TPUKIT_SLICE_RUN", "group-port-{run}"
# Names people use for an accelerator generation -> Ray's name for it (ray.util.tpu).
ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod", "v5litepod": "v5litepod", "v5p": "v5p", "v6e": "v6e",
           "v7x": "v7x", "v4": "v4", "v3": "v3", "v2": "v2"}
_TICK_S = 0.2        # how often the host pumps its queue while the function runs
_DRAIN_S = 2.0       # how long to wait for the last output after the function returned
_TAIL_S = 0.05       # how often a host's output files are read
_STALE_S = 600.0     # a dead host process's output files are removed after this long (cancelled runs)
OUTPUT_DIR = os.path.join(tempfile.gettempdir(), "tpukit-hosts")  # each host's output while its function runs


@dataclass(frozen=True)
class Host:
    """Where this process runs in a slice: host ``index`` of ``count`` (``Host(0, 1)`` off a slice)."""

    index: int
    count: int
    slice_name: str | None = None
    coordinator: str | None = None  # host 0's address (torch_xla's MASTER_ADDR)

    @property
    def first(self) -> bool:
        """True on host 0, the one that writes what all hosts hold the same (replicated state)."""
        return self.index == 0


def current() -> Host:
    """This process's host in a ``run_on_slice`` run, from the environment it set; ``Host(0, 1)``
    everywhere else (a notebook, a script, a single TPU VM)."""
    index, count = os.environ.get(INDEX_ENV), os.environ.get(COUNT_ENV)
    if index is None or count is None:
        return Host(0, 1)
    return Host(int(index), int(count), os.environ.get(SLICE_ENV) or None, os.environ.get("MASTER_ADDR") or None)


def process_group(backend: str = "gloo", timeout_s: float = 300.0) -> Host:
    """Join the slice's ``torch.distributed`` group (one process per host); every host must call it.

    It is what a ``CheckpointManager`` on a slice needs for sharded state: with the
    group up, a save of SPMD-sharded tensors is collective, each host writing the
    shards it owns into one checkpoint directory (on storage every host sees) and
    host 0 committing it after all have written, so ``latest()`` never sees a
    partial one. Replicated state needs no group: host 0 alone writes it
    (``rank() == host index``). The rendezvous is host 0's address on the port host 0
    found free as its task started, waited for (``TPUKIT_GROUP_PORT``: set it on host 0
    to choose one; 8479 outside ``run_on_slice``). Off a slice, or when a group is
    already up, it does nothing. Returns this host.
    """
    host = current()
    import torch.distributed as dist

    if host.count == 1 or dist.is_initialized():
        return host
    if not host.coordinator:
        raise SliceError("this host does not know host 0's address (MASTER_ADDR is not set): call "
                         "process_group() inside a function run by tpukit.run_on_slice.")

    port = _rendezvous_port(timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{host.coordinator}:{port}", rank=host.index,
                            world_size=host.count, timeout=datetime.timedelta(seconds=timeout_s))
    return host


@dataclass(frozen=True)
class HostStepRecord(StepRecord):
    """A :class:`~tpukit.StepRecord` made on host ``host`` of a slice, as the notebook receives it."""

    host: int = 0


@dataclass(frozen=True)
class HostCompileEvent(CompileEvent):
    """A :class:`~tpukit.CompileEvent` from host ``host`` of a slice (its ``index`` counts that host's compiles)."""

    host: int = 0


def _fields(record: Any, base: type) -> dict:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(base)}


def tag_event(event: CompileEvent, host: int) -> HostCompileEvent:
    """``event`` as a :class:`HostCompileEvent` of ``host``."""
    return HostCompileEvent(**_fields(event, CompileEvent), host=host)


def tag_step(record: StepRecord, host: int) -> HostStepRecord:
    """``record`` (and the compile events it carries) as a :class:`HostStepRecord` of ``host``."""
    fields = _fields(record, StepRecord)
    fields["compile_events"] = tuple(tag_event(e, host) for e in record.compile_events)
    return HostStepRecord(**fields, host=host)


# ------------------------------------------------------------------------------ slice shape

def ray_version(accelerator_version: str) -> str:
    """Ray's name for an accelerator generation (``"v5e"`` -> ``"v5litepod"``); SliceError if unknown."""
    key = str(accelerator_version).strip().lower().removeprefix("tpu-")
    if key not in ALIASES:
        raise SliceError(f"accelerator_version={accelerator_version!r} is not a TPU generation Ray schedules; use one "
                         f"of {', '.join(sorted(set(ALIASES) - {'v5lite', 'v5litepod'}))} (e.g. 'v5e', 'v6e', 'v5p').")
    return ALIASES[key]


def slice_shape(topology: str, accelerator_version: str) -> tuple[str, int, int]:
    """``(pod type, hosts, chips per host)`` of a slice, e.g. ``("v5litepod-16", 4, 4)`` for a v5e
    ``4x4``; SliceError, before anything starts, when the topology does not exist for the generation."""
    from ray._private.accelerators.tpu import VALID_TPU_TOPOLOGY, infer_tpu_pod_type_from_topology
    from ray.util.tpu import get_tpu_worker_resources

    version = ray_version(accelerator_version)
    shape = str(topology).strip().lower()
    valid = VALID_TPU_TOPOLOGY.get(version, set())
    if shape not in valid:
        def order(t):
            return [int(d) for d in t.split("x")]
        raise SliceError(f"topology={topology!r} does not exist for TPU {accelerator_version} ({version}): its slices "
                         f"are {', '.join(sorted(valid, key=order))}. Pick one of those (the product of the numbers "
                         "is the chip count; e.g. '4x4' is a v5e-16, four hosts of 4 chips).")
    hosts, resources = get_tpu_worker_resources(shape, version)
    return infer_tpu_pod_type_from_topology(shape, version), hosts, int(resources["TPU"])


def group_port() -> int:
    """The port :func:`process_group` listens on when this host is host 0: ``TPUKIT_GROUP_PORT`` if
    the host sets it, else one free now. Host 0's task takes and publishes it as it starts (no task
    before the run: a busy host may take minutes to start one), so two runs on one machine (two
    simulated slices, or a run beside a stale one) never rendezvous on one port."""
    if os.environ.get(GROUP_PORT_ENV):
        return int(os.environ[GROUP_PORT_ENV])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def _rendezvous_port(timeout_s: float) -> int:
    """:func:`process_group`'s port: in a run, the one host 0 published (``timeout_s`` at most), else the env's or 8479."""
    run = os.environ.get(RUN_ENV)
    if not run:
        return int(os.environ.get(GROUP_PORT_ENV, DEFAULT_GROUP_PORT))
    port = raycluster.published(GROUP_PORT_KEY.format(run=run), timeout_s)
    if port is None:
        raise SliceError(f"host 0 has not published the group's port within {timeout_s:g} s: its task has not started.")
    os.environ[GROUP_PORT_ENV] = port
    return int(port)


def host_env(index: int, plan: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment host ``index`` gets before the user's function runs: ``(always, defaults)``.

    ``always``: tpukit's own variables (host index and count, slice name, the run, under which
    host 0 publishes the group's port) and the rank ``tpukit.rank()`` reads, so ``rank() == index``. ``defaults``,
    set only where the host lacks them: torch_xla's ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES`` (every host's address in worker
    order) and ``MASTER_ADDR`` (host 0, the coordinator of torch.distributed's ``xla://`` rendezvous).
    """
    names = list(plan.get("hostnames") or ())
    always = {INDEX_ENV: str(index), COUNT_ENV: str(plan["count"]), runtime.RANK_ENV: str(index)}
    if plan.get("slice"):
        always[SLICE_ENV] = str(plan["slice"])
    if plan.get("run"):
        always[RUN_ENV] = str(plan["run"])
    defaults = {"TPU_WORKER_ID": str(index)}
    if names:
        defaults["TPU_WORKER_HOSTNAMES"] = ",".join(names)
        defaults["MASTER_ADDR"] = names[0]
    return always, defaults


# ------------------------------------------------------------------------------ on each host

def _tag(record: Any, host: int) -> Any:
    """A step record or compile event of this host, tagged with its index (what the forwarder sends)."""
    return tag_step(record, host) if isinstance(record, StepRecord) else tag_event(record, host)


def output_files(pid: int, folder: str | None = None) -> dict[str, str]:
    """Where host process ``pid`` writes its stdout and stderr while its function runs."""
    folder = folder or OUTPUT_DIR
    return {name: os.path.join(folder, f"{pid}.{name}") for name in ("stdout", "stderr")}


def read_output(pid: int, offsets: Mapping[str, int], folder: str | None = None) -> dict[str, str]:
    """What host process ``pid`` wrote past ``offsets`` (bytes sent so far, per stream), its files then
    removed: the last words of a host that died before it could send them (run on that host's node)."""
    out = {}
    for name, path in output_files(pid, folder).items():
        try:
            with open(path, "rb") as f:
                f.seek(offsets.get(name, 0))
                out[name] = f.read().decode("utf-8", "replace")
            os.remove(path)
        except OSError:
            continue
    return out


def _remove_stale(folder: str) -> None:
    """Output files of host processes that are gone and were not read (the hosts of a cancelled run);
    kept a while, so the notebook can still read a host that just died (:func:`read_output`)."""
    cutoff = time.time() - _STALE_S
    for entry in os.listdir(folder):
        path, pid = os.path.join(folder, entry), entry.split(".", 1)[0]
        try:
            if pid.isdigit() and not environment.pid_alive(int(pid)) and os.path.getmtime(path) < cutoff:
                os.remove(path)
        except OSError:
            continue


class _Capture:
    """Points fds 1 and 2 (print, logging and C-level output alike) at files on this host, which the
    kernel writes, so a crash loses nothing; threads tail them and put output Messages on the queue
    (``sent``: bytes of the stream sent so far). Puts everything back on exit."""

    def __init__(self, put: Callable[[remote.Message], None], host: int):
        self.put, self.host = put, host
        self.files = output_files(os.getpid())
        self.redirect: remote.Redirect | None = None
        self.readers: list[threading.Thread] = []
        self.done = threading.Event()

    def __enter__(self) -> "_Capture":
        os.makedirs(OUTPUT_DIR, exist_ok=True)
        _remove_stale(OUTPUT_DIR)
        targets = [os.open(self.files[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
                   for name in ("stdout", "stderr")]
        try:
            self.redirect = remote.Redirect(*targets).start()
        finally:
            for fd in targets:
                os.close(fd)
        for name in ("stdout", "stderr"):
            reader = threading.Thread(target=self._tail, args=(name,), name=f"tpukit-host-{name}", daemon=True)
            reader.start()
            self.readers.append(reader)
        return self

    def _tail(self, name: str) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        sent = 0
        with open(self.files[name], "rb", buffering=0) as f:
            while True:
                finished = self.done.is_set()  # one more read after the end was signalled
                data = f.read(65536)
                if data:
                    sent += len(data)
                    if text := decoder.decode(data):
                        self.put(remote.Message.output(self.host, name, text, sent))
                elif finished:
                    break
                else:
                    self.done.wait(_TAIL_S)
        if text := decoder.decode(b"", final=True):
            self.put(remote.Message.output(self.host, name, text, sent))

    def __exit__(self, *exc: Any) -> None:
        if self.redirect is not None:
            self.redirect.restore()
        self.done.set()
        for reader in self.readers:
            reader.join(_DRAIN_S)
        for path in self.files.values():
            try:
                os.remove(path)
            except OSError:
                pass


def _run(payload: bytes, host: int, outcome: dict) -> None:
    """Load and call the user's function; leave a RESULT Message (host 0's holds the pickled value,
    ``primary``) or an ERROR one in ``outcome``."""
    from ray import cloudpickle

    try:
        fn, args, kwargs = cloudpickle.loads(payload)
    except BaseException as exc:
        outcome["message"] = remote.Message.error(
            host, f"its function could not be loaded there ({type(exc).__name__}: {exc}); define it in the "
                  "notebook (it then travels by value) or install the module it comes from on every host",
            remote.user_traceback(exc))
        return
    msg = remote.run(host, fn, args, kwargs)
    if msg.kind == remote.RESULT:
        if host != 0:  # only host 0's value goes back (it is what run_on_slice returns)
            msg = remote.Message.result(host, None, primary=False)
        else:
            try:
                msg = remote.Message.result(host, cloudpickle.dumps(msg.value), primary=True)
            except Exception as exc:
                msg = remote.unsendable(host, msg.value, exc, "the notebook")
    outcome["message"] = msg


def _settle_compiles() -> None:
    """Wait (briefly) until the compile reader has published every compile of the function, so the
    last one's classification reaches the notebook before the result does."""
    try:
        if runtime.started() and compiles.tracing_enabled():
            compiles.settled()
    except Exception:  # telemetry must never break the host's training
        pass


def _drain(q: "queue.SimpleQueue[remote.Message]") -> Iterator[remote.Message]:
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


def _host_index(ray: Any) -> int:
    label = ray.get_runtime_context().get_node_labels().get(WORKER_ID_LABEL)
    found = label if label is not None else os.environ.get("TPU_WORKER_ID")
    if found is None:
        raise SliceError(f"this Ray node has no {WORKER_ID_LABEL} label and no TPU_WORKER_ID: it is not a host of a TPU "
                         "slice. Start Ray on the slice's TPU VMs (README, 'When one machine is not enough').")
    return int(found)


def slice_host(payload: bytes, plan: Mapping[str, Any]) -> Iterator[remote.Message]:
    """The Ray streaming task ``run_on_slice`` starts on every host of the slice.

    Yields :class:`~tpukit.parallel.remote.Message` objects, in order: HELLO (the host's name, pid and Ray
    node id); then, while the user's function runs, OUTPUT, STEP (a ``HostStepRecord``) and
    COMPILE (a ``HostCompileEvent``) as they happen; last RESULT (the pickled value, on host 0
    only) or ERROR (a summary and the user's traceback).
    """
    import ray

    host = _host_index(ray)
    always, defaults = host_env(host, plan)
    os.environ.update(always)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if host == 0 and plan.get("run"):  # the other hosts' process_group() reads it; the notebook removes it
        os.environ[GROUP_PORT_ENV] = str(group_port())
        raycluster.publish(GROUP_PORT_KEY.format(run=plan["run"]), os.environ[GROUP_PORT_ENV])
    q: queue.SimpleQueue[remote.Message] = queue.SimpleQueue()
    yield remote.Message.hello(host, socket.gethostname(), os.getpid(), ray.get_runtime_context().get_node_id())
    outcome: dict = {}
    listener = events.add_listener(remote.Forwarder(q.put, host, tag=_tag))
    try:
        with _Capture(q.put, host):
            worker = threading.Thread(target=_run, args=(payload, host, outcome), name="tpukit-host-main", daemon=True)
            worker.start()
            while worker.is_alive():  # compile events arrive from the compile reader's thread
                worker.join(_TICK_S)
                yield from _drain(q)
        _settle_compiles()
    finally:
        events.remove_listener(listener)
    yield from _drain(q)
    yield outcome.get("message") or remote.Message.error(host, "the function's thread ended without a result")
