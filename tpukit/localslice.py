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
import os
from typing import Any, Iterator

from . import hosts
from .errors import SliceError

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
        """Start the cluster's nodes, host 0 (the head) first; returns ``self``."""
        if self.cluster is not None:
            return self
        try:
            from ray.cluster_utils import Cluster
        except ImportError as exc:
            raise SliceError(f"LocalSlice needs Ray ({exc}): pip install 'tpukit[pod]'.") from None
        for host in range(self.hosts):
            env = self.node_env(host)
            node = dict(num_cpus=1, resources={"TPU": self.chips_per_host}, env_vars=env)
            try:
                with _node_environment(env):
                    if host == 0:  # no dashboard UI, no autoscaler: nothing here can add nodes
                        self.cluster = Cluster(initialize_head=True,
                                               head_node_args=dict(node, include_dashboard=False, no_monitor=True))
                    else:
                        self.cluster.add_node(**node)
            except Exception as exc:
                self.shutdown()
                raise SliceError(f"could not start simulated host {host} of {self.hosts}: {type(exc).__name__}: "
                                 f"{exc}") from None
        return self

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
