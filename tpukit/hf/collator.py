"""``BucketCollator``: a data collator that pads each batch to one of a few bucket lengths.

transformers' default collator (``DataCollatorWithPadding``) pads every batch to its
longest example, so on XLA almost every batch has a new shape and compiles the whole
training step again. ``BucketCollator`` pads to the smallest of a few fixed lengths
that holds the batch (bounding the graphs by the number of buckets), hands BERT the
ready 4-D additive mask (so transformers never reads ``attention_mask.all()`` from the
device mid-forward), and declares its buckets: the first compile of each bucket is
*expected*, not a recompilation alarm. It works as ``Trainer(data_collator=...)`` and
as a ``DataLoader``'s ``collate_fn``; it needs no transformers import itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..buckets import suggest_buckets
from ..data import DataError, bert_mask, bucket_for, bucket_lengths

DEFAULT_BATCH = 8  # TrainingArguments' per_device_train_batch_size default
_MASKS = ("4d", "2d")


class BucketCollator:
    """Pads a list of tokenized examples to the smallest bucket length that holds the longest one.

    ``buckets``: the lengths to pad to; else chosen by :func:`tpukit.data.suggest_buckets` from
    ``lengths`` (the dataset's example lengths, in tokens, for batches of ``batch_size``); else
    four equal buckets up to ``max_length``. Longer examples are truncated to the last bucket.
    ``mask="4d"`` returns ``attention_mask`` as the additive ``(batch, 1, 1, length)`` mask
    (:func:`tpukit.data.bert_mask`; same logits as the 2-D mask), ``mask="2d"`` the usual 0/1 one.
    Examples are mappings with ``input_ids`` (and optionally ``attention_mask``,
    ``token_type_ids``, ``label``/``labels`` and other per-example values).
    """

    def __init__(self, tokenizer: Any, max_length: int | None = None, buckets: Sequence[int] | None = None,
                 lengths: Iterable[int] | None = None, mask: str = "4d", batch_size: int = DEFAULT_BATCH,
                 max_buckets: int = 8):
        if mask not in _MASKS:
            raise ValueError(f"BucketCollator(mask={mask!r}): use mask='4d' (BERT's ready additive mask, no "
                             f"device read) or mask='2d' (the usual 0/1 mask).")
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise DataError("BucketCollator needs a tokenizer with a pad token (tokenizer.pad_token_id is None): "
                            "set one, e.g. tokenizer.pad_token = tokenizer.eos_token.")
        self.tokenizer = tokenizer
        self.pad_id = int(pad)
        self.mask = mask
        self.advice = None
        if buckets is not None:
            chosen = sorted({int(b) for b in buckets})
            if not chosen or chosen[0] < 1:
                raise DataError(f"BucketCollator(buckets={list(buckets)!r}) needs lengths >= 1.")
            if max_length is not None and chosen[-1] > max_length:
                raise DataError(f"BucketCollator: bucket {chosen[-1]} is longer than max_length={max_length}.")
        elif lengths is not None:
            self.advice = suggest_buckets(list(lengths), batch_size, max_buckets=max_buckets, max_length=max_length)
            chosen = list(self.advice.buckets)
        else:
            limit = max_length or _model_max_length(tokenizer)
            chosen = bucket_lengths(limit, 4)
        self.buckets: tuple[int, ...] = tuple(chosen)
        self.max_length = max_length or self.buckets[-1]

    def __repr__(self) -> str:
        return f"BucketCollator(buckets={list(self.buckets)}, mask={self.mask!r})"

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """The batch: ``input_ids``, ``attention_mask`` (4-D or 2-D), ``token_type_ids`` when the
        examples have them, ``labels`` and any other per-example values as tensors."""
        if not features:
            raise DataError("BucketCollator got an empty list of examples.")
        ids = [list(_ids(f)) for f in features]
        length = bucket_for(max(len(i) for i in ids), self.buckets)
        n = len(features)
        out: dict[str, torch.Tensor] = {}
        input_ids = torch.full((n, length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, length), dtype=torch.long)
        types = torch.zeros((n, length), dtype=torch.long) if "token_type_ids" in features[0] else None
        for row, (f, seq) in enumerate(zip(features, ids)):
            seq = seq[:length]
            if seq:
                input_ids[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
                given = f.get("attention_mask")
                mask[row, :len(seq)] = (torch.as_tensor(list(given)[:len(seq)], dtype=torch.long)
                                        if given is not None else 1)
                if types is not None:
                    types[row, :len(seq)] = torch.as_tensor(list(f["token_type_ids"])[:len(seq)], dtype=torch.long)
        out["input_ids"] = input_ids
        out["attention_mask"] = bert_mask(mask) if self.mask == "4d" else mask
        if types is not None:
            out["token_type_ids"] = types
        for key in features[0]:
            if key in ("input_ids", "attention_mask", "token_type_ids"):
                continue
            values = [f[key] for f in features]
            name = "labels" if key in ("label", "label_ids") else key
            try:
                out[name] = torch.stack(values) if isinstance(values[0], torch.Tensor) else torch.tensor(values)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise DataError(f"BucketCollator cannot batch the examples' {key!r} values ({exc}); remove that "
                                f"column from the dataset or pad it yourself.") from exc
        return out


def _ids(feature: Mapping[str, Any]) -> Sequence[int]:
    if not isinstance(feature, Mapping) or "input_ids" not in feature:
        raise DataError("BucketCollator takes tokenized examples: mappings with 'input_ids' (run the tokenizer "
                        "over the dataset first, without padding).")
    ids = feature["input_ids"]
    return ids.tolist() if hasattr(ids, "tolist") else ids


def _model_max_length(tokenizer: Any) -> int:
    """The tokenizer's model_max_length when it is a real limit (transformers uses 1e30 for none), else 512."""
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n <= 8192 else 512
