"""Sharded-checkpoint programs for tests/test_checkpoint_scale.py (run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=N).

  python ckpt_sharded.py save DIR    SPMD over N virtual devices: train 2 Adam steps, save checkpoint 2
  python ckpt_sharded.py load DIR    build the same model sharded over N devices, restore, report
  python ckpt_sharded.py plain DIR   torch_xla blocked: load the newest checkpoint whole on the CPU
  python ckpt_sharded.py loop DIR    save sharded checkpoints of a step-valued state forever (SIGKILL test)
  python ckpt_sharded.py group DIR   one of WORLD_SIZE processes (a gloo group, like the hosts of a slice):
                                      each runs its own SPMD program and all save one checkpoint together

save/load/plain print one JSON line: the device count, sha256 digests of every
model and optimizer tensor, and (save, load) the shardings and the number of
chunks DCP wrote per weight. This is a test program, so it imports torch_xla.
"""

import hashlib
import json
import os
import sys


def digests(state: dict) -> dict:
    """sha256 of each tensor's bytes, keyed by its dotted path (optimizer keys as strings)."""
    import torch

    out = {}

    def walk(obj, path):
        if isinstance(obj, torch.Tensor):
            out[path] = hashlib.sha256(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else str(k))

    walk(state, "")
    return out


def _spmd_model():
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(torch_xla.device())
    for p in model.parameters():
        xs.mark_sharding(p, mesh, ("data",) + (None,) * (p.dim() - 1))
    return n, mesh, model


def _specs(model) -> dict:
    import torch_xla

    return {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in model.state_dict().items()}


def save(directory: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    import torch_xla

    from tpukit.checkpoint import CheckpointManager

    n, _, model = _spmd_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in (1, 2):
        x = torch.randn(4, 8).to(torch_xla.device())
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    mgr = CheckpointManager(directory)
    mgr.save(2, model=model.state_dict(), optimizer=opt.state_dict())
    meta = dcp.FileSystemReader(os.path.join(directory, "ckpt-00000002.dcp")).read_metadata()
    chunks = {k: len(v.chunks) for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    print(json.dumps({"devices": n, "specs": _specs(model), "chunks": chunks,
                      "model": digests(model.state_dict()), "optimizer": digests(opt.state_dict()["state"])}))


def load(directory: str) -> None:
    import torch

    from tpukit.checkpoint import CheckpointManager

    n, _, model = _spmd_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = CheckpointManager(directory).restore(model, opt)
    print(json.dumps({"devices": n, "step": step, "specs": _specs(model),
                      "model": digests(model.state_dict()), "optimizer": digests(opt.state_dict()["state"])}))


def plain(directory: str) -> None:
    import ckpt_plain_load  # noqa: F401  (blocks every torch_xla import from here on)

    from tpukit import checkpoint

    state = checkpoint.load(directory)
    import torch  # the consolidated state loads into plain CPU PyTorch objects, optimizer state included

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.load_state_dict(state["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(state["optimizer"])
    print(json.dumps({"step": state["step"], "model": digests(state["model"]),
                      "loaded_optimizer": digests(opt.state_dict()["state"]),
                      "optimizer": digests(state["optimizer"]["state"]),
                      "devices": [str(t.device) for t in state["model"].values()],
                      "torch_xla_loaded": "torch_xla" in sys.modules}))


def loop_content(step: int):
    """The state saved at ``step`` (on the CPU): every element equals the step."""
    import torch

    return torch.full((512, 1024), float(step))


def loop(directory: str) -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from tpukit.checkpoint import CheckpointManager

    _, mesh, _ = _spmd_model()
    mgr = CheckpointManager(directory, keep=3)
    step = (mgr.latest_step() or 0) + 1
    while True:
        w = loop_content(step).to(torch_xla.device())
        xs.mark_sharding(w, mesh, ("data", None))
        torch_xla.sync()
        os.write(1, f"saving {step}\n".encode())
        mgr.save(step, w=w)
        os.write(1, f"saved {step}\n".encode())
        step += 1


def group(directory: str) -> None:
    import torch
    import torch.distributed as dist
    import torch_xla

    from tpukit.checkpoint import CheckpointManager

    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment
    n, _, model = _spmd_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    torch_xla.sync()
    mgr = CheckpointManager(directory)
    mgr.save(3, model=model.state_dict())
    print(json.dumps({"rank": dist.get_rank(), "devices": n, "model": digests(model.state_dict()),
                      "files": sorted(os.listdir(directory))}))
    dist.destroy_process_group()


if __name__ == "__main__":
    {"save": save, "load": load, "plain": plain, "loop": loop, "group": group}[sys.argv[1]](sys.argv[2])
