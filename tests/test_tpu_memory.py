"""Why a step needs the HBM it does (tpukit.tpu.memory, .dump, .advice), with the real TPU compiler.

No mocks: each step is traced lazily on XLA:CPU and compiled for a v5e by
libtpu's TPU compiler in its worker, with a dump of its buffer assignment; the
breakdown is read from that dump (or from the compiler's refusal). The models
are small (an MLP; two attention layers over a long sequence) and each graph is
compiled once per module (module-scoped fixtures): libtpu 0.0.17 takes about
20-25 s per compile of the attention step on these 2 cores.
"""

from __future__ import annotations

import inspect
import os

import pytest

tpu = pytest.importorskip("tpukit.tpu")
if not tpu.available():
    pytest.skip("the TPU compiler is not installed: pip install 'tpukit[tpu-estimate]'", allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

import torch  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla, rewrites  # noqa: E402
from tpukit.tpu import advice, dump, memory  # noqa: E402
from tpukit.tpu.estimate import near_limit  # noqa: E402
from tpukit.tpu.trace import _owners  # noqa: E402
from estimate_steps import train_step  # noqa: E402

BATCH, SEQ, DIM, HEADS = 4, 2048, 128, 8


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """One on-disk cache for this module's compiles (not the user's ~/.cache)."""
    before = os.environ.get("TPUKIT_TPU_CACHE")
    os.environ["TPUKIT_TPU_CACHE"] = str(tmp_path_factory.mktemp("tpu-cache"))
    yield
    if before is None:
        os.environ.pop("TPUKIT_TPU_CACHE", None)
    else:
        os.environ["TPUKIT_TPU_CACHE"] = before


def batch(*shape):
    """Random rows on the device: data the graph reads (a parameter of it), not a random op in it."""
    return torch.randn(*shape).to(_xla.device())


def mlp_step(dim=1024, hidden=4096):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))
    model = model.to(_xla.device())
    opt = torch.optim.AdamW(model.parameters())

    def step(x):
        opt.zero_grad()  # first: the gradients are kept (outputs of the step's graph)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return step, model, opt


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5).softmax(-1)  # the attention probabilities
        return x + self.out((att @ v).transpose(1, 2).reshape(b, n, DIM))


class Net(torch.nn.Module):
    def __init__(self, n=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Attention() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


PROBS_LINE = next(i for i, line in enumerate(inspect.getsource(Attention).splitlines())
                  if "the attention probabilities" in line) + inspect.getsourcelines(Attention)[1]


def attention_step():
    torch.manual_seed(0)
    model = Net().to(_xla.device())
    return train_step(model, torch.optim.AdamW(model.parameters()))


@pytest.fixture(scope="module")
def mlp_estimate(rt):
    step, model, opt = mlp_step()
    params = list(model.parameters())
    before = [p.detach().cpu().clone() for p in params]
    x = batch(8, 1024)
    seed = _xla.rng_seed()
    est = tpukit.estimate(step, x, target="v5e-1", memory=True, suggest="always")  # advice at 1 % of the chip
    # After the estimate and its advice (the bf16 check traced the step with the state cast): the model as it
    # was, the same Parameter objects in the model and the optimizer, fp32, device data, the same bits.
    assert list(model.parameters()) == params and all(
        p is q for p, q in zip(params, opt.param_groups[0]["params"]))
    assert all(p.dtype == torch.float32 and p.requires_grad and p.grad is None for p in params)
    assert not any(_xla.has_pending(params)) and not opt.state and _xla.rng_seed() == seed
    assert x.dtype == torch.float32 and not _xla.has_pending([x])[0]
    assert all(torch.equal(p.detach().cpu(), b) for p, b in zip(params, before))
    return est, sum(p.numel() for p in params)


@pytest.fixture(scope="module")
def attention_estimate(rt):
    return tpukit.estimate(attention_step(), batch(BATCH, SEQ, DIM), target="v5e-1",
                           memory=True, suggest="always")  # at 10 % of the chip: advice asked for


def test_a_known_mlp_breakdown_is_its_parameters_gradients_and_adam_moments(mlp_estimate):
    est, n = mlp_estimate
    why = est.memory
    assert est.fits and why is not None and why.source == memory.DUMP, est
    kinds = why.by_kind()
    # fp32: the parameters, their gradients (kept by the step: zero_grad comes first) and AdamW's two moments
    # (made by this first step), each within 5 % of what the model's size says.
    for kind, expected in ((memory.PARAMETERS, 4 * n), (memory.GRADIENTS, 4 * n), (memory.OPTIMIZER, 8 * n)):
        assert kinds.get(kind, 0) == pytest.approx(expected, rel=0.05), (kind, kinds, expected)
    assert sum(kinds[k] for k in (memory.PARAMETERS, memory.GRADIENTS, memory.OPTIMIZER)) >= 0.9 * why.total_bytes
    # The buffers are the compiler's sum of buffers (libtpu 0.0.17 reports no peak of its own: hbm_bytes is that
    # sum), to the byte apart from what its dump does not place.
    assert why.total_bytes == est.sum_bytes, (why.total_bytes, est.sum_bytes)
    assert why.peak_bytes == est.hbm_bytes
    rows = why.rows()
    assert [r.kind for r in rows[:3]] == [memory.OPTIMIZER, memory.PARAMETERS, memory.GRADIENTS], rows
    assert rows[0].count == 8 and "exp_avg of 0.weight" in rows[0].names, rows[0]  # exp_avg, exp_avg_sq x 4
    assert why.covered() >= 0.9
    text = str(est)
    assert "why: HBM at the peak" in text and "optimizer state" in text, text
    assert "<table" in why._repr_html_() and "optimizer state" in str(why)
    # Parameters and optimizer state dominate: the advice is FSDP over a v5e-8 (checked by a compile: each chip
    # holds an eighth) and bf16 weights (checked too: test_bf16_advice_halves_the_state_in_a_checked_compile).
    assert advice.shares(why)["state"] >= 0.9, advice.shares(why)
    tips = {s.change: s for s in est.advice}
    assert set(tips) == {"FSDP over 8 chips", advice.BF16}, tips
    assert tips["FSDP over 8 chips"].fits and tips["FSDP over 8 chips"].hbm_bytes < est.hbm_bytes / 3, tips
    assert "not checked" not in str(est)


def test_a_step_far_from_the_limit_gets_its_breakdown_and_no_advice(mlp_estimate):
    # The same step as mlp_estimate's, at 1 % of a v5e's HBM (its answer is cached): the breakdown, no advice
    # (FSDP over 8 chips and bf16 weights would save what nobody needs); a refused step always gets it.
    asked, _ = mlp_estimate
    step, _, _ = mlp_step()
    est = tpukit.estimate(step, batch(8, 1024), target="v5e-1", memory=True)
    assert est.fits and est.hbm_bytes < 0.02 * est.hbm_limit_bytes and not near_limit(est), est
    assert est.memory is not None and est.advice == () and asked.advice, (est.advice, asked.advice)
    assert est.memory.by_kind() == asked.memory.by_kind()


def test_bf16_advice_halves_the_state_in_a_checked_compile(mlp_estimate):
    est, _ = mlp_estimate
    why = est.memory
    tip = {s.change: s for s in est.advice}[advice.BF16]
    state = sum(why.by_kind()[k] for k in (memory.PARAMETERS, memory.GRADIENTS, memory.OPTIMIZER))
    # The step compiled again with the weights, their gradients, AdamW's moments (made by the step from the
    # bf16 weights) and the batch in bf16: 2 bytes a value instead of 4, so the state's 16 bytes a parameter
    # become 8 and the peak falls by half the state. The rest of the peak (the batch, the 8 x 4096
    # activations, the update's temporaries, the loss: 1.3 % of it here) is bf16 too and may be laid out
    # otherwise: the difference from that is bounded by the rest's own size. (libtpu 0.0.17: 136.1 MB ->
    # 68.06 MB, half the state 67.15 MB.)
    rest = why.total_bytes - state
    assert tip.fits and tip.hbm_bytes is not None, tip
    assert abs(tip.hbm_bytes - (est.hbm_bytes - state / 2)) <= rest, (tip.hbm_bytes, est.hbm_bytes, state, rest)
    assert "checked by a compile" in str(est) and "model.to(torch.bfloat16)" in tip.how


def test_bf16_check_casts_the_state_and_puts_every_tensor_back(rt):
    # A step whose optimizer state exists (one real step ran) and whose parameters hold gradients: inside
    # in_bf16 all of them are bf16 (not AdamW's step counter); after it, even after an error inside, each
    # tensor is the same object with the same dtype and bits, and the gradients are the same objects.
    step, model, opt = mlp_step(64, 128)
    x = batch(8, 64)
    step(x)
    model(x).sum().backward()
    _xla.sync()
    params = list(model.parameters())
    state = {id(p): dict(s) for p, s in opt.state.items()}
    saved = [(t, t.detach().cpu().clone()) for t in params + [p.grad for p in params] +
             [v for s in state.values() for v in s.values()]]
    grads = [p.grad for p in params]
    mods, opts, _ = tpukit.tpu.trace._owners(step, (x,), {})
    assert mods == [model] and opts == [opt]
    (x16,), _ = rewrites.batch_in_bf16((x,), {})
    assert x16.dtype == torch.bfloat16 and x.dtype == torch.float32
    with rewrites.in_bf16(mods, opts) as cast:
        assert cast == 4 * 4  # 4 parameters, their gradients, exp_avg and exp_avg_sq of each
        assert all(p.dtype == p.grad.dtype == torch.bfloat16 and p.requires_grad for p in params)
        assert {(k, v.dtype) for s in opt.state.values() for k, v in s.items()} == {
            ("exp_avg", torch.bfloat16), ("exp_avg_sq", torch.bfloat16), ("step", torch.float32)}
        traced = tpukit.tpu.trace.trace(step, (x16,), {})
        assert traced.trains and len(traced.aliases) >= 12  # the bf16 state is device data, donated
    with pytest.raises(RuntimeError, match="inside"):
        with rewrites.in_bf16(mods, opts):
            raise RuntimeError("inside")
    assert list(model.parameters()) == params and opt.param_groups[0]["params"] == params
    assert all(p.grad is g and p.requires_grad for p, g in zip(params, grads))
    assert {id(p): dict(s) for p, s in opt.state.items()} == state
    for t, value in saved:
        assert t.dtype == value.dtype and torch.equal(t.detach().cpu(), value), t.shape
    assert not any(_xla.has_pending([t for t, _ in saved]))


@pytest.mark.compiler  # the bf16 check below compiles (the lanes' scan sees no entry point it knows)
def test_advice_that_is_not_checked_says_why(rt):
    # A loss's logits dominating: the chunked loss is a rewrite of the step's code (the head's projection and
    # the loss, slice by slice), which the kit cannot make: no compile, and the advice says so.
    logits = memory.Buffer(3 << 30, memory.ACTIVATIONS, "fusion.1", "f32[8,1024,32000]", op="aten__log_softmax")
    why = memory.MemoryBreakdown(4 << 30, (logits, memory.Buffer(1 << 30, memory.PARAMETERS, "w")), memory.DUMP)
    (tip,) = advice.advise(why, None, (), {}, None, tpu.target("v5e-1"))
    assert tip.change == advice.CHUNKED_LOSS and tip.hbm_bytes is None and tip.fits is None, tip
    assert "not checked: that rewrites the step's code" in tip.how + tip.after()
    assert not tip.checked and tip.after().startswith(" (not checked") and tip.unchecked, tip
    # A step that cannot run in bf16 as written (it reads an fp32 batch of its own, not an argument the check
    # casts): torch_xla traces its fp32 x bf16 matmul, the compiler rejects it, and the bf16 check says so (no
    # HBM); the model is fp32 again.
    _, model, _ = mlp_step(64, 64)
    own = batch(4, 64)

    def step():
        return model(own).pow(2).mean()

    hbm, fits, why_not = advice._bf16_checked(step, (), {}, tpukit.tpu.trace.Traced(b"", (), 1, 0),
                                             tpu.target("v5e-1"), "step", None)
    assert (hbm, fits) == (None, None) and why_not.startswith(
        "the TPU compiler rejected the step in bf16 (op requires the same element type"), why_not
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_long_sequence_attention_is_its_probabilities_from_the_line_that_made_them(attention_estimate):
    est = attention_estimate
    why = est.memory
    assert est.fits and why.source == memory.DUMP
    top = why.rows()[0]
    probs = BATCH * HEADS * SEQ * SEQ * 4  # one layer's attention probabilities, fp32
    # The largest part of the peak: both layers' probabilities, kept for the backward, made by one line of this
    # file, in the modules that ran it.
    assert top.kind == memory.ACTIVATIONS and top.where == f"{__file__}:{PROBS_LINE}", (top, PROBS_LINE)
    scores = [b for b in why.buffers if b.source == top.where and memory.attention_like(b)]
    assert len(scores) == 2 and sum(b.bytes for b in scores) == 2 * probs, scores
    assert 2 * probs <= top.bytes < 2.01 * probs, top  # with the softmax's row maxima and sums ([32, 2048])
    assert top.shapes[0] == f"f32[{BATCH * HEADS},{SEQ},{SEQ}]" and top.modules == ("layers.0", "layers.1"), top
    assert why.by_kind()[memory.ACTIVATIONS] >= 0.6 * why.total_bytes
    assert advice.shares(why)["attention"] >= 0.6 and advice.shares(why)["state"] < 0.01, advice.shares(why)
    assert f"test_tpu_memory.py:{PROBS_LINE}" in str(est) and f"test_tpu_memory.py:{PROBS_LINE}" in str(why)
    ax = why.plot()  # the chart shows the rows, the probabilities last (on top)
    assert ax.get_yticklabels()[-1].get_text().startswith(memory.ACTIVATIONS)
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_checkpointing_advice_lowers_the_peak_in_a_checked_compile(attention_estimate):
    est = attention_estimate
    tip = {s.change: s for s in est.advice}[advice.CHECKPOINT]
    # The step compiled again with each of the two layers under torch_xla's checkpoint: one layer's
    # probabilities fewer at the peak.
    assert tip.fits and tip.hbm_bytes is not None, tip
    assert tip.hbm_bytes < est.hbm_bytes - 0.8 * BATCH * HEADS * SEQ * SEQ * 4, (tip.hbm_bytes, est.hbm_bytes)
    assert "the 2 layers of layers" in tip.how and "use_reentrant=True" in tip.how
    assert "checked by a compile" in str(est)


def test_a_language_models_logits_are_advised_a_chunked_loss_checked_by_a_compile(rt):
    # transformers' own GPT-2 (random init: 2 layers of 64, its 50257-token vocabulary) at 8 x 512 tokens, its
    # loss from labels as the model computes it: the head's logits, f32[4096, 50257] and their gradient, are
    # most of the peak. They are made by lm_head's Linear (no log-softmax op names them), and the advice is a
    # chunked loss, compiled: the step traced again with the head and the loss in slices.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=512)).to(_xla.device())
    opt = torch.optim.AdamW(model.parameters())

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    ids = torch.randint(0, 50257, (8, 512)).to(_xla.device())
    est = tpukit.estimate(step, ids, target="v5e-1", memory=True, suggest="always")
    top = est.memory.rows()[0]
    assert top.modules == ("lm_head",) and "f32[4096,50257]" in top.shapes and top.bytes > est.hbm_bytes / 2, top
    (tip,) = est.advice
    assert tip.change == advice.CHUNKED_LOSS and "checked as lm_head" in tip.how, tip
    assert tip.fits and tip.hbm_bytes < est.hbm_bytes / 2, (tip.hbm_bytes, est.hbm_bytes)
    # The model is as it was (its head's forward and its loss its own), and the chunked loss the check
    # traced is the model's loss: the same value on a small batch.
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__
    assert model.loss_function.__name__ == "ForCausalLMLoss"
    small = ids[:2, :96]
    model.eval()  # no dropout: the two forwards compute the same thing
    with torch.no_grad():
        want = model(input_ids=small, labels=small).loss.cpu()
        with rewrites.chunked_loss(rewrites.heads(_owners(step, (ids,), {})[0])):
            got = model(input_ids=small, labels=small).loss.cpu()
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    # Refused at 256 x 512 tokens, libtpu 0.0.17 names one allocation, the logits, by shape and HLO label only
    # ("Allocation (size=26352812032) would exceed memory ... shape = 'f32[131072,50257]'"): as wide as the
    # model's vocabulary, it is the head's logits, and the advice is the chunked loss (checked, it fits in
    # 6.08 GB: docs/estimates.md; not compiled here).
    refused = memory.Buffer(26352812032, memory.TEMPORARIES, "fusion.324", "f32[131072,50257]")
    why = memory.MemoryBreakdown(26352812032, (refused,), memory.REFUSAL)
    assert advice.shares(why)["logits"] == 0 and advice.shares(why, rewrites.heads(_owners(step, (ids,), {})[0]))["logits"] == 1
    (tip,) = advice.advise(why, step, (ids,), {}, None, tpu.target("v5e-1"), check=False)
    assert tip.change == advice.CHUNKED_LOSS and tip.hbm_bytes is None, tip
    # A model whose forward makes its own CrossEntropyLoss (transformers' BERT masked LM) is not changed by the
    # check: its advice stays unchecked.
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64))
    assert rewrites.heads([bert]) == []


def test_the_layers_to_checkpoint_are_the_repeated_blocks(rt):
    step = attention_step()
    path, found = rewrites.layers(_owners(step, (), {})[0])
    assert path == "layers" and len(found) == 2 and all(isinstance(m, Attention) for m in found)
    model = found[0]
    with rewrites.checkpointed(found):
        assert "forward" in vars(model)
    assert "forward" not in vars(model)  # put back
    _, mlp, _ = mlp_step(64, 64)
    assert rewrites.layers([mlp]) == ("", [])  # Linear, ReLU, Linear: no repeated block


def test_a_refused_step_is_explained_by_the_refusals_own_list(rt):
    step = attention_step()
    x = batch(16, 4096, DIM)  # 8 GiB of probabilities per layer: twice a v5e
    est = tpukit.estimate(step, x, target="v5e-1", suggest=False)
    assert not est.fits and est.status == "too big", est
    why = est.memory
    assert why is not None and why.source == memory.REFUSAL and why.peak_bytes == est.hbm_bytes, why
    # The refusal lists four buffers of 8 GiB: each layer's probabilities (its softmax, at this file's line, in
    # its module) and the backward's gradients of two of them (made by autograd: no source line).
    rows = {(r.kind, r.where): r for r in why.rows()}
    probs = rows[(memory.ACTIVATIONS, f"{__file__}:{PROBS_LINE}")]
    assert probs.bytes == 2 * 8 * 1024**3 and probs.shapes == ("f32[128,4096,4096]",), probs
    assert probs.modules == ("layers.0", "layers.1"), probs
    assert rows[(memory.TEMPORARIES, "aten__matmul in the backward")].shapes[0] == "f32[128,4096,4096]", rows
    assert why.total_bytes == est.refusal.program_bytes and "why: HBM at the peak" in str(est)
    r = est.refusal  # the refusal's totals, parsed
    assert r.reserved_bytes and r.outputs_bytes is not None and r.program_parts and r.exceeded_bytes, r
    assert r.program_parts[0][0] == "HLO temp" and r.allocations[0].unpadded_bytes, r


def test_the_dump_holds_the_files_and_the_metadata_the_breakdown_reads(rt, tmp_path):
    # What libtpu writes for one compile with a dump: the buffer assignment (with the live ranges), the
    # memory-usage report and the optimized HLO, whose metadata carries torch_xla's op names, the modules'
    # scopes and this file's lines (the trace turns torch_xla's source metadata on).
    step, model, _ = mlp_step(256, 512)
    x = batch(16, 256)
    traced = tpukit.tpu.trace.trace(step, (x,), {})
    again = tpukit.tpu.trace.trace(step, (x,), {})  # from another line, scope counters further on
    assert again.hlo == traced.hlo  # the same bytes for the same step: the compile cache's key holds
    assert [k for k, _ in traced.inputs].count(memory.PARAMETERS) == 4 and ("inputs", "x") in traced.inputs
    assert [k for k, _ in traced.results].count(memory.OPTIMIZER) == 8, traced.results
    reply = tpu.compiler.worker.compile_dump(tpu.compiler.worker.Request(
        traced.hlo, tpu.target("v5e-1"), aliases=traced.aliases, compiler=tpu.compiler.resolve()), tmp_path)
    assert "error" not in reply and reply["compiler_name"], reply
    found = dump.files(tmp_path)
    assert {"buffer-assignment", "memory-usage-report", "hlo"} <= set(found), list(tmp_path.iterdir())
    hlo = found["hlo"].read_text()
    assert f'source_file="{__file__}"' in hlo and 'op_name="module.0/aten__addmm"' in hlo
    read = dump.read(tmp_path)
    roles = [h.role for h in read.held]
    assert roles.count(dump.PARAMETER) == len(traced.inputs) and dump.OUTPUT in roles, roles
    assert read.peak_time is not None and dump.Dump.from_json(read.to_json()) == read
    why = memory.from_dump(read, traced, reply)
    assert why.total_bytes == reply["arguments_bytes"] + reply["outputs_bytes"] + reply["temp_bytes"] + \
        reply["code_bytes"] - reply["aliased_bytes"]
    assert dump.module_of("module.layers.0/module.layers.0.qkv/aten__addmm") == "layers.0.qkv"
    assert dump.phase_of("aten__mm", None) == dump.BACKWARD
    assert dump.phase_of("aten__add", "/x/site-packages/torch/optim/adam.py:3") == dump.OPTIMIZER
    assert memory.short("/x/site-packages/torch/nn/functional.py:12") == "torch/nn/functional.py:12"


# Real refusals kept as text; only the machine's folders before each source_file were cut (the repository's,
# the environment's site-packages).
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize("name, program, first", [
    # Captured here: the refused step of test_a_refused_step_is_explained_by_the_refusals_own_list (16 x 4096
    # tokens), traced by tpukit.estimate and compiled for v5e-1 by libtpu 0.0.17 (jax 0.7.2, Kaggle's pair).
    ("refusal-libtpu-0.0.17-attention.txt", 32.21, ("f32[128,4096,4096]", "aten__softmax", ":76")),
    # Captured here: a 1024-4096-1024 MLP + AdamW step at 1048576 rows (its batch made by torch.randn on the
    # device, so a temporary), traced by tpukit's trace and compiled for v5e-1 by libtpu 0.0.21.1 (jax 0.7.2,
    # Colab's pair). 0.0.21.1 adds source_end_line to the operator.
    ("refusal-libtpu-0.0.21.1-mlp.txt", 30.00, ("f32[1048576,4096]", "aten__addmm", "torch/nn/modules/linear.py:125")),
])
def test_the_whole_refusal_is_read(name, program, first):
    with open(os.path.join(DATA, name)) as f:
        text = f.read()
    r = tpu.compiler.refusal.parse(text)
    gib = 1024**3
    assert r.used_bytes == r.program_bytes == int(program * gib) and r.limit_bytes == int(15.75 * gib), r
    assert r.reserved_bytes == 258 * 1024**2 and r.arguments_bytes == 0 and r.exceeded_bytes, r
    assert (r.outputs_bytes, r.outputs_shared_bytes) == (0, 0) and r.program_parts == (("HLO temp", r.program_bytes),)
    assert len(r.allocations) == 20 and r.allocations[0].bytes == r.allocations[0].unpadded_bytes, r.allocations[0]
    a = r.allocations[0]
    assert (a.shape, a.kind) == (first[0], "HLO temp") and first[1] in a.op_name and a.source.endswith(first[2]), a
    assert all(x.parameter is None for x in r.allocations)  # these list temporaries only
    why = memory.from_refusal(r)  # without the trace: kinds from the metadata alone
    assert why.source == memory.REFUSAL and why.total_bytes == r.program_bytes
    assert why.rows()[0].bytes >= 8 * gib and "refusal lists the program's largest allocations" not in (why.note or "")
    # Its lines name a library's file from site-packages/ on, as the breakdown's rows do (not this machine's path)
    lines = r.lines()
    assert all("site-packages/" not in ln for ln in lines) and any(f"made by {first[2]}" in ln or
                                                                   f"{first[2]}" in ln for ln in lines), lines
