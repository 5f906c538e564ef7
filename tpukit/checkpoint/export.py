"""``export_pretrained``: a transformers model (and tokenizer) as a folder that loads on plain CPU PyTorch."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from .. import _xla
from ..errors import CheckpointError, TpukitWarning
from .files import fsync_dir, temp_path
from .saveload import is_master, sync_state, to_cpu


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
    master = is_master()
    model_state = model.state_dict()
    sync_state(model_state)
    cpu_state = to_cpu(model_state, copy=False, master=master)
    if not master:
        return None
    tmp = temp_path(folder)
    old = temp_path(folder, "old~")
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
    fsync_dir(folder.parent)
    return folder


def _warn_if_untied(model: Any) -> None:
    """Warn when the model declares tied weights but holds two tensors (the usual torch_xla trap)."""
    pairs = _xla.ties.untied(model)
    if pairs:
        named = ", ".join(f"{a} and {b}" for a, b in pairs)
        warnings.warn(
            f"{type(model).__name__} declares {named} tied but holds them as two separate tensors: moving a "
            "module to an XLA device unties weights, and training then updates them apart. The export keeps only "
            "one. Call model.tie_weights() right after model.to(device).",
            TpukitWarning, stacklevel=3,
        )
