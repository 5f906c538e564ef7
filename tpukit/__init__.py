"""tpukit: a notebook kit for PyTorch on XLA devices (Cloud TPUs through torch_xla).

``import tpukit`` imports neither torch_xla nor any UI library (ipywidgets,
matplotlib, IPython): it does not start the runtime. The optional parts
(``tpukit.hf``, ``tpukit.widgets``, ``tpukit.tpu``) are attributes after a plain
``import tpukit``; ``tpukit.hf`` is imported on first use (it imports neither transformers
nor torch_xla), ipywidgets and matplotlib by the front end that draws, jax only in the
TPU compiler's worker process.
"""

import importlib
from typing import Any

from ._version import __version__

from .errors import (
    CheckpointError,
    DeviceNotFoundError,
    LaunchError,
    RecompilationError,
    RuntimeStateError,
    ShardingError,
    SliceError,
    TorchXlaMissingError,
    TpuBusyError,
    TpukitError,
    TpukitWarning,
    VersionMismatchError,
)
from .checkpoint import CheckpointManager, Manifest, export_pretrained, load, save, verify
from .compiles import CompileEvent, compiling_now
from .events import remove_listener
from .guards import expect_compiles, no_recompile_after
from .magics import load_ipython_extension, unload_ipython_extension
from .metrics import Delta, Snapshot, snapshot
from .parallel import LocalSlice, launch, run_on_slice
from .profile import Profile, ProfileSummary, profile
from .runtime import Runtime, rank, setup
from .spmd import device_loader, fsdp, mesh, shard_batch, sharding_spec
from .tpu import TpuEstimate, compare, estimate, fit, largest_batch, plan
from .steps import StepRecord, add_listener, log, on_step
from .track import Tracker, dashboard, track
from . import events, widgets  # the notebook UI (imports no UI library)
from . import data  # noqa: F401 (tpukit.data.bert_mask(...) after `import tpukit`: batching and the bucket advisor)
from . import samples  # noqa: F401 (tpukit.samples.sentiment_sample(): the tutorials' offline data)
from . import eager  # noqa: F401 (follows torch_xla's eager mode to name its per-op compiles)
from .parallel import hosts  # noqa: F401 (tpukit.hosts.current(), process_group(): asked on a slice's hosts)

# The arrows from the core to the UI, drawn here where everything is imported: what tpukit.dashboard() and
# track(dashboard=True) open, and the view of long TPU work (the core cannot import widgets).
events.set_ui_factory("dashboard", widgets.open_view)
events.set_ui_factory("progress", widgets.ProgressView)

# The optional parts, reachable as tpukit.<name> after `import tpukit` (module __getattr__ below).
# widgets and tpu are imported above already (they load no UI library and no jax); hf on first use.
_PARTS = ("hf", "widgets", "tpu")


def __getattr__(name: str) -> Any:
    """``tpukit.hf`` (and the other optional parts) after a plain ``import tpukit``: imported on first use."""
    if name in _PARTS:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tpukit' has no attribute {name!r}: the public names are listed in "
                         f"tpukit.__all__, the optional parts are {', '.join('tpukit.' + p for p in _PARTS)}.")


__all__ = [
    "__version__",
    "setup",
    "Runtime",
    "snapshot",
    "Snapshot",
    "Delta",
    "CompileEvent",
    "compiling_now",
    "log",
    "on_step",
    "track",
    "Tracker",
    "StepRecord",
    "add_listener",
    "remove_listener",
    "expect_compiles",
    "no_recompile_after",
    "dashboard",
    "save",
    "load",
    "verify",
    "Manifest",
    "CheckpointManager",
    "export_pretrained",
    "mesh",
    "shard_batch",
    "sharding_spec",
    "device_loader",
    "fsdp",
    "estimate",
    "largest_batch",
    "plan",
    "fit",
    "compare",
    "TpuEstimate",
    "launch",
    "run_on_slice",
    "LocalSlice",
    "profile",
    "Profile",
    "ProfileSummary",
    "rank",
    "ShardingError",
    "load_ipython_extension",
    "unload_ipython_extension",
    "TpukitError",
    "TpukitWarning",
    "TorchXlaMissingError",
    "TpuBusyError",
    "VersionMismatchError",
    "DeviceNotFoundError",
    "RuntimeStateError",
    "RecompilationError",
    "CheckpointError",
    "LaunchError",
    "SliceError",
]
