"""``save``, ``load`` and ``verify`` of one checkpoint, and the CPU copy of a state they share.

The payload and then its manifest are each written atomically; the manifest is
the commit marker, so a save killed at any moment leaves the previous checkpoint
valid, and a payload whose manifest is missing or whose hash does not match is
never loaded. torch_xla is touched only when the state holds XLA tensors (or a
load targets an XLA device), so checkpoints load on plain CPU PyTorch.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import _xla, environment
from .._tree import is_tensor, tree_leaves, tree_map
from ..errors import CheckpointError, TpukitWarning
from .._version import __version__
from ..runtime import rank
from .checks import MismatchError, check_device, check_step
from .chunks import COPY_CHUNK, check_chunk
from .files import atomic_write, hash_file
from .format import (
    MANIFEST_SUFFIX,
    SUFFIX,
    Manifest,
    check_weights_format,
    checkpoint_name,
    committed_steps,
    manifest_path,
)
from .payload import check_state, read_payload, write_payload
from .rng import RNG_KEY, rng_state, set_rng_state
from .sharded import SHARDED, process_group, read_sharded, verify_sharded, write_sharded
from .stream import payload_bytes

log = logging.getLogger("tpukit")


# --------------------------------------------------------------------------- copying to CPU

def is_master() -> bool:
    """True on the replica that writes: rank 0 under tpukit.launch, global ordinal 0 otherwise."""
    return rank() == 0


def sync_state(state: Any) -> None:
    """Compute the state's pending XLA values (every replica must call it: the sync is collective).

    Called once per save, before the generator states are read: a sync advances
    the XLA seed, and the resumed run must start from the seed the saving run's
    next step used.
    """
    if any(_xla.is_xla_tensor(t) for _, t in tree_leaves(state, is_tensor)):
        _xla.sync()  # every replica runs the pending step: the same graph the training loop launches


def to_cpu(state: Any, copy: bool, master: bool = True) -> Any:
    """The state with every tensor on the CPU (XLA tensors synced, gathered, copied in one batch).

    For a write that runs later (async saves, exports): a synchronous save streams
    instead (``stream``), holding one tensor at a time. Tensors that are one object
    (or one XLA tensor) stay one CPU tensor, so tied weights stay tied. ``copy``
    clones CPU tensors too. Call ``sync_state`` first; non-master replicas get None.
    """
    if not master:
        return None
    xla = [t for _, t in tree_leaves(state, is_tensor) if _xla.is_xla_tensor(t)]
    unique = {("xla", _xla.tensor_id(t)): t for t in reversed(xla)}
    memo: dict[Any, torch.Tensor] = dict(zip(unique, _xla.to_cpu(list(unique.values()), sync=False))) if xla else {}

    def convert(t: torch.Tensor, _path: str) -> torch.Tensor:
        key = ("xla", _xla.tensor_id(t)) if _xla.is_xla_tensor(t) else id(t)
        if key not in memo:
            cpu = t.detach().cpu()
            memo[key] = cpu.clone() if copy and t.device.type == "cpu" else cpu
        return memo[key]

    return tree_map(convert, state, is_tensor)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def _exact(n: int) -> str:
    """A byte count to the byte, with a unit that shows the difference between two close sizes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n:,} bytes = {n / (1 << shift):.3f} {unit}"
    return f"{n:,} bytes"


def read_only(directory: Path) -> bool:
    """True when ``directory`` lies on a file system mounted read-only."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs on this platform
        return False


def preflight(state: Any, target: Path, copy_chunk: int = COPY_CHUNK) -> None:
    """Raise CheckpointError, before anything is written, when the disk or host memory cannot take the save.

    The directory must be writable; the disk needs the payload's bytes (plus 1%
    and 64 KiB of archive overhead) free beside ``target``; host memory needs room
    for what a streamed save holds at once (``stream.payload_bytes``: a few
    ``copy_chunk`` pieces of device tensors, the largest CPU tensor). A sharded
    save holds one tensor's local shards at a time, so the check is conservative.
    """
    # A sharded save's folder may not exist yet on this host (host 0 makes it): judge its nearest parent.
    existing = next((p for p in (target.parent, *target.parent.parents) if p.exists()), target.parent)
    if read_only(existing):
        raise CheckpointError(
            f"Cannot save {target.name}: {target.parent} is on a read-only file system. Nothing was written; "
            "save to a writable directory (or remount it read-write)."
        )
    if not os.access(existing, os.W_OK):
        raise CheckpointError(
            f"Cannot save {target.name}: this user may not write in {target.parent}. Nothing was written; "
            "fix its permissions or save to a directory you own."
        )
    total, peak = payload_bytes(state, copy_chunk)
    need = int(total * 1.01) + (64 << 10)
    free = shutil.disk_usage(existing).free
    if free < need:
        raise CheckpointError(
            f"Not enough disk space to save {target.name}: it needs about {_gib(need)} in {target.parent}, which "
            f"has {_gib(free)} free (needs {_exact(need)}, has {_exact(free)}: {_exact(need - free)} short). "
            "Nothing was written and the previous checkpoint is untouched; free space "
            "(e.g. keep fewer checkpoints) or save to a larger disk."
        )
    available = environment.available_memory()
    if available is not None and peak > available:
        raise CheckpointError(
            f"Not enough host memory to save {target.name}: its largest tensor takes {_gib(peak)} on the host "
            f"while it is written, and {_gib(available)} is available. Nothing was written; free host memory "
            "(delete CPU copies, restart other kernels) and save again."
        )


# --------------------------------------------------------------------------- writing

def _write_error(target: Path, exc: OSError) -> CheckpointError:
    what = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno or 0, "")
    if exc.errno == errno.EROFS or read_only(target.parent):
        return CheckpointError(
            f"Could not write checkpoint {target}: {target.parent} is on a read-only file system ({what}). "
            "The previous checkpoint is untouched; save to a writable directory."
        )
    return CheckpointError(
        f"Could not write checkpoint {target}: {what}{f' ({code})' if code else ''}. The previous checkpoint "
        f"is untouched and no temporary file was left; free space or fix permissions in {target.parent}, "
        "or save elsewhere."
    )


def commit(state: Any, payload: Path, weights_format: str, step: int | None,
           copy_chunk: int = COPY_CHUNK) -> Manifest | None:
    """Write payload then manifest, both atomically; the manifest commits the checkpoint.

    ``state`` is synced (``sync_state``) or on the CPU; its tensors are copied to
    the host and written one at a time after a disk and memory preflight. A
    sharded save with a process group is collective: every process calls it and
    only the committing one gets the manifest (the others None).
    """
    preflight(state, payload, copy_chunk)
    try:
        if weights_format == SHARDED:
            manifest = write_sharded(state, payload, step)
        else:
            size, sha = atomic_write(payload, lambda tmp: write_payload(state, tmp, weights_format, copy_chunk))
            v = environment.versions()
            manifest = Manifest(
                payload=payload.name, weights_format=weights_format, step=step, time=time.time(), bytes=size,
                sha256=sha, tpukit=__version__, torch=v.get("torch"), torch_xla=v.get("torch_xla"),
            )
            text = manifest.to_json()
            atomic_write(manifest_path(payload), lambda tmp: tmp.write_text(text))
    except OSError as exc:
        raise _write_error(payload, exc) from exc
    if manifest is not None:
        log.info("checkpoint saved: %s (%d bytes, step %s)", payload, manifest.bytes, step)
    return manifest


def _weights_format(path: Path, weights_format: str | None) -> str:
    if weights_format == SHARDED or (weights_format is None and path.suffix == SUFFIX[SHARDED]):
        return SHARDED
    return check_weights_format(weights_format or ("safetensors" if path.suffix == ".safetensors" else "torch"))


def save(
    state: Any, path: str | os.PathLike, *, step: int | None = None, weights_format: str | None = None,
    rng: bool = False, copy_chunk: int = COPY_CHUNK,
) -> Manifest | None:
    """Save ``state`` (nested dicts/lists/tuples of tensors and plain values) atomically to ``path``.

    Syncs pending XLA work, then writes the payload tensor by tensor (each copied
    to the host in turn, a device tensor larger than ``copy_chunk`` a piece at a
    time, so the extra host memory stays near a few chunks; SPMD-sharded ones
    whole) and then its manifest (``path`` with a ``.json``
    suffix), from the master replica only. ``weights_format`` is "torch" (default),
    "safetensors" (no pickle; the default when ``path`` ends in ``.safetensors``) or
    "dcp" (the default when ``path`` ends in ``.dcp``): a sharded checkpoint
    directory, each SPMD shard written as it is, never gathered (``sharded``).
    ``rng=True`` adds the generator states (``rng_state()``) to a dict ``state``
    under ``"rng_state"``; ``load(path, rng=True)`` restores them. ``copy_chunk``
    bounds the bytes of one copy from the device (``chunks``): a larger device
    tensor comes to the host in pieces. Returns the manifest, or None on replicas
    that do not write.
    """
    path = Path(path)
    copy_chunk = check_chunk(copy_chunk)
    if step is not None:
        step = check_step(step)
    if rng and (not isinstance(state, dict) or RNG_KEY in state):
        raise CheckpointError(
            f"save(rng=True) adds the generator states to a dict state under {RNG_KEY!r}; pass a dict "
            f"without that key (got {type(state).__name__})."
        )
    fmt = _weights_format(path, weights_format)
    if path.suffix == MANIFEST_SUFFIX:
        raise CheckpointError(f"Cannot save a checkpoint to {path}: .json is the manifest's suffix. Use e.g. .pt.")
    check_state(state, "state", "torch" if fmt == SHARDED else fmt)
    if step is None and isinstance(state, dict) and type(state.get("step")) is int:
        step = state["step"]
    master = is_master()
    if master and not path.parent.is_dir():
        raise CheckpointError(f"Cannot save to {path}: directory {path.parent} does not exist. Create it first.")
    other = _manifest_owner(path) if master else None
    if other is not None and other != path.name and (path.parent / other).exists():
        raise CheckpointError(
            f"Cannot save to {path}: its manifest {manifest_path(path).name} already belongs to {other}, "
            "which would become unloadable. Use a different file name."
        )
    sync_state(state)
    if rng:  # read after the sync, which advances the XLA seed
        state = {**state, RNG_KEY: rng_state()}
    return commit(state, path, fmt, step, copy_chunk) if master or collective(fmt) else None


def collective(weights_format: str) -> bool:
    """True when every process takes part in writing (a sharded save under a process group)."""
    return weights_format == SHARDED and process_group() is not None


def _manifest_owner(path: Path) -> str | None:
    """The payload named by the manifest ``path`` would use, if one exists and is readable."""
    try:
        return Manifest.read(manifest_path(path)).payload
    except CheckpointError:
        return None


# --------------------------------------------------------------------------- reading

def payload_of(path: str | os.PathLike) -> Path:
    """``path``, or the payload a manifest names when ``path`` is a checkpoint's ``.json`` manifest."""
    path = Path(path)
    if path.suffix != MANIFEST_SUFFIX or not path.is_file():
        return path
    payload = path.parent / Manifest.read(path).payload
    if manifest_path(payload) != path:
        raise CheckpointError(
            f"{path} is a manifest naming {payload.name}, whose own manifest would be {manifest_path(payload).name}: "
            "it was renamed. Pass the checkpoint file itself, not its manifest."
        )
    return payload


def verify(path: str | os.PathLike) -> Manifest:
    """Check a checkpoint against its manifest (presence, size, sha256); returns the manifest or raises.

    ``path`` is the payload, or its ``.json`` manifest (the checkpoint it names is checked).
    """
    path = payload_of(path)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the file does not exist. Check the path.")
    manifest = Manifest.read(manifest_path(path))
    if manifest.payload != path.name:
        raise CheckpointError(
            f"Manifest {manifest_path(path)} belongs to {manifest.payload}, not {path.name}: two checkpoints "
            "share a manifest name. Load the one it names, or save under distinct names."
        )
    if manifest.weights_format == SHARDED:
        verify_sharded(path, manifest)
        return manifest
    with open(path, "rb") as f:
        size, sha = hash_file(f)
    if size != manifest.bytes or sha != manifest.sha256:
        why = f"has {size} bytes, expected {manifest.bytes}" if size != manifest.bytes else "does not match its sha256"
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: it {why} (truncated or damaged on disk). Load an older checkpoint."
        )
    return manifest


def _read(path: Path, manifest: Manifest, device: Any, into: dict | None = None) -> Any:
    try:
        if manifest.weights_format == SHARDED:
            return read_sharded(path, into) if into is not None else _place(read_sharded(path), device)
        state = read_payload(path, manifest.weights_format)
    except MismatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - hash matched, so the payload itself is bad
        raise CheckpointError(f"Checkpoint {path} passed its hash check but could not be read: {exc}") from exc
    return _place(state, device)


def _place(state: Any, device: Any) -> Any:
    if device is None or torch.device(device).type == "cpu":
        return state
    memo: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor, _path: str) -> torch.Tensor:  # one tensor stays one tensor (tied weights)
        if id(t) not in memo:
            memo[id(t)] = t.to(device)
        return memo[id(t)]

    return tree_map(place, state, is_tensor)


def newest_valid(directory: Path, device: Any = None, read: bool = True,
                 into: dict | None = None) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest checkpoint in ``directory`` that verifies, or None.

    Damaged checkpoints (missing or unreadable manifest, wrong size or hash, a
    payload that does not read) are skipped with a warning naming the step.
    With ``read=False`` the payload is only verified and the state is None.
    """
    for step in reversed(committed_steps(directory)):
        try:
            payload = directory / Manifest.read(directory / checkpoint_name(step, MANIFEST_SUFFIX)).payload
            manifest = verify(payload)
            return step, (_read(payload, manifest, device, into) if read else None)
        except MismatchError:
            raise  # the checkpoint is sound; what it is loaded into differs
        except (CheckpointError, OSError) as exc:
            # stacklevel 3: the caller of the public function (load, latest, latest_step)
            warnings.warn(f"Skipping checkpoint step {step} in {directory}: {exc}", TpukitWarning, stacklevel=3)
    return None


def load(path: str | os.PathLike, device: Any = None, rng: bool = False, into: dict | None = None) -> Any:
    """Load a verified checkpoint: CPU tensors, or tensors placed on ``device``.

    ``path`` is a payload written by ``save`` (or its ``.json`` manifest: the
    checkpoint it names is loaded) or a ``CheckpointManager`` directory (its newest
    valid checkpoint). ``device`` is None (CPU tensors), 'cpu', 'xla' or another
    device torch can place tensors on here. ``rng=True`` also restores the generator states
    the checkpoint holds (``save(rng=True)``, or any manager checkpoint). A sharded
    checkpoint loads whole onto the CPU (consolidated, no torch_xla needed), or
    with ``into`` (a dict like the saved state whose tensors are sharded over the
    current mesh, any mesh shape) in place, each device reading only its slices
    (``into`` is ignored for single-file checkpoints, which load whole). Raises CheckpointError for anything missing, truncated or altered.
    """
    device = check_device(device)
    state = _load(payload_of(path), device, into)
    if rng:
        if not isinstance(state, dict) or RNG_KEY not in state:
            raise CheckpointError(
                f"Checkpoint {path} holds no generator states: save it with save(..., rng=True) or a "
                "CheckpointManager, or load it with rng=False."
            )
        set_rng_state(state[RNG_KEY])
    return state


def _load(path: Path, device: Any, into: dict | None) -> Any:
    if not path.is_dir() or path.suffix == SUFFIX[SHARDED]:
        return _read(path, verify(path), device, into)
    steps = committed_steps(path)
    if not steps:
        raise CheckpointError(
            f"No checkpoint in directory {path}: it holds no ckpt-*.json manifests. "
            "Pass a checkpoint file, or a directory written by CheckpointManager."
        )
    found = newest_valid(path, device, into=into)
    if found is None:
        raise CheckpointError(f"No valid checkpoint in {path}: all {len(steps)} are damaged (see the warnings).")
    return found[1]
