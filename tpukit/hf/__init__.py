"""Hugging Face ``Trainer`` on XLA with the kit, in two lines.

- ``Trainer(..., callbacks=[tpukit.hf.Callback()])``: checks the setup before anything
  compiles (a fused optimizer, a last partial batch, logging every step, dynamic padding,
  ``torch_compile``, fp16/bf16; with FSDPv2: no SPMD, a model sharded before the Trainer, and
  transformers 5.x's missing optimizer, made), one step record per optimizer step, the live dashboard,
  recompilation alarms in the Trainer's terms (the batch by its keys, the collator and
  its fix), ``summary()`` with ``alarms`` and ``forced_reads``.
- ``Trainer(..., data_collator=tpukit.hf.BucketCollator(tokenizer, lengths=...))``: a few
  declared bucket lengths and BERT's ready 4-D mask: no recompilation, no forced read.

Reaching ``tpukit.hf`` (``import tpukit.hf``, ``tpukit.hf.Callback``, making a ``Callback`` or a
``BucketCollator``) imports neither transformers nor torch_xla, so it may come before
``tpukit.setup()`` without costing the compile causes (transformers' ``TrainerCallback`` imports
accelerate, which imports torch_xla: ``Callback`` is not a subclass of it; see
:mod:`tpukit.hf.callback`).
"""

from __future__ import annotations

from .checks import TrainerSetupError, check_training
from .collator import BucketCollator
from .callback import Callback

__all__ = ["Callback", "BucketCollator", "check_training", "TrainerSetupError"]
