"""The random-number generator states a resumed run needs to draw the same numbers as the run it continues.

Four generators feed a typical training loop: the XLA device's (dropout and other
random ops traced on the device), torch's CPU generator (``torch.randn``, DataLoader
shuffling, initialisation), numpy's global one and Python's ``random``. The
state is a tree of plain values and tensors, so both payload formats store it.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from .. import _xla
from ..errors import CheckpointError

RNG_KEY = "rng_state"  # the key CheckpointManager (and save(rng=True)) stores the states under


def rng_state() -> dict:
    """The current states of Python's, numpy's, torch's CPU and the XLA device's generators.

    The XLA entry is present only when the XLA runtime has started (reading it never
    starts it); numpy's only when numpy is installed.
    """
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np_state = np.random.get_state(legacy=False)
        state["numpy"] = {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    if _xla.runtime_initialized():
        state["xla"] = _xla.rng_seed()
    return state


def set_rng_state(state: dict) -> None:
    """Restore generator states taken by ``rng_state`` (those present; the XLA one starts the runtime)."""
    if not isinstance(state, dict) or "torch" not in state:
        raise CheckpointError(
            f"{type(state).__name__} is not a generator state from tpukit.checkpoint.rng_state(); "
            "pass the checkpoint's 'rng_state' entry."
        )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        saved = state["numpy"]
        np.random.set_state({
            "bit_generator": saved["bit_generator"],
            "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
            "has_gauss": saved["has_gauss"], "gauss": saved["gauss"],
        })
    if "xla" in state:
        _xla.set_rng_seed(state["xla"])
