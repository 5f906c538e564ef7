"""Shape-stable batching: padding, length buckets and the 4-D mask BERT takes as it is.

XLA compiles one graph per distinct input shape. Padding every batch to the
longest sequence *in that batch* (the usual dynamic padding) gives a new shape,
hence a new compilation, for almost every batch. Padding to a few fixed bucket
lengths bounds the number of graphs by the number of buckets while wasting far
less than padding everything to the maximum length.

Which lengths: ``suggest_buckets`` picks them from the length histogram, the
set that minimises the expected training time (padded steps plus one compile
per bucket) under a stated cost model. It lives in :mod:`tpukit.buckets` and is
re-exported here with ``evaluate_buckets`` and ``BucketAdvice``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import (  # noqa: F401 (the bucket advisor, re-exported: tpukit.data.suggest_buckets)
    DEFAULT_COMPILE_S,
    DEFAULT_STEP_OVERHEAD_S,
    DEFAULT_TOKEN_S,
    BucketAdvice,
    evaluate_buckets,
    suggest_buckets,
)
from ._text import plural
from .errors import DataError  # noqa: F401 (raised here and by the advisor; tpukit.data.DataError)


def bucket_lengths(max_length: int, num_buckets: int = 4, min_length: int = 8, multiple: int = 8) -> list[int]:
    """Evenly spaced bucket lengths up to ``max_length``, each a multiple of ``multiple``.

    ``bucket_lengths(128, 4)`` gives ``[32, 64, 96, 128]``.
    """
    if max_length < 1 or num_buckets < 1 or multiple < 1:
        raise DataError("bucket_lengths needs max_length, num_buckets and multiple >= 1.")
    out = set()
    for i in range(1, num_buckets + 1):
        n = math.ceil(max_length * i / num_buckets / multiple) * multiple
        out.add(max(min(n, max_length), min(min_length, max_length)))
    return sorted(out)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket length that holds ``length`` (sequences longer than the last are truncated)."""
    if not buckets:
        raise DataError("bucket_for needs at least one bucket length.")
    return next((b for b in sorted(buckets) if length <= b), max(buckets))


def pad_to(sequences: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad/truncate token-id lists to ``length``; returns ``(ids, attention_mask)`` of shape (n, length)."""
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        seq = list(seq)[:length]
        if seq:
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[i, : len(seq)] = 1
    return ids, mask


def bert_mask(attention_mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 2-D 0/1 padding mask as the 4-D additive mask transformers' BERT uses as it is.

    The logits are the same as with the 2-D mask, but transformers no longer reads
    ``mask.all()`` from the device mid-forward to decide whether it may skip the mask
    (a forced read, and one extra small graph per input shape). The result has shape
    ``(batch, 1, 1, length)``: 0 where attended, ``dtype``'s minimum on padding,
    computed by lazy ops inside the step graph.

    ``attention_mask`` must be the tokenizer's 2-D ``(batch, length)`` tensor of 0
    (padding) and 1 (a token); bool, integer and float dtypes all work. Its type,
    shape and dtype are always checked (``TypeError`` / :class:`DataError`). Its
    *values* are checked only on a CPU tensor: checking an XLA tensor's values
    would read it from the device mid-step (the very read this function exists to
    avoid), so there a nonzero value counts as "attend" and zero as padding, which
    can never add a positive bias (a 2, or ``input_ids`` passed by mistake, does
    not boost attention; it masks only zeros).
    """
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"bert_mask() takes the attention_mask tensor (batch, length) of 0/1, not a "
                        f"{type(attention_mask).__name__}; pass batch['attention_mask'], or "
                        "torch.tensor(mask) for a list.")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"bert_mask(dtype={dtype!r}): the additive mask needs a floating dtype, "
                        "e.g. torch.float32, or model.dtype for a model cast to bfloat16.")
    if attention_mask.dim() != 2:
        hint = ("a single example? add the batch dimension: mask[None]" if attention_mask.dim() < 2 else
                "it looks already expanded; pass the tokenizer's 2-D mask, or give a ready 4-D additive mask "
                "to the model as it is")
        raise DataError(f"bert_mask() needs the 2-D attention_mask (batch, length) of 0/1, got shape "
                        f"{tuple(attention_mask.shape)}: {hint}.")
    if attention_mask.is_complex():
        raise DataError(f"bert_mask() needs a 0/1 mask of bool, integer or float dtype, got {attention_mask.dtype}.")
    if attention_mask.device.type == "cpu" and attention_mask.numel():
        bad = (attention_mask != 0) & (attention_mask != 1)
        if bool(bad.any()):
            value = attention_mask[bad][0].item()
            raise DataError(f"bert_mask() needs a mask of 0 (padding) and 1 (a token), but it holds {value!r}: "
                            "is it input_ids? Pass the tokenizer's attention_mask (e.g. batch['attention_mask']).")
    keep = (attention_mask[:, None, None, :] != 0).to(dtype)
    return (1.0 - keep) * torch.finfo(dtype).min


@dataclass(frozen=True)
class PaddingStats:
    """How much of what was fed to the device was padding."""

    batches: int
    shapes: int  # distinct (batch, length) shapes = graphs compiled for the step
    tokens: int
    pad_tokens: int

    @property
    def waste(self) -> float:
        """Fraction of token slots that were padding."""
        return self.pad_tokens / self.tokens if self.tokens else 0.0


def padding_stats(batches: Iterable[dict]) -> PaddingStats:
    """Count batches, distinct shapes and padding of batches with an ``attention_mask``."""
    n = tokens = pads = 0
    shapes = set()
    for b in batches:
        mask = b["attention_mask"]
        n += 1
        shapes.add(tuple(mask.shape))
        tokens += mask.numel()
        pads += int(mask.numel() - mask.sum())
    return PaddingStats(n, len(shapes), tokens, pads)


class BucketBatcher:
    """Batches of token-id sequences padded to a few fixed lengths (one graph per bucket).

    Examples are grouped by bucket, so every batch has the same ``batch_size`` and
    one of ``len(buckets)`` lengths. With ``drop_last=True`` (the default) partial
    batches are dropped so the batch dimension never changes either; the dropped
    examples are counted in ``dropped``. Iterating yields dicts with ``input_ids``,
    ``attention_mask`` and, when labels were given, ``labels``.

    A sequence longer than the largest bucket would lose tokens, so it is refused
    (:class:`DataError`, naming how many and the longest): add a bucket that holds
    it, or truncate when tokenizing. ``truncate=True`` cuts such sequences to the
    largest bucket instead and counts this epoch's cut ones in ``truncated`` (they
    are fed, so they are not in ``dropped``; one in a dropped partial batch is
    counted in ``dropped`` only).
    """

    def __init__(self, sequences: Sequence[Sequence[int]], labels: Sequence[int] | None = None, *,
                 batch_size: int, buckets: Sequence[int], pad_id: int = 0, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = True, truncate: bool = False):
        if batch_size < 1:
            raise DataError("batch_size must be >= 1.")
        if not buckets or min(int(b) for b in buckets) < 1:
            raise DataError(f"buckets={list(buckets)!r} needs at least one length >= 1, e.g. "
                            "tpukit.data.bucket_lengths(max_length) or suggest_buckets(lengths, batch_size).buckets.")
        if labels is not None and len(labels) != len(sequences):
            raise DataError(f"got {len(sequences)} sequences but {len(labels)} labels; they must pair up.")
        self.sequences = sequences
        self.labels = labels
        self.batch_size = batch_size
        self.buckets = sorted({int(b) for b in buckets})
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.truncate = bool(truncate)
        self.epoch = 0
        longest = self.buckets[-1]
        over = [len(seq) for seq in sequences if len(seq) > longest]
        if over and not self.truncate:
            raise DataError(
                f"{len(over)} of {plural(len(sequences), 'sequence')} {'is' if len(over) == 1 else 'are'} longer "
                f"than the largest bucket, {longest} "
                f"(the longest has {max(over)} tokens), and would lose tokens. Add a bucket of at least "
                f"{max(over)}, truncate when tokenizing (truncation=True, max_length={longest}), or pass "
                f"truncate=True to cut them to {longest} (counted in .truncated).")
        self._plan = self._make_plan()

    def _make_plan(self) -> list[tuple[int, list[int]]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.sequences), generator=g).tolist() if self.shuffle else range(len(self.sequences))
        groups: dict[int, list[int]] = {b: [] for b in self.buckets}
        for i in order:
            groups[bucket_for(len(self.sequences[i]), self.buckets)].append(i)
        plan = []
        self.dropped = self.truncated = 0
        for b, idx in groups.items():
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s: s + self.batch_size]
                if len(chunk) < self.batch_size and self.drop_last:
                    self.dropped += len(chunk)
                    continue
                plan.append((b, chunk))
                self.truncated += sum(1 for i in chunk if len(self.sequences[i]) > b)
        if self.shuffle:
            perm = torch.randperm(len(plan), generator=g).tolist()
            plan = [plan[i] for i in perm]
        return plan

    def plan(self) -> list[tuple[int, list[int]]]:
        """This epoch's batches as ``(bucket length, example indices)``, in iteration order."""
        return [(length, list(idx)) for length, idx in self._plan]

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for another epoch (when ``shuffle=True``)."""
        self.epoch = epoch
        self._plan = self._make_plan()

    def __len__(self) -> int:
        return len(self._plan)

    def __iter__(self):
        for length, idx in self._plan:
            ids, mask = pad_to([self.sequences[i] for i in idx], length, self.pad_id)
            batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
            if self.labels is not None:
                batch["labels"] = torch.as_tensor([self.labels[i] for i in idx], dtype=torch.long)
            yield batch
