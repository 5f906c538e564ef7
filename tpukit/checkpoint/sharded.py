"""Sharded checkpoints: an SPMD state saved shard by shard, never gathered onto one host.

The format is PyTorch's distributed checkpoint (``torch.distributed.checkpoint``,
DCP) written with torch_xla's SPMD save/load planners: a directory holding one
``__<rank>_0.distcp`` file per writing process (each host writes the shards its
devices own) and a ``.metadata`` file that maps every tensor's global shape to
the chunks on disk. Loading re-slices those chunks for whatever mesh the target
tensors are sharded over, so a state saved on 2 devices restores on 4 and back,
and it loads whole into plain CPU PyTorch (no torch_xla needed) on request.

Commit semantics are tpukit's, as for single-file payloads: DCP writes into a
temporary directory beside the target; its files are hashed and fsynced, the
directory is renamed into place and fsynced, and only then is the JSON manifest
(listing every file's size and sha256) written atomically. The manifest is the
commit marker: a save killed at any point leaves the previous checkpoint valid.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from .. import _xla, environment
from .._tree import is_tensor, tree_leaves
from .._version import __version__
from ..errors import CheckpointError
from .checks import MismatchError
from .files import atomic_write, fsync_dir, hash_file, temp_path
from .format import SHARDED_FORMAT_VERSION, Manifest, manifest_path

SHARDED = "dcp"  # the manifest's weights_format for a sharded checkpoint directory


def has_sharded_tensors(state: Any) -> bool:
    """True when ``state`` holds an XLA tensor split over several devices (SPMD)."""
    return any(_xla.is_sharded(t) for _, t in tree_leaves(state, is_tensor))


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it runs in a single process and about planner signatures; both are expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint.*")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch_xla\..*")
        yield


def process_group() -> Any:
    """``torch.distributed`` when several processes (hosts) save together, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def write_sharded(state: Any, target: Path, step: int | None) -> Manifest | None:
    """Save ``state`` (synced) as the sharded checkpoint directory ``target``, committed by its manifest.

    With a ``torch.distributed`` process group (one process per host), every
    process must call it: each writes its own shards into one temporary
    directory (named by rank 0) and rank 0 alone commits, after all have written.
    Returns the manifest on the committing process, None on the others.
    """
    import torch.distributed.checkpoint as dcp

    group = process_group()
    coordinator = group is None or group.get_rank() == 0
    names = [temp_path(target).name if coordinator else None]
    if group is not None:
        group.broadcast_object_list(names, src=0)
    tmp = target.parent / names[0]
    if coordinator:
        os.mkdir(tmp)
    try:
        if group is not None:
            group.barrier()
        save_planner, _ = _xla.spmd_checkpoint_planners()
        # per_thread_copy_ahead=0: DCP's plain CPU loader. Its overlapping loader runs when a privateuse1
        # backend says it is available, and torch_xla 2.8's mark_sharding imports torchax whenever jax is
        # installed (Kaggle's TPU image), which registers "jax" as that backend: the loader then asks
        # torchax for CUDA-style streams and every sharded save fails. The shards are host copies already.
        writer = dcp.FileSystemWriter(str(tmp), per_thread_copy_ahead=0)
        with _quiet_dcp():  # collective across the group: raises on every process if one fails
            dcp.save(state, storage_writer=writer, planner=save_planner, no_dist=group is None)
        manifest = _commit(tmp, target, step) if coordinator else None
    except BaseException:
        if coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if group is not None:
            group.barrier()  # nobody returns before the checkpoint is committed (or abandoned)
    return manifest


def _commit(tmp: Path, target: Path, step: int | None) -> Manifest:
    """Hash and fsync the written files, rename the directory into place, then write the manifest."""
    files = _hash_and_fsync(tmp)
    fsync_dir(tmp)
    if target.exists():  # a re-save of the same step: un-commit the old one before replacing it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(manifest_path(target))
        shutil.rmtree(target)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    v = environment.versions()
    digest = hashlib.sha256("".join(f"{n} {s} {h}\n" for n, (s, h) in sorted(files.items())).encode()).hexdigest()
    manifest = Manifest(
        payload=target.name, weights_format=SHARDED, step=step, time=time.time(),
        bytes=sum(size for size, _ in files.values()), sha256=digest, tpukit=__version__, torch=v.get("torch"),
        torch_xla=v.get("torch_xla"), format_version=SHARDED_FORMAT_VERSION, files=files,
    )
    text = manifest.to_json()
    atomic_write(manifest_path(target), lambda t: t.write_text(text))
    return manifest


def _hash_and_fsync(directory: Path) -> dict[str, list]:
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(directory / name, "r+b") as f:
            size, sha = hash_file(f)
            os.fsync(f.fileno())
        files[name] = [size, sha]
    return files


def verify_sharded(path: Path, manifest: Manifest) -> None:
    """Check every file the manifest lists: present, same size, same sha256."""
    for name, (size, sha) in sorted((manifest.files or {}).items()):
        try:
            with open(path / name, "rb") as f:
                got = hash_file(f)
        except FileNotFoundError:
            raise CheckpointError(f"Sharded checkpoint {path} is missing {name}. Load an older checkpoint.") from None
        if got != (size, sha):
            raise CheckpointError(
                f"Sharded checkpoint {path} is corrupt: {name} does not match its manifest (truncated or damaged "
                "on disk). Load an older checkpoint."
            )


def read_sharded(path: Path, into: dict | None = None) -> Any:
    """Load a verified sharded checkpoint.

    With ``into`` (a dict shaped like the saved state, e.g. ``{"model":
    model.state_dict()}`` whose tensors are sharded over the current mesh), the
    values are loaded into it in place, each device reading only its own slices;
    only its keys are read. Without, the whole state comes back as CPU tensors
    (consolidated), without torch_xla.
    """
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    with _quiet_dcp():
        if into is None:
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

            return _int_state_keys(_load_state_dict_from_keys(checkpoint_id=str(path)))  # DCP's full load
        _check_shapes(reader.read_metadata(), into, path)
        _, load_planner = _xla.spmd_checkpoint_planners()
        try:
            dcp.load(into, storage_reader=reader, planner=load_planner, no_dist=process_group() is None)
        except Exception:
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException: ``except Exception`` misses it
            if type(exc).__name__ != "CheckpointException":
                raise
            raise MismatchError(
                f"Sharded checkpoint {path} could not be loaded into the given state: {_first_cause(exc)}. "
                "Build the model (and optimizer) with the configuration it was saved from."
            ) from exc
    return into


def _dotted(tree: Any, prefix: str = "") -> Any:
    """``(dotted key, tensor)`` of every tensor in ``tree``, keyed the way DCP names them (``model.0.weight``)."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _dotted(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _dotted(v, f"{prefix}.{i}" if prefix else str(i))


def _check_shapes(metadata: Any, into: dict, path: Path) -> None:
    """Raise CheckpointError naming each key whose saved shape differs from the tensor it would load into."""
    saved = metadata.state_dict_metadata
    wrong = [
        f"{key} saved {tuple(saved[key].size)} vs {tuple(t.shape)} here"
        for key, t in _dotted(into) if key in saved and hasattr(saved[key], "size")
        and tuple(saved[key].size) != tuple(t.shape)
    ]
    if wrong:
        more = f" ... and {len(wrong) - 10} more" if len(wrong) > 10 else ""
        raise MismatchError(
            f"Sharded checkpoint {path} does not fit the state it is loaded into: shape mismatch ({len(wrong)}): "
            f"{', '.join(wrong[:10])}{more}. Build the model (and optimizer) with the configuration it was saved from."
        )


def _first_cause(exc: BaseException) -> str:
    """The first underlying error a CheckpointException carries (one per failing rank), else its text."""
    for failure in (getattr(exc, "failures", None) or {}).values():  # rank -> (exception, traceback)
        cause = failure[0] if isinstance(failure, tuple) else failure
        text = str(cause).strip()
        return f"{type(cause).__name__}: {text.splitlines()[-1]}" if text else type(cause).__name__
    return type(exc).__name__


def _int_state_keys(tree: Any) -> Any:
    """Give optimizer state dicts back their integer parameter keys.

    DCP stores dict keys as strings, so ``{"state": {0: ...}, "param_groups": ...}``
    comes back with ``"0"``; ``Optimizer.load_state_dict`` would then attach none of
    the state to its parameters, silently.
    """
    if not isinstance(tree, dict):
        return tree
    out = {k: _int_state_keys(v) for k, v in tree.items()}
    if isinstance(out.get("state"), dict) and isinstance(out.get("param_groups"), list):
        out["state"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in out["state"].items()}
    return out


def saved_keys(path: Path, entry: str | None = None) -> set[str]:
    """The top-level keys of the state saved in the sharded checkpoint ``path``; with ``entry``, the keys of
    that top-level dict (a model's state-dict names)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    mappings = metadata.planner_data or {}
    paths = [tuple(mappings[k]) if k in mappings else tuple(k.split(".", 1)) for k in metadata.state_dict_metadata]
    if entry is None:
        return {str(p[0]) for p in paths}
    return {str(p[1]) for p in paths if len(p) == 2 and str(p[0]) == entry}
