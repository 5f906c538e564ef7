"""How fast, against the chip: each step's tokens, model FLOPs and MFU, on XLA:CPU with real torch_xla.

A tiny transformers Llama trains a few steps under ``tpukit.track(loader, model=model)``: its records,
``summary()``, the verdict and the text dashboard say tokens/s, the model FLOPs (6·N·tokens here: no target
is set) and the achieved TFLOP/s; the MFU is computed against a peak the test gives (``mfu_against``) and
is "n/a: not a TPU" on XLA:CPU. One test mocks what cannot exist here, a TPU (the PJRT device type), to
see the chip's peak used; one follows a target TPU, as ``setup(target=...)`` does, to see the TPU compiler's
count used.
"""

from __future__ import annotations

import re

import pytest
import torch

import tpukit
from tpukit import _xla, tpu
from tpukit.track import chip_peak, tokens_of
from tpukit.verdict import NO_FLOPS, NOT_A_TPU, rate
from tpukit.widgets import render

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS = 2, 16, 6
TOKENS = BATCH * SEQ


def tiny_llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).to(device)


def batches(n=STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def train(model, loader, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = tpukit.track(loader, model=model, progress=False, **options)
    for batch in tracker:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        tpukit.log(loss=loss)
    return tracker


@pytest.fixture(scope="module")
def llama(rt):
    return tiny_llama(rt.device)


def test_tokens_flops_and_mfu_of_a_tiny_llama_on_xla_cpu(llama, capsys):
    capsys.readouterr()
    tracker = train(llama, batches(), dashboard=True)
    shown = capsys.readouterr().out
    n = sum(p.numel() for p in llama.parameters())
    h = tracker.history
    assert len(h) == STEPS
    peak = 1e12  # the test's peak FLOP/s: on XLA:CPU there is no chip to take it from
    for r in h:
        assert r.tokens == TOKENS  # input_ids' shape, read on the host
        assert r.tokens_per_s == pytest.approx(TOKENS / r.wall)
        assert r.flops == 6 * n * TOKENS  # exactly 6·N·tokens: no target set
        assert r.flops_source.startswith("6·N·tokens") and f"N = {n:,} parameters" in r.flops_source
        assert r.flops_per_s == pytest.approx(r.flops / r.wall)
        assert r.mfu_against(peak) == pytest.approx(6 * n * TOKENS / r.wall / peak)
        assert r.peak_flops is None and r.mfu is None and r.peak_source == NOT_A_TPU
    s = tracker.summary()
    steady = [r for r in h if r.compiles == 0]
    assert steady, [r.compiles for r in h]
    wall = sum(r.wall for r in steady)
    assert s["flops_per_step"] == 6 * n * TOKENS and s["flops_source"] == h[-1].flops_source
    assert s["tokens_per_s"] == pytest.approx(TOKENS * len(steady) / wall)
    assert s["tflops"] == pytest.approx(6 * n * TOKENS * len(steady) / wall / 1e12)
    assert s["mfu"] is None and s["mfu_note"] == NOT_A_TPU
    assert rate(steady).mfu_against(peak) == pytest.approx(s["tflops"] * 1e12 / peak)
    assert "MFU" not in s["verdict"]  # no MFU off a TPU, and none made up
    # The text dashboard says so too: its closing line, printed, and its report's rows.
    assert f" tokens/s · " in shown and f" TFLOP/s, MFU {NOT_A_TPU} · " in shown, shown
    report = render.text_report(tracker.dashboard.view())
    assert re.search(rf"^  MFU +{re.escape(NOT_A_TPU)}$", report, re.M), report
    assert re.search(r"^  tokens/s +[\d,]+$", report, re.M), report
    assert re.search(r"^  model FLOPs +[\d.]+ MFLOP per step, [\d.e-]+ TFLOP/s achieved \(by 6·N·tokens", report, re.M), report


def test_on_a_tpu_the_mfu_is_against_the_chips_peak(llama, monkeypatch):
    # A TPU cannot exist here: the PJRT device type and the TPU VM's accelerator name are mocked, the rest
    # (the loop, its graphs, their FLOPs) is XLA:CPU's.
    monkeypatch.setattr(_xla, "device_type", lambda: "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    tracker = train(llama, batches(3))
    v5e = 197e12
    for r in tracker.history:
        assert r.peak_flops == v5e and r.peak_source == "1 × v5e at 197 TFLOP/s (dense bf16)"
        assert r.mfu == pytest.approx(r.flops / r.wall / v5e)
    s = tracker.summary()
    assert s["mfu"] == pytest.approx(s["tflops"] * 1e12 / v5e)
    assert s["mfu_note"] == f"{s['mfu']:.0%} of 1 × v5e at 197 TFLOP/s (dense bf16)"
    assert re.match(r"\w+-bound at \d+% MFU over ", s["verdict"]), s["verdict"]


def test_tokens_come_from_the_batch_shape_and_only_a_language_models_batch():
    assert tokens_of({"input_ids": torch.empty(4, 7, dtype=torch.long), "attention_mask": torch.ones(4, 7)}) == 28
    assert tokens_of(torch.empty(4, 7)) is None and tokens_of({"pixel_values": torch.empty(2, 3)}) is None
    assert tokens_of((torch.empty(4, 7),)) is None


def test_the_manual_api_counts_the_tokens_of_a_steps_training_batches(rt):
    # As the Trainer callback drives it: micro-batches of gradient accumulation add up, an evaluation's not.
    model = torch.nn.Embedding(16, 4).to(rt.device)
    t = tpukit.Tracker((), None, None, None, False, None, None, False, None, model=model)
    t.begin()
    for _ in range(2):
        for _ in range(2):
            ids = torch.randint(0, 16, (3, 5)).to(rt.device)
            t.before_step({"input_ids": ids})
            model(ids).sum().backward()
        t.before_step({"input_ids": torch.zeros(7, 5, dtype=torch.long).to(rt.device)}, train=False)
        t.after_step()
    t.end()
    assert [r.tokens for r in t.history] == [30, 30]
    assert [r.flops for r in t.history] == [6 * 64 * 30] * 2


def test_a_loop_without_a_model_or_tokens_has_no_flops(rt):
    model = torch.nn.Linear(8, 2).to(rt.device)
    tracker = tpukit.track([torch.randn(4, 8) for _ in range(3)], progress=False)
    for x in tracker:
        model(x).sum().backward()
    assert all(r.tokens is None and r.flops is None and r.flops_source is None for r in tracker.history)
    s = tracker.summary()
    assert s["flops_per_step"] is None and s["tflops"] is None and s["mfu"] is None and s["mfu_note"] == NO_FLOPS


def test_the_chip_peak_by_the_names_a_tpu_goes_by():
    assert chip_peak("CPU", "v5litepod-8", 8) == (None, NOT_A_TPU)
    assert chip_peak("TPU", "v5litepod-8", 8) == (8 * 197e12, "8 × v5e at 197 TFLOP/s (dense bf16)")
    assert chip_peak("TPU", "TPU v6 lite")[0] == 918e12
    assert chip_peak("TPU", "v5p-8", 4)[0] == 4 * 459e12 and chip_peak("TPU", "TPU v4")[0] == 275e12
    peak, why = chip_peak("TPU", "TPU:0")
    assert peak is None and why.startswith("n/a: ") and "v5e" in why


def test_with_a_target_the_flops_are_the_tpu_compilers_count(rt):
    # What setup(target="v5e-1") registers (tpu.follow), here in this process: every graph the loop compiles
    # goes to the TPU compiler too. Stopped afterwards, as setup() without a target would leave it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    follower = tpu.follow("v5e-1")
    try:
        tracker = tpukit.track([{"input_ids": torch.randint(0, 64, (4, 8))} for _ in range(4)], model=model,
                               progress=False)
        for b in tracker:
            model(b["input_ids"]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        s = tracker.summary(wait=240)
    finally:
        tpu.unfollow()
    compiled = [e for r in tracker.history for e in r.compile_events if not e.eager]
    counts = [follower.estimate_of(e).flops for e in compiled]
    assert len(compiled) == 1 and all(counts), counts  # one graph: every step ran it
    assert s["flops_per_step"] == counts[0] != 6 * sum(p.numel() for p in model.parameters()) * 32, s
    assert s["flops_source"] == "the TPU compiler for v5e-1 (per chip)", s  # one chip: the step's count
    assert s["mfu"] is None and s["mfu_note"] == NOT_A_TPU, s
    # A record published before the compiler answered has 6·N·tokens and says the compiler's count is to come.
    early = [r for r in tracker.history if r.flops_source.startswith("6·N·tokens")]
    assert all(r.flops_source.endswith("; the TPU compiler's count for v5e-1 not in yet") for r in early), early
