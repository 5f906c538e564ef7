"""The small models and training steps the TPU estimate tests share (tests/test_tpu.py, test_compilers.py,
test_tpu_memory.py, test_regressions.py): a seeded MLP on the XLA device, and one training step of it."""

import torch

from tpukit import _xla


def mlp(dim: int = 256, hidden: int = 1024, dropout: float = 0.0) -> torch.nn.Module:
    """``Linear(dim, hidden) -> ReLU [-> Dropout] -> Linear(hidden, dim)`` on the XLA device, seeded."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(dim, hidden), torch.nn.ReLU()]
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, dim)).to(_xla.device())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """One training step of ``model`` with ``opt`` (squared-output loss, backward, step, zero_grad)."""
    def step(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step
