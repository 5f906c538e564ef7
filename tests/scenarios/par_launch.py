"""Launcher scenarios for tests/test_parallel.py, run in a fresh process (PJRT_DEVICE=CPU).

``tpukit.launch`` refuses to start replicas once the XLA runtime runs in the
launching process, and the pytest process has usually started it, so these
scenarios run here, in a process where nothing touched the device yet (until
the last scenario, which does so on purpose). ``python par_launch.py run DIR``
prints one JSON object (the last line of stdout); the assertions live in
test_parallel.py. Replicas write their pids to files in DIR.

XLA:CPU limitation: collectives across replicas do not work on CPU, so the
multi-replica scenarios use independent children whose code needs none, and
the XLA scenarios use a single replica. ``python par_launch.py orphan DIR``
starts sleeping replicas and waits to be killed (the test kills it).
"""

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings

import tpukit
from tpukit import _xla, runtime
from tpukit.parallel import launcher  # the module (tpukit.launch is the function)

PIDDIR = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="tpukit-par-")
os.makedirs(PIDDIR, exist_ok=True)


def write_pid(tag, index, value=None):
    path = os.path.join(PIDDIR, f"{tag}-{index}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid() if value is None else value))
    os.replace(path + ".tmp", path)


def wait_pids(tag, ranks, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(os.path.exists(os.path.join(PIDDIR, f"{tag}-{r}.pid")) for r in ranks):
            return
        time.sleep(0.02)
    raise TimeoutError(f"replicas {ranks} of {tag!r} did not start")


def read_pids(tag):
    pids = {}
    for name in os.listdir(PIDDIR):
        if name.startswith(tag + "-") and name.endswith(".pid"):
            with open(os.path.join(PIDDIR, name)) as f:
                pids[int(name[len(tag) + 1:-4])] = int(f.read())
    return pids


def alive(pid):
    """True while ``pid`` runs (a zombie, dead but not yet reaped by its parent, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def child_pids():
    """PIDs whose parent is this process (Linux /proc; no psutil), without the helpers that are not
    replicas: multiprocessing's resource tracker ('spawn' starts it once per Python process) and
    torch 2.8's inductor compile-worker pool (its import of torch._inductor starts it, before any launch)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"resource_tracker" not in cmdline \
                    and b"_inductor/compile_worker" not in cmdline:
                out.append(int(entry))
    return out


# --------------------------------------------------------------- replica functions (top level: picklable for spawn)

def ret_fn(index, base):
    write_pid("ret", index)
    write_pid("rank", index, runtime.rank())
    return {"index": index, "value": base + index, "pid": os.getpid(), "rank": runtime.rank()}


def spawn_fn(index, base):
    return {"index": index, "value": base * 2, "pid": os.getpid(), "main": getattr(sys.modules["__main__"], "__name__")}


def _inner_failure(index):
    raise ValueError(f"boom from rank {index}")


def err_fn(index):
    write_pid("err", index)
    if index == 1:
        wait_pids("err", [0, 2])  # the others are running when this one fails
        _inner_failure(index)
    time.sleep(600)


def out_fn(index):
    print(f"hello from {index}")
    print(f"err line {index}", file=sys.stderr)
    os.write(1, f"raw fd line {index}\n".encode())
    sys.stdout.write(f"partial {index}")
    return index


def exit_fn(index):
    if index == 1:
        os._exit(3)
    time.sleep(600)


def kill_fn(index):
    if index == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def sleep_fn(index, tag, ignore_term):
    if ignore_term and index == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # forces the launcher to escalate to SIGKILL
    write_pid(tag, index)
    time.sleep(600)


def refused_fn(index):
    write_pid("refused", index)


def bad_result_fn(index):
    return (lambda: index) if index == 0 else None


def xla_fn(index, scale):
    import torch

    t = torch.ones(4, device=_xla.device()) * scale
    return {"index": index, "sum": (t * 2).sum().item(), "rank": runtime.rank(), "world_size": _xla.world_size(),
            "device": str(t.device), "pid": os.getpid()}


def allreduce_fn(index):
    import torch
    import torch_xla.core.xla_model as xm  # the user's own xmp-style code, as on TPU

    t = torch.ones(3, device=_xla.device()) * (index + 1)
    reduced = xm.all_reduce(xm.REDUCE_SUM, t)
    return {"index": index, "world_size": _xla.world_size(), "reduced": reduced.cpu().tolist(),
            "thread": threading.current_thread().name, "pid": os.getpid()}


# --------------------------------------------------------------- scenarios

out = {}


def scenario(fn):
    t0 = time.time()
    print(f"scenario {fn.__name__} starts", file=sys.stderr, flush=True)  # a hang's output names it
    try:
        out[fn.__name__] = fn()
    except BaseException as exc:
        out[fn.__name__] = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    if isinstance(out[fn.__name__], dict):
        out[fn.__name__]["seconds"] = round(time.time() - t0, 2)
    return fn


def run_all():
    @scenario
    def return_fork():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = launcher.launch(ret_fn, 10, nprocs=3, start_method="fork")
        pids = read_pids("ret")
        return {"value": value, "pids": pids, "ranks": read_pids("rank"), "alive": [alive(p) for p in pids.values()], "parent": os.getpid(),
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
                "runtime_started": _xla.runtime_initialized()}

    @scenario
    def return_spawn():
        plan = launcher._plan(2, False, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = launcher.launch(spawn_fn, 21, nprocs=2)
        return {"value": value, "start_method": plan.start_method, "parent": os.getpid(), "children": child_pids()}

    @scenario
    def error():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                launcher.launch(err_fn, nprocs=3, start_method="fork")
                message = None
            except tpukit.LaunchError as exc:
                message = str(exc)
        pids = read_pids("err")
        return {"message": message, "pids": pids, "alive": [alive(p) for p in pids.values()], "children": child_pids()}

    @scenario
    def output():
        cap_out, cap_err = io.StringIO(), io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(cap_out), contextlib.redirect_stderr(cap_err):
            warnings.simplefilter("ignore")
            value = launcher.launch(out_fn, nprocs=2, start_method="fork")
        return {"value": value, "stdout": cap_out.getvalue(), "stderr": cap_err.getvalue()}

    @scenario
    def died():
        res = {}
        for name, fn in (("exit", exit_fn), ("kill", kill_fn)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    launcher.launch(fn, nprocs=2, start_method="fork")
                    res[name] = None
                except tpukit.LaunchError as exc:
                    res[name] = str(exc)
        res["children"] = child_pids()
        return res

    @scenario
    def interrupt():
        def interrupter():
            wait_pids("int", [0, 1])
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupter, daemon=True).start()
        t0 = time.time()
        raised = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                launcher.launch(sleep_fn, "int", True, nprocs=2, start_method="fork")
            except KeyboardInterrupt:
                raised = "KeyboardInterrupt"
        pids = read_pids("int")
        return {"raised": raised, "pids": pids, "alive": [alive(p) for p in pids.values()],
                "children": child_pids(), "elapsed": round(time.time() - t0, 2)}

    @scenario
    def spawn_unpicklable():
        try:
            launcher.launch(lambda i: i, start_method="spawn")
            message = None
        except tpukit.LaunchError as exc:
            message = str(exc)
        return {"message": message, "children": child_pids()}

    @scenario
    def bad_result():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                launcher.launch(bad_result_fn, nprocs=2, start_method="fork")
                return {"message": None}
            except tpukit.LaunchError as exc:
                return {"message": str(exc)}

    @scenario
    def xla_single():
        first = launcher.launch(xla_fn, 3.0)  # nprocs=None on CPU: one real XLA replica in a child
        second = launcher.launch(xla_fn, 0.5, start_method="fork")
        return {"first": first, "second": second, "parent": os.getpid(), "plan": launcher._plan(None, False, None).mode,
                "parent_runtime_started": _xla.runtime_initialized(), "children": child_pids()}

    @scenario
    def mocked_tpu():
        # Mocked: only the device kind (there is no TPU here). The child then runs
        # exactly what it runs on a TPU host: torch_xla's per-process initializer
        # and one thread per addressable device (1 XLA:CPU device -> 1 replica).
        real = launcher._device_kind
        launcher._device_kind = lambda: "TPU"
        try:
            plan = launcher._plan(None, False, "fork")
            value = launcher.launch(allreduce_fn, start_method="fork")
        finally:
            launcher._device_kind = real
        return {"plan": [plan.mode, plan.nprocs], "value": value, "parent": os.getpid()}

    @scenario
    def refused():
        dev = _xla.device()  # touches the device without tpukit.setup(): the runtime starts here
        before = child_pids()
        try:
            launcher.launch(refused_fn, nprocs=2, start_method="fork")
            message = None
        except tpukit.LaunchError as exc:
            message = str(exc)
        return {"message": message, "device": str(dev), "children_before": before, "children_after": child_pids(),
                "replica_ran": bool(read_pids("refused"))}


def orphan():
    """Start sleeping replicas and block; the test SIGKILLs this process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        launcher.launch(sleep_fn, "orphan", False, nprocs=2, start_method="fork")


if __name__ == "__main__":
    if sys.argv[1:2] == ["orphan"]:
        orphan()
    else:
        launcher._TERMINATE_GRACE = 1.0  # the SIGTERM-ignoring replica is killed after 1 s
        run_all()
        sys.stdout.flush()
        print(json.dumps(out))
