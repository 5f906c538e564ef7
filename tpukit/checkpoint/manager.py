"""``CheckpointManager``: numbered checkpoints in one directory, kept, pruned and resumed."""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

from .. import _xla
from ..errors import CheckpointError, TpukitWarning
from .checks import check_count, check_device, check_flag, check_optimizer_state, check_step, check_target
from .chunks import COPY_CHUNK, check_chunk
from .files import remove_path, remove_stale_temps
from .lock import DirectoryLock
from .format import (
    MANIFEST_SUFFIX,
    NAME_PREFIX,
    SUFFIX,
    check_weights_format,
    checkpoint_name,
    Manifest,
    committed_steps,
    parse_name,
)
from .payload import check_state
from .rng import RNG_KEY, rng_state, set_rng_state
from .sharded import SHARDED, has_sharded_tensors, process_group, saved_keys
from .saveload import collective, commit, is_master, newest_valid, sync_state, to_cpu
from .wrappers import match_keys, own_key, own_keys, unwrap

log = logging.getLogger("tpukit")


class CheckpointManager:
    """Numbered checkpoints in one directory: save every N steps, keep the newest K, resume.

    Files are ``ckpt-00000005.pt`` (or ``.safetensors``) plus ``ckpt-00000005.json``.
    A synchronous save writes tensor by tensor, device tensors a chunk at a time
    (extra host memory: a few ``copy_chunk`` pieces). With ``async_save=True`` a CPU copy of the whole state is taken during
    ``save`` and the disk write runs in a background thread (at most one pending,
    so up to two CPU copies exist at once); its errors surface on the next call or
    on ``wait()``.

    With ``rng=True`` (the default) each checkpoint also holds the generator states
    (XLA device, torch CPU, numpy, Python; see ``rng_state``) and ``restore`` puts
    them back, so a resumed run with dropout draws what the uninterrupted run drew.

    A state holding SPMD-sharded tensors is saved as a sharded checkpoint
    (``ckpt-00000005.dcp/``, see ``sharded``): each shard written as it is, never
    gathered; ``restore`` loads it into whatever mesh the model is sharded over now.
    ``sharded=True``/``False`` forces or forbids that layout. Sharded saves are
    synchronous even with ``async_save`` (shards go from the devices to disk).

    Rules: one manager saves into a directory at a time. The first ``save`` takes
    the directory's lock (``lock``): a manager of another process on the machine is
    refused with the owner's pid until this one is closed (``close()``), collected
    or its process ends, and a lock left by a process that is gone is taken over;
    a newer manager of this process takes the directory over with a warning, and
    this one's next save raises. A pending asynchronous save still finishes when the script
    ends without ``wait()`` (its thread is joined at exit, and a failure is
    reported then as a TpukitWarning); call ``wait()`` before another process reads
    the directory, and before ``os._exit``. Rotation (``keep``) never deletes a
    checkpoint newer than the one just saved. Device tensors come to the host in
    pieces of at most ``copy_chunk`` bytes (``chunks``).
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, every: int | None = None,
                 weights_format: str = "torch", async_save: bool = False, rng: bool = True,
                 sharded: bool | None = None, copy_chunk: int = COPY_CHUNK):
        check_count("keep", keep, "how many checkpoints to keep")
        check_count("every", every, "save every that many steps")
        check_flag("async_save", async_save)
        check_flag("rng", rng)
        check_flag("sharded", sharded, allow_none=True)
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep={keep} would delete every checkpoint; use keep >= 1, or None to keep all.")
        if every is not None and every < 1:
            raise CheckpointError(f"every={every} is not a step interval; use every >= 1, or None for every call.")
        check_weights_format(weights_format)
        self.directory = Path(directory)
        self.keep, self.every, self.weights_format, self.async_save = keep, every, weights_format, async_save
        self.rng, self.sharded, self.copy_chunk = rng, sharded, check_chunk(copy_chunk)
        self._pending = _Pending()
        self._lock = DirectoryLock(self.directory)
        # at exit (or when collected): finish a pending write, report its failure, give the lock up
        self._finalizer = weakref.finalize(self, _finish, self._pending, self._lock, str(self.directory))
        if is_master():
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.directory, NAME_PREFIX)

    def __repr__(self) -> str:
        steps = self.all_steps()
        return f"CheckpointManager({str(self.directory)!r}, keep={self.keep}, every={self.every}, steps={steps})"

    # -- writing

    def save(self, step: int, **state: Any) -> bool:
        """Save ``state`` (plus a "step" key) as checkpoint ``step``; returns False when ``every`` skips it.

        ``step`` is a whole number >= 0. Every replica calls it (all sync); only the
        master writes. The ``model`` entry is saved under the model's own key names:
        the segments wrappers add (``tpukit.fsdp``'s ``_orig_module.``, per layer too,
        ``torch.compile``'s ``_orig_mod.``) are dropped, so ``restore`` loads it into the
        model wrapped another way, or bare on one device.
        """
        step = check_step(step)
        if self.every is not None and step % self.every:
            if self._pending.thread is not None and not self._pending.thread.is_alive():
                self.wait()
            return False
        if RNG_KEY in state:
            raise CheckpointError(
                f"{RNG_KEY!r} is the entry the manager stores the generator states under; name yours differently "
                "(or pass rng=False to the CheckpointManager to manage them yourself)."
            )
        state = {"step": step, **state}
        if isinstance(state.get("model"), dict):  # the model's own names, whatever wrapper it trains in
            try:
                state["model"] = own_keys(state["model"])
            except ValueError as exc:
                raise CheckpointError(f"Cannot save the model's state: {exc}. Save the wrapper's own "
                                      "state_dict() under another name than 'model'.") from exc
        check_state(state, "state", self.weights_format)
        master = is_master()
        sync_state(state)
        if self.rng:  # read after the sync, which advances the XLA seed
            state[RNG_KEY] = rng_state()
        fmt = self.weights_format
        if self.sharded or (self.sharded is None and has_sharded_tensors(state)):
            fmt = SHARDED
        # async: the write runs later, so take the CPU copy now (at most one pending);
        # sync: written tensor by tensor (or shard by shard) from where it lives
        background = self.async_save and fmt != SHARDED
        cpu_state = to_cpu(state, copy=True, master=master) if background else state
        self.wait()
        if not master and not collective(fmt):
            return True
        group = process_group()
        if master and (group is None or group.get_rank() == 0):  # one lock per saving group: its coordinator's
            if self._lock.acquire():
                warnings.warn(
                    f"This CheckpointManager took {self.directory} over from another manager of this process, "
                    "created earlier: that one can no longer save into it (its next save raises). Two managers "
                    "saving into one directory prune each other's checkpoints; give each its own directory.",
                    TpukitWarning, stacklevel=2,
                )
        newer = [s for s in self.all_steps() if s > step]
        if newer:
            warnings.warn(
                f"Saving step {step} into {self.directory}, which already holds step {newer[-1]} (newer steps: "
                f"{newer}): latest() and restore() keep returning step {newer[-1]}, and rotation never deletes a "
                "checkpoint newer than the one saved, so they all stay. Use a fresh directory for a new run (or "
                "delete the newer checkpoints first to roll back).",
                TpukitWarning, stacklevel=2,
            )
        if background:
            self._pending.step = step
            self._pending.thread = threading.Thread(target=self._background, args=(step, cpu_state, fmt),
                                                    name="tpukit-checkpoint")
            self._pending.thread.start()
        else:
            self._write(step, cpu_state, fmt)
        return True

    def _write(self, step: int, cpu_state: Any, fmt: str) -> None:
        payload = self.directory / checkpoint_name(step, SUFFIX[fmt])
        if commit(cpu_state, payload, fmt, step, self.copy_chunk) is not None:  # the process that committed it prunes
            self._prune(step)

    def _background(self, step: int, cpu_state: Any, fmt: str) -> None:
        try:
            self._write(step, cpu_state, fmt)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._pending.error = exc

    def wait(self) -> None:
        """Block until the pending background write finished; raise its error, if it failed."""
        error = self._pending.join()
        if error is not None:
            raise CheckpointError(f"Background save of step {self._pending.step} failed: {error}") from error

    def close(self) -> None:
        """Finish a pending write (raising its error) and give the directory's lock up for another manager."""
        try:
            self.wait()
        finally:
            self._lock.release()

    def _prune(self, saved: int) -> None:
        """Keep ``saved``, every newer step and the newest ``keep - 1`` older ones; delete the rest, manifest first."""
        steps = self.all_steps()
        older = [s for s in steps if s < saved]
        kept_older = older if self.keep is None else older[max(0, len(older) - self.keep + 1):]
        keep = set(kept_older) | {s for s in steps if s >= saved}
        for step in steps:
            if step not in keep:
                self._delete(step)
        for name in os.listdir(self.directory):  # payloads whose save died before the manifest
            parsed = parse_name(name)
            if parsed and parsed[1] != MANIFEST_SUFFIX and parsed[0] < saved and parsed[0] not in keep:
                remove_path(self.directory / name)

    def _delete(self, step: int) -> None:
        for suffix in (MANIFEST_SUFFIX, *SUFFIX.values()):
            remove_path(self.directory / checkpoint_name(step, suffix))

    # -- reading

    def all_steps(self) -> list[int]:
        """Steps that have a committed manifest, oldest first (``latest`` also verifies the payload)."""
        return committed_steps(self.directory)

    def latest_step(self) -> int | None:
        """The step of the newest valid checkpoint, or None."""
        self.wait()
        found = newest_valid(self.directory, read=False)
        return None if found is None else found[0]

    def latest(self, device: Any = None) -> dict | None:
        """The state of the newest valid checkpoint (damaged ones skipped with a warning), or None."""
        device = check_device(device)
        self.wait()
        found = newest_valid(self.directory, device)
        return None if found is None else found[1]

    def restore(self, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
                step_var: torch.Tensor | None = None, *, strict: bool = True) -> int:
        """Load the newest valid checkpoint into the given objects; returns its step (0 when there is none).

        Tensors are read on the CPU and copied by ``load_state_dict`` onto the
        device each parameter lives on (optimizer state follows its parameters,
        with the same placement rules as a fresh run). ``step_var``, a tensor such
        as an on-device step counter, is filled with the step in place. The generator
        states are restored last (when the manager has ``rng=True`` and the
        checkpoint holds them), whatever the process seeded before. Every
        ``torch_xla.sync()`` advances the XLA seed, so for an exact resume save
        after the step's sync (``tpukit.track`` does) and restore right before the
        loop, with no sync in between. Weights the model declares tied but holds as two tensors (a Hugging
        Face model moved to an XLA device) are tied again first, as ``tpukit.track`` ties them, and an
        optimizer made before holds the tied tensor after, so the state of a run
        that trained the tied model fits.
        """
        for name, target in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
            check_target(name, target)
        if step_var is not None and not isinstance(step_var, torch.Tensor):
            raise TypeError(f"restore(step_var=...) got a {type(step_var).__name__}; pass a tensor (or None).")
        if model is not None:
            _xla.ties.retie(unwrap(model), "CheckpointManager.restore")
        self.wait()
        newest = self.all_steps()
        sharded = self._sharded_payload(newest[-1]) if newest else None
        into = self._template(sharded, model, optimizer, scheduler) if sharded is not None else None
        found = newest_valid(self.directory, into=into)
        if found is None:
            log.info("no checkpoint in %s; starting from step 0", self.directory)
            return 0
        state = found[1]
        saved = saved_keys(sharded) if state is into else set(state)
        step = int(state["step"])
        for key, target in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)):
            if target is not None and key not in saved:
                raise CheckpointError(
                    f"Checkpoint step {step} in {self.directory} has no {key!r} entry (it has {sorted(saved)}); "
                    f"save it with manager.save(step, {key}={key}.state_dict())."
                )
        if model is not None:
            saved_model = _in_model_keys(model.state_dict(), state["model"])
            _check_keys(model, saved_model, strict, f"step {step} in {self.directory}")
            model.load_state_dict(saved_model, strict=strict)
        if optimizer is not None:
            check_optimizer_state(optimizer, state["optimizer"], f"step {step} in {self.directory}")
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
        if _xla.runtime_initialized():
            # the restored values become device data now (a pending copy read before a sync can lose an
            # uneven sharding); before the generator states, since a sync advances the XLA seed
            _xla.sync()
        if self.rng and RNG_KEY in state:
            set_rng_state(state[RNG_KEY])
        return step

    def _sharded_payload(self, step: int) -> Path | None:
        """The directory of checkpoint ``step`` when it is a sharded one (per its manifest)."""
        try:
            manifest = Manifest.read(self.directory / checkpoint_name(step, MANIFEST_SUFFIX))
        except CheckpointError:
            return None
        return self.directory / manifest.payload if manifest.weights_format == SHARDED else None

    def _template(self, path: Path, model: Any, optimizer: Any, scheduler: Any) -> dict:
        """The dict a sharded checkpoint loads into: the objects' own state dicts, sharded as they are now."""
        keys = saved_keys(path)
        template: dict[str, Any] = {"step": 0}
        if model is not None and "model" in keys:  # under the names it was saved with (wrapped or not)
            own = model.state_dict()
            template["model"] = {saved: own[k] for k, saved in match_keys(own, saved_keys(path, "model")).items()}
        if optimizer is not None and "optimizer" in keys:
            if not optimizer.state:  # its state tensors must exist to be loaded into (torch_xla's recipe)
                _xla.prime_optimizer(optimizer)
            template["optimizer"] = optimizer.state_dict()
        if scheduler is not None and "scheduler" in keys:
            template["scheduler"] = scheduler.state_dict()
        if self.rng and RNG_KEY in keys:
            template[RNG_KEY] = rng_state()
        return template


class _Pending:
    """The background write of a manager: its thread, step and error (shared with the exit hook)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.step: int | None = None
        self.error: BaseException | None = None

    def join(self) -> BaseException | None:
        """Wait for the write; return (and forget) its error."""
        if self.thread is not None:
            if self.thread is not threading.current_thread():  # the manager may be collected in its own writer
                self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        return error


def _finish(pending: _Pending, lock: DirectoryLock, directory: str) -> None:
    """A manager's last act (collected, or the process exits): finish its write, warn if it failed, unlock."""
    try:
        error = pending.join()
        if error is not None:
            warnings.warn(
                f"The background save of step {pending.step} into {directory} failed and nobody called wait(): "
                f"{error}. That checkpoint was not written; call manager.wait() after the last save.",
                TpukitWarning, stacklevel=1,
            )
    finally:
        lock.release()


def _in_model_keys(own: dict, saved: Any) -> Any:
    """The saved model state keyed as ``own`` (the model's state dict) names it, wrapped or not; saved keys the
    model has no name for keep their own names (reported as unexpected)."""
    if not isinstance(saved, dict):
        return saved
    matched = match_keys(own, saved)
    out = {k: saved[s] for k, s in matched.items()}
    used = set(matched.values())
    out.update({own_key(s): v for s, v in saved.items() if s not in used})
    return out


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
