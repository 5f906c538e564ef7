"""What ``run_on_slice`` asks of a Ray cluster: a connection, a whole idle slice, its reservation
and its release, and a value its hosts share (:func:`publish`: host 0's port for the group).

Ray manages the cluster (``ray.util.tpu``: a ``SlicePlacementGroup`` reserves every host of one
slice, host 0's ``TPU-<pod type>-head`` resource first); this module checks, before anything
starts, that the cluster is reachable and has a complete slice of the asked shape with all its
TPUs free, reserves it, tells what each host will be told (:func:`slice_plan`), and releases it,
waiting until Ray confirms. A reservation cut short by Ctrl-C leaves nothing reserved
(:func:`reserve`). Ray is imported only inside functions: it is an optional dependency.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from ..errors import SliceError

log = logging.getLogger("tpukit")

# The labels Ray gives a TPU host's node (from the TPU metadata; ray.util.tpu schedules on them).
SLICE_LABEL = "ray.io/tpu-slice-name"
WORKER_LABEL = "ray.io/tpu-worker-id"  # the host's index in its slice
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
_RELEASE_S = 30.0      # how long to wait for Ray to confirm the slice's placement groups are gone
_FREE_WAIT_S = 5.0     # how long a busy-looking slice gets to show as free (Ray reports releases late)
_KV_NAMESPACE = "tpukit"  # tpukit's keys in Ray's key-value store (the cluster's GCS)


def import_ray() -> Any:
    """The ``ray`` module, with ``ray.util.tpu``; SliceError saying how to install it when it is missing."""
    try:
        import ray
        import ray.util.tpu  # noqa: F401  (Ray >= 2.60: SlicePlacementGroup, run_on_slice)
    except ImportError as exc:
        raise SliceError(f"run_on_slice needs Ray ({exc}). Install it with: pip install 'tpukit[pod]' "
                         "(Ray 2.60 with ray.util.tpu), on this machine and on every host of the slice.") from None
    return ray


def reachable(address: str) -> None:
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


def connect(ray: Any, address: str | None) -> bool:
    """Make sure this process is connected to a Ray cluster; True when this call connected it."""
    if ray.is_initialized():
        return False
    if address is None:
        raise SliceError("this process is not connected to a Ray cluster: call ray.init(address='HOST:6379') first "
                         "(the address `ray start --head` printed on the slice's host 0), or pass "
                         "run_on_slice(..., address='HOST:6379'). ray.init() without an address would start a "
                         "cluster of this machine alone, which has no TPU slice.")
    reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except Exception as exc:
        raise SliceError(f"could not connect to the Ray cluster at {address}: {type(exc).__name__}: {exc}") from None
    return True


def tpu_hosts(nodes: list[dict]) -> str:
    """What TPU hosts a cluster has, in words."""
    groups: dict[tuple, int] = {}
    for node in nodes:
        if node.get("Alive") and (node.get("Resources") or {}).get("TPU"):
            labels = node.get("Labels") or {}
            key = (labels.get(SLICE_LABEL) or "(no slice name)",
                   labels.get(POD_TYPE_LABEL) or "(no pod type)", labels.get(TOPOLOGY_LABEL) or "?")
            groups[key] = groups.get(key, 0) + 1
    if not groups:
        return "no TPU host at all (no alive node has a TPU resource)"
    return "; ".join(f"slice {name!r}: {n} host{'s' if n != 1 else ''} of a {pod} ({topo})"
                     for (name, pod, topo), n in sorted(groups.items()))


def check_capacity(ray: Any, pod_type: str, topology: str, count: int, chips: int) -> None:
    """SliceError unless the cluster has a complete slice of this shape (``count`` alive hosts of its pod
    type with all their chips, host 0 among them), and one whose TPUs are all free."""
    from ray._private.state import available_resources_per_node  # what ray.util.tpu reads too

    slices: dict[str, list[dict]] = {}
    for node in ray.nodes():
        labels = node.get("Labels") or {}
        if node.get("Alive") and labels.get(POD_TYPE_LABEL) == pod_type:
            slices.setdefault(labels.get(SLICE_LABEL) or node["NodeID"], []).append(node)
    whole = [nodes for nodes in slices.values()
             if sum((n.get("Resources") or {}).get("TPU", 0) for n in nodes) == count * chips
             and any((n.get("Labels") or {}).get(WORKER_LABEL) == "0" for n in nodes)]
    if not whole:
        raise SliceError(f"the Ray cluster has no complete {pod_type} slice (topology {topology}, {count} hosts with "
                         f"their TPU chips and slice labels): it has {tpu_hosts(ray.nodes())}. Start Ray on every "
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


def slice_plan(ray: Any, handle: Any, count: int) -> dict:
    """What every host is told: the host count, the slice name, every host's address in worker order
    (and, for the notebook, every host's Ray node id in worker order)."""
    from ray.util.tpu import get_tpu_nodes_for_slice

    name = next((sel.get(SLICE_LABEL) for sel in handle.bundle_label_selector if sel.get(SLICE_LABEL)), None)
    found: dict[int, dict] = {}
    for node in (get_tpu_nodes_for_slice(name) if name else []):
        worker = (node.get("Labels") or {}).get(WORKER_LABEL)
        if worker is not None:
            found[int(worker)] = node
    nodes = [found[i] for i in sorted(found)] if len(found) == count else []
    return {"count": count, "slice": name, "hostnames": [n.get("NodeManagerAddress") for n in nodes],
            "node_ids": [n.get("NodeID") for n in nodes]}


def release(handle: Any) -> None:
    """Remove the slice's placement groups and wait until Ray says they are gone: the slice's TPUs are
    free for the next run when this returns."""
    groups = [g for g in (handle.slice_placement_group, *handle.head_placement_groups) if g is not None]
    handle.shutdown()
    wait_removed(groups)


def wait_removed(groups: list) -> None:
    """Wait (at most 30 s) until Ray reports each of these placement groups removed."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + _RELEASE_S
    for group in groups:
        while placement_group_table(group).get("state", "REMOVED") != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.1)


def own_groups(ray: Any) -> set[bytes]:
    """The placement groups this process's Ray job holds (ids; empty when Ray cannot tell)."""
    try:
        from ray._private.state import state  # what ray.util.placement_group_table reads, with the creator
        from ray.core.generated.gcs_pb2 import PlacementGroupTableData

        job = ray.get_runtime_context().get_job_id()
        found = set()
        for blob in state._connect_and_get_accessor().get_placement_group_table():
            group = PlacementGroupTableData.FromString(blob)
            if group.creator_job_id.hex() == job and group.state != PlacementGroupTableData.REMOVED:
                found.add(group.placement_group_id)
        return found
    except Exception as exc:  # e.g. a Ray client connection (ray://), which has no state accessor
        log.debug("tpukit.run_on_slice: could not list this job's placement groups: %s", exc)
        return set()


def reserve(ray: Any, topology: str, version: str, timeout: float) -> Any:
    """Reserve a slice through ``ray.util.tpu`` (host 0's head resource first, then every host);
    its handle, for :func:`release`. SliceError when Ray cannot within ``timeout`` seconds.

    Ray removes what it reserved when the reservation fails, but not when it is interrupted: a
    Ctrl-C while it waits for the head would leave that reservation held until this process
    disconnects. So on any way out without a handle, the placement groups this job created during
    the call (:func:`own_groups`) are removed here, and KeyboardInterrupt says so."""
    from ray.util import remove_placement_group, tpu
    from ray.util.placement_group import PlacementGroup

    before = own_groups(ray)
    try:
        return tpu.slice_placement_group(topology, version, head_reservation_timeout_s=timeout)
    except BaseException as exc:
        left = [PlacementGroup(ray.PlacementGroupID(pg_id)) for pg_id in own_groups(ray) - before]
        for group in left:
            try:
                remove_placement_group(group)
            except Exception as error:
                log.debug("tpukit.run_on_slice: could not remove placement group %s: %s", group.id, error)
        wait_removed(left)
        if isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt(f"run_on_slice was interrupted while the {topology} slice was being reserved; "
                                    "the reservation was removed") from None
        if not isinstance(exc, Exception):
            raise
        raise SliceError(f"could not reserve a {topology} slice within {timeout:g} s: "
                         f"{type(exc).__name__}: {exc}") from None


def publish(key: str, value: str) -> None:
    """Put ``value`` under ``key`` in the cluster's key-value store, from any process connected to it."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, namespace=_KV_NAMESPACE)


def published(key: str, timeout: float) -> str | None:
    """The value under ``key``, waiting (``timeout`` seconds at most) for another process to publish it;
    None when none did."""
    from ray.experimental import internal_kv

    deadline = time.monotonic() + timeout
    while (value := internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return value.decode()


def unpublish(key: str) -> None:
    """Remove ``key`` from the cluster's key-value store (nothing when it is not there)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=_KV_NAMESPACE)
