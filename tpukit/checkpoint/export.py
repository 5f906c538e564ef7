"""Exports that load on plain CPU PyTorch: a transformers model (``export_pretrained``), peft adapters (``export_adapters``).

Both take the model where it trained: on an XLA device, sharded over an SPMD mesh,
inside ``tpukit.fsdp``'s wrapper (or per-layer wrappers, or ``torch.compile``'s). The
weights come to the CPU (synced, shards gathered, tied weights kept tied), keyed by
the model's own names (``wrappers``), and the model stays where it is, unchanged.
Each folder is written beside its target under a temporary name, its files
fsynced, and renamed into place: it appears complete or not at all. An existing
folder is replaced as a whole only when it is an earlier export (or empty).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .. import _xla
from ..errors import CheckpointError, TpukitWarning
from .files import fsync_dir, temp_path
from .saveload import is_master, sync_state, to_cpu
from .wrappers import own_keys, unwrap

# A folder holding one of these is an export (ours or save_pretrained's): replacing it loses nothing else.
EXPORT_MARKERS = ("config.json", "adapter_config.json")


def export_pretrained(model: Any, folder: str | os.PathLike, tokenizer: Any = None, *, merge: bool = False,
                      **save_kwargs: Any) -> Path | None:
    """Write a transformers model (and tokenizer) with ``save_pretrained`` so it loads on plain CPU PyTorch.

    ``model`` is a transformers model, possibly inside ``tpukit.fsdp``'s wrapper (or
    per-layer or ``torch.compile`` wrappers), or, with ``merge=True``, a peft model
    whose adapters are merged into the base on a CPU copy (``merge_and_unload``), so
    the folder is a plain model of the base's class. The weights are copied to the
    CPU first (synced, SPMD shards gathered, keys without the wrappers' segments,
    tied weights kept tied so safetensors dedupes them); the config and generation
    config are the model's. The model stays where it is, unchanged. The folder
    appears complete or not at all; an existing one is replaced as a whole when it is
    an earlier export (or empty) and refused otherwise. Returns it (None on
    non-master replicas).
    """
    inner = unwrap(model)
    peft_model = _is_peft(inner)
    if peft_model and not merge:
        raise CheckpointError(
            f"export_pretrained got a peft model ({type(inner).__name__}): its folder would hold the adapters "
            "only. Pass merge=True for a plain model with the adapters merged into the base, or call "
            "tpukit.checkpoint.export_adapters(model, folder) for the adapters on their own."
        )
    if merge and not peft_model:
        raise CheckpointError(
            f"export_pretrained(merge=True) merges peft adapters into their base, and {type(inner).__name__} is "
            "not a peft model (peft.get_peft_model). Drop merge=True to export it as it is."
        )
    if not peft_model and not callable(getattr(inner, "save_pretrained", None)):
        raise CheckpointError(
            f"export_pretrained needs a transformers model with save_pretrained(), got {type(inner).__name__}. "
            "For other modules use tpukit.checkpoint.save(model.state_dict(), path)."
        )
    folder = Path(folder)
    _check_folder(folder, "export_pretrained")
    _warn_if_untied(inner.get_base_model() if peft_model else inner)
    cpu_state = _cpu_state(inner.state_dict())
    if cpu_state is None:
        return None
    if peft_model:
        target, cpu_state = _merged_on_cpu(inner, cpu_state)
    else:
        target = inner

    def write(tmp: Path) -> None:
        target.save_pretrained(tmp, state_dict=cpu_state, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)

    return _publish(folder, write, type(inner).__name__)


def export_adapters(model: Any, folder: str | os.PathLike) -> Path | None:
    """Write a peft model's adapters on their own, in peft's format, from wherever they train.

    The folder (``adapter_config.json`` and ``adapter_model.safetensors``; an adapter
    other than ``"default"`` in a subfolder of its name, as ``PeftModel.save_pretrained``
    lays them out) loads on plain CPU peft with ``PeftModel.from_pretrained(base,
    folder)``. peft picks each adapter's tensors (LoRA's matrices, ``modules_to_save``);
    only those come to the CPU (synced, shards gathered), keyed without the wrappers'
    segments (peft's own ``save_pretrained`` writes no tensor at all for a model whose
    layers ``tpukit.fsdp`` wrapped: it looks them up under its module names). The model
    stays where it is. Atomic, and refusing a folder that is not an earlier export,
    like :func:`export_pretrained`. Returns the folder (None on non-master replicas).
    """
    inner = unwrap(model)
    if not _is_peft(inner):
        raise CheckpointError(
            f"export_adapters needs a peft model (peft.get_peft_model(model, config)), got {type(inner).__name__}. "
            "For a whole transformers model use tpukit.checkpoint.export_pretrained(model, folder)."
        )
    import copy

    from peft import get_peft_model_state_dict

    folder = Path(folder)
    _check_folder(folder, "export_adapters")
    # keyed by module path (segments included), as peft finds its layers among the modules
    by_path = dict(inner.named_parameters(remove_duplicate=False))
    by_path.update((n, b) for n, b in inner.named_buffers(remove_duplicate=False) if n not in by_path)
    adapters = {}
    for name in inner.peft_config:
        chosen = get_peft_model_state_dict(inner, state_dict=by_path, adapter_name=name)
        adapters[name] = {k: t for k, t in chosen.items() if isinstance(t, torch.Tensor)}
    if not any(adapters.values()):
        raise CheckpointError(
            f"export_adapters found no adapter tensors in {type(inner).__name__} (adapters "
            f"{sorted(inner.peft_config)}): nothing was written. Export the peft model itself, the one "
            "peft.get_peft_model returned (or tpukit.fsdp's wrapper of it)."
        )
    cpu = _cpu_state({f"{name}\0{k}": t for name, tensors in adapters.items() for k, t in tensors.items()})
    if cpu is None:
        return None
    base = inner.get_base_model()

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        for name, config in inner.peft_config.items():
            where = tmp if name == "default" else tmp / name
            where.mkdir(parents=True, exist_ok=True)
            config = copy.deepcopy(config)
            config.inference_mode = True
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = base.__dict__.get("name_or_path") or getattr(
                    getattr(base, "config", None), "_name_or_path", None) or None
            config.save_pretrained(str(where))
            seen: set[int] = set()
            tensors = {}
            for key, t in cpu.items():
                owner, _, k = key.partition("\0")
                if owner == name:  # safetensors refuses two names for one storage
                    tensors[k] = t.clone() if id(t) in seen else t.contiguous()
                    seen.add(id(t))
            save_file(tensors, str(where / "adapter_model.safetensors"), metadata={"format": "pt"})

    return _publish(folder, write, type(inner).__name__)


# --------------------------------------------------------------------------- helpers

def _is_peft(model: Any) -> bool:
    """True for a peft ``PeftModel`` (checked without importing peft when it is not loaded)."""
    return any(c.__module__.startswith("peft.") and c.__name__ == "PeftModel" for c in type(model).__mro__)


def _cpu_state(state: dict) -> dict | None:
    """``state`` synced and copied to the CPU in the model's own key names (None on non-master replicas)."""
    master = is_master()
    sync_state(state)
    cpu = to_cpu(state, copy=False, master=master)
    if cpu is None:
        return None
    try:
        return own_keys(cpu)
    except ValueError as exc:
        raise CheckpointError(f"Cannot export: {exc}. Export the model inside the wrapper instead.") from exc


def _merged_on_cpu(peft_model: Any, cpu_state: dict) -> tuple[Any, dict]:
    """A CPU copy of ``peft_model`` (built on the meta device, given ``cpu_state``), its adapters merged into the
    base by peft's ``merge_and_unload``: the plain model and its state dict. The model on the device is untouched.

    The copy is only saved, never run: its non-persistent buffers (rotary frequencies) stay on the meta device,
    and ``save_pretrained`` writes the state dict given, which has none."""
    import copy

    import peft

    base = peft_model.get_base_model()
    with torch.device("meta"):
        skeleton = type(base)(copy.deepcopy(base.config))
    config = copy.deepcopy(peft_model.peft_config)
    names = list(config)
    clone = peft.get_peft_model(skeleton, config[names[0]], adapter_name=names[0])
    for name in names[1:]:
        clone.add_adapter(name, config[name])
    missing, unexpected = clone.load_state_dict(cpu_state, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(
            f"Could not rebuild {type(base).__name__} with its adapters on the CPU to merge them: "
            f"{len(missing)} keys missing ({', '.join(missing[:5])}), {len(unexpected)} unexpected "
            f"({', '.join(unexpected[:5])}). Merge on the device instead: "
            "export_pretrained(model.merge_and_unload(), folder)."
        )
    merged = clone.merge_and_unload(adapter_names=names)
    if getattr(base, "generation_config", None) is not None:
        merged.generation_config = copy.deepcopy(base.generation_config)
    merged.tie_weights()
    return merged, merged.state_dict()


def _check_folder(folder: Path, what: str) -> None:
    """Refuse a target that is a file, or a non-empty directory that is not an earlier export, before any work."""
    if folder.is_file() or folder.is_symlink() and not folder.is_dir():
        raise CheckpointError(
            f"{what} writes a folder, and {folder} is a file. Nothing was written; pass a new folder's path."
        )
    if folder.is_dir():
        names = sorted(os.listdir(folder))
        if names and not any(m in names for m in EXPORT_MARKERS):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise CheckpointError(
                f"{what} would replace {folder} as a whole, and it holds files that are not an export ({shown}): "
                "nothing was written. Pass a new or empty folder (an earlier export is replaced, nothing else is)."
            )


def _publish(folder: Path, write: Callable[[Path], Any], what: str) -> Path | None:
    """Run ``write(tmp)`` into a temp folder beside ``folder``, fsync its files, and rename it into place."""
    if not is_master():
        return None
    tmp = temp_path(folder)
    old = temp_path(folder, "old~")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        _fsync_tree(tmp)
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
            f"Could not export {what} to {folder}: {exc.strerror or exc}. Nothing was replaced; "
            f"free space or fix permissions in {folder.parent}."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(folder.parent)
    return folder


def _fsync_tree(directory: Path) -> None:
    """fsync every file under ``directory`` and the directories themselves, so the rename publishes durable bytes."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(root))


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
