"""A decoder's checkpoints (tests/test_llm_checkpoint.py; issue 46): transformers' Llama, tiny, under tpukit.fsdp.

  python llm_ckpt.py train DIR    SPMD over 8 virtual devices: 4 AdamW steps, checkpoint 2 saved by the manager
                                  (its host memory measured, and a 128 MiB sharded state's), the step-4 model
                                  exported and its greedy tokens taken on the device; a tied Llama saved and
                                  exported; a peft LoRA model trained one step, its adapters
                                  exported, and merged into the base and exported
  python llm_ckpt.py resume DIR   SPMD over 8 devices, a fresh model: restore checkpoint 2, run steps 3 and 4;
                                  restore it into the model wrapped once (layers=False) and checkpointed per layer
  python llm_ckpt.py single DIR   one XLA device, no SPMD: restore both checkpoints into bare models, step 3
  python llm_ckpt.py plain DIR    torch_xla blocked: the exports with plain transformers and peft on the CPU

tpukit.fsdp wraps each decoder layer (its default, layers=None). Each prints ``RESULT <json>`` last; the assertions live in the test. This is a test program.
"""

import hashlib
import json
import os
import sys
import time

T0 = time.time()
MODE, DIR = sys.argv[1], sys.argv[2]
PROMPT = [[17, 200, 3, 99, 140]]  # the greedy prompt: 5 tokens, 8 new ones
NEW = 8
PROBE = [[5, 77, 13, 250, 1, 64, 31, 8, 190, 42, 7, 111, 2]]  # the logits probe of the adapters
out: dict = {"mode": MODE}

if MODE == "plain":
    import ckpt_plain_load  # noqa: F401  (blocks every torch_xla import from here on)
else:
    import tpukit

    rt = tpukit.setup(device="cpu", cpu_devices=8 if MODE in ("train", "resume") else None,
                      spmd=MODE in ("train", "resume"), trace_compiles=False)
    from tpukit import _xla, spmd

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama(tied: bool = False) -> LlamaForCausalLM:
    """The tiny Llama every mode builds: seeded, so a base built anywhere has the same weights."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def tokens(step: int) -> torch.Tensor:
    """Step ``step``'s batch: 8 sequences of 32 tokens, the same in every run."""
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(step))


def digest(state: dict) -> dict:
    """sha256 of each tensor's bytes, by key."""
    return {k: hashlib.sha256(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for k, v in state.items()}


def train_step(model, opt, step: int, mesh=None) -> float:
    ids = tokens(step)
    ids = spmd.shard_batch(ids, mesh) if mesh is not None else ids.to(_xla.device())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    _xla.sync()
    return loss.item()


def greedy_on_device(model) -> list:
    """Greedy tokens of the model on the XLA device, each step one forward of a fixed-length buffer (one graph:
    the model is causal, so what follows the position read does not change its logits)."""
    buf = torch.zeros(1, len(PROMPT[0]) + NEW, dtype=torch.long)
    buf[0, :len(PROMPT[0])] = torch.tensor(PROMPT[0])
    with torch.no_grad():
        for i in range(len(PROMPT[0]), buf.shape[1]):
            best = model(input_ids=buf.to(_xla.device()), use_cache=False).logits.argmax(-1).cpu()
            buf[0, i] = best[0, i - 1]
    return buf[0].tolist()


def logits_on_device(model) -> list:
    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE).to(_xla.device()), use_cache=False).logits.cpu().tolist()


def memory_of(call) -> int:
    """Peak extra resident bytes while ``call()`` runs (VmHWM after a reset; ckpt_hardening's measure)."""
    from ckpt_hardening import _reset_peak, _status

    before = _reset_peak()
    call()
    return _status("VmHWM") - before


def train() -> None:
    from tpukit.checkpoint import CheckpointManager, export_adapters, export_pretrained
    from tpukit.checkpoint.stream import payload_bytes

    mesh = spmd.mesh()
    model = llama()
    wrapper = tpukit.fsdp(model, mesh)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    out["keys"] = list(wrapper.state_dict())[:2]
    out["specs"] = {k: spmd.sharding_spec(v) for k, v in list(model.state_dict().items())[:3]}
    # warm-up: DCP's imports and first-call set-up are not the save's memory
    warm = torch.ones(8, 8, device=_xla.device())
    _xla.mark_sharding(warm, mesh, ("data", None))
    tpukit.save({"w": warm}, os.path.join(DIR, "warm.dcp"))
    mgr = CheckpointManager(os.path.join(DIR, "run"))
    losses = []
    for step in range(1, 5):
        losses.append(train_step(wrapper, opt, step, mesh))
        if step == 2:
            state = dict(model=wrapper.state_dict(), optimizer=opt.state_dict())
            out["state_bytes"] = payload_bytes(state)[0]
            out["save_extra_rss"] = memory_of(lambda: mgr.save(2, **state))
    out["losses"] = losses
    out["files"] = sorted(os.listdir(os.path.join(DIR, "run")))
    # the bound at a size where it means something: 8 sharded tensors of 16 MiB, computed on the device
    big = {f"w{i}": torch.arange(1 << 22, dtype=torch.float32, device=_xla.device()).reshape(1024, 4096) * (i + 1)
           for i in range(8)}
    for t in big.values():
        _xla.mark_sharding(t, mesh, ("data", None))
    _xla.sync()
    _xla.wait_device_ops()
    for t in big.values():
        t[0, :1].cpu()  # landed
    out["big_bytes"] = payload_bytes(big)[0]
    out["big_extra_rss"] = memory_of(lambda: tpukit.save(big, os.path.join(DIR, "big.dcp")))
    del big

    t = time.time()
    export_pretrained(wrapper, os.path.join(DIR, "export"))  # the wrapper: its keys are not the model's
    out["export_s"] = time.time() - t
    out["export_files"] = sorted(os.listdir(os.path.join(DIR, "export")))
    out["weights"] = digest(model.state_dict())
    t = time.time()
    out["greedy"] = greedy_on_device(model)
    out["greedy_s"] = time.time() - t

    # tied embeddings: tpukit.fsdp moves the model, which unties them; tie_weights() ties the sharded ones again
    tied = llama(tied=True)
    tied_wrapper = tpukit.fsdp(tied, mesh)
    out["tied_after_fsdp"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.tie_weights()
    out["tied_params"] = len(list(tied_wrapper.parameters()))  # one embedding matrix for both ends
    CheckpointManager(os.path.join(DIR, "tied")).save(1, model=tied_wrapper.state_dict())  # (untrained: cheaper)
    export_pretrained(tied_wrapper, os.path.join(DIR, "tied-export"))
    out["tied_weights"] = digest(tied.state_dict())
    out["tied_greedy"] = greedy_on_device(tied)

    # peft LoRA, sharded like the rest
    import peft

    lora = peft.get_peft_model(llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                         task_type="CAUSAL_LM"))
    lora_wrapper = tpukit.fsdp(lora, mesh)
    lora_opt = torch.optim.AdamW([p for p in lora_wrapper.parameters() if p.requires_grad], lr=1e-2)
    out["lora_losses"] = [train_step(lora_wrapper, lora_opt, 1, mesh)]  # one AdamW step: lora_B is not zero
    out["lora_sharded"] = sum(_xla.is_sharded(p) for p in lora.parameters() if p.requires_grad)
    before = digest(lora.state_dict())
    export_adapters(lora_wrapper, os.path.join(DIR, "adapters"))
    export_pretrained(lora_wrapper, os.path.join(DIR, "merged"), merge=True)
    out["lora_unchanged"] = digest(lora.state_dict()) == before and hasattr(
        lora.get_base_model().model.layers[0].self_attn.q_proj, "lora_A")
    out["lora_logits"] = logits_on_device(lora)
    out["lora_greedy"] = greedy_on_device(lora)


def resume() -> None:
    from tpukit.checkpoint import CheckpointManager

    mesh = spmd.mesh()
    model = llama()
    wrapper = tpukit.fsdp(model, mesh)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-3)
    torch.manual_seed(1234)  # a resumed run seeds differently: restore puts the generators back
    start = CheckpointManager(os.path.join(DIR, "run")).restore(wrapper, opt)
    out["start"] = start
    out["specs"] = {k: spmd.sharding_spec(v) for k, v in list(model.state_dict().items())[:3]}
    out["opt_sharded"] = sum(_xla.is_sharded(s["exp_avg"]) for s in opt.state.values())
    out["losses"] = [train_step(wrapper, opt, step, mesh) for step in range(start + 1, 5)]
    # the same checkpoint (saved wrapped per layer, tpukit.fsdp's default) into other wrappings of the model
    from tpukit.checkpoint import load

    saved = digest(load(os.path.join(DIR, "run"))["model"])
    out["other_wrappings"] = {}
    for name, kwargs in (("one wrapper", {"layers": False}), ("checkpointed layers", {"checkpoint": True})):
        other = llama()
        other_wrapper = tpukit.fsdp(other, mesh, **kwargs)
        CheckpointManager(os.path.join(DIR, "run")).restore(other_wrapper)
        out["other_wrappings"][name] = digest(other.state_dict()) == saved


def single() -> None:
    from tpukit.checkpoint import CheckpointManager, load

    out["devices"] = rt.device_count
    model = llama().to(_xla.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = CheckpointManager(os.path.join(DIR, "run")).restore(model, opt)
    saved = load(os.path.join(DIR, "run"))  # the same checkpoint whole on the CPU
    out["start"] = start
    out["saved_keys"] = sorted(saved["model"])[:2]
    out["weights_equal"] = digest(model.state_dict()) == digest(saved["model"])
    out["moments_equal"] = all(torch.equal(opt.state_dict()["state"][i]["exp_avg"].cpu(), s["exp_avg"])
                               for i, s in saved["optimizer"]["state"].items())
    out["loss3"] = train_step(model, opt, 3)

    tied = llama(tied=True).to(_xla.device())
    tied.tie_weights()
    out["tied_start"] = CheckpointManager(os.path.join(DIR, "tied")).restore(tied)
    out["tied_still_tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    out["tied_weights"] = digest(tied.state_dict())


def plain() -> None:
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    def generate(folder: str) -> list:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(DIR, folder)).eval()
        with torch.no_grad():
            return model.generate(torch.tensor(PROMPT), max_new_tokens=NEW, do_sample=False)[0].tolist()

    model = AutoModelForCausalLM.from_pretrained(os.path.join(DIR, "export"))
    out["class"] = type(model).__name__
    out["weights"] = digest(model.state_dict())
    out["greedy"] = generate("export")
    tied = AutoModelForCausalLM.from_pretrained(os.path.join(DIR, "tied-export"))
    out["tied_tied"] = tied.lm_head.weight is tied.model.embed_tokens.weight
    out["tied_weights"] = digest(tied.state_dict())
    out["tied_greedy"] = generate("tied-export")
    out["generation_config"] = os.path.exists(os.path.join(DIR, "export", "generation_config.json"))

    with safe_open(os.path.join(DIR, "adapters", "adapter_model.safetensors"), "pt") as f:
        out["adapter_keys"] = sorted(f.keys())
    adapted = PeftModel.from_pretrained(llama(), os.path.join(DIR, "adapters")).eval()
    with torch.no_grad():
        out["lora_logits"] = adapted(input_ids=torch.tensor(PROBE)).logits.tolist()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(DIR, "merged"))
    out["merged_class"] = type(merged).__name__
    out["merged_keys"] = [k for k in merged.state_dict() if "lora" in k or "base_layer" in k]
    out["lora_greedy"] = generate("merged")
    out["torch_xla_loaded"] = "torch_xla" in sys.modules


{"train": train, "resume": resume, "single": single, "plain": plain}[MODE]()
out["seconds"] = time.time() - T0
print("RESULT " + json.dumps(out))
