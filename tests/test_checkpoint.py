"""Tests of tpukit.checkpoint on XLA:CPU (real torch_xla, single device in this process).

Runtime settings that cannot change after the runtime starts (SPMD, 4 virtual
devices) and "torch_xla is not installed" run in subprocesses (tests/scenarios/ckpt_*.py).
The only things mocked are what this machine cannot produce on demand: a full
disk or a refused write (tests run as root, where chmod does not block writes;
a real full disk is also tested where a tiny tmpfs can be mounted), and being a
non-master replica (XLA:CPU has no collectives, so several replicas cannot run).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch_xla

import tpukit
from tpukit import checkpoint as ck
from tpukit.checkpoint import manager as ck_manager
from tpukit.errors import CheckpointError, TpukitWarning

SCENARIOS = Path(__file__).parent / "scenarios"
from ckpt_saver import content as saver_content  # noqa: E402
from ckpt_spmd import build as spmd_build  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    return torch_xla.device()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CPU_NUM_DEVICES", "XLA_USE_SPMD")}
    return {**env, "PJRT_DEVICE": "CPU", **extra}


def _run(script: str, *args: str, timeout: float = 180, **env: str) -> str:
    proc = subprocess.run([sys.executable, str(SCENARIOS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(**env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


# --------------------------------------------------------------------------- save / load

def test_round_trip_of_plain_values_rng_states_and_manifest(tmp_path):
    state = {
        "w": torch.randn(5, 3), "half": torch.ones(2, dtype=torch.bfloat16), "step": 12,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "extras": {"name": "run", 3: [1.5, None, (True, b"x")], "lr": 1e-3, "dtype": torch.float16,
                   "shape": torch.Size([2, 3]), "tags": {"a", "b"}},
    }
    manifest = ck.save(state, tmp_path / "a.pt")
    loaded = ck.load(tmp_path / "a.pt")

    assert _equal(loaded["w"], state["w"]) and loaded["half"].dtype == torch.bfloat16
    assert loaded["rng"]["python"] == state["rng"]["python"]
    np_state = loaded["rng"]["numpy"]
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], state["rng"]["numpy"][1])
    np.random.set_state(np_state)  # numpy's RNG state is usable after a weights_only load
    assert loaded["extras"] == state["extras"]
    # the manifest describes the payload and the versions that wrote it
    data = json.loads((tmp_path / "a.json").read_text())
    payload = (tmp_path / "a.pt").read_bytes()
    assert data["sha256"] == hashlib.sha256(payload).hexdigest() == manifest.sha256
    assert data["bytes"] == len(payload) and data["step"] == 12 and data["payload"] == "a.pt"
    assert data["tpukit"] == tpukit.__version__ and data["torch"] == tpukit.environment.versions()["torch"]
    assert data["torch_xla"] == tpukit.environment.versions()["torch_xla"] and data["format_version"] == 1
    assert ck.verify(tmp_path / "a.pt") == manifest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_xla_tensors_are_synced_copied_to_cpu_and_keep_ties(tmp_path, dev):
    a = torch.arange(6.0, device=dev).reshape(2, 3)
    pending = a * 3 + 1  # not synced yet: save must compute it
    lin = nn.Linear(3, 2).to(dev)
    # three tensor objects, one XLA tensor (what state_dict() gives for tied weights)
    ck.save({"pending": pending, "a": lin.state_dict()["weight"], "b": lin.state_dict()["weight"], "param": lin.weight},
            tmp_path / "x.pt")

    loaded = ck.load(tmp_path / "x.pt")
    assert loaded["pending"].device.type == "cpu"
    assert torch.equal(loaded["pending"], torch.arange(6.0).reshape(2, 3) * 3 + 1)
    assert loaded["a"] is loaded["b"] is loaded["param"], "one XLA tensor must stay one CPU tensor (tied weights)"
    assert torch.equal(loaded["a"], lin.weight.detach().cpu())
    assert lin.weight.device.type == "xla"  # the caller's tensors stay on the device

    on_dev = ck.load(tmp_path / "x.pt", device=dev)
    assert on_dev["pending"].device.type == "xla" and on_dev["a"] is on_dev["b"]
    assert torch.equal(on_dev["pending"].cpu(), loaded["pending"])


def test_checkpoint_from_xla_loads_where_torch_xla_cannot_be_imported(tmp_path, dev):
    torch.manual_seed(3)
    cpu_model = nn.Linear(4, 3)
    expected = {"model": cpu_model.state_dict(), "x": torch.arange(10, dtype=torch.int64) * 7, "step": 3,
                "meta": {"note": "from xla", "pair": (1, 2)}}
    tied = torch.linspace(0, 1, 5)
    expected["tied_a"] = expected["tied_b"] = tied
    torch.save(expected, tmp_path / "expected.pt")

    xla_model = nn.Linear(4, 3).to(dev)
    xla_model.load_state_dict(cpu_model.state_dict())
    x_dev = (torch.arange(10, dtype=torch.int64) * 7).to(dev)
    t_dev = tied.to(dev)
    on_xla = {"model": xla_model.state_dict(), "x": x_dev, "step": 3, "meta": {"note": "from xla", "pair": (1, 2)},
              "tied_a": t_dev, "tied_b": t_dev}
    assert all(v.device.type == "xla" for v in on_xla["model"].values())
    ck.save(on_xla, tmp_path / "ckpt.pt")
    ck.save(on_xla, tmp_path / "st.safetensors")
    with pytest.raises(CheckpointError, match="manifest ckpt.json already belongs to ckpt.pt"):
        ck.save(on_xla, tmp_path / "ckpt.safetensors")

    out = json.loads(_run("ckpt_plain_load.py", str(tmp_path / "expected.pt"), str(tmp_path / "ckpt.pt"),
                          str(tmp_path / "st.safetensors")))
    assert out["blocked"] is True and out["torch_xla_loaded"] is False and out["saved_again"] is True
    assert out["results"][str(tmp_path / "ckpt.pt")] == {"equal": True, "tied": True}
    assert out["results"][str(tmp_path / "st.safetensors")] == {"equal": True, "tied": True}


def test_spmd_sharded_model_saves_full_tensors(tmp_path):
    out = json.loads(_run("ckpt_spmd.py", str(tmp_path / "spmd.pt"), CPU_NUM_DEVICES="4"))
    assert out["devices"] == 4 and out["wrapped_type"] == "XLAShardedTensor"
    assert out["specs"]["0.weight"].startswith("{devices=[4,1]") and out["specs"]["2.weight"].startswith("{devices=[1,4]")

    expected = spmd_build()
    with torch.no_grad():
        for p in expected.parameters():
            p.mul_(2).add_(1)
    loaded = ck.load(tmp_path / "spmd.pt")
    plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))  # unsharded, CPU
    plain.load_state_dict(loaded["model"])
    for name, value in expected.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    assert loaded["wrapped"] is loaded["model"]["2.weight"]  # the XLAShardedTensor wrapper is the same tensor


def test_safetensors_payload_has_no_pickle_and_round_trips(tmp_path, dev):
    from safetensors.torch import load_file

    model = nn.Linear(3, 2).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3, device=dev)).sum().backward()
    opt.step()
    mgr = ck.CheckpointManager(tmp_path, weights_format="safetensors")
    mgr.save(4, model=model.state_dict(), optimizer=opt.state_dict(), note="hi")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000004.json", "ckpt-00000004.safetensors"]

    raw = load_file(tmp_path / "ckpt-00000004.safetensors")  # any safetensors reader, no pickle
    assert torch.equal(raw["model/weight"], model.weight.detach().cpu())
    state = mgr.latest()
    assert state["step"] == 4 and state["note"] == "hi"
    assert mgr.latest(device=dev)["model"]["weight"].device.type == "xla"
    assert _equal(state["optimizer"], ck.load(tmp_path / "ckpt-00000004.safetensors")["optimizer"])
    assert state["optimizer"]["param_groups"][0]["betas"] == opt.state_dict()["param_groups"][0]["betas"]
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"].cpu())

    with pytest.raises(CheckpointError, match=r"state\['extra'\] is a builtins.bytes.*weights_format='torch'"):
        mgr.save(5, extra=b"raw bytes")


def test_only_the_master_replica_writes(tmp_path, monkeypatch, dev):
    # Simulated: replica 1 of 2. Several replicas cannot run here (XLA:CPU has no collectives).
    monkeypatch.setattr(tpukit._xla, "world_size", lambda: 2)
    monkeypatch.setattr(tpukit._xla, "global_ordinal", lambda: 1)
    pending = torch.ones(3, device=dev) * 2
    assert ck.save({"x": pending}, tmp_path / "a.pt") is None
    mgr = ck.CheckpointManager(tmp_path / "m")
    assert mgr.save(1, x=pending) is True  # every replica takes part; only the master writes
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(tpukit._xla, "global_ordinal", lambda: 0)
    assert ck.save({"x": pending}, tmp_path / "a.pt").step is None
    assert torch.equal(ck.load(tmp_path / "a.pt")["x"], torch.full((3,), 2.0))


# --------------------------------------------------------------------------- faults

def test_sigkill_at_random_moments_never_loses_a_checkpoint(tmp_path):
    kills, seed = 24, random.randrange(1 << 30)
    rng = random.Random(seed)
    server = subprocess.Popen([sys.executable, str(SCENARIOS / "ckpt_saver.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_env(), bufsize=1)
    child = None
    seen = {"temp": 0, "orphan": 0}
    try:
        assert server.stdout.readline().split() == ["ready", "False"], "the saver must not import torch_xla"
        committed = 0
        for _ in range(kills):
            server.stdin.write(f"go {tmp_path}\n")
            server.stdin.flush()
            child = int(server.stdout.readline().split()[1])
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(child, signal.SIGKILL)
            server.stdin.write(f"reap {child}\n")
            server.stdin.flush()
            saved = []
            while not (line := server.stdout.readline()).startswith("dead"):
                saved.append(int(line.split()[1]))
            status = int(line.split()[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"saver died on its own ({status})"
            child = None
            names = os.listdir(tmp_path)
            seen["temp"] += any(n.startswith(".tmp-") for n in names)
            seen["orphan"] += any(n.endswith(".pt") and n[:-3] + ".json" not in names for n in names)

            with warnings.catch_warnings():
                warnings.simplefilter("error", TpukitWarning)  # nothing committed may be damaged
                direct = ck.load(tmp_path) if any(n.endswith(".json") for n in names) else None  # temps still there
                mgr = ck.CheckpointManager(tmp_path, keep=3)  # removes the dead saver's temp files
                assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
                steps = mgr.all_steps()
                for step in steps:  # every committed checkpoint holds exactly what was saved at its step
                    loaded = ck.load(tmp_path / f"ckpt-{step:08d}.pt")
                    assert set(loaded.pop("rng_state")) == {"python", "numpy", "torch"}  # no XLA runtime in the saver
                    assert _equal(loaded, {"step": step, **saver_content(step)}), (seed, step)
                state = mgr.latest()
            newest = max(saved, default=committed)
            if state is None:
                assert newest == 0, f"seed {seed}: save({newest}) returned but nothing is loadable"
                continue
            assert state["step"] == steps[-1] == mgr.latest_step() == direct["step"] >= newest, (seed, state["step"], saved)
            state.pop("rng_state")
            assert _equal(state, {"step": state["step"], **saver_content(state["step"])})
            committed = state["step"]
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        server.kill()
        server.wait()
    assert committed >= 5, f"the savers made too little progress to test anything (seed {seed})"
    # the kills landed inside writes: temp files or payloads without a manifest were left behind
    assert seen["temp"] + seen["orphan"] >= 1, (seed, seen)


def test_truncated_or_flipped_payload_is_skipped_for_the_previous_one(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=None)
    for step in (1, 2, 3):
        mgr.save(step, w=torch.full((1000,), float(step)))
    p3, p2 = tmp_path / "ckpt-00000003.pt", tmp_path / "ckpt-00000002.pt"
    p3.write_bytes(p3.read_bytes()[:-100])  # truncated
    with pytest.warns(TpukitWarning, match=r"step 3.*truncated"):
        state = mgr.latest()
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((1000,), 2.0))

    data = bytearray(p2.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    p2.write_bytes(bytes(data))
    with pytest.warns(TpukitWarning) as record:
        state = mgr.latest()
        assert mgr.latest_step() == 1
    assert state["step"] == 1
    assert any("step 2" in str(w.message) and "sha256" in str(w.message) for w in record)
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        ck.load(p2)
    with pytest.warns(TpukitWarning):
        assert ck.load(tmp_path)["step"] == 1  # a directory loads its newest valid checkpoint

    (tmp_path / "ckpt-00000001.json").unlink()  # payload without manifest: never valid
    with pytest.raises(CheckpointError, match="manifest .* is missing"):
        ck.load(tmp_path / "ckpt-00000001.pt")
    with pytest.warns(TpukitWarning):
        assert mgr.latest() is None and mgr.restore() == 0


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_failed_rename_keeps_previous_checkpoint_and_leaves_no_temp(tmp_path, monkeypatch, err):
    # Simulated: a full disk / refused write cannot be produced on demand here (root ignores chmod).
    mgr = ck.CheckpointManager(tmp_path, keep=1)
    mgr.save(1, w=torch.ones(3))
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).parent == tmp_path:
            raise OSError(err, os.strerror(err))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match=rf"ckpt-00000002.pt: {os.strerror(err)}.*{tmp_path}"):
        mgr.save(2, w=torch.zeros(3))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.json", "ckpt-00000001.pt"]  # not pruned, no temp
    assert mgr.latest_step() == 1 and torch.equal(mgr.latest()["w"], torch.ones(3))


def test_disk_full_in_the_middle_of_the_write(tmp_path, monkeypatch):
    # Simulated: torch.save writes part of the payload, then the "disk" is full.
    ck.save({"w": torch.ones(3)}, tmp_path / "m.pt")

    def half_write(obj, f):
        f.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", half_write)
    with pytest.raises(CheckpointError, match=r"m.pt: No space left on device \(ENOSPC\)"):
        ck.save({"w": torch.zeros(3)}, tmp_path / "m.pt")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["m.json", "m.pt"]
    assert torch.equal(ck.load(tmp_path / "m.pt")["w"], torch.ones(3))


def test_real_full_disk_on_a_tiny_tmpfs(tmp_path, monkeypatch):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        ck.save({"w": torch.ones(10)}, mnt / "c.pt")
        # the preflight: refused before anything is written, saying how much is needed and where
        for name in ("c.pt", "d.safetensors"):
            with pytest.raises(CheckpointError, match=rf"Not enough disk space to save {name}: it needs about "
                                                      rf"1\.[0-9] MiB in {mnt}, which has 0\.[0-9] MiB free"):
                ck.save({"w": torch.zeros(1 << 18)}, mnt / name)
            assert sorted(os.listdir(mnt)) == ["c.json", "c.pt"]
        # a write that runs out of space midway reports the real OS error and keeps the good checkpoint.
        # Simulated: the free-space report is stale (another writer fills the disk during the save).
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))
        for name in ("c.pt", "d.safetensors"):
            with pytest.raises(CheckpointError, match="No space left on device"):
                ck.save({"w": torch.zeros(1 << 18)}, mnt / name)  # torch.save alone says "unexpected pos"
            assert sorted(os.listdir(mnt)) == ["c.json", "c.pt"]
        monkeypatch.undo()
        assert torch.equal(ck.load(mnt / "c.pt")["w"], torch.ones(10))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --------------------------------------------------------------------------- bad input

def test_module_and_other_objects_are_rejected_up_front_with_the_key_path(tmp_path, dev):
    model = nn.Linear(2, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"state\['model'\] is a torch.nn.modules.linear.Linear .*\.state_dict\(\)"):
        ck.save({"model": model}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"state\['parts'\]\[1\] is a torch.optim.sgd.SGD.*state_dict"):
        ck.CheckpointManager(tmp_path / "m").save(1, parts=[model.state_dict(), opt])
    with pytest.raises(CheckpointError, match=r"state\['cfg'\]\['fn'\] is a builtins.function.*plain values"):
        ck.save({"cfg": {"fn": lambda: 1}}, tmp_path / "a.pt")
    loop = {"a": 1}
    loop["self"] = loop
    with pytest.raises(CheckpointError, match="contains itself"):
        ck.save(loop, tmp_path / "a.pt")
    assert not (tmp_path / "a.pt").exists() and not (tmp_path / "m" / "ckpt-00000001.pt").exists()


def test_missing_path_empty_directory_and_bad_targets(tmp_path):
    with pytest.raises(CheckpointError, match=r"No checkpoint at .*nope.pt: the file does not exist"):
        ck.load(tmp_path / "nope.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"No checkpoint in directory .*empty"):
        ck.load(tmp_path / "empty")
    assert ck.CheckpointManager(tmp_path / "empty").latest() is None
    with pytest.raises(CheckpointError, match="directory .*missing does not exist"):
        ck.save({"a": 1}, tmp_path / "missing" / "a.pt")
    with pytest.raises(CheckpointError, match="manifest's suffix"):
        ck.save({"a": 1}, tmp_path / "a.json")
    torch.save({"a": 1}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="manifest .*foreign.json is missing"):
        ck.load(tmp_path / "foreign.pt")


def test_restore_into_a_different_model_lists_missing_unexpected_and_mismatched_keys(tmp_path, dev):
    mgr = ck.CheckpointManager(tmp_path)
    mgr.save(1, model=nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).state_dict())
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).to(dev)
    before = {k: v.cpu().clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        mgr.restore(model=other)
    msg = str(info.value)
    assert "missing (2): 2.weight, 2.bias" in msg and "unexpected (2): 1.weight, 1.bias" in msg
    assert "0.weight saved (3, 4) vs model (5, 4)" in msg and "0.bias saved (3,) vs model (5,)" in msg
    assert all(torch.equal(v.cpu(), before[k]) for k, v in other.state_dict().items()), "model was partly loaded"
    with pytest.raises(CheckpointError, match=r"has no 'optimizer' entry .*optimizer=optimizer.state_dict"):
        mgr.restore(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


# --------------------------------------------------------------------------- manager

def test_manager_every_keep_steps_and_pruning(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=2, every=2, rng=False)  # rng=False: only what is passed is saved
    assert mgr.latest() is None and mgr.latest_step() is None and mgr.all_steps() == []
    saved = [mgr.save(step, w=torch.tensor(float(step))) for step in range(1, 9)]
    assert saved == [False, True] * 4
    assert mgr.all_steps() == [6, 8] and mgr.latest_step() == 8
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000006.json", "ckpt-00000006.pt", "ckpt-00000008.json", "ckpt-00000008.pt"]
    assert mgr.latest() == {"step": 8, "w": torch.tensor(8.0)}
    with pytest.warns(TpukitWarning, match="already holds step 8"):
        mgr.save(2, w=torch.tensor(2.0))
    assert mgr.all_steps() == [2, 6, 8] and mgr.latest()["step"] == 8  # the new one counts; newer ones are never pruned (issue 27)
    with pytest.raises(CheckpointError, match="keep=0"):
        ck.CheckpointManager(tmp_path, keep=0)


def test_manager_removes_only_stale_temp_files_and_never_lists_them(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid is gone
    host = socket.gethostname()
    stale = tmp_path / f".tmp-ckpt-00000009.pt~{host}~{dead.pid}~abcd"
    live = tmp_path / f".tmp-ckpt-00000009.pt~{host}~1~abcd"  # pid 1 is alive: someone else's write
    other_host = tmp_path / f".tmp-ckpt-00000009.json~elsewhere~{dead.pid}~abcd"
    for p in (stale, live, other_host):
        p.write_bytes(b"partial")
    mgr = ck.CheckpointManager(tmp_path)
    assert not stale.exists() and live.exists() and other_host.exists()
    assert mgr.all_steps() == [] and mgr.latest() is None


def test_resume_matches_the_uninterrupted_run_on_xla(tmp_path, dev):
    def build(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def batch(step):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 8, generator=gen)
        return x.to(dev), x.sum(1, keepdim=True).sin().to(dev)

    def train(model, opt, sched, steps):
        losses = []
        for step in steps:
            x, y = batch(step)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            sched.step()
            torch_xla.sync()
            losses.append(loss.item())
        return losses

    model, opt, sched = build(0)
    full = train(model, opt, sched, range(1, 11))
    reference = {k: v.cpu() for k, v in model.state_dict().items()}

    mgr = ck.CheckpointManager(tmp_path)
    model, opt, sched = build(0)
    first = train(model, opt, sched, range(1, 6))
    mgr.save(5, model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict())
    at5 = {k: v.cpu() for k, v in model.state_dict().items()}

    model, opt, sched = build(123)  # fresh objects, different init: restore must overwrite everything
    step_var = torch.zeros((), dtype=torch.int64, device=dev)
    assert mgr.restore(model=model, optimizer=opt, scheduler=sched, step_var=step_var) == 5
    assert step_var.item() == 5 and sched.last_epoch == 5 and sched.get_last_lr() == [0.025]
    assert all(p.device.type == "xla" for p in model.parameters())
    assert all(torch.equal(v.cpu(), at5[k]) for k, v in model.state_dict().items())
    rest = train(model, opt, sched, range(6, 11))

    # Exact: the resumed run executes the same XLA:CPU graphs on bit-identical inputs.
    assert first + rest == full
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), reference[name]), name


def test_async_save_copies_synchronously_and_writes_one_at_a_time(tmp_path, monkeypatch, dev):
    active, peak, threads = [0], [0], set()
    real_commit = ck_manager.commit
    gate = threading.Event()

    def slow_commit(*args, **kwargs):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        threads.add(threading.current_thread().name)
        gate.wait(timeout=30)
        time.sleep(0.02)  # a slow disk: the next save() has to wait for this write
        try:
            return real_commit(*args, **kwargs)
        finally:
            active[0] -= 1

    monkeypatch.setattr(ck_manager, "commit", slow_commit)
    mgr = ck.CheckpointManager(tmp_path, keep=None, async_save=True)
    w = torch.zeros(4)
    x = torch.zeros(4, device=dev)
    for step in range(1, 5):
        w.fill_(step)
        x.fill_(step)
        assert mgr.save(step, w=w, x=x) is True
        if step == 1:
            assert not (tmp_path / "ckpt-00000001.json").exists(), "save() waited for the disk write"
            gate.set()
        w.fill_(-1)  # changed right after save(): the checkpoint must hold the value at save time
        x.fill_(-1)
    mgr.wait()
    assert peak[0] == 1 and threads == {"tpukit-checkpoint"}
    assert mgr.all_steps() == [1, 2, 3, 4]
    for step in range(1, 5):
        state = ck.load(tmp_path / f"ckpt-{step:08d}.pt")
        assert torch.equal(state["w"], torch.full((4,), float(step))) and torch.equal(state["x"], state["w"])


def test_async_save_error_surfaces_on_the_next_call(tmp_path, monkeypatch):
    # Simulated disk full inside the background write.
    mgr = ck.CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, w=torch.ones(2))
    mgr.wait()
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name.startswith(("ckpt-00000002", "ckpt-00000004")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    assert mgr.save(2, w=torch.zeros(2)) is True  # returns at once; the write fails in the background
    with pytest.raises(CheckpointError, match=r"Background save of step 2 failed: .*No space left on device"):
        mgr.save(3, w=torch.zeros(2))
    assert mgr.all_steps() == [1]  # step 3 was not started either
    mgr.save(4, w=torch.zeros(2))
    with pytest.raises(CheckpointError, match="step 4 failed"):
        mgr.wait()
    monkeypatch.undo()
    assert mgr.latest_step() == 1 and not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))


# --------------------------------------------------------------------------- transformers

def _gpt2_in_the_readmes_order(dev, seed):
    """A tiny GPT-2 moved to the device (which unties lm_head.weight from transformer.wte.weight), then its
    optimizer: over 17 tensors, the untied copy among them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert model.lm_head.weight is not model.transformer.wte.weight and len(_held(opt)) == 17
    return model, opt


def _held(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def test_track_and_restore_tie_a_moved_gpt2_again_and_its_optimizer_holds_the_models_own_parameters(tmp_path, dev):
    model, opt = _gpt2_in_the_readmes_order(dev, seed=0)
    copy = model.lm_head.weight
    batches = [torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for ids in tpukit.track(batches, progress=False):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(_held(opt)) == 16 and {id(p) for p in _held(opt)} == {id(p) for p in model.parameters()}
    assert copy not in opt.state and len(opt.state) == 16  # every parameter trained, the copy never
    (told,) = [str(w.message) for w in said if issubclass(w.category, TpukitWarning)]
    assert ("tpukit.track tied them again with model.tie_weights(); the optimizer made before (AdamW) held the "
            "untied copy, and now holds the tied tensor in its place") in told
    mgr = ck.CheckpointManager(tmp_path)
    mgr.save(2, model=model.state_dict(), optimizer=opt.state_dict())
    mgr.close()

    fresh, fresh_opt = _gpt2_in_the_readmes_order(dev, seed=1)  # made the same way, before the restore
    with pytest.warns(TpukitWarning, match=r"CheckpointManager\.restore tied them again"):
        assert ck.CheckpointManager(tmp_path).restore(fresh, fresh_opt) == 2
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # the tie held
    assert {id(p) for p in _held(fresh_opt)} == {id(p) for p in fresh.parameters()} and len(_held(fresh_opt)) == 16
    assert torch.equal(fresh.transformer.wte.weight.cpu(), model.transformer.wte.weight.cpu())
    saved, loaded = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert sorted(saved) == sorted(loaded) == list(range(16))
    for i in saved:  # each parameter's AdamW moments landed on the same parameter
        assert torch.equal(saved[i]["exp_avg"].cpu(), loaded[i]["exp_avg"].cpu()), i


def test_export_pretrained_tiny_bert_from_xla_loads_on_cpu(tmp_path, dev, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "tpu", "##s"] + [f"w{i}" for i in range(55)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = BertForMaskedLM(cfg).to(dev).eval()
    decoder, embeddings = model.cls.predictions.decoder, model.bert.embeddings.word_embeddings
    assert decoder.weight is not embeddings.weight  # torch_xla quirk: .to(xla) unties weights
    with pytest.warns(TpukitWarning, match=r"tie_weights\(\)"):
        ck.export_pretrained(model, tmp_path / "untied")
    model.tie_weights()
    assert decoder.weight is embeddings.weight  # tied weights: safetensors refuses shared memory
    ids = torch.randint(0, len(vocab), (2, 12))
    with torch.no_grad():
        expected = model(ids.to(dev)).logits.cpu()

    with warnings.catch_warnings():
        warnings.simplefilter("error", TpukitWarning)
        folder = ck.export_pretrained(model, tmp_path / "bert", tokenizer=tokenizer)
    assert next(model.parameters()).device.type == "xla" and decoder.weight is embeddings.weight
    files = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files and "pytorch_model.bin" not in files
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))

    loaded = BertForMaskedLM.from_pretrained(folder).eval()
    assert next(loaded.parameters()).device.type == "cpu"
    assert loaded.cls.predictions.decoder.weight.data_ptr() == loaded.bert.embeddings.word_embeddings.weight.data_ptr()
    own = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, own[name].cpu()), name
    with torch.no_grad():
        got = loaded(ids).logits
    # Same weights; XLA:CPU and eager CPU kernels may round differently in the last bits.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    text = "hello tpus world"
    assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == tokenizer(text)["input_ids"]

    ck.export_pretrained(model, folder)  # replaces the folder as a whole
    assert "tokenizer.json" not in os.listdir(folder)
    with pytest.raises(CheckpointError, match="needs a transformers model"):
        ck.export_pretrained(nn.Linear(2, 2), tmp_path / "x")
