"""tpukit: a notebook kit for PyTorch on XLA devices (Cloud TPUs through torch_xla).

``import tpukit`` imports neither torch_xla nor any UI library (ipywidgets,
matplotlib, IPython): it does not start the runtime.
"""

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
from .launch import launch
from .localslice import LocalSlice
from .magics import load_ipython_extension, unload_ipython_extension
from .metrics import Delta, Snapshot, snapshot
from .pod import run_on_slice
from .profile import Profile, ProfileSummary, profile
from .runtime import Runtime, rank, setup
from .spmd import device_loader, fsdp, mesh, shard_batch, sharding_spec
from .tpu import TpuEstimate, estimate, largest_batch
from .steps import StepRecord, add_listener, log, on_step
from .track import Tracker, dashboard, track
from . import events, widgets  # the notebook UI (imports no UI library)
from . import data  # noqa: F401 (tpukit.data.bert_mask(...) after `import tpukit`: batching and the bucket advisor)
from . import samples  # noqa: F401 (tpukit.samples.sentiment_sample(): the tutorials' offline data)
from . import eager  # noqa: F401 (follows torch_xla's eager mode to name its per-op compiles)

# The one arrow from the core to the UI, drawn here where everything is imported: what
# tpukit.dashboard() and track(dashboard=True) open (the core cannot import widgets).
events.set_dashboard_factory(widgets.open_view)

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
