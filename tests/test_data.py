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


# ------------------------------------------------------------------ the bucket advisor

def _skewed(n=600, seed=0, top=128):
    """Many short examples and a long tail, like real text."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    return [max(1, min(top, int(torch.exp(3.0 + 0.6 * torch.erfinv(2 * x - 1) * 2 ** 0.5)))) for x in u]


def test_advisor_beats_equal_buckets_and_is_exact():
    import itertools

    lengths = _skewed()
    advice = data.suggest_buckets(lengths, 16, max_buckets=4, max_length=128)
    naive = data.evaluate_buckets(lengths, 16, data.bucket_lengths(128, 4))  # [32, 64, 96, 128]
    assert advice.total_s < naive.total_s
    assert advice.step_s + advice.compile_s == pytest.approx(advice.total_s)
    # Exact: no bucket set of multiples of 8 (at most 4, the last holding the longest) costs less.
    cands = list(range(8, max(lengths) + 8, 8))
    grid = min(data.evaluate_buckets(lengths, 16, list(c) + [cands[-1]]).total_s
               for k in range(4) for c in itertools.combinations(cands[:-1], k))
    assert advice.total_s == pytest.approx(grid)

    assert advice.compiles <= naive.compiles
    # It drives BucketBatcher; with as many buckets as the naive set (compiles made free, so it uses all 4),
    # the real batches waste less padding than the equal-width ones.
    four = data.suggest_buckets(lengths, 16, max_buckets=4, max_length=128, compile_s=0.0)
    assert len(four.buckets) == 4
    seqs = [[1] * n for n in lengths]
    real = {}
    for name, buckets in (("advice", four.buckets), ("naive", naive.buckets)):
        batcher = data.BucketBatcher(seqs, batch_size=16, buckets=buckets, drop_last=False)
        real[name] = data.padding_stats(batcher)
        assert len(batcher) == data.evaluate_buckets(lengths, 16, buckets).steps
        assert data.BucketBatcher(seqs, batch_size=16, buckets=buckets).dropped == \
            data.evaluate_buckets(lengths, 16, buckets).dropped
    assert real["advice"].waste < real["naive"].waste
    assert four.waste < naive.waste
    assert real["advice"].tokens - real["advice"].pad_tokens == four.tokens == sum(lengths)


def test_advisor_respects_max_buckets_and_multiple():
    lengths = _skewed(seed=1)
    for cap in (1, 2, 3, 5):
        free = data.suggest_buckets(lengths, 8, max_buckets=cap, compile_s=0.0)  # compiles free: uses the cap
        assert len(free.buckets) == cap and all(b % 8 == 0 for b in free.buckets)
        assert free.buckets[-1] >= max(lengths)
    capped = [min(n, 124) for n in lengths]
    odd = data.suggest_buckets(capped, 8, multiple=16, max_length=124, compile_s=0.0, max_buckets=4)
    assert all(b % 16 == 0 for b in odd.buckets[:-1]) and odd.buckets[-1] == 124  # max_length caps the last
    exact = data.suggest_buckets([3, 3, 5, 5, 9, 9], 2, multiple=1, compile_s=0.0)
    assert exact.buckets == (3, 5, 9) and exact.waste == 0  # one bucket per length when compiles cost nothing
    # ... unless a bucket's partial batch costs more than it saves: 5 joins 9 (2 steps of 9, not 1 of 5 + 2 of 9)
    assert data.suggest_buckets([3, 3, 5, 9, 9, 9], 2, multiple=1, compile_s=0.0).buckets == (3, 9)
    # Compiles dominate: a single bucket; a cheaper compile or more epochs buy more buckets.
    assert data.suggest_buckets(lengths, 16, compile_s=1e6).buckets == (data.suggest_buckets(lengths, 16).buckets[-1],)
    counts = [len(data.suggest_buckets(lengths, 16, epochs=e).buckets) for e in (1, 4, 16)]
    assert counts == sorted(counts) and counts[-1] > counts[0]


def test_advisor_step_time_measured_or_given():
    lengths = _skewed(seed=2)
    by_token = data.suggest_buckets(lengths, 16, token_s=1 / 256, step_overhead_s=0.0, compile_s=30)
    # Measured step times at two lengths (batch 16): 1 s at 16 tokens, 4 s at 64, the same line.
    measured = data.suggest_buckets(lengths, 16, step_time={16: 1.0, 64: 4.0}, compile_s=30)
    assert measured.buckets == by_token.buckets
    assert measured.total_s == pytest.approx(by_token.total_s)
    called = data.suggest_buckets(lengths, 16, step_time=lambda n: n / 16, compile_s=30)
    assert called.buckets == by_token.buckets
    # A noisy, non-monotone measurement is made non-decreasing; one point scales with length.
    noisy = data.suggest_buckets(lengths, 16, step_time={16: 1.0, 32: 0.9, 64: 4.0})
    assert noisy.step_times == tuple(sorted(noisy.step_times))
    one = data.evaluate_buckets(lengths, 16, [64, 128], step_time={64: 2.0})
    assert one.step_times == (2.0, 4.0)
    with pytest.raises(data.DataError, match="either step_time or token_s"):
        data.suggest_buckets(lengths, 16, step_time={16: 1.0}, token_s=1e-3)


def test_advice_explains_with_numbers():
    lengths = _skewed(seed=3)
    advice = data.suggest_buckets(lengths, 16, max_buckets=6, compile_s=20, token_s=2.5e-3, step_overhead_s=0.0)
    line = advice.explain()
    k = len(advice.buckets)
    assert line.startswith(f"{k} buckets {list(advice.buckets)}: {advice.waste:.0%} padding, {k} compiles")
    saves = advice.more_saves_s  # 7.0 s here
    assert f"a {k + 1}th bucket would save {saves:.1f} s of padding" in line
    assert f"a {k + 1}th bucket would save" in line and "but cost 20 s to compile" in line
    assert f"expected {advice.total_s:.0f} s" in line
    assert "\n" not in line and advice.more_saves_s < 20
    capped = data.suggest_buckets(lengths, 16, max_buckets=2, compile_s=0.5)
    assert "a 3rd bucket would save" in capped.explain() and "raise max_buckets=2" in capped.explain()
    # A near tie (15.12 s saved vs 14.9 s to compile) is shown with the digit that decides it.
    near = data.suggest_buckets([8] * 4 + [64] * 4, 4, max_buckets=1, compile_s=14.9, step_time=lambda n: 0.27 * n)
    assert near.buckets == (64,) and "a 2nd bucket would save 15.1 s of padding and cost only 14.9 s" in near.explain()
    full = data.suggest_buckets([8, 8, 16, 16], 2, compile_s=0.0)
    assert full.buckets == (8, 16) and "no 3rd bucket is possible" in full.explain()
    given = data.evaluate_buckets(lengths, 16, [32, 64, 128])
    assert given.explain().startswith("3 buckets [32, 64, 128]") and "would save" not in given.explain()


def test_advisor_bad_input():
    from tpukit import TpukitError

    with pytest.raises(data.DataError, match="lengths is empty"):
        data.suggest_buckets([], 16)
    with pytest.raises(data.DataError, match="batch_size must be"):
        data.suggest_buckets([5, 6], 0)
    with pytest.raises(data.DataError, match=r"2 examples are longer than max_length=64 \(longest 90\).*truncat"):
        data.suggest_buckets([10, 70, 90], 4, max_length=64)
    with pytest.raises(TpukitError, match="negative"):
        data.suggest_buckets([5, -1], 4)
    with pytest.raises(ValueError, match="max_buckets"):  # DataError is a ValueError too
        data.suggest_buckets([5, 6], 4, max_buckets=0)
    with pytest.raises(data.DataError, match="whole numbers"):
        data.suggest_buckets(["a"], 4)
    with pytest.raises(data.DataError, match="compile_s"):
        data.evaluate_buckets([5], 4, [8], compile_s=-1)


def _tiny_bert(attn: str):
    """A 1-layer BERT classifier built from a config (no hub), in eval mode (no dropout)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    config._attn_implementation = attn
    return BertForSequenceClassification(config).eval()


def test_bert_mask_gives_the_same_logits_without_a_forced_read(rt):
    import torch_xla

    import tpukit

    ids, mask = data.pad_to([[5, 6, 7, 8, 9], [10, 11]], 8)
    m4 = data.bert_mask(mask)
    assert m4.shape == (2, 1, 1, 8) and m4.dtype == torch.float32
    assert m4[0, 0, 0, :5].eq(0).all() and m4[1, 0, 0, 2:].eq(torch.finfo(torch.float32).min).all()
    assert data.bert_mask(mask, torch.bfloat16).dtype == torch.bfloat16
    for attn in ("sdpa", "eager"):  # transformers turns a 2-D mask into this for both (with a .all() read)
        model = _tiny_bert(attn)
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits,
                                  model(input_ids=ids, attention_mask=m4).logits, atol=1e-6), attn

    device = torch_xla.device()
    model = _tiny_bert("sdpa").to(device)
    ids, mask = ids.to(device), mask.to(device)
    reads = {}
    for name, make in (("2-D", lambda m: m), ("4-D", data.bert_mask)):
        before = tpukit.snapshot()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=make(mask)).logits
        torch_xla.sync()
        reads[name] = (tpukit.snapshot() - before).item_reads
        logits.cpu()
    # transformers 5.x reads padding_mask.all() mid-forward from a 2-D mask; the 4-D mask is used as it is.
    assert reads == {"2-D": 1, "4-D": 0}, reads
