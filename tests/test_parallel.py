"""Tests of tpukit.spmd and tpukit.launch (issue 7): SPMD data parallel and the notebook-safe launcher.

Everything runs on real torch_xla on XLA:CPU. The runtime's device count and
SPMD mode are fixed when it starts, so the SPMD checks run once in a subprocess
with 4 virtual devices (tests/scenarios/par_spmd.py) and the launcher scenarios once in a
fresh process where nothing touched the device yet (tests/scenarios/par_launch.py); the
tests below assert on what those report.

XLA:CPU limitation (pytorch/xla #5005, #9089):
collectives across replicas are not supported on CPU (they hang, then abort),
so launcher tests with several replicas use independent child processes whose
code needs no collectives, and the XLA replica code paths run with one replica.
The only mock is the device kind 'TPU' (there is no TPU here), used to drive the
TPU code path of the launcher; it is named where it is used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from tpukit import spmd as spmd_mod

import tpukit
from tpukit import _ipython, _xla, runtime
from tpukit import spmd as tk_spmd  # "spmd" is the fixture below
from tpukit.parallel import launcher  # the module (tpukit.launch is the function)

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")


# --------------------------------------------------------------------------- helpers

def _env(**extra: str) -> dict:
    """This environment without runtime settings that would leak into a fresh XLA process."""
    drop = ("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD", "PJRT_LOCAL_PROCESS", runtime.RANK_ENV)
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PJRT_DEVICE"] = "CPU"
    env.update(extra)
    return env


def _run_json(args: list, env: dict, timeout: float = 240) -> dict:
    try:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"{args[0]} did not end within {timeout:g} s; the end of its stderr:\n{err[-4000:]}")
    assert proc.returncode == 0, f"{args[0]} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _part(data: dict, name: str):
    value = data[name]
    if isinstance(value, dict) and "crashed" in value:
        pytest.fail(f"{name} crashed in the subprocess: {value['crashed']}\n{value['traceback']}")
    return value


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, waiting to be reaped by init) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _child_pids() -> set[int]:
    """Children of this process from /proc (no psutil), minus multiprocessing's resource tracker."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == os.getpid() and b"resource_tracker" not in cmdline:
                out.add(int(entry))
    return out


@pytest.fixture(scope="module")
def spmd() -> dict:
    """Results of tests/scenarios/par_spmd.py: 4 virtual XLA:CPU devices, tpukit.setup(spmd=True)."""
    return _run_json([os.path.join(SCENARIOS, "par_spmd.py")], _env(CPU_NUM_DEVICES="4"))


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Results of tests/scenarios/par_launch.py, run in a process that has not started the XLA runtime."""
    piddir = tmp_path_factory.mktemp("pids")
    return _run_json([os.path.join(SCENARIOS, "par_launch.py"), "run", str(piddir)], _env())


# --------------------------------------------------------------------------- SPMD

def test_spmd_training_matches_single_device(spmd):
    assert spmd["runtime"] == {"device_count": 4, "spmd": True, "problems": []}
    eq = _part(spmd, "equivalence")
    # Checked, not assumed: the inputs are split 4 ways along the batch dimension.
    assert "devices=[4,1]" in eq["batch_specs"]["x"]
    assert "devices=[4]" in eq["batch_specs"]["y"]
    # Same MLP, same data, 10 SGD steps: sharded over 4 devices vs eager CPU torch.
    # Tolerance 1e-5: the sharded mean loss and gradients are summed as 4 partial
    # sums plus an all-reduce instead of one sum, and XLA:CPU and eager torch use
    # different float32 kernels; both only reorder float32 additions (eps 1.2e-7).
    assert eq["losses"] == pytest.approx(eq["ref_losses"], abs=1e-5, rel=1e-4)
    assert eq["max_weight_diff"] < 1e-5
    assert eq["ref_losses"][-1] < eq["ref_losses"][0] - 0.1  # it learned: the comparison is not of constants


def test_shard_batch_nested_structures(spmd):
    b = _part(spmd, "shard_batch")
    assert b["x"] == b["pair0"] == "{devices=[4,1]0,1,2,3}"
    assert b["y"] == b["list_y"] == "{devices=[4]0,1,2,3}"
    assert b["pair_is_tuple"] and b["name"] == "ids"  # structure kept, non-tensors passed through
    assert b["scalar_device"].startswith("xla") and b["scalar_value"] == 2.5  # scalars replicated
    assert b["x_roundtrip_equal"] and b["type_is_plain_tensor"]
    assert b["in_place_same_object"] and "devices=[4,1]" in b["in_place_spec"]  # XLA tensors annotated in place
    assert b["unsharded_spec"] == ""
    assert "devices=[2,1,2]" in b["two_d_mesh_spec"] and "last_tile_dim_replicate" in b["two_d_mesh_spec"]


def test_shard_batch_indivisible_batch_error(spmd):
    err = _part(spmd, "indivisible")
    assert err["type"] == "ShardingError" and err["is_tpukit"] and err["is_value_error"]
    msg = err["message"]
    for part in ("batch of 30", "batch['x']", "4 devices", "axis 'data'", "multiple of 4", "28 or 32", "drop_last=True"):
        assert part in msg, (part, msg)


def test_mesh_shapes_and_errors(spmd):
    m = _part(spmd, "mesh")
    assert m["default"] == {"data": 4}
    assert m["two_axes"] == m["inferred"] == {"data": 2, "model": 2}
    assert "covers 3 devices but the runtime has 4" in m["bad_shape"]
    assert "one size per axis" in m["bad_len"]
    assert "distinct" in m["dup_axes"]
    assert "no axis 'model'" in m["missing_axis"] and "('data',)" in m["missing_axis"]


def test_device_loader_shards_each_batch(spmd):
    d = _part(spmd, "device_loader")
    assert d["batches"] == 10 and d["values_equal"]
    assert d["specs"] == [["{devices=[4,1]0,1,2,3}", "{devices=[4]0,1,2,3}"]]
    assert d["dict_specs"] == [{"input_ids": "{devices=[4,1]0,1,2,3}", "labels": "{devices=[4]0,1,2,3}"}] * 2
    assert d["no_mesh_device"].startswith("xla") and "devices=" not in d["no_mesh_specs"][0]
    # 330 rows in batches of 32: the last batch of 10 cannot be split; it raises, it is not dropped silently.
    assert d["ragged_error"]["type"] == "ShardingError"
    assert "batch of 10" in d["ragged_error"]["message"] and "drop_last=True" in d["ragged_error"]["message"]
    assert 1 <= d["ragged_good_batches"] < 11
    assert d["drop_last_batches"] == 10


def test_fsdp_shards_parameters_and_trains(spmd):
    f = _part(spmd, "fsdp")
    eq = _part(spmd, "equivalence")
    # Every parameter is split 4 ways along its largest dimension (checked, before and after training).
    for specs in (f["param_specs"], f["after_specs"]):
        assert specs["0.weight"] == "{devices=[4,1]0,1,2,3}"  # (32, 16): dim 0
        assert specs["2.weight"] == "{devices=[1,4]0,1,2,3}"  # (4, 32): dim 1
        assert specs["0.bias"] == specs["2.bias"] == "{devices=[4]0,1,2,3}"
    losses = f["losses"]
    assert losses[-1] < losses[0] - 0.1
    assert sum(losses[-3:]) < sum(losses[:3])
    # FSDP changes where parameters live, not the math: same trajectory as eager CPU (tolerance as above).
    assert losses == pytest.approx(eq["ref_losses"], abs=1e-5, rel=1e-4)
    assert f["wrapper_keys"][0].startswith("_orig_module.")
    assert not any(spmd_mod.FSDP_HOOK_NOTICE in w for w in f["warnings"]), f["warnings"]


def test_sharded_parameters_gather_for_checkpoint(spmd):
    f = _part(spmd, "fsdp")
    # .cpu() of a sharded parameter returns the whole tensor, as tpukit.checkpoint.save needs.
    assert f["shapes"] == f["ref_shapes"]
    assert f["max_weight_diff"] < 1e-5
    assert f["restored_matches_live"] < 1e-5  # saved, loaded into a CPU model: same outputs


def test_launch_refused_under_spmd(spmd):
    msg = spmd["launch_refused_under_spmd"]
    assert msg is not None and "SPMD mode is on" in msg and "tpukit.mesh()" in msg


# --------------------------------------------------------------------------- SPMD errors in this process

def test_mesh_needs_spmd_after_runtime_started(rt):
    assert tpukit.runtime.current() is not None and not tpukit.runtime.current().spmd
    with pytest.raises(tpukit.RuntimeStateError) as info:
        tk_spmd.mesh()
    msg = str(info.value)
    assert "already started without it" in msg and "Restart the kernel" in msg and "tpukit.setup(spmd=True)" in msg


def test_mesh_needs_spmd_before_runtime_start():
    code = ("import json, sys, tpukit.spmd as p\n"
            "try:\n    p.mesh()\nexcept Exception as e:\n"
            "    print(json.dumps([type(e).__name__, str(e), 'torch_xla' in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    kind, msg, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert kind == "RuntimeStateError"
    assert "tpukit.setup(spmd=True)" in msg and "cpu_devices=N" in msg and "Restart" not in msg
    assert not imported  # the check itself neither imports torch_xla nor starts the runtime


def test_sharding_spec_needs_an_xla_tensor(rt):
    import torch

    with pytest.raises(tpukit.ShardingError, match="needs a tensor on the XLA device, got a cpu tensor"):
        tk_spmd.sharding_spec(torch.zeros(2))
    assert tk_spmd.sharding_spec(torch.zeros(2, device=_xla.device())) == ""


# --------------------------------------------------------------------------- launcher in this process

def _touch(index: int, path: str) -> None:
    open(f"{path}-{index}", "w").close()


def _debug_replica(index: int, x: float):
    import torch

    return index, os.getpid(), (torch.ones(2, device=_xla.device()) * x).sum().item()


def _divide_by_zero(index: int):
    return 1 / index


def test_launch_refuses_when_runtime_running(rt, tmp_path):
    assert _xla.runtime_initialized()
    before = _child_pids()
    with pytest.raises(tpukit.LaunchError) as info:
        launcher.launch(_touch, str(tmp_path / "ran"), nprocs=2, start_method="fork")
    msg = str(info.value)
    assert "already running in this kernel" in msg and "tpukit.setup() started it" in msg
    assert "Restart the kernel" in msg and "before anything touches the device" in msg
    assert _child_pids() == before and not list(tmp_path.iterdir())  # nothing was started


def test_debug_single_process_runs_here(rt):
    assert launcher.launch(_debug_replica, 1.5, debug_single_process=True) == (0, os.getpid(), 3.0)
    with pytest.raises(ZeroDivisionError):  # not wrapped: debuggers see the original exception
        launcher.launch(_divide_by_zero, debug_single_process=True)


def test_rank_outside_launch(rt):
    assert runtime.rank() == 0


def test_plan_decisions(monkeypatch):
    assert launcher._plan(None, False, "fork") == launcher._Plan("single", 1, "fork", "CPU")
    assert launcher._plan(4, False, "spawn") == launcher._Plan("independent", 4, "spawn", "CPU")
    assert launcher._plan(3, True, None).mode == "in-process"
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="nprocs="):
            launcher._plan(bad, False, None)
    with pytest.raises(ValueError, match="start_method="):
        launcher._plan(None, False, "thread")
    # Mocked: a TPU host with 4 chips (neither exists here).
    monkeypatch.setattr(launcher, "_device_kind", lambda: "TPU")
    monkeypatch.setattr(_xla, "local_process_count", lambda: 4)
    assert launcher._plan(None, False, "fork") == launcher._Plan("replicated", 4, "fork", "TPU")
    assert launcher._plan(1, False, "fork").mode == "single"
    with pytest.raises(ValueError, match="nprocs=2 is not supported on TPU"):
        launcher._plan(2, False, "fork")


def test_start_method_follows_the_context(monkeypatch):
    # pytest's __main__ is a file: a script, so spawn.
    assert getattr(sys.modules["__main__"], "__file__", None) and launcher._default_start_method() == "spawn"
    shell = types.SimpleNamespace()  # a terminal IPython shell: no kernel, still a script here
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert launcher._default_start_method() == "spawn"
    shell.kernel = object()  # a Jupyter kernel (the real one is tested below)
    assert _ipython.in_kernel() and launcher._default_start_method() == "fork"
    monkeypatch.setattr(sys.modules["__main__"], "__file__", None)  # a REPL / python -c
    monkeypatch.delitem(sys.modules, "ipykernel")
    assert launcher._default_start_method() == "fork"


# --------------------------------------------------------------------------- launcher in a fresh process

def test_launch_returns_rank0_value(launched):
    r = _part(launched, "return_fork")
    pids = {int(k): v for k, v in r["pids"].items()}
    assert r["value"] == {"index": 0, "value": 10, "pid": pids[0], "rank": 0}
    assert len(set(pids.values())) == 3 and r["parent"] not in pids.values()
    assert {int(k): v for k, v in r["ranks"].items()} == {0: 0, 1: 1, 2: 2}  # rank() inside each replica
    assert not r["runtime_started"]  # the parent never starts the runtime
    assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("TpukitWarning")
    assert "independent" in r["warnings"][0] and "collectives" in r["warnings"][0]


def test_launch_spawns_in_scripts(launched):
    r = _part(launched, "return_spawn")
    assert r["start_method"] == "spawn"
    assert r["value"]["value"] == 42 and r["value"]["pid"] != r["parent"]
    assert r["value"]["main"] == "__mp_main__"  # spawn re-imported the script in the child
    assert r["children"] == []


def test_launch_reraises_replica_exception_with_traceback(launched):
    msg = _part(launched, "error")["message"]
    assert msg.startswith("replica rank 1 failed with ValueError: boom from rank 1")
    assert "Traceback (most recent call last)" in msg
    assert "in err_fn" in msg and "in _inner_failure" in msg  # the replica's own frames
    assert os.path.join("tpukit", "parallel", "launcher.py") not in msg and os.path.join("tpukit", "_xla") not in msg  # plumbing trimmed


def test_failure_leaves_no_process_behind(launched):
    r = _part(launched, "error")
    assert len(r["pids"]) == 3 and r["alive"] == [False, False, False]  # checked in the launching process
    assert not any(_alive(p) for p in r["pids"].values())  # and from here
    assert r["children"] == []
    assert r["seconds"] < 10  # the sleeping replicas were stopped, not waited for


def test_keyboard_interrupt_leaves_no_process_behind(launched):
    r = _part(launched, "interrupt")
    assert r["raised"] == "KeyboardInterrupt"
    assert len(r["pids"]) == 2 and r["alive"] == [False, False]
    assert not any(_alive(p) for p in r["pids"].values())
    assert r["children"] == []
    assert r["elapsed"] < 10  # rank 1 ignored SIGTERM: it was killed after the grace period


def test_output_streamed_with_rank_prefix(launched):
    r = _part(launched, "output")
    assert r["value"] == 0
    out, err = r["stdout"].splitlines(), r["stderr"].splitlines()
    for i in (0, 1):
        assert f"[rank {i}] hello from {i}" in out
        assert f"[rank {i}] raw fd line {i}" in out  # C-level writes to fd 1 too
        assert f"[rank {i}] partial {i}" in out  # an unterminated last line is not lost
        assert f"[rank {i}] err line {i}" in err
    assert all(line.startswith("[rank ") for line in out + err)
    assert out.index("[rank 0] hello from 0") < out.index("[rank 0] raw fd line 0") < out.index("[rank 0] partial 0")


def test_replica_that_dies_is_reported(launched):
    r = _part(launched, "died")
    assert r["exit"].startswith("replica rank 1 exited with code 3 without returning a result")
    assert r["kill"].startswith("replica rank 0 was killed by signal SIGKILL")
    assert r["children"] == []


def test_spawn_needs_a_picklable_function(launched):
    r = _part(launched, "spawn_unpicklable")
    assert "could not start replica 0 with start_method='spawn'" in r["message"]
    assert "picklable" in r["message"] and "start_method='fork'" in r["message"]
    assert r["children"] == []


def test_unpicklable_return_value(launched):
    msg = _part(launched, "bad_result")["message"]
    assert msg.startswith("replica rank 0 failed: it returned a function that cannot be sent back")
    assert "t.cpu()" in msg


def test_single_xla_replica_in_a_child(launched):
    r = _part(launched, "xla_single")
    assert r["plan"] == "single"
    assert r["first"]["sum"] == 24.0 and r["second"]["sum"] == 4.0  # real XLA computations in the children
    assert r["first"]["device"].startswith("xla") and r["first"]["world_size"] == 1 and r["first"]["rank"] == 0
    assert len({r["first"]["pid"], r["second"]["pid"], r["parent"]}) == 3
    assert not r["parent_runtime_started"]  # so the cell can be run again
    assert r["children"] == []


def test_tpu_code_path_with_mocked_device_kind(launched):
    # Mocked: the device kind only. The child ran torch_xla's per-process set-up and
    # one thread per device (as on a TPU host), here over 1 XLA:CPU device.
    r = _part(launched, "mocked_tpu")
    assert r["plan"] == ["replicated", 1]
    v = r["value"]
    assert v["index"] == 0 and v["world_size"] == 1 and v["reduced"] == [1.0, 1.0, 1.0]
    assert v["thread"].startswith("ThreadPoolExecutor") and v["pid"] != r["parent"]


def test_refusal_names_the_cause(launched):
    r = _part(launched, "refused")
    assert "something already used the device" in r["message"] and "Restart the kernel" in r["message"]
    assert r["children_before"] == r["children_after"] == [] and not r["replica_ran"]


def test_children_die_with_the_launching_process(tmp_path):
    script = subprocess.Popen([sys.executable, os.path.join(SCENARIOS, "par_launch.py"), "orphan", str(tmp_path)],
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180  # a generous wait: CI runs two suites side by side on 2 cores
        while len(list(tmp_path.glob("orphan-*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("orphan-*.pid")]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        script.send_signal(signal.SIGKILL)  # the kernel dies without any cleanup
        script.wait()
    deadline = time.time() + 10
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def test_launch_in_a_real_notebook_kernel(tmp_path):
    manager = pytest.importorskip("jupyter_client.manager")
    pytest.importorskip("ipykernel")
    km, kc = manager.start_new_kernel(kernel_name="python3", env=_env())
    try:
        def run(code: str) -> tuple[dict, list]:
            msgs: list = []
            reply = kc.execute_interactive(code, timeout=120, output_hook=msgs.append)
            streams = [m["content"] for m in msgs if m["msg_type"] == "stream"]
            return reply["content"], streams

        # fn is defined in a cell: only a forked child can run it.
        reply, streams = run("import logging\nfrom tpukit.parallel import launcher\n"
                             "logging.basicConfig()  # a handler bound to the kernel's stderr stream\n"
                             "def work(i, x):\n    print(f'hello {i}')\n"
                             "    logging.getLogger('user').warning('logged in %d', i)\n    return x * 2\n"
                             "result = launcher.launch(work, 21, nprocs=2)\n"
                             "print('RESULT', result, launcher._default_start_method())")
        assert reply["status"] == "ok", reply
        out = "".join(s["text"] for s in streams if s["name"] == "stdout")
        err = "".join(s["text"] for s in streams if s["name"] == "stderr")
        assert "[rank 0] hello 0\n" in out and "[rank 1] hello 1\n" in out
        assert "RESULT 42 fork" in out
        assert "[rank 0] WARNING:user:logged in 0\n" in err and "[rank 1] WARNING:user:logged in 1\n" in err
        assert "TpukitWarning" in err  # nprocs=2 on XLA:CPU: independent replicas, said in the cell

        reply, _ = run("def bad(i):\n    if i == 1:\n        raise KeyError('nope')\n    import time; time.sleep(600)\n"
                       "launcher.launch(bad, nprocs=2)")
        assert reply["status"] == "error" and reply["ename"] == "LaunchError"
        assert "replica rank 1 failed with KeyError: 'nope'" in reply["evalue"] and "in bad" in reply["evalue"]

        # Interrupt the kernel as Jupyter does (SIGINT to its process group) while replicas sleep.
        piddir = tmp_path / "kernel-pids"
        piddir.mkdir()
        msg_id = kc.execute("import os, time\n"
                            "def sleeper(i):\n"
                            f"    tmp = os.path.join({str(piddir)!r}, '.tmp' + str(i))\n"
                            "    open(tmp, 'w').write(str(os.getpid()))\n"
                            f"    os.replace(tmp, os.path.join({str(piddir)!r}, str(i)))  # never seen half-written\n"
                            "    time.sleep(600)\n"
                            "launcher.launch(sleeper, nprocs=2)")
        deadline = time.time() + 180  # a generous wait: CI runs two suites side by side on 2 cores
        while len(list(piddir.glob("[0-9]"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in piddir.glob("[0-9]")]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        km.interrupt_kernel()
        while True:
            reply = kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert not any(_alive(p) for p in pids)

        # ipykernel aborts requests that arrive just after an interrupted (failed) one (status
        # "aborted", no output): ask again until one runs; read the answer from user_expressions.
        for _ in range(10):
            reply = kc.execute_interactive("import multiprocessing", timeout=120,
                                           user_expressions={"left": "len(multiprocessing.active_children())"})
            if reply["content"]["status"] != "aborted":
                break
            time.sleep(0.5)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert reply["content"]["user_expressions"]["left"]["data"]["text/plain"] == "0", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_rank0_records_reach_the_launching_process():
    # One real XLA:CPU replica in a forked child (collectives are not needed for this);
    # the launching process's listener receives the child's step records and compile events.
    from conftest import run_python

    code = (
        "import json, torch, tpukit\n"
        "from tpukit.parallel.launcher import launch\n"
        "got = []\n"
        "class L:\n"
        "    def on_step(self, r): got.append(['step', r.step, r.scalars.get('v')])\n"
        "    def on_compile(self, e): got.append(['compile', e.graph_hash[:6]])\n"
        "tpukit.add_listener(L())\n"
        "tpukit.runtime.configure()  # compile tracing on, runtime not started (what %load_ext does)\n"
        "def work(i):\n"
        "    x = torch.zeros(3, device='xla')\n"
        "    for _ in tpukit.track([torch.ones(2)] * 3, progress=False):\n"
        "        x = x + 1\n"
        "        tpukit.log(v=x.sum())\n"
        "    return 7\n"
        "value = launch(work, nprocs=1, start_method='fork')\n"
        "print('RESULT', json.dumps([value, got]))\n")
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr[-3000:]
    value, got = json.loads(out.stdout.split("RESULT", 1)[1])
    assert value == 7
    assert [g for g in got if g[0] == "step"] == [["step", 1, 3.0], ["step", 2, 6.0], ["step", 3, 9.0]]
    assert any(g[0] == "compile" for g in got)
