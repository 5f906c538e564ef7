"""tpukit.run_on_slice on a real local multi-node Ray cluster standing in for a 4-host TPU slice.

``tpukit.LocalSlice`` starts one Ray node per host of a v5e ``4x4`` (a v5e-16: four hosts of four
chips) with ``ray.cluster_utils.Cluster``, each node started with the environment GKE gives a TPU
host, so that Ray itself gives it its TPU resource and the slice labels ``ray.util.tpu`` schedules
on. Nothing is mocked but the TPU chips, which cannot exist here: each host process runs torch_xla
on XLA:CPU with two virtual devices, its own SPMD program (XLA:CPU has no collectives between
processes). The tests check scheduling (one task per host, pinned to it), each host's environment,
telemetry (output, step records, compile events back in this process), host 0's result,
checkpoint coordination (sharded state written by every host into one checkpoint committed by host
0, replicated state by host 0 alone), failure handling (a raising host, Ctrl-C) and that nothing
is left running afterwards; and the errors raised before anything starts. One cluster for the module (starting it is the slow part).
"""

from __future__ import annotations

import _thread
import re
import sys
import time

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

import tpukit  # noqa: E402
from tpukit import events  # noqa: E402
from tpukit.parallel import hosts  # noqa: E402

# The hosts cannot import this test module: its functions travel by value, as a notebook's do.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The module's slice starts in its first test's setup: on a busy machine a host may need several of
# LocalSlice's five tries (about a minute each), more than the default 300 s.
pytestmark = pytest.mark.timeout(900)

TOPOLOGY, VERSION, HOSTS, CHIPS = "4x4", "v5e", 4, 4
LEFT_BEHIND_WAIT_S = 90  # how long Ray gets to finish removing what a run released


def _descendants() -> list:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _host_task_processes() -> list[str]:
    """Worker processes of this machine running (or stuck in) a host task."""
    return [f"{p.pid}: {c}" for p in _descendants() if (c := _cmdline(p)).startswith("ray::slice_host")]


def assert_nothing_left_running() -> None:
    """The slice's placement groups are removed, all its TPUs are free, and no host task process is alive."""
    deadline = time.monotonic() + LEFT_BEHIND_WAIT_S
    while True:
        groups = {pg_id: pg["state"] for pg_id, pg in ray.util.placement_group_table().items()}
        live_groups = {k: v for k, v in groups.items() if v != "REMOVED"}
        free_tpus = ray.available_resources().get("TPU", 0)
        procs = _host_task_processes()
        if not live_groups and free_tpus == HOSTS * CHIPS and not procs:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"left running after the run: placement groups {live_groups}, {free_tpus} of "
                        f"{HOSTS * CHIPS} TPUs free, host task processes {procs}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def local_slice():
    with tpukit.LocalSlice(TOPOLOGY, VERSION, devices_per_host=2) as sim:  # started; stopped at the end
        assert repr(sim).startswith("<LocalSlice v5litepod-16 (4x4): 4 hosts × 2 XLA:CPU devices, running at ")
        ray.init(address=sim.address, log_to_driver=False)
        ray_processes = [p for p in _descendants() if "ray" in _cmdline(p)]
        assert ray_processes, "the simulated slice started no Ray process"
        yield sim
    assert not ray.is_initialized() and sim.session_dir is None
    gone, alive = psutil.wait_procs(ray_processes, timeout=60)
    assert not alive, f"Ray processes still alive after LocalSlice.shutdown(): {[_cmdline(p) for p in alive]}"


class Collect:
    """A listener keeping every record and event it receives (as the notebook's dashboard would)."""

    def __init__(self):
        self.steps, self.compiles = [], []

    def on_step(self, record):
        self.steps.append(record)

    def on_compile(self, event):
        self.compiles.append(event)


# ------------------------------------------------------------------ the functions the hosts run

def train_on_host(steps):
    """An ordinary SPMD training function: each host trains over its own devices."""
    import os

    import torch

    import tpukit
    from tpukit import hosts

    rt = tpukit.setup(spmd=True)
    mesh = tpukit.mesh()
    host = hosts.current()
    node = ray.get_runtime_context().get_node_id()
    print(f"host {host.index} of {host.count}: {rt.device_count} {rt.device_type} devices; node {node}; "
          f"TPU_WORKER_ID={os.environ['TPU_WORKER_ID']} hostnames={len(os.environ['TPU_WORKER_HOSTNAMES'].split(','))} "
          f"MASTER_ADDR={os.environ['MASTER_ADDR']} rank={tpukit.rank()}")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).to(rt.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(host.index)
    batches = [(torch.randn(8, 8, generator=data), torch.randint(0, 2, (8,), generator=data)) for _ in range(steps)]
    for x, y in tpukit.track(batches, mesh=mesh, progress=False):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tpukit.log(loss=loss)
    return {"host": host.index, "count": host.count, "devices": rt.device_count, "loss": float(loss)}


def checkpoint_on_host(directory):
    """Each host joins the slice's group and checkpoints an SPMD-sharded model: sharded, and gathered."""
    import os

    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    import tpukit
    from tpukit import hosts
    from tpukit.checkpoint import CheckpointManager

    host = hosts.process_group()
    rt = tpukit.setup(spmd=True)
    mesh = tpukit.mesh()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(rt.device)
    xs.mark_sharding(model.weight, mesh, ("data", None))
    sharded = CheckpointManager(os.path.join(directory, "sharded"), keep=2)
    whole = CheckpointManager(os.path.join(directory, "whole"), keep=2, sharded=False)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        torch_xla.sync()
        sharded.save(step, model=model.state_dict())
        whole.save(step, model=model.state_dict())  # replicated on the CPU: host 0 alone writes it
    seen = sorted(os.listdir(os.path.join(directory, "sharded")))  # after save returned: committed
    return {"host": host.index, "weight": model.weight.cpu().tolist(), "seen": seen,
            "group_port": int(os.environ[hosts.GROUP_PORT_ENV])}


def fail_on_host_two():
    import time

    from tpukit import hosts

    index = hosts.current().index
    if index == 2:
        print("host two is about to fail")
        raise ValueError("host 2 cannot go on")
    time.sleep(600)  # the others would wait here for a long time: they must be cancelled


def fail_at_once_on_host_two():
    """Host 2 raises as soon as it runs; the others sleep 30 s (issue #37's case: only a cancel ends them early)."""
    import time

    from tpukit import hosts

    if hosts.current().index == 2:
        print(f"host two fails at once at {time.time():.3f}", flush=True)  # this machine's clock, as the test's
        raise ValueError("host 2 failed at once")
    time.sleep(30)


def crash_on_host_one():
    import os
    import time

    from tpukit import hosts

    if hosts.current().index == 1:
        print("host one goes down", flush=True)
        os._exit(3)  # what an out-of-memory kill or a segfault looks like from outside: no exception, no result
    time.sleep(600)


def report_then_wait():
    """A step record from each host (the way tpukit.track publishes one), then wait to be cancelled."""
    import time

    from tpukit import events, steps

    events.call("on_step", steps.StepRecord(step=1, start=time.time() - 0.5, end=time.time()))
    time.sleep(600)


def not_run():
    raise AssertionError("this function must never run")


# ------------------------------------------------------------------ errors before anything starts

@pytest.mark.light
def test_no_reachable_cluster_is_a_clear_error_before_anything_starts():
    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if address:
        ray.shutdown()  # this test needs a process that is not connected
    try:
        with pytest.raises(tpukit.SliceError, match=r"not connected to a Ray cluster: call ray.init\(address="):
            tpukit.run_on_slice(not_run)
        with pytest.raises(tpukit.SliceError, match=r"no Ray cluster is reachable at 127\.0\.0\.1:9 .*ray start --head"):
            tpukit.run_on_slice(not_run, address="127.0.0.1:9")
        assert not ray.is_initialized()
    finally:
        if address:
            ray.init(address=address, log_to_driver=False)


def test_bad_input_is_refused_before_anything_starts(local_slice):
    import threading

    lock = threading.Lock()

    def holds_a_lock():
        return lock.locked()

    groups_before = len(ray.util.placement_group_table())
    with pytest.raises(tpukit.SliceError, match=r"holds_a_lock or its arguments cannot be pickled"):
        tpukit.run_on_slice(holds_a_lock)
    with pytest.raises(tpukit.SliceError, match=r"topology='3x3' does not exist for TPU v5e .* 2x2, 2x4, 2x8, 4x4"):
        tpukit.run_on_slice(not_run, topology="3x3")
    with pytest.raises(tpukit.SliceError, match=r"accelerator_version='v9' is not a TPU generation"):
        tpukit.run_on_slice(not_run, accelerator_version="v9")
    # a 4x8 v5e is a v5e-32: eight hosts; the cluster has the four of one v5e-16
    with pytest.raises(tpukit.SliceError, match=r"no complete v5litepod-32 slice \(topology 4x8, 8 hosts.*it has "
                                                r"slice 'tpukit-local-slice': 4 hosts of a v5litepod-16 \(4x4\)"):
        tpukit.run_on_slice(not_run, topology="4x8")
    assert len(ray.util.placement_group_table()) == groups_before, "an error case reserved a slice"
    assert_nothing_left_running()


@pytest.mark.light
def test_a_local_slice_needs_a_positive_device_count():
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=re.escape(f"devices_per_host={bad!r} must be a positive int")):
            tpukit.LocalSlice(TOPOLOGY, VERSION, devices_per_host=bad)
    assert tpukit.LocalSlice(TOPOLOGY, VERSION).devices_per_host == CHIPS  # None: one device per chip
    assert tpukit.LocalSlice(TOPOLOGY, VERSION, devices_per_host=1).devices_per_host == 1


def test_a_busy_slice_is_refused_before_anything_starts(local_slice):
    from ray.util.tpu import slice_placement_group

    taken = slice_placement_group(TOPOLOGY, "v5litepod")  # someone else holds the slice's TPUs
    try:
        ray.get(taken.placement_group.ready(), timeout=60)
        with pytest.raises(tpukit.SliceError, match=r"all 1 v5litepod-16 slice\(s\) of the Ray cluster are busy"):
            tpukit.run_on_slice(not_run)
    finally:
        taken.shutdown()
    assert_nothing_left_running()


# ------------------------------------------------------------------ runs

def test_one_task_per_host_with_its_environment_and_telemetry(local_slice, capsys):
    seen = events.add_listener(Collect())
    result = tpukit.run_on_slice(train_on_host, 3, topology=TOPOLOGY, accelerator_version=VERSION, dashboard=True)
    out = capsys.readouterr().out

    # host 0's return value comes back
    assert result["host"] == 0 and result["count"] == HOSTS and result["devices"] == 2, result

    # one task on each host, each told its index, the host count and host 0's address
    nodes = set()
    for i in range(HOSTS):
        line = re.search(rf"^\[host {i}\] host {i} of {HOSTS}: 2 CPU devices; node (\w+); TPU_WORKER_ID={i} "
                         rf"hostnames={HOSTS} MASTER_ADDR=\S+ rank={i}$", out, re.M)
        assert line, f"no line from host {i} in:\n{out}"
        nodes.add(line.group(1))
    assert len(nodes) == HOSTS, f"the hosts' tasks did not run on {HOSTS} different nodes: {nodes}"

    # every host's step records and compile events reached this process's listeners, tagged
    by_host = {}
    for record in seen.steps:
        by_host.setdefault(record.host, []).append(record)
    assert sorted(by_host) == list(range(HOSTS)), sorted(by_host)
    assert all([r.step for r in recs] == [1, 2, 3] for recs in by_host.values()), by_host
    assert all("loss" in r.scalars for r in seen.steps)
    assert {e.host for e in seen.compiles} == set(range(HOSTS))
    assert all(isinstance(e, tpukit.CompileEvent) for e in seen.compiles)

    # the per-host view (dashboard=True; text mode here) printed its final table
    assert f"slice: {HOSTS} of {HOSTS} hosts reporting, steps 3/3/3/3; slowest host" in out, out
    assert_nothing_left_running()


def test_checkpoints_from_a_slice_sharded_per_host_and_replicated_from_host_0(local_slice, tmp_path):
    import json

    import torch

    from tpukit import checkpoint

    import socket

    # Another run's rendezvous already listens on the port a fixed choice would take (two simulated
    # slices on one machine, or a stale run): host 0 gives the run a free port instead.
    with socket.socket() as taken:
        taken.bind(("", hosts.DEFAULT_GROUP_PORT))
        taken.listen()
        result = tpukit.run_on_slice(checkpoint_on_host, str(tmp_path), topology=TOPOLOGY, accelerator_version=VERSION)
    assert result["host"] == 0
    assert result["group_port"] != hosts.DEFAULT_GROUP_PORT
    committed = ["ckpt-00000001.dcp", "ckpt-00000001.json", "ckpt-00000002.dcp", "ckpt-00000002.json"]
    assert result["seen"] == committed  # every host returned from save only after host 0 committed
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == committed  # no temporary directory left
    manifest = json.loads((tmp_path / "sharded" / "ckpt-00000002.json").read_text())
    assert sorted(manifest["files"]) == [".metadata"] + [f"__{i}_0.distcp" for i in range(HOSTS)]  # one per host
    expected = torch.tensor(result["weight"])
    assert torch.equal(checkpoint.load(tmp_path / "sharded")["model"]["weight"], expected)
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == [
        "ckpt-00000001.json", "ckpt-00000001.pt", "ckpt-00000002.json", "ckpt-00000002.pt"]
    assert torch.equal(checkpoint.load(tmp_path / "whole")["model"]["weight"], expected)
    assert_nothing_left_running()


def test_a_raising_host_shows_its_traceback_and_the_others_are_cancelled(local_slice, capsys):
    with pytest.raises(tpukit.SliceError) as failure:
        tpukit.run_on_slice(fail_on_host_two)
    message = str(failure.value)
    assert message.startswith("host 2 failed: ValueError: host 2 cannot go on; the other hosts' tasks were cancelled. "
                              "Its traceback:"), message
    assert "in fail_on_host_two" in message and 'raise ValueError("host 2 cannot go on")' in message, message
    assert "tpukit/parallel/hosts.py" not in message, "the traceback should start at the user's function"
    assert "[host 2] host two is about to fail" in capsys.readouterr().out
    assert_nothing_left_running()  # the other three hosts would sleep for 10 minutes if not cancelled


def test_a_failing_host_reaches_the_notebook_without_waiting_for_the_others(local_slice, capsys):
    """Host 2 raises at once while the other three sleep 30 s: the SliceError, with host 2's traceback and
    last output, reaches the caller without waiting for them, the others cancelled, nothing left.

    Not a performance measurement (those are not timed assertions in tests) but the behaviour issue #37
    asks for: a failure must not wait for the sleeping hosts (from host 2's failure to the caller: well
    under their 30 s), nor for anything before the hosts start (a small task on host 0 took up to 120 s).
    The whole call also reserves the slice and starts four fresh host processes that each import torch:
    15-24 s at a load of 9-13 on two cores (the 25 s the issue asks for), 73 s once beside three other
    jobs. That part is the machine's, so it is printed, not asserted."""
    start = time.monotonic()
    with pytest.raises(tpukit.SliceError) as failure:
        tpukit.run_on_slice(fail_at_once_on_host_two)
    ended, took = time.time(), time.monotonic() - start
    message = str(failure.value)
    assert message.startswith("host 2 failed: ValueError: host 2 failed at once; the other hosts' tasks were "
                              "cancelled. Its traceback:"), message
    assert 'raise ValueError("host 2 failed at once")' in message, message
    out = capsys.readouterr().out
    failed_at = float(re.search(r"\[host 2\] host two fails at once at ([\d.]+)", out).group(1))
    print(f"SliceError {took:.1f} s after the call, {ended - failed_at:.1f} s after host 2 raised")
    assert ended - failed_at < 15, f"the SliceError came {ended - failed_at:.1f} s after host 2 raised: it waited"
    assert_nothing_left_running()


def test_a_host_that_dies_ends_the_run_and_the_others_are_cancelled(local_slice, capsys):
    with pytest.raises(tpukit.SliceError, match=r"(?s)^host 1's task died without a result \(.*\): a crash, os._exit or "
                                                r"out of memory; its output above may say why; the other hosts' "
                                                r"tasks were cancelled\.$"):
        tpukit.run_on_slice(crash_on_host_one)
    assert "[host 1] host one goes down" in capsys.readouterr().out
    assert_nothing_left_running()


def test_ctrl_c_while_the_slice_is_being_reserved_leaves_no_reservation(local_slice):
    import threading

    from ray.util import placement_group, placement_group_table, remove_placement_group

    # Someone else holds host 0's head resource (not its TPUs: the slice looks idle), so run_on_slice's
    # reservation waits for it; Ctrl-C comes while it waits, as a user's would.
    holder = placement_group([{"TPU-v5litepod-16-head": 1}])
    ray.get(holder.ready(), timeout=60)
    before = set(placement_group_table())
    waited = []

    def interrupt_while_reserving():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            waiting = [g for g, pg in placement_group_table().items() if g not in before and pg["state"] == "PENDING"]
            if waiting:
                waited.extend(waiting)
                time.sleep(0.5)
                _thread.interrupt_main()  # what Ctrl-C (the kernel's interrupt) does to the notebook
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_while_reserving, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt, match="while the 4x4 slice was being reserved; the reservation was removed"):
            tpukit.run_on_slice(not_run, timeout=60)
        assert waited, "the reservation never waited: the test did not interrupt it"
        left = {g: pg["state"] for g, pg in placement_group_table().items() if g not in before and pg["state"] != "REMOVED"}
        assert left == {}, f"the interrupted reservation left placement groups in Ray: {left}"
    finally:
        remove_placement_group(holder)
    assert_nothing_left_running()


def test_ctrl_c_cancels_the_slice(local_slice):
    class InterruptOnFirstStep:
        def on_step(self, record):
            _thread.interrupt_main()  # what Ctrl-C (the kernel's interrupt) does to the notebook

    events.add_listener(InterruptOnFirstStep())
    with pytest.raises(KeyboardInterrupt, match="tasks on the 4 hosts were cancelled and the slice was released"):
        tpukit.run_on_slice(report_then_wait)
    assert_nothing_left_running()
