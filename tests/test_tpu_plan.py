"""``tpukit.plan``: a decoder LM's planning table by the real TPU compiler (libtpu, compile-only), no mocks.

The model is transformers' Llama at a tiny width with many heads, so that its attention's scores reach the
chip's HBM at a few rows of a few thousand tokens: the table's edges (a size that fits, the next refused)
are real refusals at sizes a test can compile. Its weights are placeholders (the host holds none).
"""

from __future__ import annotations

import pytest

tpu = pytest.importorskip("tpukit.tpu")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla  # noqa: E402
from tpukit.tpu import ask, modes, trace  # noqa: E402
from tpukit.tpu.plan import DECIDED, PLANNED, PREDICTED, held_bytes, holds  # noqa: E402


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk answer cache for this module's tests (not the user's ~/.cache)."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path_factory.getbasetemp() / "tpu-cache"))


def config(**kw) -> LlamaConfig:
    """Two layers of 128 wide, 16 heads of 8: the attention's fp32 scores dominate at thousands of tokens."""
    base = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=32768)
    return LlamaConfig(**{**base, **kw})


def test_a_mode_is_a_base_and_options_and_a_wrong_one_says_what_is_known():
    m = modes.Mode.parse("LoRA+ckpt")
    assert (m.name, m.base, m.ckpt, m.bf16, m.fsdp) == ("lora+ckpt", "lora", True, False, False)
    with pytest.raises(ValueError, match="starts with one of full, lora"):
        modes.Mode.parse("qlora")
    with pytest.raises(ValueError, match=r"unknown option\(s\) qkv.*ckpt, bf16, autocast, chunk, eager, flash"):
        modes.Mode.parse("full+qkv")
    f = modes.Mode.parse("lora+ckpt+flash")
    assert (f.flash, f.eager, f.attention) == (True, False, modes.FLASH)
    assert modes.Mode.parse("full+autocast+eager").attention == "eager"
    with pytest.raises(ValueError, match="one attention at a time"):
        modes.Mode.parse("full+eager+flash")
    with pytest.raises(ValueError, match="partition_spec"):
        modes.Mode.parse("lora+flash+fsdp")


def test_placeholder_weights_give_the_same_program_as_real_ones(rt):
    # The step on a model whose weights hold no buffer is the very graph of the model on real weights
    # (the same HLO bytes): what the compiler answers for it is the real model's answer.
    cfg = config()
    torch.manual_seed(0)
    real = LlamaForCausalLM(cfg).to(_xla.device())
    with torch.device("meta"):
        empty = LlamaForCausalLM(cfg)
    _xla.placeholders(empty)
    assert empty.lm_head.weight is not empty.model.embed_tokens.weight  # untied in this config: two parameters
    ids = torch.randint(0, 2048, (2, 64))

    def step_of(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            opt.zero_grad()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return loss
        return step

    assert trace.trace(step_of(real), (ids,), {}).hlo == trace.trace(step_of(empty), (ids,), {}).hlo
    tied = LlamaConfig(**{**config().to_dict(), "tie_word_embeddings": True})
    with torch.device("meta"):
        m = LlamaForCausalLM(tied)
    _xla.placeholders(m)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # a tie stays one parameter


@pytest.mark.compiler
def test_the_buffer_assignment_answers_as_the_full_compile_does_in_a_fraction_of_its_time(rt):
    # ask(early=True) stops the compile once its buffer assignment is written: the same verdict as the full
    # compile, and the HBM it allocates within 2% of the compiler's sum of buffers (the code comes after it).
    made = modes.build(config(), modes.Mode.parse("full"))
    tgt, comp = ask.resolve("v5e-1", None)
    for b, n in ((1, 2048), (4, 8192)):
        traced = trace.trace(made.step, (torch.randint(0, made.vocab, (b, n)),), {})
        early = ask.ask(traced, tgt, comp, "llama", early=True)
        full = ask.ask(traced, tgt, comp, "llama")
        assert early.hbm_source == tpu.outcome.PLANNED, early
        assert holds(early) == holds(full), (early, full)
        if full.fits:  # the allocations are the program's buffers but its code
            held = held_bytes(full)
            assert early.hbm_bytes == pytest.approx(held, rel=0.02), (early.hbm_bytes, held)
            assert early.compile_s < full.compile_s, (early.compile_s, full.compile_s)
        if not holds(full):
            assert early.hbm_bytes > early.hbm_limit_bytes, early


@pytest.mark.compiler
def test_a_plan_finds_each_edge_by_a_refusal_decides_one_per_mode_and_measures_its_prediction(rt):
    # Two modes at one length: every cell's largest batch is bounded by a size the compiler refused, the
    # longest sequence at batch 1 too; one cell per mode is decided by full compiles; every compile after the
    # first few carries the HBM the model predicted for it.
    p = tpukit.plan(config(), "v5e-1", lengths=(2048,), modes=("full", "lora+ckpt"), progress=False)
    assert p.compiler.startswith("libtpu") and p.target == "v5e-1"
    for c in p.cells + p.longest:
        assert c.how in (DECIDED, PLANNED), c
        assert c.refused is not None and c.refused > (c.length if c in p.longest else c.batch), c
        size = (lambda q: q.length) if c in p.longest else (lambda q: q.batch)
        at = [q for q in p.points if q.mode == c.mode and (q.batch == 1 if c in p.longest else q.length == c.length)]
        assert any(size(q) == c.refused and not q.fits for q in at), (c, at)  # the refusal is a compile
        assert any(size(q) == (c.length if c in p.longest else c.batch) and q.fits for q in at), (c, at)
    assert {c.mode for c in p.cells if c.how == DECIDED} == {"full", "lora+ckpt"}
    # LoRA with each layer checkpointed fits more rows than the full fine-tune, a sequence as long at batch 1.
    assert p.cell("lora+ckpt", 2048).batch > p.cell("full", 2048).batch, p
    assert p.longest_of("lora+ckpt").length >= p.longest_of("full").length, p
    errs = p.errors()
    # Each mode's first two compiles have no model yet; a refusal's need is not a figure to hold it against.
    unheld = sum(q.hbm_bytes is None for q in p.points)
    assert len(errs) == len(p.points) - 2 * len(p.modes) - unheld, (errs, p.points)
    assert "compiles, each predicted before it ran" in p.error_text(), p.error_text()
    assert "first predictions: " in p.error_text() and p.cell_hits()[1] == len(p.cells) + len(p.longest)
    text = str(p)
    assert "largest batch (rows) per sequence length" in text and "longest at batch 1" in text, text
    assert " c " in f" {text} " and "c: the compiler decided it" in text, text
    assert "<table>" in p._repr_html_() and "font-weight:bold" in p._repr_html_()
    times = p.times()
    assert times["buffer assignment"] > 0 and times["full compiles"] > 0 and times["trace"] > 0, times
    ax = p.chart()
    assert len(ax.get_lines()) >= 2 and ax.get_xlabel() == "sequence length (tokens)"
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.compiler
def test_a_time_budget_ends_a_plan_with_its_best_answer_and_says_so(rt):
    # A budget of a few compiles: the plan ends, its cells are predicted from the compiles it made, and it
    # says what stopped it.
    p = tpukit.plan(config(num_attention_heads=8, num_key_value_heads=2), "v5e-1", lengths=(1024, 4096),
                    modes=("full",), budget=15, progress=False, verify=False)
    assert p.stopped.startswith("stopped by the time budget (15 s)"), p.stopped
    assert "the best answer so far" in str(p), str(p)
    assert p.points and all(c.how in (PREDICTED, PLANNED) for c in p.cells), p.cells
    if len({(q.batch, q.length) for q in p.points}) >= 2:  # enough for a model: the rest is predicted from it
        assert any(c.how == PREDICTED and c.batch > 0 for c in p.cells + p.longest), p


def test_checkpointed_layers_recompute_without_the_key_value_cache(rt):
    # A decoder in training mode still makes a key/value cache unless use_cache=False (the Trainer's and the
    # guide's loops pass only input_ids and labels): the checkpoint's recompute would append each layer's keys
    # a second time, and eager attention then adds the mask to scores twice as long (it raised in the
    # backward). Checkpointed, the step runs on XLA:CPU and gives the loss and gradients of the plain step.
    from tpukit import rewrites

    cfg = config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=320, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(_xla.device())
    ids = torch.randint(0, 320, (2, 16)).to(_xla.device())

    def grads(checkpoint: bool):
        model.zero_grad()
        if checkpoint:
            with rewrites.checkpointed(list(model.model.layers)):
                loss = model(input_ids=ids, labels=ids).loss
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _xla.sync()
        return loss.item(), [p.grad.cpu().clone() for p in model.parameters()]

    plain, ckpt = grads(False), grads(True)
    assert ckpt[0] == pytest.approx(plain[0], rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(plain[1], ckpt[1]))


@pytest.mark.compiler
def test_attention_loss_and_precision_modes_are_real_steps_and_a_trap_is_said_not_raised(rt):
    # Each option is a step the TPU compiler answers: a chunked loss below the full logits, eager attention
    # under autocast below fp32, torch_xla's Pallas flash attention lowered for the TPU (a tpu_custom_call in
    # the program, written at the Mosaic version this libtpu reads). sdpa under autocast is the stack's trap
    # (it raises as the user's loop would): that mode is marked and explained, the others go on.
    cfg = config(vocab_size=32000, num_attention_heads=4, num_key_value_heads=2)
    tgt, comp = ask.resolve("v5e-1", None)
    ids = torch.randint(0, 32000, (1, 1024))
    hbm = {}
    for name in ("full", "full+chunk", "full+autocast+eager"):
        made = modes.build(cfg, modes.Mode.parse(name))
        hbm[name] = ask.ask(trace.trace(made.step, (ids,), {}), tgt, comp, name, early=True).hbm_bytes
    assert hbm["full+chunk"] < hbm["full"] and hbm["full+autocast+eager"] < hbm["full"], hbm
    flash = modes.build(cfg, modes.Mode.parse("full+flash"))
    with flash.tracing():
        assert b"tpu_custom_call" in trace.trace(flash.step, (ids,), {}).hlo
    with open("/proc/self/maps") as maps:  # jax lowered the kernel on its CPU backend: no libtpu beside torch_xla
        assert "libtpu" not in maps.read()
    p = tpukit.plan(cfg, "v5e-1", lengths=(1024,), modes=("full+flash", "full+autocast"), progress=False,
                    verify=False)
    assert set(p.failed) == {"full+autocast"}, p.failed
    assert "eager attention under autocast" in p.failed["full+autocast"], p.failed
    assert p.cell("full+autocast", 1024).how == "failed" and "- x" in str(p) and "full+autocast failed:" in str(p)
    c = p.cell("full+flash", 1024)
    assert c.how in (PLANNED, DECIDED) and c.batch and c.refused, p
    # The first +flash compile runs in full (the kernel compiles after the buffer assignment): it decides
    # whether the kernels are read as written. Kaggle's libtpu reads Mosaic up to version 4; jax 0.7.2 writes 7.
    assert p.points[0].source == DECIDED and p.points[0].fits, p.points
    if "libtpu 0.0.17" in p.compiler:
        assert any("Mosaic version 4" in n for n in p.notes), p.notes


@pytest.mark.compiler
def test_fit_advises_only_a_step_near_the_limit_each_change_compiled_most_saved_first(rt):
    # A full fine-tune at 4 x 8192 tokens does not fit a v5e-1: every change people make (LoRA, checkpointing,
    # bf16, a chunked loss, flash attention, FSDP over a v5e-8, a shorter sequence) is compiled, and the list is
    # ordered by the HBM each leaves (least first). The same model at 1 x 512 holds 0 % of the chip: no advice.
    f = tpukit.fit(config(), "v5e-1", mode="full", batch=4, length=8192, progress=False)
    assert not f.fits and f.mode == "full" and f.compiler.startswith("libtpu"), f
    changes = [s.change for s in f.advice]
    for want in ("lora", "full+ckpt", "full+bf16", "full+chunk", "full+flash", "full+fsdp on v5e-8"):
        assert want in changes, changes
    assert any(c.startswith("sequence ") for c in changes), changes
    held = [s.hbm_bytes for s in f.advice if s.checked]
    assert len(held) == len(f.advice) and held == sorted(held), f
    assert f.advice[0].fits and f.advice[0].hbm_bytes < f.hbm_limit_bytes, f
    text = str(f)
    assert "does not fit" in text and "1. " in text and "(checked by a compile)" in text, text
    small = tpukit.fit(config(), "v5e-1", mode="full", batch=1, length=512, progress=False)
    assert small.fits and small.advice == () and small.share < 0.02, small
    assert small.note.startswith("no advice: the step holds 0% of the chip"), small.note
