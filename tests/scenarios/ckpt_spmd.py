"""SPMD half of the sharded-checkpoint test: run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.

Shards a small MLP over 4 virtual CPU devices, changes its weights on the device
(so the saved values come from sharded computation), saves it with
tpukit.checkpoint.save and prints a JSON line describing the shardings.
This is a test program, so it imports torch_xla directly.
"""

import json
import sys

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from tpukit import checkpoint


def build() -> torch.nn.Sequential:
    """The model both sides build: seeded init, then w * 2 + 1 (exact in float32 on any backend)."""
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def main(path: str) -> None:
    xr.use_spmd()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
    model = build().to(torch_xla.device())
    xs.mark_sharding(model[0].weight, mesh, ("data", None))
    xs.mark_sharding(model[0].bias, mesh, ("data",))
    wrapped = xs.mark_sharding(model[2].weight, mesh, (None, "data"))  # an XLAShardedTensor
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2).add_(1)  # pending, sharded computation: save must sync it
    specs = {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in model.state_dict().items()}
    checkpoint.save({"model": model.state_dict(), "wrapped": wrapped}, path, step=1)
    print(json.dumps({"devices": n, "specs": specs, "wrapped_type": type(wrapped).__name__}))


if __name__ == "__main__":
    main(sys.argv[1])
