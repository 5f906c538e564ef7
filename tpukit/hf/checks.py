"""What silently slows (or crashes) a ``transformers.Trainer`` on XLA, checked before anything compiles.

:func:`check_training` runs at the start of training (``tpukit.hf.Callback`` calls it from
``on_train_begin``, after the Trainer built its optimizer and data loaders and before the
first batch is fetched). Each finding is a :class:`~tpukit.TpukitWarning` saying what it
costs and what to change, or a :class:`~tpukit.TpukitError` when training cannot work; a
fused optimizer, which would crash at the first ``optimizer.step()``, is switched to the
plain one and the warning says so. :func:`check_fsdp_v2` runs earlier, when the Trainer is built
(``on_init_end``): the traps of torch_xla's FSDPv2 through the Trainer. Reads the Trainer's objects only;
imports no transformers.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from .. import _xla
from ..errors import TpukitError, TpukitWarning

FIX = ('data_collator=tpukit.hf.BucketCollator(tokenizer) (a few bucket lengths, declared, and the 4-D mask), '
       'or DataCollatorWithPadding(tokenizer, padding="max_length", max_length=N) or pad_to_multiple_of=M')


class TrainerSetupError(TpukitError):
    """A Trainer setting that cannot work on XLA (raised before anything compiles)."""


def unwrap_collator(collator: Any) -> Any:
    """The user's data collator behind the Trainer's ``RemoveColumnsCollator`` wrapper (if any)."""
    seen = 0
    while hasattr(collator, "data_collator") and seen < 4:
        collator = collator.data_collator
        seen += 1
    return collator


def collator_of(loader: Any) -> Any:
    """The data collator of a (possibly wrapped: accelerate, torch_xla) DataLoader, or None."""
    for _ in range(4):
        if loader is None:
            return None
        fn = getattr(loader, "collate_fn", None)
        if fn is not None:
            return unwrap_collator(fn)
        loader = getattr(loader, "_loader", None) or getattr(loader, "base_dataloader", None)
    return None


def dataset_length(loader: Any) -> int | None:
    """How many examples a (possibly wrapped) DataLoader's dataset holds, when it says."""
    for _ in range(4):
        if loader is None:
            return None
        ds = getattr(loader, "dataset", None)
        if ds is not None and hasattr(ds, "__len__"):
            return len(ds)
        loader = getattr(loader, "_loader", None) or getattr(loader, "base_dataloader", None)
    return None


def collator_name(collator: Any) -> str:
    """``DataCollatorWithPadding(padding=True)``: the collator as the user would recognise it."""
    if collator is None:
        return "the Trainer's data collator"
    name = type(collator).__name__ if not hasattr(collator, "__name__") else collator.__name__
    if hasattr(collator, "buckets"):
        return repr(collator)
    parts = [f"{k}={getattr(collator, k)!r}" for k in ("padding", "max_length", "pad_to_multiple_of")
             if getattr(collator, k, None) not in (None, False) or k == "padding" and hasattr(collator, k)]
    return f"{name}({', '.join(parts)})" if parts else name


def pads_dynamically(collator: Any) -> bool:
    """True for a collator that pads each batch to its own longest example (transformers' default)."""
    padding = getattr(collator, "padding", None)
    if padding is None or hasattr(collator, "buckets"):
        return False
    padding = getattr(padding, "value", padding)
    return padding in (True, "longest") and not getattr(collator, "pad_to_multiple_of", None)


def shape_hint(collator: Any) -> str:
    """The hint for a batch-shape recompilation in a Trainer: the collator in use and the fix."""
    if hasattr(collator, "buckets"):
        return (f"the batches left {collator_name(collator)}'s declared buckets (a last batch of fewer rows, or "
                f"an example longer than the last bucket): set dataloader_drop_last=True, or add that length")
    what = ("pads each batch to its longest example, so every new length compiles the step again"
            if pads_dynamically(collator) else "produces batches whose shape changes")
    return (f"the Trainer's data collator, {collator_name(collator)}, {what}: pass {FIX}; "
            f"a last batch of fewer rows: dataloader_drop_last=True")


def _warn(text: str) -> None:
    warnings.warn(text, TpukitWarning, stacklevel=4)


def refuse(args: Any, on_xla: bool | None = None) -> None:
    """Raise :class:`TrainerSetupError` for a setting that cannot work on XLA. ``torch_compile=True``
    is refused when the Trainer is built (``Callback.on_init_end``): accelerate already fails on it
    in ``trainer.train()`` before the first callback of training runs."""
    if on_xla is None:
        on_xla = "xla" in str(getattr(args, "device", ""))
    if on_xla and getattr(args, "torch_compile", False) and getattr(args, "torch_compile_backend", None) != "openxla":
        raise TrainerSetupError(
            f"torch_compile=True compiles the model with torch.compile's {args.torch_compile_backend or 'inductor'} "
            f"backend, which does not take XLA tensors (and accelerate fails on the compiled model in "
            f"trainer.train()); torch_xla already compiles the whole step: remove torch_compile=True.")


def check_training(args: Any, optimizer: Any = None, train_dataloader: Any = None, eval_dataloader: Any = None,
                   on_xla: bool | None = None) -> list[str]:
    """Check a Trainer's ``TrainingArguments``, optimizer and loaders for XLA; returns the warnings
    given (each also issued as a TpukitWarning). Raises :class:`TrainerSetupError` for a setting that
    cannot work. ``on_xla``: whether the Trainer runs on an XLA device (read from ``args.device``)."""
    if on_xla is None:
        on_xla = "xla" in str(getattr(args, "device", ""))
    found: list[str] = []

    def warn(text: str) -> None:
        found.append(text)
        _warn(text)

    if not on_xla:
        return found
    refuse(args, on_xla)
    optim = str(getattr(getattr(args, "optim", None), "value", getattr(args, "optim", "")))
    groups = getattr(optimizer, "param_groups", None) or []
    fused = [g for g in groups if g.get("fused")]
    if "fused" in optim or fused:
        for g in fused:
            g["fused"] = False
        warn(f'optim="{optim}" (transformers\' default for torch >= 2.8) uses the fused AdamW kernel, which does '
             f'not run on XLA tensors: the first optimizer.step() would raise "fused=True requires ... xla". '
             f'tpukit switched this run to the plain AdamW (same update); pass optim="adamw_torch" to '
             f'TrainingArguments to do it yourself.')
    train_collator = collator_of(train_dataloader)
    n = dataset_length(train_dataloader)
    batch = int(getattr(args, "per_device_train_batch_size", 0) or 0)
    if not getattr(args, "dataloader_drop_last", False) and n and batch and n % batch:
        warn(f"the training set's {n} examples leave a last batch of {n % batch} (batch {batch}): a new batch "
             f"shape, so every graph of the step compiles once more at the end of each epoch; set "
             f"dataloader_drop_last=True in TrainingArguments.")
    if pads_dynamically(train_collator):
        warn(f"the data collator, {collator_name(train_collator)}, pads each batch to its longest example: "
             f"almost every batch has a new length and compiles the training step again (the recompilation "
             f"alarms name it); pass {FIX}.")
    strategy = str(getattr(getattr(args, "logging_strategy", None), "value", getattr(args, "logging_strategy", "")))
    if strategy == "steps" and getattr(args, "logging_steps", 0) == 1:
        warn("logging_steps=1: the Trainer syncs and reads the loss from the device (.item()) after every "
             "step, so the host waits for each step to finish instead of tracing the next one (a forced read "
             "per step); log every 50 steps or more (logging_steps=50).")
    eval_strategy = str(getattr(getattr(args, "eval_strategy", None), "value", getattr(args, "eval_strategy", "no")))
    eval_collator = collator_of(eval_dataloader) or train_collator
    if eval_strategy != "no" and pads_dynamically(eval_collator):
        warn(f"evaluation pads with {collator_name(eval_collator)}: each new length of an evaluation batch "
             f"compiles the evaluation graph again, at every evaluation; pass {FIX} (the Trainer uses the same "
             f"collator for evaluation).")
    if getattr(args, "fp16", False):
        warn("fp16=True: TPUs compute in bfloat16, not float16; fp16 adds a gradient scaler whose overflow check "
             "reads a value every step. Use bf16=True on a TPU.")
    if getattr(args, "bf16", False) and _xla.device_type() != "TPU":
        warn(f"bf16=True on XLA:{_xla.device_type()}: bfloat16 is emulated here and slower than float32; "
             f"it pays on a TPU only.")
    return found


# transformers' Trainer with torch_xla's FSDP (fsdp_config={"xla": True, ...}, FSDPv2 included) delays making
# its optimizer until the model is wrapped, then makes it only on the branch of a model accelerate prepares;
# an FSDP-XLA model is wrapped by the Trainer itself, so no optimizer is made and create_scheduler fails
# before the first step ("'NoneType' object has no attribute 'param_groups'"). Run here (the scenario
# tests/scenarios/hf_fsdpv2.py, mode plain) on transformers 5.15.0 (Colab: Python 3.13, torch_xla 2.9),
# 5.24.0 (Kaggle's stack: torch_xla 2.8) and 5.25.0 (the newest on the index when checked, December 2026:
# its Trainer._prepare_for_training is unchanged): each fails the same way, and each trains with the fix.
# 4.x made the delayed optimizer on both branches. Upstream issue: not found (none could be searched from here).
FSDP_XLA_OPTIMIZER = (
    "this transformers' Trainer never makes the optimizer of an FSDP-XLA run (fsdp_config xla=True): train() "
    "fails in create_scheduler with \"'NoneType' object has no attribute 'param_groups'\". tpukit makes it where "
    "transformers 4.x did, after the model is wrapped (the parameters FSDPv2 shards in place); without "
    "tpukit.hf.Callback, call tpukit.hf.checks.fix_fsdp_xla_optimizer(trainer) before trainer.train().")


def fix_fsdp_xla_optimizer(trainer: Any) -> bool:
    """Make an FSDP-XLA Trainer create its optimizer when it schedules (see :data:`FSDP_XLA_OPTIMIZER`): its
    ``create_scheduler``, on this instance only, first makes the optimizer the Trainer would have (its own
    ``create_optimizer``, then ``accelerator.prepare``). True when the trainer needed it; applied once."""
    if not getattr(trainer, "is_fsdp_xla_enabled", False) or "create_scheduler" in vars(trainer):
        return False
    original = trainer.create_scheduler

    def create_scheduler(num_training_steps: int, optimizer: Any = None) -> Any:
        if optimizer is None and trainer.optimizer is None:
            trainer.create_optimizer()
            trainer.optimizer = trainer.accelerator.prepare(trainer.optimizer)
        return original(num_training_steps=num_training_steps, optimizer=optimizer)

    trainer.create_scheduler = create_scheduler
    return True


def fsdp_v2(args: Any) -> bool:
    """True for ``TrainingArguments`` asking torch_xla's FSDPv2 (``fsdp=...``, ``fsdp_config={"xla": True,
    "xla_fsdp_v2": True}``), the Trainer's SPMD sharding."""
    config = getattr(args, "fsdp_config", None) or {}
    return bool(getattr(args, "fsdp", None)) and bool(config.get("xla")) and bool(config.get("xla_fsdp_v2"))


FSDPV2_NO_SPMD = (
    "fsdp_config xla_fsdp_v2=True shards the model with SPMD, which this runtime does not run: trainer.train() "
    "would fail in torch_xla's mark_sharding (\"Check failed: UseVirtualDevice()\"). Call "
    "tpukit.setup(spmd=True) first, before anything touches the TPU (restart the kernel if the runtime already "
    "started), or drop fsdp/fsdp_config to train on one device.")


def _wrapped_by_fsdp(model: Any) -> bool:
    return any(c.__name__ in ("SpmdFullyShardedDataParallel", "XlaFullyShardedDataParallel")
               for c in type(model).__mro__)


def check_fsdp_v2(args: Any, model: Any) -> list[str]:
    """What breaks an FSDPv2 Trainer before it starts (``Callback.on_init_end`` runs it, before the Trainer
    wraps the model): no SPMD, or a model already FSDP-wrapped (``tpukit.fsdp``), raise
    :class:`TrainerSetupError`; parameters already carrying a sharding (``mark_sharding`` by hand), which
    FSDPv2 leaves as they are, warn. Returns the warnings given (each also a TpukitWarning)."""
    if not fsdp_v2(args):
        return []
    if not _xla.is_spmd():
        raise TrainerSetupError(FSDPV2_NO_SPMD)
    if _wrapped_by_fsdp(model):
        raise TrainerSetupError(
            f"the model is already wrapped for FSDP ({type(model).__name__}, as tpukit.fsdp(model, mesh) returns) "
            f"and fsdp_config xla_fsdp_v2=True wraps it again: trainer.train() would fail with \"Cannot wrap a "
            f"module that is already wrapped with FSDP\". Pass the model itself (wrapped.module) and let the "
            f"Trainer shard it, or keep tpukit.fsdp and train it with tpukit.track instead of the Trainer.")
    params = list(model.parameters()) if model is not None else []
    marked = [p for p in params if _xla.is_xla_tensor(p) and _xla.sharding_spec(p)]
    if not marked:
        return []
    whole = sum(not _xla.is_sharded(p) for p in marked)
    text = (f"{len(marked)} of the model's {len(params)} parameters already carry a sharding ({whole} of them "
            f"replicated: whole on every device), and FSDPv2 shards only the parameters that carry none: those "
            f"stay as they are, {'so this run saves no memory on them' if whole else 'on their own mesh'}. Pass "
            f"the model without marking its parameters (no xs.mark_sharding, no tpukit.fsdp): the Trainer shards "
            f"each one over its 'fsdp' axis.")
    _warn(text)
    return [text]


def trainer_of(callback: Any, depth: int = 8) -> Any:
    """The ``Trainer`` whose ``__init__`` is calling ``callback``'s ``on_init_end`` now (a callback is given
    no reference to its Trainer): the ``self`` of a calling frame whose callback handler holds it; None if
    none does."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if any(c is callback for c in getattr(getattr(owner, "callback_handler", None), "callbacks", ())):
            return owner
        frame = frame.f_back
    return None
