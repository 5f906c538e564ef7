"""Fork server for the SIGKILL test (tests/test_checkpoint.py).

Imports torch and tpukit.checkpoint once (never torch_xla: startup time, and the
saver only needs CPU tensors), prints "ready <torch_xla imported?>", then reads
commands from stdin:
  go DIR    fork a child that saves checkpoints into DIR in an endless loop,
            printing "saved N" after each save returned; replies "child PID"
  reap PID  wait for a (killed) child; replies "dead PID STATUS"
Each child is a real process that the test kills with SIGKILL.
"""

import os
import sys

import torch

from tpukit.checkpoint import CheckpointManager


def content(step: int) -> dict:
    """The state saved at ``step``: a deterministic function of the step (4 MiB, so writes take time)."""
    gen = torch.Generator().manual_seed(step)
    return {
        "big": torch.arange(1 << 20, dtype=torch.int32) + step,
        "noise": torch.randn(64, generator=gen),
        "meta": {"name": f"step-{step}", "pair": (step, -step)},
    }


def _child(directory: str) -> None:
    mgr = CheckpointManager(directory, keep=3)
    step = (mgr.latest_step() or 0) + 1
    while True:
        mgr.save(step, **content(step))
        os.write(1, f"saved {step}\n".encode())
        step += 1


def main() -> None:
    print("ready", "torch_xla" in sys.modules, flush=True)
    for line in sys.stdin:
        cmd, arg = line.split()
        if cmd == "go":
            pid = os.fork()
            if pid == 0:
                try:
                    _child(arg)
                finally:
                    os._exit(1)
            print("child", pid, flush=True)
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            print("dead", arg, status, flush=True)


if __name__ == "__main__":
    main()
