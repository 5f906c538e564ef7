"""A training run with dropout, for the exact-resume test (tests/test_checkpoint_scale.py).

  python ckpt_resume.py DIR full     seed 0, train steps 1..6, checkpoint after step 3
  python ckpt_resume.py DIR resume   seed differently, restore the step-3 checkpoint, train steps 4..6

Each step draws from all four generators: dropout on the XLA device, the batch
from torch's CPU generator, a numpy noise term and a Python ``random`` scale.
Prints "loss STEP VALUE" lines with the float's exact hex.
"""

import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch_xla

from tpukit.checkpoint import CheckpointManager


def main(directory: str, mode: str) -> None:
    seed = 0 if mode == "full" else 12345
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    dev = torch_xla.device()
    torch_xla.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mgr = CheckpointManager(directory, keep=2)
    first = 1
    if mode == "resume":
        first = mgr.restore(model, opt) + 1
        assert first == 4, first
    for step in range(first, 7):
        x = torch.randn(8, 16) * random.uniform(0.5, 1.5) + torch.from_numpy(np.random.randn(8, 16)).float()
        loss = model(x.to(dev)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
        print("loss", step, float(loss.item()).hex(), flush=True)
        if mode == "full" and step == 3:
            mgr.save(step, model=model.state_dict(), optimizer=opt.state_dict())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
