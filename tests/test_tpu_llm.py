"""Decoder LLM fine-tuning steps as people write them, estimated by the real TPU compiler ahead of time:
transformers' Llama (tiny configs of the published architecture, random weights), LoRA through peft, each
decoder layer checkpointed. The breakdown's kinds are held against what the model's sizes say.
"""

from __future__ import annotations

import pytest

tpu = pytest.importorskip("tpukit.tpu")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla  # noqa: E402
from tpukit.tpu import advice, memory  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk answer cache for this module's tests (not the user's ~/.cache)."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path_factory.getbasetemp() / "tpu-cache"))


def llama(layers: int, hidden: int, vocab: int = 8192, heads: int = 8, kv_heads: int = 4) -> LlamaForCausalLM:
    """A Llama of the published architecture (grouped-query attention, SwiGLU, RoPE), small, fp32."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def causal_lm_step(model, opt):
    def step(ids):
        opt.zero_grad()  # first: the step keeps its gradients (outputs of its graph), as the MLP test does
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.compiler
def test_a_lora_steps_breakdown_is_frozen_weights_adapters_their_gradients_and_adam_moments(rt):
    base = llama(layers=4, hidden=512)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"])).to(_xla.device())
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert trained and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trained, lr=1e-4)
    ids = torch.randint(0, 8192, (2, 64)).to(_xla.device())
    est = tpukit.estimate(causal_lm_step(model, opt), ids, target="v5e-1", memory=True)
    assert est.fits and est.memory.source == memory.DUMP, est
    kinds = est.memory.by_kind()
    n_trained, n_frozen = sum(p.numel() for p in trained), sum(p.numel() for p in frozen)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's inverse frequencies
    # fp32: the base's weights frozen (4 bytes each), the adapters, their gradients and AdamW's two moments.
    expected = {memory.FROZEN: 4 * n_frozen, memory.PARAMETERS: 4 * n_trained + buffers,
                memory.GRADIENTS: 4 * n_trained, memory.OPTIMIZER: 8 * n_trained}
    for kind, size in expected.items():
        assert kinds.get(kind, 0) == pytest.approx(size, rel=0.05), (kind, kinds, expected)
    assert "By kind: frozen weights" in str(est.memory), str(est.memory)  # the base holds most of the peak
    adapters = {b.name for b in est.memory.buffers if b.kind == memory.PARAMETERS}
    assert adapters and all("lora_" in n or "rotary" in n for n in adapters), adapters
    # At a few percent of the chip: no advice (issue: LoRA at 1 % needs no FSDP over 8 chips).
    assert est.hbm_bytes < 0.05 * est.hbm_limit_bytes and est.advice == (), est.advice


@pytest.mark.compiler
def test_checkpointing_each_decoder_layer_lowers_a_long_sequences_peak_in_a_checked_compile(rt):
    model = llama(layers=3, hidden=128, vocab=4096, heads=4, kv_heads=2).to(_xla.device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (8, 512)).to(_xla.device())
    est = tpukit.estimate(causal_lm_step(model, opt), ids, target="v5e-1", memory=True, suggest="always")
    assert est.fits, est
    tips = {t.change: t for t in est.advice}
    # What the decoder keeps for backward at 8 x 512 tokens dominates: each of model.layers' three
    # LlamaDecoderLayers checkpointed, compiled, and the compiler's peak is lower.
    assert advice.CHECKPOINT in tips, est.advice
    tip = tips[advice.CHECKPOINT]
    assert "the 3 layers of model.layers" in tip.how, tip.how
    assert tip.checked and tip.fits and tip.hbm_bytes < 0.8 * est.hbm_bytes, (tip, est.hbm_bytes)
    # The model is its own again: no layer keeps the checkpointed forward.
    assert not any("forward" in vars(layer) for layer in model.model.layers)


def test_transformers_gradient_checkpointing_on_xla_is_explained_and_the_xla_safe_form_trains(rt):
    # transformers' documented per-layer checkpointing uses torch.utils.checkpoint, which fails on XLA tensors
    # in torch 2.8 ("module 'torch' has no attribute 'xla'"): the estimate says what, why and the fix, and a
    # tracked loop that stops on it says so above the traceback.
    import warnings

    from tpukit import rewrites

    model = llama(layers=2, hidden=64, vocab=512, heads=2, kv_heads=1).to(_xla.device())
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = causal_lm_step(model, opt)
    ids = torch.randint(0, 512, (2, 32)).to(_xla.device())
    with pytest.raises(tpukit.TpukitError, match=r"torch.utils.checkpoint failed on XLA tensors .*"
                                                 r"model.gradient_checkpointing_disable\(\)"):
        tpukit.estimate(step, ids, target="v5e-1", progress=False)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(AttributeError, match="no attribute 'xla'"):
        warnings.simplefilter("always")
        for batch in tpukit.track([ids, ids], progress=False):
            step(batch)
    said = [str(w.message) for w in seen if issubclass(w.category, tpukit.TpukitWarning)]
    assert any("stopped by AttributeError at step 1" in s and "tpukit.rewrites.checkpointed" in s for s in said), said
    # The fix: transformers' checkpointing off, torch_xla's around each decoder layer. It trains (every
    # parameter gets a gradient, the loss falls over a few steps on one batch) and the model is its own after.
    model.gradient_checkpointing_disable()
    losses = []
    with rewrites.checkpointed(list(model.model.layers)):
        for batch in tpukit.track([ids] * 4, progress=False):
            losses.append(float(step(batch).detach().cpu()))
            assert all(p.grad is not None for p in model.parameters())  # the step keeps them (zero_grad first)
    assert losses[-1] < losses[0], losses
    assert not any("forward" in vars(layer) for layer in model.model.layers)
