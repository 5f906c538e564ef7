"""tpukit: a notebook kit for PyTorch on XLA devices (Cloud TPUs through torch_xla).

``import tpukit`` is cheap: it imports neither torch_xla nor any UI library.
"""

__version__ = "0.1.0"

from .errors import (
    CheckpointError,
    DeviceNotFoundError,
    LaunchError,
    RecompilationError,
    RuntimeStateError,
    TorchXlaMissingError,
    TpukitError,
    TpukitWarning,
    VersionMismatchError,
)
from .compiles import CompileEvent, compiling_now
from .metrics import Delta, Snapshot, snapshot
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
