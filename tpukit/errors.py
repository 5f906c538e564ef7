"""tpukit's error and warning types.

Every error a user can cause says what happened, why, and what to do next.
"""

from __future__ import annotations


class TpukitError(Exception):
    """Base class of every error tpukit raises on purpose."""


class TorchXlaMissingError(TpukitError, ImportError):
    """torch_xla is not installed in this Python environment."""


class VersionMismatchError(TpukitError):
    """The installed torch and torch_xla releases do not belong together."""


class DeviceNotFoundError(TpukitError):
    """The requested kind of device does not exist on this machine."""


class TpuBusyError(TpukitError):
    """The TPU is held by another process (the message names its pid and command and how to free it),
    or ``free_tpu`` could not end that process."""


class RuntimeStateError(TpukitError):
    """An operation needs the runtime in a different state (e.g. SPMD on)."""


class RecompilationError(TpukitError):
    """A guarded block compiled more graphs than it was allowed to."""


class CheckpointError(TpukitError):
    """A checkpoint could not be written, read or restored."""


class LaunchError(TpukitError):
    """A multi-process launch could not start or a replica failed."""


class SliceError(LaunchError):
    """A run on the hosts of a TPU slice (``tpukit.run_on_slice``) could not start or a host failed."""


class DataError(TpukitError, ValueError):
    """Bad input to tpukit.data's batching helpers or to the bucket advisor (empty lengths, a batch
    size below 1, ...)."""


class ShardingError(TpukitError, ValueError):
    """A tensor cannot be split the way it was asked to (e.g. an indivisible batch)."""


class TpukitWarning(UserWarning):
    """Category of every warning tpukit emits, so it can be filtered."""
