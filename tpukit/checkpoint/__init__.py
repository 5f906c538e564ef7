"""Checkpoints that are never lost: ``save`` / ``load``, ``CheckpointManager``, ``export_pretrained``.

A checkpoint is two files: the payload (``torch.save`` or safetensors) and a small
JSON manifest next to it (format version, library versions, step, time, byte
size and sha256 of the payload). Both are written to a temporary file in the
same directory, fsynced and renamed over the target, payload first: the manifest
is the commit marker, so a save killed at any moment leaves the previous
checkpoint valid, and a payload whose manifest is missing or whose hash does not
match is never loaded.

Payloads load with ``torch.load(weights_only=True)`` (no code runs while
unpickling), with numpy's array/scalar rebuilders allowed so numpy RNG states
load too. To make that always possible, ``save`` rejects up front anything else:
tensors, numbers, strings, bytes, None, dicts, lists, tuples, sets,
``torch.Size/dtype/device`` and numeric numpy values are fine (so are torch and
Python RNG states); modules, optimizers and other objects are not.

torch_xla is touched only when the state holds XLA tensors (or a load targets an
XLA device), so checkpoints load on plain CPU PyTorch.

At scale: saves stream tensor by tensor, device tensors larger than a chunk
(``copy_chunk``, 4 MiB) coming to the host a chunk at a time, so the extra host
memory is a few chunks whatever the tensor sizes; a preflight refuses a save the disk or host memory cannot hold before
anything is written, ``CheckpointManager`` keeps the generator states so a resumed
run draws the same random numbers, and SPMD-sharded states are saved shard by
shard as a ``torch.distributed.checkpoint`` directory committed by the same kind
of manifest, restorable into any mesh or whole on the CPU.

Rules of use (``CheckpointManager``): one manager saves into a directory at a
time (a lock file naming its process: another process's is refused, a dead one's
lock taken over, an older one of the same process superseded); a pending asynchronous save finishes when the script ends, but call
``wait()`` before another process reads it; rotation never deletes a checkpoint
newer than the one just saved.

Modules, bottom to top: ``files`` (atomic writes, the sha256 loop, temp names),
``format`` (the manifest, checkpoint file names), ``checks`` (arguments checked up
front), ``lock`` (one writing manager per directory), ``chunks`` (device-to-host
copies in bounded pieces), ``stream`` (payloads written tensor by tensor), ``payload`` (the payload formats and the up-front state check),
``rng`` (generator states), ``sharded`` (sharded checkpoint directories),
``saveload`` (save, load, verify, the preflight), ``manager`` (CheckpointManager)
``wrappers`` (the model inside tpukit.fsdp's and other wrappers, and its own
key names) and ``export`` (export_pretrained, export_adapters).
"""

from .export import export_adapters, export_pretrained
from .format import Manifest
from .manager import CheckpointManager
from .rng import rng_state, set_rng_state
from .saveload import load, save, verify

__all__ = ["CheckpointManager", "Manifest", "export_adapters", "export_pretrained", "load", "rng_state", "save", "set_rng_state", "verify"]
