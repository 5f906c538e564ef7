"""A decoder (transformers' Llama, tiny) fine-tuned by the ``Trainer`` with torch_xla's FSDPv2 as the Hugging
Face docs give it, on 8 virtual XLA:CPU devices under SPMD, in a fresh interpreter (test_hf_fsdp.py; issue 46).

Each argument is a run, in turn, of a fresh model and Trainer: ``plain``, the Trainer alone (transformers 5.15
and 5.24 fail before the first step); ``callback``, with ``tpukit.hf.Callback()``. Prints ``RESULT <json>``, per
run: the error, or the losses, the callback's warnings, how many parameters the optimizer holds of how many the
model has, and how many are sharded over the mesh.
"""

import json
import sys
import tempfile

import tpukit

tpukit.setup(cpu_devices=8, spmd=True)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from tpukit import _xla  # noqa: E402

torch.manual_seed(0)


def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def arguments() -> TrainingArguments:
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=4, logging_steps=2, report_to=[],
        save_strategy="no", dataloader_drop_last=True, optim="adamw_torch", learning_rate=1e-3,
        fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


out: dict = {}
for mode in sys.argv[1:]:
    callback = tpukit.hf.Callback(dashboard=False) if mode == "callback" else None
    trainer = Trainer(model=llama(), args=arguments(), train_dataset=Tokens(), callbacks=[callback] if callback else None)
    try:
        trainer.train()
    except Exception as exc:  # what the Trainer alone does
        out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    params = list(trainer.model.parameters())
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    out[mode] = dict(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                     warnings=callback.warnings if callback else [], params=len(params),
                     optimized=sum(id(p) in held for p in params),
                     sharded=sum(_xla.is_sharded(p) for p in params),
                     records=len(callback.tracker.history) if callback else None)
print("RESULT " + json.dumps(out))
