"""tpukit.tpu.ask: one seam from a traced step to an outcome, names resolved once at the edge; what the
outcome says (issue 44's items 1, 3, 6) with the real TPU compiler on this CPU, and through a real kernel.

No mocks: every estimate is a step traced lazily on XLA:CPU and compiled by libtpu's TPU compiler. The
resolution counts wrap the kit's own resolving functions (they still run).
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import run_python
from estimate_steps import mlp, train_step

tpu = pytest.importorskip("tpukit.tpu")
if not tpu.available():
    pytest.skip("the TPU compiler is not installed: pip install 'tpukit[tpu-estimate]'", allow_module_level=True)
pytestmark = pytest.mark.timeout(900)

import torch  # noqa: E402

import tpukit  # noqa: E402
from tpukit import _xla  # noqa: E402
from tpukit.tpu import compiler, memory, outcome  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """One on-disk cache for this module's tests (not the user's ~/.cache)."""
    monkeypatch.setenv("TPUKIT_TPU_CACHE", str(tmp_path_factory.getbasetemp() / "tpu-cache"))


@pytest.fixture
def resolutions(monkeypatch):
    """Counts of the target and compiler names turned into objects, wherever the kit does it."""
    counts = {"target": 0, "compiler": 0, "edge": 0}

    def counting(fn, key):
        def wrapped(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(compiler, "target", counting(compiler.target, "target"))
    monkeypatch.setattr(compiler.pins, "resolve", counting(compiler.pins.resolve, "compiler"))
    edge = counting(tpu.ask.resolve, "edge")
    for module in ("ask", "estimate", "search", "compare", "recorded", "followers", "tools"):  # each one's name
        monkeypatch.setattr(sys.modules[f"tpukit.tpu.{module}"], "resolve", edge)
    return counts


def test_one_estimate_with_memory_and_one_search_resolve_target_and_compiler_once_each(rt, resolutions):
    model = mlp(64, 256)
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    est = tpukit.estimate(step, torch.randn(16, 64, device=_xla.device()), target="v5e-1",
                          compiler="torch_xla 2.8", memory=True, suggest="always")
    assert est.fits and est.memory is not None and est.compiler_name == "torch_xla 2.8" and est.advice, est
    assert resolutions == {"target": 1, "compiler": 1, "edge": 1}, resolutions  # advice compiled too: no more
    for k in resolutions:
        resolutions[k] = 0
    fit = tpukit.largest_batch(step, lambda b: torch.randn(b, 64, device=_xla.device()), target="v5e-1",
                               start=8, limit=64)
    assert fit.at_limit and fit.batch == 64 and len(fit.tried) >= 2, fit
    assert resolutions == {"target": 1, "compiler": 1, "edge": 1}, resolutions


def test_tpu_alone_knows_the_runtimes_defaults_without_wiring_at_import():
    code = (
        "import sys, tpukit.tpu.ask as ask, tpukit.runtime as runtime\n"
        "tgt, comp = ask.resolve()\n"
        "print('ENV', tgt.name, comp.name)\n"
        "import tpukit\n"
        "tpukit.setup(device='cpu', target='v5e-4', compiler='torch_xla 2.9')\n"
        "tgt, comp = ask.resolve()\n"
        "print('SETUP', tgt.name, comp.name, tpukit.tpu.follower().target.name)\n"
        "print('WIRED', [n for n in ('read_default_from',) if hasattr(tpukit.tpu.compiler.targets, n)"
        " or hasattr(tpukit.tpu.compiler.pins, n)])\n")
    done = run_python(code, env={"TPUKIT_TARGET": "v5e-8", "TPUKIT_COMPILER": "torch_xla 2.8"}, timeout=300)
    out = done.stdout + done.stderr
    assert "ENV v5e-8 torch_xla 2.8" in out and "SETUP v5e-4 torch_xla 2.9 v5e-4" in out, out
    assert "WIRED []" in out, out


def test_the_advice_adds_up_and_says_what_was_checked(rt):
    # Issue 44.3: a refused step of 131,072 rows was advised "accumulate 2 x 98384" (196,768 rows): k micro-batches
    # were counted from the largest batch that fits, but the batch kept. The step (a 30 GB step on a v5e-1) is
    # test_tpu's big one; its largest batch is not a divisor of the rows.
    model = mlp(1024, 8192)
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    rows = 1 << 19
    est = tpukit.estimate(step, torch.randn(rows, 1024, device=_xla.device()), target="v5e-1")
    assert est.status == outcome.TOO_BIG and est.refused_for_memory, est
    tips = {s.change.split(" ")[0]: s for s in est.advice}
    fits_at, acc = tips["batch"].batch, tips["accumulate"]
    k, micro = map(int, acc.change.split()[1::2])
    assert k == math.ceil(rows / fits_at) and micro == acc.batch <= fits_at, (acc, fits_at)
    assert k * micro >= rows and (k - 1) * micro < rows and f"{k} x {micro} = {k * micro} rows" in acc.how, acc
    # bf16: what was compiled is autocast; model.to(bfloat16) is named as not checked.
    assert "checked as that" in tips["bf16"].how and "not checked" in tips["bf16"].how, tips["bf16"]
    # One unit system per figure: the kit's in GB, the compiler's own quote marked as its GiB.
    text = str(est)
    assert "G = GiB" in text and "GB of" in text, text
    assert all(s.checked == (s.hbm_bytes is not None) for s in est.advice)


def test_a_v4_figure_says_what_it_is_and_a_wide_row_of_a_one_device_step_says_so(rt):
    model = mlp(64, 128)
    step = train_step(model, torch.optim.AdamW(model.parameters()))
    x = torch.randn(8, 64, device=_xla.device())
    est = tpukit.estimate(step, x, target="v4-8")
    assert est.fits and est.chip_note and "32 GiB" in est.chip_note, est.chip_note
    assert "per chip" in str(est) and tpukit.estimate(step, x, target="v5e-1").chip_note is None
    cmp = tpukit.compare(step, x, pairs=[("v5e-1", None), ("v5e-8", None)])
    assert any("v5e-8: one chip's program of this one-device step" in n for n in cmp.notes()), cmp.notes()
    assert "fsdp=True" in str(cmp)
    sharded = tpukit.compare(step, x, pairs=[("v5e-8", None)], fsdp=True)
    assert not any("one chip's program" in n for n in sharded.notes()), sharded.notes()


def test_an_estimate_before_training_says_it_is_the_optimizers_first_step(rt):
    model = mlp(64, 128)
    opt = torch.optim.AdamW(model.parameters())
    step = train_step(model, opt)
    x = torch.randn(8, 64, device=_xla.device())
    first = tpukit.estimate(step, x, target="v5e-1")
    assert first.note == outcome.FIRST_STEP and "first step" in str(first), first.note
    step(x)  # one real step: AdamW's state exists now
    _xla.sync()
    later = tpukit.estimate(step, x, target="v5e-1")
    assert later.note is None, later.note


def test_a_breakdown_without_gradients_says_why():
    # The record's own rule (plain data): a dump's breakdown with optimizer state and no gradients row says why.
    state = memory.Buffer(4096, memory.OPTIMIZER, "exp_avg of w")
    params = memory.Buffer(2048, memory.PARAMETERS, "w")
    without = memory.MemoryBreakdown(6144, (state, params), memory.DUMP)
    with_grads = memory.MemoryBreakdown(8192, (state, params, memory.Buffer(2048, memory.GRADIENTS, "w")), memory.DUMP)
    assert memory.NO_GRADIENTS in str(without) and any(memory.NO_GRADIENTS == v for _, v in without.summary())
    assert memory.NO_GRADIENTS not in str(with_grads)


INTERRUPTED = r"""
import os, signal, sys, time
from jupyter_client.manager import start_new_kernel

def run(kc, code, timeout=900):
    msg = kc.execute(code)
    out, status = [], None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = kc.get_iopub_msg(timeout=timeout)
        if m["parent_header"].get("msg_id") != msg:
            continue
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        elif m["msg_type"] == "error":
            out.append(m["content"]["ename"])
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(out)
    raise TimeoutError(code)

def workers(parent):
    # the TPU compiler's worker processes the kernel started
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"serve.main()" in cmd and ppid == parent:  # the worker's boot line (_serve.main() before 44.1)
            found.append(int(pid))
    return found

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

km, kc = start_new_kernel(kernel_name="python3")
try:
    print(run(kc, "import tpukit; rt = tpukit.setup(device='cpu'); import torch\n"
                  "big = torch.nn.Sequential(torch.nn.Linear(1024, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1024))"
                  ".to(rt.device)\n"
                  "opt = torch.optim.AdamW(big.parameters())\n"
                  "def step(x):\n"
                  "    loss = big(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad(); return loss\n"
                  "x = torch.randn(1 << 19, 1024, device=rt.device)\n"
                  "print('ready')"))
    kernel = km.provisioner.pid
    msg = kc.execute("est = tpukit.estimate(step, x, target='v5e-1', suggest=False)")
    deadline = time.monotonic() + 300
    while not workers(kernel) and time.monotonic() < deadline:
        time.sleep(0.2)
    (worker,) = workers(kernel)
    while time.monotonic() < deadline:  # until the graph is traced and sent: the worker burns CPU compiling it
        busy = cpu(worker)
        time.sleep(0.5)
        if cpu(worker) - busy > 0.2:
            break
    time.sleep(3)
    before = workers(kernel)
    # A stop button that interrupts the kernel alone (a kernel whose interrupt is a message, as ipykernel's
    # interrupt_mode "message"; Jupyter's signal mode interrupts its whole process group, worker included).
    os.kill(kernel, signal.SIGINT)
    time.sleep(2)
    print("INTERRUPTED", run(kc, "print('after the interrupt')"))
    print(run(kc, "small = torch.nn.Linear(8, 20).to(rt.device)\n"
                  "o2 = torch.optim.SGD(small.parameters(), lr=0.1)\n"
                  "def s2(x):\n"
                  "    l = small(x).sum(); l.backward(); o2.step(); o2.zero_grad(); return l\n"
                  "e = tpukit.estimate(s2, torch.ones(4, 8, device=rt.device), target='v5e-1')\n"
                  "print('SMALL', e.arguments_bytes, int(e.flops), e.hbm_bytes)\n"
                  "again = tpukit.estimate(s2, torch.ones(4, 8, device=rt.device), target='v5e-1')\n"
                  "print('AGAIN', again.arguments_bytes, int(again.flops))"))
    print("WORKERS", before, workers(kernel))
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
"""


def test_an_interrupted_estimate_in_a_kernel_never_answers_the_next_one(tmp_path):
    # Issue 44.1: Jupyter's stop button 30 s into a big step's estimate returned at once, but the worker went on
    # compiling, and the next estimate (of a Linear(8, 20) step) got the abandoned step's figures, cached.
    done = run_python(INTERRUPTED, env={"TPUKIT_TPU_CACHE": str(tmp_path / "cache")}, timeout=900)
    out = done.stdout + done.stderr[-3000:]
    small = [line for line in out.splitlines() if line.startswith("SMALL ")]
    assert small, out
    small = small[0]
    args, flops, hbm = map(int, small.split()[1:])
    assert args < 10_000 and flops < 10_000_000 and hbm < 1_000_000, out  # a Linear(8, 20)'s, not 1 GB's
    again = next(line for line in out.splitlines() if line.startswith("AGAIN "))
    assert again.split()[1:] == small.split()[1:3], out
    assert "after the interrupt" in out, out
