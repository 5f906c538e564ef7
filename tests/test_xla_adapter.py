"""The torch_xla adapter as a package (tpukit/_xla/): its version gates, the eager-mode switch's one
follower, and what ``import tpukit`` loads. Real torch_xla on XLA:CPU; nothing is mocked."""

from __future__ import annotations

import json

from conftest import run_python


def test_the_version_gates_read_the_installed_torch_xla():
    import torch_xla

    from tpukit import _xla

    major, minor = (int(x) for x in torch_xla.__version__.split(".")[:2])
    assert _xla.versions.installed() == (major, minor)
    assert _xla.versions.KAGGLE == (2, 8) and _xla.versions.COLAB == (2, 9)
    assert _xla.versions.at_least(_xla.versions.OLDEST)
    assert _xla.versions.at_least(_xla.versions.CUDA_REMOVED) == ((major, minor) >= (2, 9))
    assert not _xla.versions.at_least((major, minor + 1))


def test_the_package_keeps_every_name_the_rest_of_tpukit_calls():
    from tpukit import _xla

    missing = [n for n in _xla.__all__ if not hasattr(_xla, n)]
    assert not missing, missing
    for name in ("sync", "device", "to_cpu", "run_replica_process", "profiler_start", "has_pending", "make_mesh"):
        assert callable(getattr(_xla, name)), name
    assert not hasattr(_xla, "on_eager_mode") and not hasattr(_xla, "_EAGER_HOOKS")  # one follower, not a list


FOLLOW = r"""
import json, sys
import tpukit
from tpukit import _xla, eager
heard = []
torch_xla_loaded_by_import = "torch_xla" in sys.modules
_xla.device()  # loads torch_xla through the adapter: the switch gets wrapped for tpukit.eager
from torch_xla.experimental import eager_mode
xlac = sys.modules["torch_xla"]._XLAC
wrapped_once = hasattr(xlac._set_use_eager_mode, "tpukit_original")
eager_mode(True)
tpukit_follows = eager.active()
eager_mode(False)
_xla.eager.follow(heard.append)  # takes the one slot: tpukit.eager no longer hears the switch
eager_mode(True)
replaced = not eager.active()
eager_mode(False)
_xla.eager.follow(None)
eager_mode(True)
_xla.eager.follow(heard.append)  # eager mode already on: the new follower hears it at once
eager_mode(False)
print(json.dumps({"imported": torch_xla_loaded_by_import, "wrapped": wrapped_once, "follows": tpukit_follows,
                  "replaced": replaced, "heard": heard,
                  "not_rewrapped": not hasattr(xlac._set_use_eager_mode.tpukit_original, "tpukit_original")}))
"""


def test_the_eager_mode_switch_has_one_follower():
    proc = run_python(FOLLOW)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["imported"] is False  # import tpukit does not load torch_xla
    assert r["wrapped"] and r["not_rewrapped"], r
    assert r["follows"] is True, r  # tpukit.eager is the follower tpukit sets
    assert r["replaced"] is True, r
    # heard.append got: True/False while it held the slot, nothing while the slot was empty,
    # True at once when it took the slot with eager mode on, then False.
    assert r["heard"] == [True, False, True, False], r


def test_import_tpukit_makes_tpukit_data_reachable_without_loading_torch_xla():
    proc = run_python("import sys, tpukit, torch\n"
                      "m = tpukit.data.bert_mask(torch.tensor([[1, 1, 0]]))\n"
                      "print(tuple(m.shape), float(m[0, 0, 0, 2]) < -1e30, 'torch_xla' in sys.modules,\n"
                      "      tpukit.data.suggest_buckets is tpukit.buckets.suggest_buckets)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["(1,", "1,", "1,", "3)", "True", "False", "True"], proc.stdout
