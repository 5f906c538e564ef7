"""Shape-stable batching (tpukit.data)."""

import pytest
import torch

from tpukit import data


def test_bucket_lengths_and_choice():
    assert data.bucket_lengths(128, 4) == [32, 64, 96, 128]
    assert data.bucket_lengths(30, 2, multiple=8) == [16, 30]
    assert data.bucket_for(33, [32, 64]) == 64
    assert data.bucket_for(500, [32, 64]) == 64  # longer than every bucket: truncated to the last
    with pytest.raises(ValueError):
        data.bucket_lengths(0)


def test_pad_to_pads_and_truncates():
    ids, mask = data.pad_to([[5, 6, 7], [8], list(range(1, 12))], 4, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 3, 4]]
    assert mask.sum(1).tolist() == [3, 1, 4]


def test_bucket_batcher_bounds_shapes_and_waste():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (200,), generator=g).tolist()
    seqs = [[1] * n for n in lengths]
    labels = [n % 2 for n in lengths]
    buckets = data.bucket_lengths(64, 4)
    batcher = data.BucketBatcher(seqs, labels, batch_size=8, buckets=buckets, shuffle=True, seed=1)
    batches = list(batcher)
    stats = data.padding_stats(batches)
    assert stats.shapes <= len(buckets)
    assert all(b["input_ids"].shape[0] == 8 for b in batches)
    assert len(batches) * 8 + batcher.dropped == 200
    # Every kept example appears once with its own label.
    assert sum(int(b["labels"].sum()) for b in batches) <= sum(labels)
    full = data.padding_stats([{"attention_mask": data.pad_to(seqs, 64)[1]}])
    assert stats.waste < full.waste
    with pytest.raises(ValueError, match="must pair up"):
        data.BucketBatcher(seqs, labels[:3], batch_size=8, buckets=buckets)


def test_plan_lists_the_kept_examples():
    seqs = [[1] * n for n in (3, 9, 4, 10, 5, 11, 2)]
    batcher = data.BucketBatcher(seqs, batch_size=2, buckets=[8, 16])
    plan = batcher.plan()
    assert all(len(idx) == 2 for _, idx in plan)
    kept = [i for _, idx in plan for i in idx]
    assert len(kept) == len(set(kept)) == 6 and batcher.dropped == 1
    assert {length for length, _ in plan} == {8, 16}
