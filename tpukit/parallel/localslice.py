"""``LocalSlice``: a TPU slice simulated on this machine, to try ``run_on_slice`` without one.

A real multi-node Ray cluster (``ray.cluster_utils.Cluster``), one Ray node per host, each started
the way Ray starts on a GKE TPU host: with the TPU environment variables GKE sets
(``TPU_NAME``, ``TPU_WORKER_ID``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``), so Ray itself gives each
node its ``TPU`` resource, the slice labels (``ray.io/tpu-slice-name``, ``ray.io/tpu-worker-id``,
``ray.io/tpu-pod-type``, ``ray.io/tpu-topology``) and host 0 its ``TPU-<pod type>-head`` resource:
what ``ray.util.tpu``'s slice scheduling reads. There are no chips: each host's processes run on
XLA:CPU (``PJRT_DEVICE=CPU``) with ``devices_per_host`` virtual devices, so each host runs its own
SPMD program over its own devices. XLA:CPU has no collectives across processes: what the
simulation checks is scheduling, environment, telemetry, failure handling and checkpoint
coordination, not cross-host communication.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any, Iterator

from ..errors import SliceError
from . import hosts

log = logging.getLogger("tpukit")

_START_ATTEMPTS = 5  # tries to start one simulated host's Ray node (see LocalSlice.start)
# How long a start waits for a node's agents to serve (its raylet alive all along) before it starts the node again.
_AGENT_WAIT_S = 300

# What this process's XLA runtime was configured with: the simulated hosts start their own.
_NOT_INHERITED = ("PT_XLA_DEBUG", "XLA_FLAGS", "XLA_USE_SPMD", "CPU_NUM_DEVICES", "TPUKIT_REPLICA_RANK",
                  hosts.INDEX_ENV, hosts.COUNT_ENV, hosts.SLICE_ENV, "TPU_")


@contextlib.contextmanager
def _node_environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment as a Ray node started now inherits it (Ray resolves a node's TPU
    resources and labels in the process that starts it): ``env`` in, runtime settings out."""
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith(_NOT_INHERITED)]:
            del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _child_pids() -> set[int]:
    """The processes this one started, at any depth (a Ray node's raylet, agents and GCS)."""
    import psutil  # Ray's own dependency

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _agent_ports() -> dict[str, int]:
    """Ports free now for one Ray node's agents. Given, the node's agents bind these rather than choose
    their own, and two simulated slices on one machine do not both take the head's default agent port
    (52365)."""
    names = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port", "runtime_env_agent_port")
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in names]
    try:
        for probe in probes:  # held open together: four different ports
            probe.bind(("", 0))
        return {name: int(probe.getsockname()[1]) for name, probe in zip(names, probes)}
    finally:
        for probe in probes:
            probe.close()


def _announce_listen_port(session_dir: str, node_id: str, port: int) -> None:
    """Write the node's dashboard-agent listen port where its raylet reads it, before the node starts.

    Ray 2.60's raylet is given its agents' other ports on its command line but not this one: it waits
    for the agent to write it, 15 s at most (no setting changes that), and aborts when the agent has not.
    A dashboard agent took 40 s to import on a busy 2-core machine here, and every attempt of that host
    died. The agent binds the port it is given (``--listen-port``) and writes the same number again when
    it serves; :func:`_wait_until_serving` still waits for the ports only the agents write."""
    from ray._raylet import DASHBOARD_AGENT_LISTEN_PORT_NAME, persist_port

    os.makedirs(session_dir, exist_ok=True)
    persist_port(session_dir, node_id, DASHBOARD_AGENT_LISTEN_PORT_NAME, port)


def _stop_processes(pids: set[int]) -> None:
    """Kill these processes (those still alive) and reap them, waiting a few seconds at most."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


class _NodeNotServing(Exception):
    """A Ray node that registered but whose raylet then exited, or whose agents never served."""


def _wait_until_serving(node: Any) -> None:
    """Return once ``node``'s agents have written their ports (they do once they serve), or raise
    :class:`_NodeNotServing` when its raylet exits first (an agent failed and the raylet went with it)."""
    from ray._private import ray_constants
    from ray._raylet import (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, RUNTIME_ENV_AGENT_PORT_NAME,
                             get_port_filename)

    names = (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, RUNTIME_ENV_AGENT_PORT_NAME)
    files = [os.path.join(node.get_session_dir_path(), get_port_filename(node.node_id, name)) for name in names]
    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    deadline = time.monotonic() + _AGENT_WAIT_S
    while not all(os.path.exists(f) for f in files):
        if raylet.poll() is not None:
            raise _NodeNotServing(f"its raylet exited (code {raylet.returncode}) before its agents served")
        if time.monotonic() > deadline:
            raise _NodeNotServing(f"its agents did not serve within {_AGENT_WAIT_S} s")
        time.sleep(0.1)


class LocalSlice:
    """A simulated TPU slice: a local Ray cluster with one node per host of ``topology``.

    ``LocalSlice("4x4", "v5e").start()`` starts the 4 hosts of a v5e-16 (host 0 is the head node),
    ``address`` is what ``ray.init(address=...)`` takes, and :meth:`shutdown` stops every process it
    started (also at exit, and with ``with LocalSlice(...) as sim:``). ``devices_per_host``: virtual
    XLA:CPU devices per host (default: the host's chip count).
    """

    def __init__(self, topology: str = "4x4", accelerator_version: str = "v5e", devices_per_host: int | None = None,
                 name: str = "tpukit-local-slice"):
        if devices_per_host is not None and (isinstance(devices_per_host, bool) or not isinstance(devices_per_host, int)
                                             or devices_per_host < 1):
            raise ValueError(f"devices_per_host={devices_per_host!r} must be a positive int (the XLA:CPU devices each "
                             "simulated host runs on), or None for the host's chip count.")
        self.pod_type, self.hosts, self.chips_per_host = hosts.slice_shape(topology, accelerator_version)
        self.topology = str(topology).strip().lower()
        self.devices_per_host = devices_per_host if devices_per_host is not None else self.chips_per_host
        self.name = name
        self.cluster: Any = None

    def node_env(self, host: int) -> dict[str, str]:
        """The environment host ``host``'s Ray node (and every process it starts) runs with."""
        return {"TPU_NAME": self.name, "TPU_WORKER_ID": str(host), "TPU_ACCELERATOR_TYPE": self.pod_type,
                "TPU_TOPOLOGY": self.topology, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(self.devices_per_host)}

    def start(self) -> "LocalSlice":
        """Start the cluster's nodes, host 0 (the head) first; returns ``self``.

        A node counts as started when its raylet registered with the cluster and its agents serve
        (they wrote their ports). On a busy machine either can fail: Ray gives a raylet 30 s to
        register, and an agent that cannot bind its port takes its raylet down with it. A node that failed is stopped (every process
        that attempt started) and started again with fresh ports, up to ``_START_ATTEMPTS`` times (5),
        saying so; the slice then has no node left half-started."""
        if self.cluster is not None:
            return self
        try:
            from ray.cluster_utils import Cluster
        except ImportError as exc:
            raise SliceError(f"LocalSlice needs Ray ({exc}): pip install 'tpukit[pod]'.") from None
        self.cluster = Cluster()
        for host in range(self.hosts):
            self._start_host(host)
        return self

    def _start_host(self, host: int) -> None:
        """Start host ``host``'s Ray node, again on a busy machine's failures (see :meth:`start`)."""
        import ray
        from ray._common.utils import get_default_ray_temp_dir

        env = self.node_env(host)
        for attempt in range(1, _START_ATTEMPTS + 1):
            # Fresh ports each attempt: the last attempt's agent may still hold its own (its port was
            # in use when one was started again on it, and the raylet went down with that agent).
            ports = _agent_ports()
            node = dict(num_cpus=1, resources={"TPU": self.chips_per_host}, env_vars=env, **ports)
            # The node's id and session folder are chosen here, so that its agent's listen port can be
            # written before its raylet looks for it (see _announce_listen_port).
            node_id = ray.NodeID.from_random().hex()
            if host == 0:  # no dashboard UI, no autoscaler: nothing here can add nodes
                session_name = f"session_{time.strftime('%Y-%m-%d_%H-%M-%S')}_{os.getpid()}_{attempt}"
                node.update(include_dashboard=False, no_monitor=True, temp_dir=get_default_ray_temp_dir(),
                            session_name=session_name)
                session_dir = os.path.join(node["temp_dir"], session_name)
            else:
                session_dir = self.cluster.head_node.get_session_dir_path()
            started, workers = _child_pids(), set(self.cluster.worker_nodes)
            try:
                _announce_listen_port(session_dir, node_id, ports["dashboard_agent_listen_port"])
                with _node_environment({**env, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id}):
                    added = self.cluster.add_node(**node)
                _wait_until_serving(added)
                return
            except Exception as exc:
                _stop_processes(_child_pids() - started)  # what this attempt started, and only that
                if host == 0:  # the cluster's bookkeeping forgets the node that failed
                    self.cluster.head_node = None
                self.cluster.worker_nodes = workers
                busy = isinstance(exc, _NodeNotServing) or "timed out during startup" in str(exc)
                if attempt < _START_ATTEMPTS and busy:
                    log.warning("tpukit.LocalSlice: simulated host %d of %d did not start (%s; a busy machine); "
                                "starting it again (attempt %d of %d)", host, self.hosts,
                                exc if isinstance(exc, _NodeNotServing) else "it did not register with Ray in time",
                                attempt + 1, _START_ATTEMPTS)
                    continue
                self.shutdown()
                raise SliceError(f"could not start simulated host {host} of {self.hosts}: {type(exc).__name__}: "
                                 f"{exc}") from None

    @property
    def address(self) -> str:
        """The cluster's address, for ``ray.init(address=...)`` (``HOST:PORT``)."""
        if self.cluster is None:
            raise SliceError("this LocalSlice is not running: call start() first.")
        return self.cluster.address

    @property
    def session_dir(self) -> str | None:
        """Ray's session folder of this cluster (logs, sockets); None when not running."""
        return None if self.cluster is None or self.cluster.head_node is None else \
            self.cluster.head_node.get_session_dir_path()

    def shutdown(self) -> None:
        """Disconnect this process if it is connected here, and stop every node's processes."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return
        import ray

        if ray.is_initialized():  # Ray refuses to stop the node this process is connected through
            try:
                here = ray.get_runtime_context().gcs_address == cluster.address
            except Exception:
                here = True
            if here:
                ray.shutdown()
        cluster.shutdown()

    def __enter__(self) -> "LocalSlice":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = f"running at {self.cluster.address}" if self.cluster is not None else "stopped"
        return (f"<LocalSlice {self.pod_type} ({self.topology}): {self.hosts} hosts × {self.devices_per_host} "
                f"XLA:CPU devices, {state}>")
