"""tpukit: a notebook kit for PyTorch on XLA devices (Cloud TPUs through torch_xla).

``import tpukit`` imports neither torch_xla nor any UI library: it does not start the runtime.
"""

__version__ = "0.1.0"

from .errors import (
    CheckpointError,
    DeviceNotFoundError,
    LaunchError,
    RecompilationError,
    RuntimeStateError,
    ShardingError,
    TorchXlaMissingError,
    TpukitError,
    TpukitWarning,
    VersionMismatchError,
)
from .checkpoint import CheckpointManager, Manifest, export_pretrained, load, save, verify
from .compiles import CompileEvent, compiling_now
from .magics import load_ipython_extension, unload_ipython_extension
from .metrics import Delta, Snapshot, snapshot
from .parallel import device_loader, fsdp, launch, mesh, rank, shard_batch, sharding_spec
from .runtime import Runtime, setup
from .steps import (
    StepRecord,
    Tracker,
    add_listener,
    dashboard,
    expect_compiles,
    log,
    no_recompile_after,
    on_step,
    remove_listener,
    track,
)

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
    "launch",
    "rank",
    "ShardingError",
    "load_ipython_extension",
    "unload_ipython_extension",
    "TpukitError",
    "TpukitWarning",
    "TorchXlaMissingError",
    "VersionMismatchError",
    "DeviceNotFoundError",
    "RuntimeStateError",
    "RecompilationError",
    "CheckpointError",
    "LaunchError",
]
