"""Loads checkpoints in a process where torch_xla cannot be imported (plain CPU PyTorch).

Usage: python ckpt_plain_load.py EXPECTED.pt CKPT [CKPT ...]
Blocks every torch_xla import before anything else, loads each checkpoint with
tpukit.checkpoint.load and compares it to EXPECTED (written with torch.save),
then saves and reloads CPU state through save() and CheckpointManager (which must
not need torch_xla either); prints one JSON line with the findings.
"""

import importlib.abc
import json
import sys
import tempfile


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError(f"{name} is blocked for this test", name=name)
        return None


sys.meta_path.insert(0, _Blocker())

import torch  # noqa: E402

from tpukit import checkpoint  # noqa: E402


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.device.type == "cpu" and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def main() -> None:
    expected = torch.load(sys.argv[1], weights_only=True)
    result = {}
    for path in sys.argv[2:]:
        state = checkpoint.load(path)
        result[path] = {
            "equal": same(state, expected),
            "tied": state["tied_a"] is state["tied_b"] or state["tied_a"].data_ptr() == state["tied_b"].data_ptr(),
        }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint.save(expected, f"{tmp}/again.pt")
        mgr = checkpoint.CheckpointManager(tmp, async_save=True)
        mgr.save(2, model=expected["model"])
        again = same(checkpoint.load(f"{tmp}/again.pt"), expected) and mgr.restore() == 2
    try:
        import torch_xla  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    print(json.dumps({"results": result, "saved_again": again, "blocked": blocked,
                      "torch_xla_loaded": "torch_xla" in sys.modules}))


if __name__ == "__main__":
    main()
