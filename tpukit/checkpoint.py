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
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import _xla, environment
from .errors import CheckpointError, TpukitWarning

log = logging.getLogger("tpukit")

FORMAT_VERSION = 1
WEIGHTS_FORMATS = ("torch", "safetensors")
TMP_PREFIX = ".tmp-"  # never matches _CKPT_RE, so all_steps() cannot mistake it
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})\.json$")
_SUFFIX = {"torch": ".pt", "safetensors": ".safetensors"}
_STRUCTURE_KEY = "tpukit.structure"


# --------------------------------------------------------------------------- manifest

@dataclass(frozen=True)
class Manifest:
    """The JSON record written next to a payload; its presence commits the checkpoint."""

    payload: str  # file name of the payload, in the manifest's directory
    weights_format: str  # "torch" or "safetensors"
    step: int | None
    time: float  # unix wall time of the save
    bytes: int
    sha256: str
    tpukit: str
    torch: str | None
    torch_xla: str | None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        """The manifest as JSON text."""
        return json.dumps({"kind": "tpukit-checkpoint", **asdict(self)}, indent=1) + "\n"

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        """Read and check a manifest file; raises CheckpointError when it is unusable."""
        try:
            data = json.loads(Path(path).read_text())
            if data.pop("kind") != "tpukit-checkpoint":
                raise ValueError("not a tpukit manifest")
            if data.get("format_version", 0) > FORMAT_VERSION:
                raise CheckpointError(
                    f"Checkpoint {path} has format version {data['format_version']}, newer than this "
                    f"tpukit understands ({FORMAT_VERSION}). Upgrade tpukit to load it."
                )
            return cls(**data)
        except FileNotFoundError:
            raise CheckpointError(
                f"Checkpoint manifest {path} is missing: the save did not finish or the payload "
                "was not written by tpukit.save, so it is not trusted. Load another checkpoint."
            ) from None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointError(
                f"Checkpoint manifest {path} is unreadable ({exc!r}); the checkpoint is not trusted. "
                "Load another checkpoint."
            ) from None


def _manifest_path(path: str | os.PathLike) -> Path:
    """Where the manifest of payload ``path`` lives: the same name with a ``.json`` suffix."""
    return Path(path).with_suffix(".json")


# --------------------------------------------------------------------------- state checks

_PLAIN = (type(None), bool, int, float, str)
_TORCH_LEAVES = _PLAIN + (complex, bytes, torch.dtype, torch.device)
_NUMPY_KINDS = "biufcSU"  # numeric, bool, bytes and str arrays; their rebuilders are allowed at load


def _check_state(obj: Any, path: str, weights_format: str, active: set[int] | None = None) -> None:
    """Reject, before any work, what the payload format cannot store and reload safely."""
    active = set() if active is None else active
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            raise CheckpointError(f"{path} is a meta tensor, which holds no data to save. Materialize it first.")
        return
    if type(obj) in _PLAIN or (weights_format == "torch" and type(obj) in _TORCH_LEAVES):
        return
    if weights_format == "safetensors" and type(obj) in (torch.dtype, torch.device):
        return
    if weights_format == "torch" and _is_numpy(obj):
        if obj.dtype.kind not in _NUMPY_KINDS:
            raise CheckpointError(
                f"{path} is a numpy value of dtype {obj.dtype}, which cannot be loaded safely. "
                "Convert it to a list or a numeric array."
            )
        return
    containers = (dict, OrderedDict, list, tuple, torch.Size) + ((set,) if weights_format == "torch" else ())
    if type(obj) not in containers:
        raise CheckpointError(_unsupported(obj, path, weights_format))
    if id(obj) in active:
        raise CheckpointError(f"{path} contains itself; a checkpoint must be a tree of values. Remove the cycle.")
    active.add(id(obj))
    if isinstance(obj, dict):
        for key, value in obj.items():
            if type(key) not in _PLAIN:
                raise CheckpointError(f"{path} has a key of type {type(key).__name__} ({key!r}); use str or int keys.")
            _check_state(value, f"{path}[{key!r}]", weights_format, active)
    elif isinstance(obj, set):
        for value in obj:
            if type(value) not in _TORCH_LEAVES:
                raise CheckpointError(
                    f"{path} is a set holding a {type(value).__name__}; sets may hold plain values only."
                )
    else:
        for i, value in enumerate(obj):
            _check_state(value, f"{path}[{i}]", weights_format, active)
    active.discard(id(obj))


def _unsupported(obj: Any, path: str, weights_format: str) -> str:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if isinstance(obj, torch.nn.Module) or callable(getattr(obj, "state_dict", None)):
        return (
            f"{path} is a {kind} object, not its state: a checkpoint stores values, and saving the object "
            f"itself can hang torch_xla and break loading. Pass {path}.state_dict() instead "
            "(e.g. model=model.state_dict())."
        )
    hint = (
        "use weights_format='torch' or convert it to numbers, strings, lists and dicts"
        if weights_format == "safetensors"
        else "convert it to plain values (dict, list, tuple, tensor, number, str)"
    )
    return f"{path} is a {kind}, which a {weights_format} checkpoint cannot store and reload safely; {hint}."


def _is_numpy(obj: Any) -> bool:
    if not type(obj).__module__.startswith("numpy"):
        return False
    import numpy as np

    return isinstance(obj, (np.ndarray, np.generic))


# --------------------------------------------------------------------------- copying to CPU

def _is_master() -> bool:
    """True on the replica that writes: rank 0 under tpukit.launch, global ordinal 0 otherwise."""
    from .parallel import rank

    return rank() == 0


def _to_cpu(state: Any, copy: bool, master: bool = True) -> Any:
    """The state with every tensor on the CPU (XLA tensors synced, gathered, copied in one batch).

    Tensors that are one object (or one XLA tensor) stay one CPU tensor, so tied
    weights stay tied. ``copy`` clones CPU tensors too (for a write that runs later).
    """
    xla: list[torch.Tensor] = []
    _walk(state, lambda t: xla.append(t) if _xla.is_xla_tensor(t) else None)
    if xla:
        _xla.sync()  # every replica runs the pending step: the same graph the training loop launches
    if not master:
        return None
    unique = {("xla", _xla.tensor_id(t)): t for t in reversed(xla)}
    memo: dict[Any, torch.Tensor] = dict(zip(unique, _xla.to_cpu(list(unique.values())))) if xla else {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        key = ("xla", _xla.tensor_id(t)) if _xla.is_xla_tensor(t) else id(t)
        if key not in memo:
            cpu = t.detach().cpu()
            memo[key] = cpu.clone() if copy and t.device.type == "cpu" else cpu
        return memo[key]

    return _map(state, convert)


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> None:
    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, fn)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, fn)


def _map(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map(v, fn)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


# --------------------------------------------------------------------------- payload formats

class _Sink:
    """A file wrapper that remembers the first OSError: torch.save swallows a failed write
    (e.g. ENOSPC) and later reports only "RuntimeError: unexpected pos"."""

    def __init__(self, f: Any):
        self._f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _write_torch(state: Any, tmp: Path) -> None:
    with open(tmp, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(state, sink)
        except Exception:
            if sink.error is not None:
                raise sink.error from None
            raise


def _safe_globals() -> list:
    """numpy's array and scalar rebuilders: data only, so safe to allow (numpy RNG states)."""
    try:
        import numpy as np
    except ImportError:
        return []
    arr, scalar = np.zeros(1), np.float64(0)
    dtypes = {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSU"}
    return [arr.__reduce__()[0], scalar.__reduce__()[0], np.ndarray, np.dtype, *dtypes]


def _read_torch(path: Path) -> Any:
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5
    with allow(_safe_globals()) if allow else contextlib.nullcontext():
        return torch.load(path, map_location="cpu", weights_only=True)


def _write_safetensors(state: Any, tmp: Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    storages: set[int] = set()

    def encode(obj: Any, keys: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in names:
                name = "/".join(map(str, keys)) or "tensor"
                while name in tensors:
                    name += "~"
                t = obj.detach().contiguous()
                if t.numel() and t.untyped_storage().data_ptr() in storages:
                    t = t.clone()  # safetensors refuses tensors that share memory
                storages.add(t.untyped_storage().data_ptr())
                names[id(obj)], tensors[name] = name, t
            return {"T": names[id(obj)]}
        if isinstance(obj, dict):
            tag = "O" if type(obj) is OrderedDict else "D"
            return {tag: [[k, encode(v, keys + (k,))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            tag = {list: "L", tuple: "U"}.get(type(obj), "S")
            return {tag: [encode(v, keys + (i,)) for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        return obj

    structure = json.dumps(encode(state, ()))
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt", _STRUCTURE_KEY: structure})
    except Exception as exc:  # SafetensorError: "... (os error 28)" for a full disk
        code = re.search(r"os error (\d+)", str(exc))
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from exc
        raise


def _read_safetensors(path: Path) -> Any:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        structure = json.loads((f.metadata() or {})[_STRUCTURE_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def decode(obj: Any) -> Any:
        if not isinstance(obj, dict):
            return obj
        (tag, value), = obj.items()
        if tag == "T":
            return tensors[value]
        if tag in "DO":
            return (dict if tag == "D" else OrderedDict)((k, decode(v)) for k, v in value)
        if tag in "LUS":
            return {"L": list, "U": tuple, "S": torch.Size}[tag](decode(v) for v in value)
        return getattr(torch, value) if tag == "dtype" else torch.device(value)

    return decode(structure)


# --------------------------------------------------------------------------- atomic files

def _owner_tag() -> str:
    return f"{socket.gethostname()}~{os.getpid()}~{secrets.token_hex(4)}"


def _atomic_write(target: Path, write: Callable[[Path], None]) -> tuple[int, str]:
    """Write ``target`` through a temp file in its directory: write, fsync, rename, fsync the directory.

    Returns the byte size and sha256 of what was written. On any failure the temp
    file is removed and ``target`` is untouched.
    """
    tmp = target.parent / f"{TMP_PREFIX}{target.name}~{_owner_tag()}"
    try:
        write(tmp)
        digest, size = hashlib.sha256(), 0
        with open(tmp, "r+b") as f:  # read back what is on disk, and fsync it
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return size, digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform / file system
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_error(target: Path, exc: OSError) -> CheckpointError:
    what = exc.strerror or str(exc)
    code = errno.errorcode.get(exc.errno or 0, "")
    return CheckpointError(
        f"Could not write checkpoint {target}: {what}{f' ({code})' if code else ''}. The previous checkpoint "
        f"is untouched and no temporary file was left; free space or fix permissions in {target.parent}, "
        "or save elsewhere."
    )


def _commit(cpu_state: Any, payload: Path, weights_format: str, step: int | None) -> Manifest:
    """Write payload then manifest, both atomically; the manifest commits the checkpoint."""
    writer = _write_torch if weights_format == "torch" else _write_safetensors
    try:
        size, sha = _atomic_write(payload, lambda tmp: writer(cpu_state, tmp))
        import tpukit

        v = environment.versions()
        manifest = Manifest(
            payload=payload.name, weights_format=weights_format, step=step, time=time.time(), bytes=size,
            sha256=sha, tpukit=tpukit.__version__, torch=v.get("torch"), torch_xla=v.get("torch_xla"),
        )
        text = manifest.to_json()
        _atomic_write(_manifest_path(payload), lambda tmp: tmp.write_text(text))
    except OSError as exc:
        raise _write_error(payload, exc) from exc
    log.info("checkpoint saved: %s (%d bytes, step %s)", payload, size, step)
    return manifest


# --------------------------------------------------------------------------- save / load

def _weights_format(path: Path, weights_format: str | None) -> str:
    fmt = weights_format or ("safetensors" if path.suffix == ".safetensors" else "torch")
    if fmt not in WEIGHTS_FORMATS:
        raise CheckpointError(f"weights_format={fmt!r} is not known; use one of {WEIGHTS_FORMATS}.")
    return fmt


def save(
    state: Any, path: str | os.PathLike, *, step: int | None = None, weights_format: str | None = None
) -> Manifest | None:
    """Save ``state`` (nested dicts/lists/tuples of tensors and plain values) atomically to ``path``.

    Syncs pending XLA work, copies XLA tensors to the CPU (sharded ones whole),
    writes the payload and then its manifest (``path`` with a ``.json`` suffix)
    from the master replica only. ``weights_format`` is "torch" (default) or
    "safetensors" (no pickle; the default when ``path`` ends in ``.safetensors``).
    Returns the manifest, or None on replicas that do not write.
    """
    path = Path(path)
    fmt = _weights_format(path, weights_format)
    if path.suffix == ".json":
        raise CheckpointError(f"Cannot save a checkpoint to {path}: .json is the manifest's suffix. Use e.g. .pt.")
    _check_state(state, "state", fmt)
    if step is None and isinstance(state, dict) and type(state.get("step")) is int:
        step = state["step"]
    master = _is_master()
    if master and not path.parent.is_dir():
        raise CheckpointError(f"Cannot save to {path}: directory {path.parent} does not exist. Create it first.")
    other = _manifest_owner(path) if master else None
    if other is not None and other != path.name and (path.parent / other).exists():
        raise CheckpointError(
            f"Cannot save to {path}: its manifest {_manifest_path(path).name} already belongs to {other}, "
            "which would become unloadable. Use a different file name."
        )
    cpu_state = _to_cpu(state, copy=False, master=master)
    return _commit(cpu_state, path, fmt, step) if master else None


def _manifest_owner(path: Path) -> str | None:
    """The payload named by the manifest ``path`` would use, if one exists and is readable."""
    try:
        return Manifest.read(_manifest_path(path)).payload
    except CheckpointError:
        return None


def verify(path: str | os.PathLike) -> Manifest:
    """Check a checkpoint against its manifest (presence, size, sha256); returns the manifest or raises."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"No checkpoint at {path}: the file does not exist. Check the path.")
    manifest = Manifest.read(_manifest_path(path))
    if manifest.payload != path.name:
        raise CheckpointError(
            f"Manifest {_manifest_path(path)} belongs to {manifest.payload}, not {path.name}: two checkpoints "
            "share a manifest name. Load the one it names, or save under distinct names."
        )
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    if size != manifest.bytes or digest.hexdigest() != manifest.sha256:
        why = f"has {size} bytes, expected {manifest.bytes}" if size != manifest.bytes else "does not match its sha256"
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: it {why} (truncated or damaged on disk). Load an older checkpoint."
        )
    return manifest


def _read(path: Path, manifest: Manifest, device: Any) -> Any:
    try:
        state = (_read_torch if manifest.weights_format == "torch" else _read_safetensors)(path)
    except Exception as exc:  # noqa: BLE001 - hash matched, so the payload itself is bad
        raise CheckpointError(f"Checkpoint {path} passed its hash check but could not be read: {exc}") from exc
    if device is None or torch.device(device).type == "cpu":
        return state
    memo: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:  # one tensor stays one tensor (tied weights)
        if id(t) not in memo:
            memo[id(t)] = t.to(device)
        return memo[id(t)]

    return _map(state, place)


def load(path: str | os.PathLike, device: Any = None) -> Any:
    """Load a verified checkpoint: CPU tensors, or tensors placed on ``device``.

    ``path`` is a payload written by ``save`` or a ``CheckpointManager`` directory
    (its newest valid checkpoint). Raises CheckpointError for anything missing,
    truncated or altered.
    """
    path = Path(path)
    if path.is_dir():
        steps = _steps(path)
        if not steps:
            raise CheckpointError(
                f"No checkpoint in directory {path}: it holds no ckpt-*.json manifests. "
                "Pass a checkpoint file, or a directory written by CheckpointManager."
            )
        for step in reversed(steps):
            try:
                payload = path / Manifest.read(path / _name(step, ".json")).payload
                return _read(payload, verify(payload), device)
            except CheckpointError as exc:
                warnings.warn(f"Skipping checkpoint step {step}: {exc}", TpukitWarning, stacklevel=2)
        raise CheckpointError(f"No valid checkpoint in {path}: all {len(steps)} are damaged (see the warnings).")
    return _read(path, verify(path), device)


# --------------------------------------------------------------------------- manager

def _name(step: int, suffix: str) -> str:
    return f"ckpt-{step:08d}{suffix}"


def _steps(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_CKPT_RE.match, names) if m)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class CheckpointManager:
    """Numbered checkpoints in one directory: save every N steps, keep the newest K, resume.

    Files are ``ckpt-00000005.pt`` (or ``.safetensors``) plus ``ckpt-00000005.json``.
    With ``async_save=True`` the CPU copy is taken during ``save`` and the disk
    write runs in a background thread (at most one pending, so up to two CPU
    copies exist at once); its errors surface on the next call or on ``wait()``.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, every: int | None = None,
                 weights_format: str = "torch", async_save: bool = False):
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep={keep} would delete every checkpoint; use keep >= 1, or None to keep all.")
        if every is not None and every < 1:
            raise CheckpointError(f"every={every} is not a step interval; use every >= 1, or None for every call.")
        if weights_format not in WEIGHTS_FORMATS:
            raise CheckpointError(f"weights_format={weights_format!r} is not known; use one of {WEIGHTS_FORMATS}.")
        self.directory = Path(directory)
        self.keep, self.every, self.weights_format, self.async_save = keep, every, weights_format, async_save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending_step: int | None = None
        if _is_master():
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temps()

    def __repr__(self) -> str:
        steps = self.all_steps()
        return f"CheckpointManager({str(self.directory)!r}, keep={self.keep}, every={self.every}, steps={steps})"

    # -- writing

    def save(self, step: int, **state: Any) -> bool:
        """Save ``state`` (plus a "step" key) as checkpoint ``step``; returns False when ``every`` skips it.

        Every replica calls it (all sync); only the master writes.
        """
        step = int(step)
        if self.every is not None and step % self.every:
            if self._thread is not None and not self._thread.is_alive():
                self.wait()
            return False
        state = {"step": step, **state}
        _check_state(state, "state", self.weights_format)
        master = _is_master()
        cpu_state = _to_cpu(state, copy=self.async_save, master=master)
        self.wait()
        if not master:
            return True
        newest = self.all_steps()
        if newest and newest[-1] > step:
            warnings.warn(
                f"Saving step {step} into {self.directory}, which already holds step {newest[-1]}: latest() and "
                "restore() keep returning the newer one. Use a fresh directory for a new run.",
                TpukitWarning, stacklevel=2,
            )
        if self.async_save:
            self._pending_step = step
            self._thread = threading.Thread(target=self._background, args=(step, cpu_state), name="tpukit-checkpoint")
            self._thread.start()
        else:
            self._write(step, cpu_state)
        return True

    def _write(self, step: int, cpu_state: Any) -> None:
        payload = self.directory / _name(step, _SUFFIX[self.weights_format])
        _commit(cpu_state, payload, self.weights_format, step)
        self._prune(step)

    def _background(self, step: int, cpu_state: Any) -> None:
        try:
            self._write(step, cpu_state)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc

    def wait(self) -> None:
        """Block until the pending background write finished; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"Background save of step {self._pending_step} failed: {error}") from error

    def _prune(self, saved: int) -> None:
        """Keep ``saved`` and the newest ``keep - 1`` others; delete the rest, manifest first."""
        steps = self.all_steps()
        others = [s for s in steps if s != saved]
        keep = set(others if self.keep is None else others[max(0, len(others) - self.keep + 1):]) | {saved}
        for step in steps:
            if step not in keep:
                self._delete(step)
        for name in os.listdir(self.directory):  # payloads whose save died before the manifest
            m = re.match(r"^ckpt-(\d{8,})\.(pt|safetensors)$", name)
            if m and int(m.group(1)) < saved and int(m.group(1)) not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)

    def _delete(self, step: int) -> None:
        for suffix in (".json", ".pt", ".safetensors"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / _name(step, suffix))

    def _remove_stale_temps(self) -> None:
        """Remove temp files of saves that died on this host (their process is gone)."""
        host = socket.gethostname()
        for name in os.listdir(self.directory):
            if not name.startswith(TMP_PREFIX + "ckpt-"):
                continue
            parts = name.split("~")
            if len(parts) == 4 and parts[1] == host and parts[2].isdigit():
                pid = int(parts[2])
                if pid != os.getpid() and not _pid_alive(pid):
                    with contextlib.suppress(OSError):
                        os.unlink(self.directory / name)
                        log.info("removed stale temporary checkpoint file %s", name)

    # -- reading

    def all_steps(self) -> list[int]:
        """Steps that have a committed manifest, oldest first (``latest`` also verifies the payload)."""
        return _steps(self.directory)

    def _valid(self, step: int) -> tuple[Path, Manifest] | None:
        """Payload and manifest of ``step`` if it verifies, else None with a warning."""
        try:
            payload = self.directory / Manifest.read(self.directory / _name(step, ".json")).payload
            return payload, verify(payload)
        except (CheckpointError, OSError) as exc:
            warnings.warn(f"Skipping checkpoint step {step} in {self.directory}: {exc}", TpukitWarning, stacklevel=3)
            return None

    def latest_step(self) -> int | None:
        """The step of the newest valid checkpoint, or None."""
        self.wait()
        for step in reversed(self.all_steps()):
            if self._valid(step) is not None:
                return step
        return None

    def latest(self, device: Any = None) -> dict | None:
        """The state of the newest valid checkpoint (damaged ones skipped with a warning), or None."""
        self.wait()
        for step in reversed(self.all_steps()):
            found = self._valid(step)
            if found is not None:
                try:
                    return _read(*found, device)
                except CheckpointError as exc:
                    warnings.warn(f"Skipping checkpoint step {step}: {exc}", TpukitWarning, stacklevel=2)
        return None

    def restore(self, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
                step_var: torch.Tensor | None = None, *, strict: bool = True) -> int:
        """Load the newest valid checkpoint into the given objects; returns its step (0 when there is none).

        Tensors are read on the CPU and copied by ``load_state_dict`` onto the
        device each parameter lives on (optimizer state follows its parameters,
        with the same placement rules as a fresh run). ``step_var``, a tensor such
        as an on-device step counter, is filled with the step in place.
        """
        state = self.latest()
        if state is None:
            log.info("no checkpoint in %s; starting from step 0", self.directory)
            return 0
        step = int(state["step"])
        for key, target in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
            if target is not None and key not in state:
                raise CheckpointError(
                    f"Checkpoint step {step} in {self.directory} has no {key!r} entry (it has {sorted(state)}); "
                    f"save it with manager.save(step, {key}={key}.state_dict())."
                )
        if model is not None:
            _check_keys(model, state["model"], strict, f"step {step} in {self.directory}")
            model.load_state_dict(state["model"], strict=strict)
        if optimizer is not None:
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(
                    f"The optimizer state of step {step} does not fit this optimizer ({exc}). Build the optimizer "
                    "over the same parameters, in the same groups, as the run that saved it."
                ) from exc
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
        if step_var is not None:
            with torch.no_grad():
                step_var.fill_(step)
        return step


def _check_keys(model: torch.nn.Module, saved: dict, strict: bool, where: str) -> None:
    """Raise one CheckpointError listing missing, unexpected and shape-mismatched keys."""
    own = model.state_dict()
    problems = []

    def listing(label: str, items: list[str]) -> None:
        if items:
            more = f" ... and {len(items) - 10} more" if len(items) > 10 else ""
            problems.append(f"{label} ({len(items)}): {', '.join(items[:10])}{more}")

    if strict:
        listing("missing", [k for k in own if k not in saved])
        listing("unexpected", [k for k in saved if k not in own])
    listing("shape mismatch", [
        f"{k} saved {tuple(saved[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != own[k].shape
    ])
    if problems:
        raise CheckpointError(
            f"Checkpoint {where} does not fit {type(model).__name__}: " + "; ".join(problems)
            + ". Build the model with the configuration it was saved from "
            "(or pass strict=False to skip missing/unexpected keys)."
        )


# --------------------------------------------------------------------------- transformers export

def export_pretrained(model: Any, folder: str | os.PathLike, tokenizer: Any = None, **save_kwargs: Any) -> Path | None:
    """Write a transformers model (and tokenizer) with ``save_pretrained`` so it loads on plain CPU PyTorch.

    The weights are copied to the CPU first (synced, SPMD shards gathered, tied
    weights kept tied so safetensors dedupes them); the model stays where it is.
    The folder appears complete or not at all (an existing one is replaced as a whole).
    Returns it (None on non-master replicas).
    """
    if not callable(getattr(model, "save_pretrained", None)):
        raise CheckpointError(
            f"export_pretrained needs a transformers model with save_pretrained(), got {type(model).__name__}. "
            "For other modules use tpukit.checkpoint.save(model.state_dict(), path)."
        )
    _warn_if_untied(model)
    folder = Path(folder)
    master = _is_master()
    cpu_state = _to_cpu(model.state_dict(), copy=False, master=master)
    if not master:
        return None
    tmp = folder.parent / f"{TMP_PREFIX}{folder.name}~{_owner_tag()}"
    old = folder.parent / f"{TMP_PREFIX}{folder.name}~old~{_owner_tag()}"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp, state_dict=cpu_state, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if folder.exists():
            os.replace(folder, old)
        try:
            os.replace(tmp, folder)
        except OSError:
            if old.exists():
                os.replace(old, folder)
            raise
    except OSError as exc:
        raise CheckpointError(
            f"Could not export {type(model).__name__} to {folder}: {exc.strerror or exc}. Nothing was replaced; "
            f"free space or fix permissions in {folder.parent}."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(folder.parent)
    return folder


def _warn_if_untied(model: Any) -> None:
    """Warn when the config ties the embeddings but the model holds two tensors (the usual torch_xla trap)."""
    try:
        tied = getattr(model.config, "tie_word_embeddings", False)
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return
    if tied and inp is not None and out is not None and inp.weight is not out.weight:
        warnings.warn(
            f"{type(model).__name__} declares tied input/output embeddings but holds two separate tensors: moving a "
            "module to an XLA device unties weights, and training then updates them apart. The export keeps only "
            "one. Call model.tie_weights() right after model.to(device).",
            TpukitWarning, stacklevel=3,
        )
