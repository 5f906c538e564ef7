"""The compile-event pipeline (issue 23): one producer, pushed once, judged per loop.

- exactly one place reads the trace file and the HLO dump: the reader's own thread,
  also while a dashboard is open, whose thread never classifies;
- each compile reaches a listener at most twice (started, then finished and
  classified), on the guide's loop, a loop in the style of pytorch/xla's decoder
  example (``torch_xla.compile`` over an ``MpDeviceLoader``) and a ``%%xla`` cell;
- two tracked loops in two threads: each loop's alarms name only its own inputs;
- step records hold the reader's own event objects, not copies.

All on the real torch_xla runtime (XLA:CPU); nothing here is mocked.
"""

import collections
import itertools
import sys
import threading

import diag_loops as loops
import pytest
import torch

import tpukit
from tpukit import compiles, events
from tpukit.compiles import classify, config


class Counter:
    """A listener that keeps every on_compile call, by event index."""

    def __init__(self):
        self.calls = collections.defaultdict(list)
        self.lock = threading.Lock()

    def on_compile(self, ev):
        with self.lock:
            self.calls[ev.index].append(ev)

    def check(self):
        """Each compile at most twice: a started one first (if at all), then its final version."""
        assert self.calls, "no compile reached the listener"
        for index, seen in self.calls.items():
            assert 1 <= len(seen) <= 2, (index, [(e.kind, e.end) for e in seen])
            *first, last = seen
            assert last.settled and last.end is not None, (index, last)
            assert all(not e.settled and e.end is None for e in first), (index, first)
        return {i: seen[-1] for i, seen in self.calls.items()}


@pytest.fixture
def counter(rt):
    compiles.settled()  # earlier tests' compiles are published before this listener listens
    c = Counter()
    events.add_listener(c)
    yield c
    events.remove_listener(c)


_SIZES = itertools.count(40)  # each test's model sizes are new: its graphs compile here, not in a cache


def _guide_loop():
    """The guide's "Running on a Single XLA Device" loop (as tests/scenarios/diag_loops.py has it), at sizes no
    other test compiled, so its graphs compile now."""
    import torch_xla.core.xla_model as xm
    from torch.utils.data import DataLoader, TensorDataset

    n_in = next(_SIZES)
    device = xm.xla_device()
    model = loops.MNIST(n_in, 23, 5).train().to(device)
    loss_fn = torch.nn.NLLLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    train_loader = DataLoader(TensorDataset(torch.randn(32, n_in), torch.randint(0, 5, (32,))), batch_size=8)
    tracker = tpukit.track(train_loader, progress=False)
    for data, target in tracker:
        optimizer.zero_grad()
        data = data.to(device)
        target = target.to(device)
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        optimizer.step()
        xm.mark_step()
    return tracker


def _dynamic_padding_loop():
    """Batches whose length changes every step (what dynamic padding gives), at new sizes."""
    width = next(_SIZES)
    model = torch.nn.Linear(width, 3).to("xla")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = tpukit.track([{"input_ids": torch.randn(4, n, width)} for n in (5, 7, 9, 11)], progress=False)
    for batch in tracker:
        model(batch["input_ids"]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return tracker


def test_each_compile_reaches_a_listener_at_most_twice_on_the_guides_loop(counter):
    tracker = _guide_loop()
    final = counter.check()
    recorded = [e for r in tracker.history for e in r.compile_events]
    assert recorded and all(final[e.index] is e for e in recorded)  # the reader's own objects, no copies
    assert sum(r.compiles for r in tracker.history) == len(recorded)


def _decoder_style_loop(steps: int = 4):
    """A loop in the style of pytorch/xla's examples/train_decoder_only_base.py: a small causal
    decoder, fake data from ``xu.SampleGenerator`` through ``MpDeviceLoader``, the step compiled
    with ``torch_xla.compile``, a step closure every other step (written here for the test)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.utils.utils as xu

    vocab, seq, batch = 64 + next(_SIZES), 16, 4  # a vocabulary no other test compiled

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, 32)
            self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(32, vocab)

        def forward(self, ids):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
            return self.head(self.layer(self.embed(ids), src_mask=mask, is_causal=True))

    device = torch_xla.device()
    loader = xu.SampleGenerator(data=(torch.zeros(batch, seq, dtype=torch.int64),
                                      torch.zeros(batch, seq, dtype=torch.int64)), sample_count=steps)
    model = Decoder().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step_fn(data, target):
        optimizer.zero_grad()
        loss = loss_fn(model(data).view(-1, vocab), target.view(-1))
        loss.backward()
        optimizer.step()
        return loss

    compiled = torch_xla.compile(step_fn, full_graph=True, name="decoder_step_fn")
    losses = []
    tracker = tpukit.track(pl.MpDeviceLoader(loader, device), progress=False)
    for step, (data, target) in enumerate(tracker):
        loss = compiled(data, target)
        if step % 2 == 0:
            xm.add_step_closure(lambda v: losses.append(float(v)), args=(loss,))
    return tracker, losses


def test_each_compile_reaches_a_listener_at_most_twice_on_a_decoder_style_loop(counter):
    tracker, losses = _decoder_style_loop()
    final = counter.check()
    assert len(losses) == 2 and len(tracker.history) == 4
    recorded = [e for r in tracker.history for e in r.compile_events]
    assert recorded and all(final[e.index] is e for e in recorded)
    assert not any(e.recompilation for e in recorded), [e.describe() for e in recorded]


def test_each_compile_reaches_a_listener_at_most_twice_in_an_xla_cell(counter):
    import types

    from IPython.core.interactiveshell import InteractiveShell

    main, hooks = sys.modules["__main__"], (sys.displayhook, sys.excepthook)
    shell = InteractiveShell.instance(user_module=types.ModuleType("tpukit_pipeline_cells"))
    try:
        shell.run_cell("%load_ext tpukit", store_history=True)
        res = shell.run_cell("%%xla\nimport torch\nx = torch.ones(3, 5, device='xla')\ny = (x * 7 - 2).sum()\n"
                             "z = y.item()\nw = (x + z).mean()\n", store_history=True)
        assert res.success, res.error_in_exec
    finally:
        shell.run_cell("%unload_ext tpukit")
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = main
        sys.displayhook, sys.excepthook = hooks
    final = counter.check()
    assert len(final) >= 2  # the forced read and the closing sync
    assert all(e.settled for e in final.values())


def test_one_reader_reads_the_trace_and_the_dump_and_the_dashboard_never_classifies(rt):
    """Every open of the trace file and every listing of the dump folder happens on the reader's
    thread, and so does every classification, while a live dashboard polls for its refreshes."""
    from tpukit.widgets import Dashboard

    trace, dump = compiles.trace_file(), config.hlo_dir()
    assert trace and dump
    seen = {"open": set(), "listdir": set(), "classify": set()}
    active = [True]

    def audit(event, args):
        if not active[0]:
            return
        if event == "open" and args and str(args[0]) == trace:
            seen["open"].add(threading.current_thread().name)
        elif event == "os.listdir" and args and str(args[0]) == dump:
            seen["listdir"].add(threading.current_thread().name)

    sys.addaudithook(audit)  # hooks cannot be removed: `active` turns it off
    original = classify.Classifier.classify

    def recording(self, *a, **k):
        seen["classify"].add(threading.current_thread().name)
        return original(self, *a, **k)

    classify.Classifier.classify = recording
    try:
        dash = Dashboard(mode="widgets", show=False, plot=False)
        try:
            tracker = _dynamic_padding_loop()
        finally:
            dash.close()
    finally:
        classify.Classifier.classify = original
        active[0] = False
    alarms = [e for r in tracker.history for e in r.recompilations]
    assert alarms and dash.view().recompilations == len(alarms)
    assert seen["open"] == {"tpukit-compiles"}, seen
    assert seen["listdir"] == {"tpukit-compiles"}, seen
    assert seen["classify"] == {"tpukit-compiles"}, seen


TWO_LOOPS = """
import json, threading, tpukit
tpukit.setup(device="cpu", cpu_devices=2)
import torch, torch_xla
import torch_xla.core.xla_model as xm

def loop(key, lengths, width, index, out):
    # One thread per device, as torch_xla's own thread-per-device runner sets it up.
    device = xm.get_xla_supported_devices()[index]
    torch_xla._XLAC._xla_set_default_device(device)
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [{key: torch.randn(width, n, 4)} for n in lengths]
    try:
        tracker = tpukit.track(batches, progress=False, device=torch.device(device))
        for batch in tracker:  # the same lines in both threads: the same code place
            loss = model(batch[key]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[key] = [[e.describe(), list(e.evidence), e.recompilation] for r in tracker.history
                    for e in r.compile_events]
    except BaseException as exc:
        out[key] = repr(exc)

out = {}
threads = [threading.Thread(target=loop, args=("left", [8, 12, 16, 20], 3, 0, out)),
           threading.Thread(target=loop, args=("right", [5, 7, 9, 11], 6, 1, out))]
[t.start() for t in threads]
[t.join(300) for t in threads]
print("RESULT " + json.dumps(out))
"""


def test_two_tracked_loops_in_two_threads_each_name_only_their_own_inputs():
    """Two loops at the same code place, in two threads, each on its own device (as
    ``tpukit.launch`` runs replicas on XLA:CPU), with batches of different shapes."""
    import json

    from conftest import run_python

    done = run_python(TWO_LOOPS, env={"PJRT_DEVICE": "CPU"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT ", 1)[1])
    for key, other in (("left", "right"), ("right", "left")):
        found = out[key]
        assert isinstance(found, list), found
        alarms = [(text, evidence) for text, evidence, alarm in found if alarm]
        assert alarms, found
        assert all(any(ev.startswith(f"{key}: (") for ev in evidence) for _, evidence in alarms), alarms
        assert not any(other in text for text, _ in alarms), alarms
    left = [ev for _, evidence, alarm in out["left"] if alarm for ev in evidence]
    assert "left: (3, 8, 4) -> (3, 12, 4)" in left, left


TARGET_RUN = """
import json, time, tpukit
rt = tpukit.setup(device="cpu", target="v5e-1")
import torch
from tpukit import events
got = []

class Estimates:
    def on_tpu_estimate(self, ev, est):
        got.append([ev.index, ev.kind, est.target, est.fits, est.hbm_bytes, est.compile_s, est.flops])

events.add_listener(Estimates())
dash = tpukit.dashboard(mode="text", show=False)
model = torch.nn.Linear(64, 32).to(rt.device)
opt = torch.optim.AdamW(model.parameters())
tracker = tpukit.track([torch.randn(8, 64) for _ in range(3)], progress=False)
for x in tracker:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
events_ = [e.index for r in tracker.history for e in r.compile_events]
# A compile reaches the follower only once its graph's HLO is matched to it, which can be after the loop
# ended (a loaded machine): wait for an answer for every compile of the loop, not only for the
# follower's queue to be empty.
deadline = time.time() + 180
while (tpukit.tpu.follower().pending() or not set(events_) <= {g[0] for g in got}) and time.time() < deadline:
    time.sleep(0.2)
summary_tpu = tracker.summary()["tpu"]
from tpukit.widgets import render
shown = render.text_report(dash.view())
dash.close()

# A tracked loop with its own dashboard that ends before the TPU compiler answers for its last graph (a new
# one: it is sent once its CPU compile finished, and the loop ends right after): the dashboard shows the
# answers that come after its closing line, and then stops listening.
import contextlib, io, threading
# The TPU compiler can answer within the loop on a quiet machine: a listener ahead of the loop's dashboard
# holds the answers (events are called in registration order) until the loop has ended, so that the
# dashboard really closes before its last answer. Only the timing is held; the answers are the compiler's.
released = threading.Event()

class HoldAnswers:
    def on_tpu_estimate(self, ev, est):
        if threading.current_thread() is not threading.main_thread():  # never hold the loop itself
            released.wait(300)

events.add_listener(HoldAnswers())
late_out = io.StringIO()
with contextlib.redirect_stdout(late_out):
    small = torch.nn.Linear(48, 16).to(rt.device)
    small_opt = torch.optim.AdamW(small.parameters())
    loop = tpukit.track([torch.randn(4, 48) for _ in range(2)], progress=False, dashboard=True)
    for x in loop:
        small(x).square().mean().backward()
        small_opt.step()
        small_opt.zero_grad()
    waited_at_close = loop.dashboard.state.awaiting_estimates()
    released.set()
    loop_events = {e.index for r in loop.history for e in r.compile_events}
    deadline = time.time() + 180
    while not loop_events <= {g[0] for g in got} and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
late = {"waited": waited_at_close, "tpu_rows": len(loop.dashboard.view().tpu), "out": late_out.getvalue(),
        "listening": loop.dashboard in events.listeners()}

from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("%load_ext tpukit")
import contextlib, io
out = io.StringIO()
with contextlib.redirect_stdout(out):
    shell.run_cell("%%xla --target v5e-8\\nimport torch\\ny = (torch.ones(16, 16, device='xla') @ torch.ones(16, 16, device='xla')).sum()\\n")
# The follower stopped by hand: nothing compiles the graphs for a TPU now, so they no longer keep their HLO
# (a dashboard would wait for their answers); a %%xla --target cell keeps it for its own graphs only.
from tpukit import compiles
tpukit.tpu.unfollow()
kept = {"after_unfollow": compiles.reader().hlo.protos}
alone = io.StringIO()
with contextlib.redirect_stdout(alone):
    shell.run_cell("%%xla --target v5e-8\\nimport torch\\ny = (torch.ones(8, 8, device='xla') * 3).sum()\\n")
kept.update(after_cell=compiles.reader().hlo.protos, cell=alone.getvalue())
print("RESULT " + json.dumps({"target": rt.target, "got": got, "events": events_, "cell": out.getvalue(),
                              "report": rt.report(), "dashboard": shown, "summary": summary_tpu, "late": late,
                              "kept": kept}))
"""


def test_with_a_target_every_graph_is_compiled_for_it_in_the_background():
    """``setup(target="v5e-1")``: each graph the reader publishes reaches the real TPU compiler (in its
    worker process) and its answer reaches listeners once per compile; ``%%xla --target`` does it for
    one cell, for another target."""
    import json

    from conftest import run_python

    done = run_python(TARGET_RUN, env={"PJRT_DEVICE": "CPU"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert out["target"] == "v5e-1" and "target TPU" in out["report"]
    got = out["got"]
    assert set(out["events"]) <= {g[0] for g in got} and len(out["events"]) >= 2, out  # (the cell's come later)
    parameters = (64 * 32 + 32) * 4
    for index, kind, target, fits, hbm, compile_s, flops in got:
        assert target == "v5e-1" and fits and compile_s > 0
        assert hbm >= parameters  # the step's graph holds at least the parameters on the chip
    assert max(g[6] for g in got) >= 2 * 8 * 64 * 32  # the forward matmul's FLOPs at least
    rows = out["summary"]
    assert rows and all(r["target"] == "v5e-1" and r["answered"] and r["fits"] for r in rows), rows
    assert all(r["hbm_bytes"] <= r["hbm_limit_bytes"] and r["step_s_min"] > 0 for r in rows), rows
    # Every place that shows an answer names the compiler that gave it: by default the libtpu the installed
    # torch_xla's runtime loads (torch_xla 2.8: libtpu 0.0.17; 2.9: 0.0.21.1).
    runtime_compiler = tpukit.tpu.compiler.pins.pin()
    by = f"[libtpu {runtime_compiler.libtpu}, {runtime_compiler.name}'s compiler]"
    assert all(r["compiler"].startswith(f"libtpu {runtime_compiler.libtpu} ")
               and r["compiler_name"] == runtime_compiler.name for r in rows), rows
    shown = [ln for ln in out["dashboard"].splitlines() if "on the target TPU:" in ln]
    assert 1 <= len(shown) <= len({g[0] for g in got}) and all("v5e-1: fits" in ln for ln in shown), out["dashboard"]
    assert all(ln.endswith(by) for ln in shown), (by, shown)
    late = out["late"]  # the loop's dashboard closed before the TPU compiler's answer for its last graph
    assert late["waited"] and late["tpu_rows"] >= 1 and not late["listening"], late
    assert "tpukit: on the target TPU:" in late["out"] and "v5e-1: fits" in late["out"], late["out"]
    cell = out["cell"]
    assert "%%xla --target v5e-8: each graph compiled by the TPU compiler" in cell, cell
    assert "v5e-8: fits" in cell and "HBM per chip" in cell and by in cell, cell
    kept = out["kept"]  # with no follower, graphs keep their HLO only inside a %%xla --target cell
    assert not kept["after_unfollow"] and not kept["after_cell"], kept
    assert "%%xla --target v5e-8: each graph compiled" in kept["cell"] and "v5e-8: fits" in kept["cell"], kept


def test_a_process_removes_its_trace_and_dump_and_sweeps_those_of_dead_ones(tmp_path):
    """Every process that calls setup() removes its trace file and HLO dump folder when it ends; one
    that was killed cannot, so the next setup() removes what it left."""
    import os
    import signal
    import subprocess

    from conftest import run_python

    code = ("import os, sys, tpukit\n"
            "rt = tpukit.setup(device='cpu')\n"
            "import torch\n"
            "(torch.ones(3, device='xla') * 2).sum().item()\n"
            "print('TRACE', rt.trace_file, flush=True)\n"
            "if len(sys.argv) > 1: os.kill(os.getpid(), 9)\n")
    done = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert done.returncode == 0, done.stderr[-2000:]
    trace = done.stdout.split("TRACE ", 1)[1].split()[0]
    assert "compiles-" in trace and not os.path.exists(trace) and not os.path.exists(trace + ".hlo")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_"))}
    killed = subprocess.run([sys.executable, "-c", code, "kill"], capture_output=True, text=True, env=env)
    assert killed.returncode == -signal.SIGKILL
    left = killed.stdout.split("TRACE ", 1)[1].split()[0]
    assert os.path.exists(left)  # a killed process leaves its files ...
    again = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert not os.path.exists(left) and not os.path.exists(left + ".hlo")  # ... the next setup() sweeps them
