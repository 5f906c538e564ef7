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
from .runtime import Runtime, setup

__all__ = [
    "__version__",
    "setup",
    "Runtime",
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
