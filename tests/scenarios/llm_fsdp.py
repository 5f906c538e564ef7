"""A decoder (transformers' Llama, tiny) trained by hand with ``tpukit.fsdp`` (FSDPv2: per-layer wrappers,
gradient checkpointing) and ``tpukit.track(loader, mesh=mesh)``, in a fresh interpreter per device count
(tests/test_llm_fsdp.py; issue 46).

Run as ``llm_fsdp.py DEVICES [PART ...]`` (PJRT_DEVICE=CPU). Parts: ``ckpt`` (checkpoint=True, the dashboard
live: losses, every parameter's sharding, the wrappers, the keys), ``plain`` (the same model without
checkpointing: its losses and first gradients), ``lora`` (peft LoRA on the same path), ``errors`` (the calls
refused, no compile). Prints one JSON object (the last line of stdout); the assertions live in the test.
"""

import json
import sys
import time
import traceback
import warnings

T0 = time.time()
DEVICES = int(sys.argv[1])
PARTS = sys.argv[2:]

import tpukit  # noqa: E402

rt = tpukit.setup(cpu_devices=DEVICES, spmd=True)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tpukit import _xla  # noqa: E402

STEPS, BATCH, SEQ, LR, LORA_LR = 4, 16, 32, 1.0, 10.0
out: dict = {"devices": rt.device_count, "spmd": rt.spmd, "seconds": {}}
GRADS: dict = {}  # each part's first-step gradients, by its name
MESH = tpukit.mesh()


def section(name):
    def wrap(fn):
        if name in PARTS:
            t = time.time()
            try:
                out[name] = fn()
            except Exception as exc:  # recorded so one broken part does not hide the others
                out[name] = {"crashed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            out["seconds"][name] = round(time.time() - t, 1)
        return fn
    return wrap


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


class Counting(torch.utils.data.Dataset):
    """Runs of consecutive tokens from random starts: the next token is learnable, so the loss falls."""

    def __len__(self):
        return STEPS * BATCH

    def __getitem__(self, i):
        start = int(torch.randint(0, 256, (1,), generator=torch.Generator().manual_seed(i)))
        ids = (torch.arange(SEQ) + start) % 256
        return {"input_ids": ids, "labels": ids}


def loader():
    return torch.utils.data.DataLoader(Counting(), batch_size=BATCH, shuffle=False, drop_last=True)


def attention_calls(model) -> list:
    """A counter of the attention modules' forward calls: a checkpointed layer runs its forward twice a step."""
    calls = [0]
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def train(wrapped, params, lr=LR, dashboard=False):
    """The cell a user writes: the optimizer after wrapping, batches sharded by track, the loss logged."""
    opt = torch.optim.SGD(params, lr=lr)
    losses, grads, batch_specs = [], None, None
    loop = tpukit.track(loader(), mesh=MESH, progress=False, dashboard=dashboard)
    for step, batch in enumerate(loop):
        if step == 1:  # the first step's gradients, synced with it: a read, not another graph
            grads = {k: v.grad.cpu() for k, v in named_trainable(wrapped)}
        if step == 0:
            batch_specs = {k: tpukit.sharding_spec(v) for k, v in batch.items()}
        opt.zero_grad()
        output = wrapped(**batch)
        output.loss.backward()
        opt.step()
        tpukit.log(loss=output.loss)
    losses = [r.scalars["loss"] for r in loop.history]
    held = sum(len(g["params"]) for g in opt.param_groups)
    return dict(losses=losses, grads=grads, batch_specs=batch_specs, logits_spec=tpukit.sharding_spec(output.logits),
                optimized=held, records=len(loop.history), compiles=loop.summary(wait=0)["compiles"])


def named_trainable(wrapped):
    return [(n.replace(_xla.spmd.INNER_PREFIX, ""), p) for n, p in wrapped.named_parameters() if p.requires_grad]


def layout(model) -> dict:
    """Every state_dict entry's sharding and the wrappers' names (what the tests check)."""
    state = model.state_dict()
    return dict(keys=list(state), specs={k: tpukit.sharding_spec(v) for k, v in state.items()},
                wrappers=[n for n, _ in _xla.fsdp_wrappers(model)],
                checkpointed=[n for n, m in model.named_modules() if _xla.is_checkpointed(m)])


def cpu_state(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@section("ckpt")
def _():
    model = llama()
    keys = list(model.state_dict())
    fresh = cpu_state(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = tpukit.fsdp(model, MESH, checkpoint=True)
        calls = attention_calls(model)
        res = train(wrapped, wrapped.parameters(), dashboard=True)
    GRADS["ckpt"] = res.pop("grads")
    res["grad_norms"] = {k: float(g.norm()) for k, g in GRADS["ckpt"].items()}
    res.update(layout(model), plain_keys=keys, use_cache=model.config.use_cache,
               attention_calls=calls[0], warnings=sorted({str(w.message)[:160] for w in caught}))
    # The keys load back: a fresh CPU state into the wrapped model restores it (then the trained one again).
    trained = cpu_state(model)
    model.load_state_dict(fresh)
    res["reloaded_fresh"] = diff(cpu_state(model), fresh)
    model.load_state_dict(trained)
    res["reloaded_trained"] = diff(cpu_state(model), trained)
    res["wrapper_keys"] = list(wrapped.state_dict())[:2]
    return res


@section("plain")
def _():
    model = llama()
    wrapped = tpukit.fsdp(model, MESH)
    calls = attention_calls(model)
    res = train(wrapped, wrapped.parameters())
    grads = res.pop("grads")
    if "ckpt" in GRADS:  # the checkpointed model's first gradients against these
        res["grad_diff_vs_ckpt"] = diff(grads, GRADS["ckpt"])
        res["grad_max"] = max(float(g.abs().max()) for g in grads.values())
    res.update(layout(model), attention_calls=calls[0], use_cache=model.config.use_cache)
    return res


@section("lora")
def _():
    import peft

    model = peft.get_peft_model(llama(), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                         task_type="CAUSAL_LM"))
    keys = list(model.state_dict())
    before = cpu_state(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    wrapped = tpukit.fsdp(model, MESH, checkpoint=True)
    calls = attention_calls(model)
    res = train(wrapped, [p for p in wrapped.parameters() if p.requires_grad], lr=LORA_LR)
    after = cpu_state(model)
    adapters = [k for k in after if "lora_" in k]
    res.update(layout(model), plain_keys=keys, trainable=trainable, attention_calls=calls[0], adapters=adapters,
               base_unchanged=[k for k in after if k not in adapters and torch.equal(after[k], before[k])],
               adapters_changed=[k for k in adapters if not torch.equal(after[k], before[k])],
               params=sum(1 for _ in model.parameters()))
    res["grads"] = sorted(res["grads"])  # the names of the parameters that got one
    return res


@section("errors")
def _():
    res = {}
    for name, call in {
        "unknown_layer": lambda: tpukit.fsdp(llama(), MESH, layers="Nope"),
        "not_a_layer": lambda: tpukit.fsdp(llama(), MESH, layers=3),
        "checkpoint_without_layers": lambda: tpukit.fsdp(torch.nn.Linear(8, 8), MESH, checkpoint=True),
        "twice": lambda: tpukit.fsdp(tpukit.fsdp(llama(), MESH).module, MESH),
    }.items():
        try:
            call()
            res[name] = None
        except Exception as exc:
            res[name] = {"type": type(exc).__name__, "message": str(exc)}
    one = tpukit.fsdp(llama(), MESH, layers=False)
    res["layers_false_wrappers"] = [n for n, _ in _xla.fsdp_wrappers(one)]
    by_class = llama()
    tpukit.fsdp(by_class, MESH, layers=[type(by_class.model.layers[0])])
    res["by_class_wrappers"] = [n for n, _ in _xla.fsdp_wrappers(by_class)]
    return res


out["seconds"]["total"] = round(time.time() - T0, 1)
sys.stdout.flush()
print(json.dumps(out))
