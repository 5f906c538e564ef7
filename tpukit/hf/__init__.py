"""Hugging Face ``Trainer`` on XLA with the kit, in two lines.

- ``Trainer(..., callbacks=[tpukit.hf.Callback()])``: checks the setup before anything
  compiles (a fused optimizer, a last partial batch, logging every step, dynamic padding,
  ``torch_compile``, fp16/bf16), one step record per optimizer step, the live dashboard,
  recompilation alarms in the Trainer's terms (the batch by its keys, the collator and
  its fix), ``summary()`` with ``alarms`` and ``forced_reads``.
- ``Trainer(..., data_collator=tpukit.hf.BucketCollator(tokenizer, lengths=...))``: a few
  declared bucket lengths and BERT's ready 4-D mask: no recompilation, no forced read.

``import tpukit.hf`` does not import transformers: ``Callback`` (a
``transformers.TrainerCallback``) is built the first time it is used.
"""

from __future__ import annotations

from typing import Any

from .checks import TrainerSetupError, check_training
from .collator import BucketCollator
from .callback import CallbackLogic, callback_class

__all__ = ["Callback", "BucketCollator", "check_training", "TrainerSetupError"]


def __getattr__(name: str) -> Any:
    if name == "Callback":
        return callback_class()
    raise AttributeError(f"module 'tpukit.hf' has no attribute {name!r}")
