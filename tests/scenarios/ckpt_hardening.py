"""Programs for tests/test_checkpoint_hardening.py that need a process of their own (run with PJRT_DEVICE=CPU).

  python ckpt_hardening.py hold DIR         a CheckpointManager saves step 1 into DIR, prints "held PID",
                                             then waits (holding DIR's lock) until stdin closes
  python ckpt_hardening.py async-exit DIR   an async save of an XLA state, then the script ends without wait()
  python ckpt_hardening.py shape DIR        SPMD over CPU_NUM_DEVICES virtual devices: save a sharded
                                             Linear(8, 16), restore it into a sharded Linear(8, 32)
  python ckpt_hardening.py memory MIB CHUNK_MIB   save one XLA tensor of MIB MiB with copy_chunk CHUNK_MIB;
                                             print the peak extra resident memory of the save (VmHWM)

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


def memory(mib: str, chunk_mib: str) -> None:
    import gc

    import torch
    import torch_xla

    from tpukit.checkpoint import save

    dev = torch_xla.device()
    t = torch.randn(int(mib) << 18).to(dev) * 0.5  # MIB MiB of float32, a graph output living on the device
    torch_xla.sync()
    small = torch.ones(8, device=dev)
    torch_xla.sync()
    save({"w": small}, os.path.join(os.environ["OUT_DIR"], "warm.pt"))  # imports and first-call set-up
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    before = status("VmRSS")
    save({"w": t}, os.path.join(os.environ["OUT_DIR"], "big.pt"), copy_chunk=int(chunk_mib) << 20)
    print(json.dumps({"state": int(mib) << 20, "extra": status("VmHWM") - before}))


if __name__ == "__main__":
    {"hold": hold, "async-exit": async_exit, "shape": shape, "memory": memory}[sys.argv[1]](*sys.argv[2:])
