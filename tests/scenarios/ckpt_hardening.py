"""Programs for tests/test_checkpoint_hardening.py that need a process of their own (run with PJRT_DEVICE=CPU).

  python ckpt_hardening.py hold DIR         a CheckpointManager saves step 1 into DIR, prints "held PID",
                                             then waits (holding DIR's lock) until stdin closes
  python ckpt_hardening.py async-exit DIR   an async save of an XLA state, then the script ends without wait()
  python ckpt_hardening.py shape DIR        SPMD over CPU_NUM_DEVICES virtual devices: save a sharded
                                             Linear(8, 16), restore it into a sharded Linear(8, 32)
  python ckpt_hardening.py memory MIB CHUNK_MIB   save an XLA tensor of MIB MiB with copy_chunk CHUNK_MIB,
                                             computed on the device, then one moved there with .to();
                                             print the peak extra resident memory of each save (VmHWM)
                                             and what the move itself still added after sync()

Each prints one JSON line last (hold: its pid first). This is a test program, so it imports torch_xla.
"""

import json
import os
import sys


def hold(directory: str) -> None:
    import torch

    from tpukit.checkpoint import CheckpointManager

    mgr = CheckpointManager(directory, keep=1, rng=False)
    mgr.save(1, w=torch.ones(4))
    print(json.dumps({"held": os.getpid()}), flush=True)
    sys.stdin.read()  # until the test closes stdin (or kills this process)


def async_exit(directory: str) -> None:
    import torch
    import torch_xla

    from tpukit.checkpoint import CheckpointManager

    dev = torch_xla.device()
    mgr = CheckpointManager(directory, async_save=True, rng=False)
    w = torch.arange(1 << 20, dtype=torch.float32).to(dev) * 2  # 4 MiB: the write takes a moment
    mgr.save(7, w=w)
    print(json.dumps({"returned": True}), flush=True)
    # no mgr.wait(): the script ends here


def shape(directory: str) -> None:
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from tpukit.checkpoint import CheckpointManager, load
    from tpukit.errors import CheckpointError

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))

    def model(width: int) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, width)).to(torch_xla.device())
        for p in m.parameters():
            xs.mark_sharding(p, mesh, ("data",) + (None,) * (p.dim() - 1))
        return m

    CheckpointManager(directory).save(3, model=model(16).state_dict())
    wider = model(32)
    out = {"devices": n}
    for how, call in (("restore", lambda: CheckpointManager(directory).restore(wider)),
                      ("load", lambda: load(os.path.join(directory, "ckpt-00000003.dcp"),
                                            into={"model": wider.state_dict()}))):
        try:
            call()
            out[how] = None
        except CheckpointError as exc:
            out[how] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - what the test must never see
            out[how] = f"RAW {type(exc).__name__}: {exc}"
    print(json.dumps(out))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Free what is free (gc, malloc_trim), reset VmHWM to the resident memory, and return that."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    return _status("VmRSS")


def _landed(t) -> None:
    """Wait until ``t``'s device buffer holds its data, and torch_xla's host staging copy is freed.

    torch_xla's ``.to(device)`` returns once the data is in a host staging buffer; the PJRT client fills
    the device buffer from it in the background and frees it when done, and neither ``torch_xla.sync()``
    nor ``xm.wait_device_ops()`` waits for that (on XLA:CPU the device buffer is host memory too). A
    one-element read of ``t`` runs after the copy; resident memory then stops falling.
    """
    import time

    t.reshape(-1)[:1].cpu()
    rss, deadline = _status("VmRSS"), time.monotonic() + 3
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _status("VmRSS")
        if now > rss - (1 << 20):
            return
        rss = now


def memory(mib: str, chunk_mib: str) -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from tpukit.checkpoint import save

    dev = torch_xla.device()
    out_dir, n, chunk = os.environ["OUT_DIR"], int(mib) << 18, int(chunk_mib) << 20  # n float32 = MIB MiB
    small = torch.ones(8, device=dev)
    torch_xla.sync()
    save({"w": small}, os.path.join(out_dir, "warm.pt"))  # imports and first-call set-up
    out = {"state": int(mib) << 20}

    # A graph's output (trained weights): on the device once the execution is done.
    t = torch.arange(n, dtype=torch.float32).to(dev) * 0.5  # arange: quicker to fill than randn
    torch_xla.sync()
    xm.wait_device_ops()
    before = _reset_peak()
    save({"w": t}, os.path.join(out_dir, "computed.pt"), copy_chunk=chunk)
    out["computed"] = _status("VmHWM") - before
    del t

    # Host data moved to the device (a model placed there, a loaded checkpoint): still being copied in
    # the background when sync() and wait_device_ops() return. What that copy adds with no save running is
    # "in_flight" (what issue 37 measured as the save's); the save is measured once the tensor has landed.
    host = torch.arange(n, dtype=torch.float32)
    t = host.to(dev)
    del host
    torch_xla.sync()
    xm.wait_device_ops()
    before = _reset_peak()
    _landed(t)
    out["in_flight"] = _status("VmHWM") - before
    before = _reset_peak()
    save({"w": t}, os.path.join(out_dir, "moved.pt"), copy_chunk=chunk)
    out["moved"] = _status("VmHWM") - before
    print(json.dumps(out))


if __name__ == "__main__":
    {"hold": hold, "async-exit": async_exit, "shape": shape, "memory": memory}[sys.argv[1]](*sys.argv[2:])
