"""Training loops as users write them (copied from the PyTorch/XLA guide and Hugging Face
examples), wrapped in ``tpukit.track``: the corpus of tests/test_diagnosis.py.

Each loop is its own function with its own lines (the kit tells graphs apart by the
code place that cut them) and its own layer sizes (so no loop finds another's graph
in XLA's cache). Each returns the Tracker. ``guard`` is passed to ``track`` as is.
Imported by the tests in-process and by the guard test in a fresh interpreter.
"""

import random

import torch
import torch.nn.functional as F
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

import tpukit


class MNIST(nn.Module):
    """A small stand-in for the guide's MNIST network (log-probabilities out)."""

    def __init__(self, n_in, hidden, n_out):
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def _dataset(n, n_in, n_out, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, n_in, generator=g), torch.randint(0, n_out, (n,), generator=g))


class TextClassifier(nn.Module):
    """Mean-pooled embeddings and a linear head: a tiny stand-in for a Hugging Face classifier."""

    def __init__(self, vocab, dim, labels):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, labels)

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).to(self.embed.weight.dtype)
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.head(pooled)


def _sequences(lengths, vocab, seed):
    rnd = random.Random(seed)
    return [[rnd.randrange(1, vocab) for _ in range(n)] for n in lengths]


def pad_collate(examples):
    """Dynamic padding, like transformers' DataCollatorWithPadding: pad to the longest in the batch."""
    longest = max(len(ids) for ids, _ in examples)
    input_ids = torch.zeros(len(examples), longest, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for i, (ids, _) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    labels = torch.tensor([label for _, label in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ------------------------------------------------------------------ the guide's loops

def guide_single_device(guard=None):
    """The guide's "Running on a Single XLA Device" loop, train_loader wrapped in track."""
    import torch_xla.core.xla_model as xm

    device = xm.xla_device()
    model = MNIST(12, 29, 5).train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    train_loader = DataLoader(_dataset(64, 12, 5, seed=1), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for data, target in tracker:
        optimizer.zero_grad()
        data = data.to(device)
        target = target.to(device)
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        xm.mark_step()  # MARK: guide mark_step
    return tracker


def guide_multi_device(guard=None):
    """The guide's multi-device idiom on one device: MpDeviceLoader + xm.optimizer_step."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    device = xm.xla_device()
    train_loader = DataLoader(_dataset(64, 14, 5, seed=2), batch_size=8)
    mp_device_loader = pl.MpDeviceLoader(train_loader, device)
    model = MNIST(14, 31, 5).train().to(device)
    loss_fn = nn.NLLLoss()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

    tracker = tpukit.track(mp_device_loader, progress=False, guard=guard)
    for data, target in tracker:  # MARK: multi-device for
        optimizer.zero_grad()
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        xm.optimizer_step(optimizer)
    return tracker


def dataloader_adam(guard=None):
    """A DataLoader handed straight to track (it prefetches to the device), Adam."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 3)).to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(_dataset(64, 10, 3, seed=3), batch_size=8, shuffle=True)

    tracker = tpukit.track(loader, progress=False, guard=guard)
    for x, y in tracker:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tpukit.log(loss=loss)
    return tracker


def gradient_accumulation(guard=None):
    """Gradient accumulation over two micro-batches, as in the Hugging Face examples."""
    import torch_xla.core.xla_model as xm

    device = xm.xla_device()
    model = MNIST(9, 35, 4).train().to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gradient_accumulation_steps = 2
    train_loader = DataLoader(_dataset(80, 9, 4, seed=4), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for step, (data, target) in enumerate(tracker):
        loss = F.nll_loss(model(data), target)
        loss = loss / gradient_accumulation_steps
        loss.backward()
        if (step + 1) % gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    return tracker


def train_eval_alternating(guard=None):
    """Training steps and evaluation steps alternating in one loop."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(7, 37), nn.ReLU(), nn.Linear(37, 3)).to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = DataLoader(_dataset(80, 7, 3, seed=5), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for step, (x, y) in enumerate(tracker):
        if step % 2 == 0:
            model.train()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.eval()
            with torch.no_grad():
                accuracy = (model(x).argmax(dim=1) == y).float().mean()
            tpukit.log(accuracy=accuracy)
    return tracker


def adamw_first_steps(guard=None):
    """A stateful optimizer (AdamW) on Hugging Face style dict batches of fixed length."""
    import torch_xla

    device = torch_xla.device()
    model = TextClassifier(vocab=101, dim=19, labels=2).to(device)
    optimizer = optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(6)
    batches = [{"input_ids": torch.randint(1, 101, (8, 20), generator=g),
                "attention_mask": torch.ones(8, 20, dtype=torch.long),
                "labels": torch.randint(0, 2, (8,), generator=g)} for _ in range(7)]

    tracker = tpukit.track(batches, progress=False, guard=guard)
    for batch in tracker:
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


DYNAMIC_LENGTHS = (16, 16, 16, 24, 24, 32)


def dynamic_padding(guard=None):
    """Dynamic padding: each batch padded to its longest sequence (16, 16, 16, 24, 24, 32 tokens)."""
    import torch_xla

    device = torch_xla.device()
    rnd = random.Random(7)
    examples = []
    for longest in DYNAMIC_LENGTHS:  # 8 examples per batch, the longest one sets the length
        lengths = [longest] + [rnd.randint(4, longest) for _ in range(7)]
        examples += [(ids, rnd.randrange(2)) for ids in _sequences(lengths, 97, rnd.random())]
    train_dataloader = DataLoader(examples, batch_size=8, collate_fn=pad_collate)
    model = TextClassifier(vocab=97, dim=21, labels=2).to(device)
    optimizer = optim.AdamW(model.parameters(), lr=5e-5)

    tracker = tpukit.track(train_dataloader, progress=False, guard=guard)
    for batch in tracker:  # MARK: dynamic padding for
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def _bucketed_corpus(seed):
    """24 sequences per bucket of 16, 24 and 32 tokens (lengths 9-16, 17-24, 25-32), mixed."""
    rnd = random.Random(seed)
    lengths = [rnd.randint(lo, hi) for lo, hi in ((9, 16), (17, 24), (25, 32)) for _ in range(24)]
    rnd.shuffle(lengths)
    return _sequences(lengths, 89, seed), [rnd.randrange(2) for _ in lengths]


def bucket_batcher(guard=None):
    """tpukit.data.BucketBatcher over variable-length sequences, shuffled."""
    import torch_xla

    from tpukit.data import BucketBatcher

    device = torch_xla.device()
    sequences, labels = _bucketed_corpus(seed=8)
    batcher = BucketBatcher(sequences, labels, batch_size=8, buckets=[16, 24, 32], shuffle=True, seed=8)
    model = TextClassifier(vocab=89, dim=23, labels=2).to(device)
    optimizer = optim.AdamW(model.parameters(), lr=5e-5)

    tracker = tpukit.track(batcher, progress=False, guard=guard)
    for batch in tracker:
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def _padded_buckets(seed, pad_to):
    """Batches padded by the user's own code to 16, 24 or 32 tokens: a plain list."""
    from tpukit.data import bucket_for
    from tpukit.data import pad_to as pad

    sequences, labels = _bucketed_corpus(seed)
    by_length = {}
    for ids, label in zip(sequences, labels):
        by_length.setdefault(bucket_for(len(ids), pad_to), []).append((ids, label))
    batches = []
    for length, items in by_length.items():
        for s in range(0, len(items) - 7, 8):
            ids, mask = pad([i for i, _ in items[s:s + 8]], length)
            batches.append({"input_ids": ids, "attention_mask": mask,
                            "labels": torch.tensor([label for _, label in items[s:s + 8]])})
    random.Random(seed).shuffle(batches)
    return batches


def declared_shapes(guard=None):
    """The same bucketed shapes from a plain list, declared with track(shapes=[16, 24, 32])."""
    import torch_xla

    device = torch_xla.device()
    batches = _padded_buckets(seed=9, pad_to=[16, 24, 32])
    model = TextClassifier(vocab=89, dim=25, labels=2).to(device)
    optimizer = optim.AdamW(model.parameters(), lr=5e-5)

    tracker = tpukit.track(batches, progress=False, guard=guard, shapes=[16, 24, 32])
    for batch in tracker:
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def undeclared_shapes(guard=None):
    """The same plain list of bucketed batches without declaring the shapes."""
    import torch_xla

    device = torch_xla.device()
    batches = _padded_buckets(seed=9, pad_to=[16, 24, 32])
    model = TextClassifier(vocab=89, dim=27, labels=2).to(device)
    optimizer = optim.AdamW(model.parameters(), lr=5e-5)

    tracker = tpukit.track(batches, progress=False, guard=guard)
    for batch in tracker:
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def focal_gamma_schedule(guard=None):
    """A Python float baked into the graph: a focal loss whose gamma goes 2.5 -> 3.5 at step 4."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(6, 39), nn.ReLU(), nn.Linear(39, 3)).to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    train_loader = DataLoader(_dataset(56, 6, 3, seed=10), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for step, (x, y) in enumerate(tracker):
        gamma = 2.5 if step < 3 else 3.5
        logp = F.log_softmax(model(x), dim=1).gather(1, y[:, None]).squeeze(1)
        loss = (-(1 - logp.exp()).pow(gamma) * logp).mean()  # MARK: focal pow
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def item_mid_step(guard=None):
    """A mid-step .item() for a running loss, before backward (a common logging habit)."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(5, 41), nn.ReLU(), nn.Linear(41, 3)).to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    train_loader = DataLoader(_dataset(48, 5, 3, seed=11), batch_size=8)
    running_loss = 0.0

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for x, y in tracker:
        loss = F.cross_entropy(model(x), y)
        running_loss += loss.item()  # MARK: item
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def loss_scale_from_one(guard=None):
    """A Python loss weight that starts at exactly 1.0 and drops to 0.5 at step 4."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(4, 43), nn.ReLU(), nn.Linear(43, 3)).to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.05)
    train_loader = DataLoader(_dataset(56, 4, 3, seed=12), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for step, (x, y) in enumerate(tracker):
        loss_weight = 1.0 if step < 3 else 0.5
        loss = F.cross_entropy(model(x), y) * loss_weight
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def logit_scale_eval(guard=None):
    """Evaluation with a Python logit scale (a temperature) of exactly 1.0, then 0.5 from step 4."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(8, 49), nn.ReLU(), nn.Linear(49, 3)).to(device).eval()
    eval_loader = DataLoader(_dataset(56, 8, 3, seed=14), batch_size=8)

    tracker = tpukit.track(eval_loader, progress=False, guard=guard)
    with torch.no_grad():
        for step, (x, y) in enumerate(tracker):
            logit_scale = 1.0 if step < 3 else 0.5
            probs = F.softmax(model(x) * logit_scale, dim=1)
            confidence = probs.max(dim=1).values.mean()
            tpukit.log(confidence=confidence)
    return tracker


def last_partial_batch(guard=None):
    """An MLP on a DataLoader without drop_last: 68 examples in batches of 8 leave a last batch of 4."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(10, 53), nn.ReLU(), nn.Linear(53, 53), nn.ReLU(),
                          nn.Linear(53, 3)).to(device)
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    train_loader = DataLoader(_dataset(68, 10, 3, seed=15), batch_size=8)

    tracker = tpukit.track(train_loader, progress=False, guard=guard)
    for x, y in tracker:  # MARK: partial batch for
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def never_settles(guard=None):
    """A new batch shape every step: the number of rows grows (no drop_last, varying sizes)."""
    import torch_xla

    device = torch_xla.device()
    model = nn.Sequential(nn.Linear(3, 45), nn.ReLU(), nn.Linear(45, 2)).to(device)
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(13)
    batches = [(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in range(4, 10)]

    tracker = tpukit.track(batches, progress=False, guard=guard)
    for x, y in tracker:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def marker_line(marker):
    """The line number of ``# MARK: <marker>`` in this file."""
    with open(__file__) as f:
        for n, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# MARK: {marker}"):
                return n
    raise LookupError(marker)
