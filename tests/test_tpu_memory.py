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
from tpukit import _xla  # noqa: E402
from tpukit.tpu import advice, dump, memory  # noqa: E402
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

    return step, model


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
    step, model = mlp_step()
    est = tpukit.estimate(step, batch(8, 1024), target="v5e-1", memory=True)
    return est, sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def attention_estimate(rt):
    return tpukit.estimate(attention_step(), batch(BATCH, SEQ, DIM), target="v5e-1",
                           memory=True)


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
    # holds an eighth) and bf16 weights (not checked).
    tips = {s.change: s for s in why.advice}
    assert set(tips) == {"FSDP over 8 chips", "bf16 weights"}, tips
    assert tips["FSDP over 8 chips"].fits and tips["FSDP over 8 chips"].hbm_bytes < est.hbm_bytes / 3, tips
    assert tips["bf16 weights"].hbm_bytes is None and "not checked" in str(why)


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
    tip = {s.change: s for s in est.memory.advice}[advice.CHECKPOINT]
    # The step compiled again with each of the two layers under torch_xla's checkpoint: one layer's
    # probabilities fewer at the peak.
    assert tip.fits and tip.hbm_bytes is not None, tip
    assert tip.hbm_bytes < est.hbm_bytes - 0.8 * BATCH * HEADS * SEQ * SEQ * 4, (tip.hbm_bytes, est.hbm_bytes)
    assert "the 2 layers of layers" in tip.how and "use_reentrant=True" in tip.how
    assert "checked by a compile" in str(est.memory)


def test_the_layers_to_checkpoint_are_the_repeated_blocks(rt):
    step = attention_step()
    path, found = advice.layers(step, (), {})
    assert path == "layers" and len(found) == 2 and all(isinstance(m, Attention) for m in found)
    model = found[0]
    with advice.checkpointed(found):
        assert "forward" in vars(model)
    assert "forward" not in vars(model)  # put back
    mlp, _ = mlp_step(64, 64)
    assert advice.layers(mlp, (), {}) == ("", [])  # Linear, ReLU, Linear: no repeated block


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
    step, model = mlp_step(256, 512)
    x = batch(16, 256)
    traced = tpukit.tpu.trace.trace(step, (x,), {})
    again = tpukit.tpu.trace.trace(step, (x,), {})  # from another line, scope counters further on
    assert again.hlo == traced.hlo  # the same bytes for the same step: the compile cache's key holds
    assert [k for k, _ in traced.inputs].count(memory.PARAMETERS) == 4 and ("inputs", "x") in traced.inputs
    assert [k for k, _ in traced.results].count(memory.OPTIMIZER) == 8, traced.results
    reply = tpu.worker.compile_dump(tpu.worker.Request(traced.hlo, tpu.target("v5e-1"), aliases=traced.aliases),
                                tmp_path)
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
    r = tpu.refusal.parse(text)
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
