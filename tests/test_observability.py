"""Metrics snapshots, compile events, step closures and guards on XLA:CPU (issue: core observability)."""

import importlib
import inspect
import json
import re
import threading
import time

import pytest
import torch

import tpukit
from tpukit import _xla, compiles, events, metrics
from conftest import run_python


def _model(dev, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(dev)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _batches(n, size=16, change_at=None, new_size=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(1, n + 1):
        b = new_size if change_at is not None and i >= change_at else size
        out.append((torch.randn(b, 8, generator=g), torch.randint(0, 3, (b,), generator=g)))
    return out


def _train_step(model, opt, x, y):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_tracing_is_on_in_this_process(rt):
    assert compiles.tracing_enabled()
    assert compiles.reader().path == rt.trace_file


def test_induced_recompilation_is_found_at_the_right_line(rt):
    model, opt = _model(rt.device)
    data = _batches(8, change_at=5)
    with pytest.raises(tpukit.RecompilationError) as err:
        with tpukit.expect_compiles(max=0):
            loop_line = inspect.currentframe().f_lineno + 2
            tracker = tpukit.track(data, progress=False)
            for x, y in tracker:
                _train_step(model, opt, x, y)
    recs = tracker.history
    assert [r.step for r in recs] == list(range(1, 9))
    assert recs[4].compiles == 1  # step 5: batch 16 -> 12
    assert all(r.compiles == 0 for r in recs[2:4] + recs[5:])
    (event,) = recs[4].recompilations
    assert event.recompilation and "shape" in event.hint
    assert event.user_frame.filename == __file__ and event.user_frame.line == loop_line
    assert f"test_observability.py:{loop_line}" in str(err.value)
    # Steps 1 and 2 (optimizer state created, then steady graph) are warm-up, not alarms.
    assert not recs[0].recompilations and not recs[1].recompilations


def test_steady_loop_compiles_at_most_two_graphs_and_passes_guard(rt):
    model, opt = _model(rt.device, seed=3)
    tracker = tpukit.track(_batches(20, size=24), progress=False, guard=tpukit.no_recompile_after(warmup_steps=2))
    for x, y in tracker:
        _train_step(model, opt, x, y)
    s = tracker.summary()
    assert s["steps"] == 20 and s["compiles"] <= 2 and s["recompilations"] == 0
    assert sum(r.compiles for r in tracker.history[2:]) == 0


def test_guard_raises_on_a_late_compile(rt):
    model, opt = _model(rt.device, seed=4)
    with pytest.raises(tpukit.RecompilationError, match="after 2 warm-up step"):
        for x, y in tpukit.track(_batches(6, size=20, change_at=4, new_size=13), progress=False,
                                 guard=tpukit.no_recompile_after(warmup_steps=2)):
            _train_step(model, opt, x, y)


def test_log_adds_no_executions_and_reads_exact_values(rt):
    def run(with_log):
        model, opt = _model(rt.device, seed=5)
        data = _batches(6, size=10, seed=7)

        def loop():
            kept = []
            tracker = tpukit.track(data, progress=False)
            for x, y in tracker:
                loss = _train_step(model, opt, x, y)
                if with_log:
                    tpukit.log(loss=loss, lr=0.01)
                kept.append(loss.detach())
            return tracker, kept

        loop()  # warm both graphs first
        _xla.wait_device_ops()  # executions are counted when they finish
        before = metrics.snapshot()
        tracker, kept = loop()
        _xla.wait_device_ops()
        return metrics.snapshot() - before, tracker, kept

    plain, _, _ = run(False)
    logged, tracker, kept = run(True)
    assert logged.executions == plain.executions
    assert logged.compiles == plain.compiles == 0
    assert [r.scalars["loss"] for r in tracker.history] == [k.item() for k in kept]
    assert all(r.scalars["lr"] == 0.01 for r in tracker.history)


def test_values_logged_over_many_steps_are_read_together_and_land_on_their_steps(rt, monkeypatch):
    # The tracker reads logged values several steps at a time (a read waits for every execution
    # launched before it): each value must still land on its own step, and records must reach
    # listeners during the loop, not only at its end. READ_AFTER_S is shortened so a short loop
    # crosses it several times.
    monkeypatch.setattr(importlib.import_module("tpukit.steps"), "READ_AFTER_S", 0.15)
    torch.manual_seed(3)
    w = torch.randn(384, 384, device=rt.device) / 20
    x0 = torch.randn(384, 384, device=rt.device)
    _xla.sync()

    class Seen:
        def __init__(self):
            self.steps = []

        def on_step(self, rec):
            self.steps.append(rec.step)

    def loop(n):
        x, kept, seen, during = x0, [], Seen(), []
        tpukit.add_listener(seen)
        try:
            tracker = tpukit.track(range(n), progress=False)
            for _ in tracker:
                during.append(len(seen.steps))  # records published before this step began
                for _ in range(6):
                    x = torch.tanh(x @ w)
                value = x.mean()
                tpukit.log(value=value, step_no=len(kept))
                kept.append(value.detach())
                time.sleep(0.01)
        finally:
            tpukit.remove_listener(seen)
        return tracker, kept, seen, during

    loop(3)  # compiles the step
    _xla.wait_device_ops()
    before = metrics.snapshot()
    tracker, kept, seen, during = loop(30)
    delta = metrics.snapshot() - before
    assert delta.compiles == 0
    assert [r.scalars["value"] for r in tracker.history] == [k.item() for k in kept]
    assert [r.scalars["step_no"] for r in tracker.history] == list(range(30))
    assert seen.steps == list(range(1, 31))
    assert during[-1] >= 5, during  # records arrived while the loop ran
    assert 2 <= delta.to_host < 30, delta  # fewer device reads than steps, more than the final one


def test_a_listener_wanting_exact_steps_gets_each_record_before_the_next_step_is_launched(rt):
    # A profile of N steps must stop before step N + 1 runs: with a listener that sets
    # exact_steps, record k arrives when the loop has synced k steps, not k + 1 (and not in a burst).
    w = torch.randn(64, 64, device=rt.device) / 8
    _xla.sync()

    class Exact:
        exact_steps = True

        def __init__(self):
            self.syncs_at = []

        def on_step(self, rec):
            self.syncs_at.append((rec.step, metrics.snapshot().syncs - self.base))

    exact = Exact()
    tpukit.add_listener(exact)
    try:
        tracker = tpukit.track(range(6), progress=False)
        exact.base = metrics.snapshot().syncs + 1  # track() flushes once before step 1
        for i in tracker:
            x = torch.tanh(torch.full((64, 64), float(i), device=rt.device) @ w)
            tpukit.log(value=x.mean())
    finally:
        tpukit.remove_listener(exact)
    assert exact.syncs_at == [(k, k) for k in range(1, 7)], exact.syncs_at
    assert [r.step for r in tracker.history] == list(range(1, 7))
    assert all("value" in r.scalars for r in tracker.history)
    assert not events.wants_exact_steps()


def test_log_rejects_non_scalars(rt):
    with pytest.raises(ValueError, match="shape \\(3,\\)"):
        tpukit.log(v=torch.ones(3, device=rt.device))
    with pytest.raises(TypeError, match="str"):
        tpukit.log(v="high")


def test_item_inside_a_step_is_reported_as_forced_execution(rt):
    model, opt = _model(rt.device, seed=6)
    tracker = tpukit.track(_batches(3, size=9, seed=9), progress=False)
    for x, y in tracker:
        loss = _train_step(model, opt, x, y)
        item_line = inspect.currentframe().f_lineno + 1
        if loss.item() > 100:  # reading the value mid-step forces an execution
            pass
    forced = [e for r in tracker.history for e in r.compile_events if e.forced]
    assert forced, [e.describe() for r in tracker.history for e in r.compile_events]
    assert forced[0].user_frame.line == item_line
    assert ".item()" in forced[0].hint
    assert all(r.item_reads >= 1 for r in tracker.history)


def test_cpu_fallback_is_listed_in_delta(rt):
    before = tpukit.snapshot()
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], device=rt.device)
    idx = torch.nonzero(x)
    assert idx.cpu().flatten().tolist() == [1, 3]
    d = tpukit.snapshot() - before
    assert d.fallbacks.get("aten::nonzero", 0) >= 1
    assert "CPU fallbacks: aten::nonzero x" in str(d)
    assert d.to_host >= 1 and "device->host transfer" in str(d)
    assert d.memory is None  # XLA:CPU has no allocator stats: absent, not an error
    rows = dict(metrics.table(tpukit.snapshot(memory=True), full=True))
    assert rows["device memory"] == "not reported by this device"


def test_delta_line_format():
    a = metrics.Snapshot(time=0.0)
    b = metrics.Snapshot(time=2.0, compiles=2, compile_time=1.4, executions=5, execute_time=0.3, to_host=1,
                         fallbacks={"aten::nonzero": 3})
    assert str(b - a) == ("2 compiles (1.4 s) · 5 executions (0.3 s) · 1 device->host transfer · "
                          "CPU fallbacks: aten::nonzero x3")


def test_compiling_now_while_a_large_graph_compiles(rt):
    def big():
        x = torch.randn(64, 64, device=rt.device)
        for i in range(600):
            x = torch.tanh(x @ x.T * (1.0 + i / 1000.0)) + i
        torch_sync()

    from tpukit import _xla

    def torch_sync():
        _xla.sync(wait=True)

    assert tpukit.compiling_now() is None
    t = threading.Thread(target=big)
    t.start()
    seen = None
    deadline = time.time() + 120
    while t.is_alive() and time.time() < deadline and seen is None:
        seen = tpukit.compiling_now()
        time.sleep(0.02)
    t.join()
    assert seen is not None and seen.compiling and seen.start <= time.time()
    assert tpukit.compiling_now() is None
    done = compiles.reader().events[seen.index]
    assert done.end is not None and done.duration > 0


def test_cell_mapping_through_an_interactive_shell(rt):
    import sys
    import types

    from IPython.core.interactiveshell import InteractiveShell

    main, hooks = sys.modules["__main__"], (sys.displayhook, sys.excepthook)
    shell = InteractiveShell.instance(user_module=types.ModuleType("tpukit_cells"))
    try:
        shell.run_cell("import torch, tpukit", store_history=True)
        n0 = compiles.event_count()
        res = shell.run_cell("x = torch.ones(5, 7, device='xla')\n"
                             "y = (x * 3 + 1).sum()\n"
                             "value = y.item()\n", store_history=True)
        assert res.success, res.error_in_exec
        events = compiles.events_since(n0)
        assert events, "the cell compiled nothing"
        frame = events[-1].user_frame
        assert frame.cell == f"[{res.execution_count}]" and frame.line == 3
        assert events[-1].where == f"cell [{res.execution_count}] line 3"
    finally:
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = main  # the shell installs its own __main__
        sys.displayhook, sys.excepthook = hooks


def test_on_step_every_n_and_failing_listener_is_detached(rt):
    model, opt = _model(rt.device, seed=8)
    seen = []
    remove = tpukit.on_step(lambda r: seen.append(r.step), every=2)

    class Broken:
        calls = 0

        def on_step(self, rec):
            Broken.calls += 1
            raise RuntimeError("renderer exploded")

    broken = tpukit.add_listener(Broken())
    try:
        with pytest.warns(tpukit.TpukitWarning, match="renderer exploded"):
            tracker = tpukit.track(_batches(6, size=5), progress=False)
            for x, y in tracker:
                _train_step(model, opt, x, y)
    finally:
        remove()
        tpukit.remove_listener(broken)
    assert seen == [2, 4, 6]
    assert Broken.calls == 1 and broken not in events.listeners()
    assert len(tracker.history) == 6  # the loop went on


def test_on_step_outside_track_fires_per_sync(rt):
    from tpukit import _xla

    records = []
    remove = tpukit.on_step(records.append)
    try:
        x = torch.ones(4, device=rt.device)
        for _ in range(3):
            x = x * 2
            tpukit.log(total=x.sum())
            _xla.sync()
    finally:
        remove()
    assert [r.scalars.get("total") for r in records[-3:]] == [8.0, 16.0, 32.0]


def test_expect_compiles_decorator_passes_when_warm(rt):
    x = torch.ones(3, 3, device=rt.device)

    def f():
        return (x @ x + 1).sum()

    with tpukit.expect_compiles(max=1) as guard:
        first = f()
    assert guard.compiled == 1

    @tpukit.expect_compiles(max=0)
    def warm():
        return f()

    assert warm().item() == first.item() == 36.0  # same graph again: no compile, no error  # same graph again: no compile, no error


def test_without_tracing_counts_still_work_and_say_so():
    code = ("import tpukit, torch\n"
            "tpukit.setup(device='cpu', trace_compiles=False)\n"
            "from tpukit import compiles\n"
            "print(compiles.tracing_enabled())\n"
            "try:\n"
            "    with tpukit.expect_compiles(max=0):\n"
            "        r = (torch.ones(3, device='xla') * 5).sum()\n"
            "except tpukit.RecompilationError as e:\n"
            "    print(str(e).replace('\\n', ' '))\n")
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-2] == "False"
    assert "compiled 1" in lines[-1] and "compile tracing is off" in lines[-1]


def test_compile_events_end_under_spmd():
    # Under SPMD torch_xla writes the "Post Compilation" block to stderr, not the trace
    # file; the event must still end (the runtime's compile count says it finished).
    code = ("import tpukit, torch\n"
            "rt = tpukit.setup(device='cpu', cpu_devices=4, spmd=True)\n"
            "from tpukit import compiles, _xla\n"
            "x = tpukit.shard_batch(torch.randn(8, 4), tpukit.mesh())\n"
            "y = (x * 2).sum(); _xla.sync(wait=True)\n"
            "evs = compiles.settled()  # waits for the reader\n"
            "print(len(evs), all(e.end is not None for e in evs), tpukit.compiling_now())\n")
    out = run_python(code, env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    n, ended, now = out.stdout.strip().splitlines()[-1].split()
    assert int(n) >= 1 and ended == "True" and now == "None"


def test_track_moves_mapping_batches_like_batchencoding(rt):
    from collections import UserDict  # transformers' BatchEncoding is a UserDict

    batches = [UserDict({"x": torch.ones(4, 3), "y": torch.zeros(4)}) for _ in range(2)]
    tracker = tpukit.track(batches, progress=False)
    for b in tracker:
        assert b["x"].device.type == "xla" and b["y"].device.type == "xla"
    assert [r.batch_size for r in tracker.history] == [4, 4]


def test_library_only_stack_still_names_a_place():
    from tpukit.compiles import CompileEvent, Frame

    frames = (Frame("all", "/venv/lib/python3.11/site-packages/torch/_tensor.py", 10),
              Frame("mask", "/venv/lib/python3.11/site-packages/transformers/masking_utils.py", 369))
    ev = CompileEvent(0, 0.0, 1.0, "user code trying to access tensor value", "ab" * 16, 1, 1, frames)
    assert ev.user_frames == () and ev.user_frame.line == 369 and "masking_utils.py:369" in ev.where


def test_events_registry_dispatch_reset_and_errors():
    """One registry: listeners need a hook, call() reaches only those with it, _reset() empties it."""
    class OnlyCompile:
        def __init__(self):
            self.seen = []

        def on_compile(self, ev):
            self.seen.append(ev)

    lst = events.add_listener(OnlyCompile())
    assert events.add_listener(lst) is lst and events.listeners().count(lst) == 1  # added once
    events.call("on_step", "record")  # no on_step: not called, no error
    events.call("on_compile", "event")
    assert lst.seen == ["event"] and events.has("on_compile") and not events.has("on_step")
    with pytest.raises(TypeError, match="none of the listener methods"):
        events.add_listener(object())
    with pytest.raises(ValueError, match="unknown listener hook"):
        events.call("on_nothing")
    events._reset()
    assert events.listeners() == []


def test_eager_mode_per_op_compiles_are_counted():
    """Eager mode compiles each new op by itself (torch_xla's EagerOp* metrics): counted like lazy compiles."""
    out = run_python(
        "import tpukit\nrt = tpukit.setup(device='cpu')\nimport torch\n"
        "from torch_xla.experimental import eager_mode\n"
        "before = tpukit.snapshot()\neager_mode(True)\n"
        "x = torch.randn(4, 8, device=rt.device)\ny = torch.tanh(x @ x.T).sum()\n"
        "eager_mode(False)\nd = tpukit.snapshot() - before\n"
        "print('EAGER', d.compiles, d.compile_time > 0, d.executions)\n", env={"PJRT_DEVICE": "CPU"})
    assert out.returncode == 0, out.stderr
    compiled, timed, executed = out.stdout.split("EAGER ", 1)[1].split()
    assert int(compiled) >= 3 and timed == "True" and int(executed) >= 3  # randn, mm, tanh, sum: one graph each


EAGER_LOOP = """\
import json, tpukit
rt = tpukit.setup(device='cpu')
import torch
import torch_xla.debug.metrics as met
from torch_xla.experimental import eager_mode
from tpukit import compiles, eager
count = lambda: (met.metric_data('EagerOpCompileTime') or (0,))[0]
w = torch.randn(8, 5).to(rt.device)
eager_mode(True)
n0, e0 = count(), compiles.event_count()
tracker = tpukit.track([torch.randn(n, 8) for n in (4, 4, 6)], progress=False, dashboard=True)
for x in tracker:
    y = torch.tanh(x @ w).sum()
n1, e1 = count(), compiles.event_count()
def body(x):
    return torch.relu(x @ w)
for batches, shapes in (([torch.randn(3, 8)], None), ([torch.randn(7, 8)], [7])):
    for x in tpukit.track(batches, progress=False, shapes=shapes):
        body(x)
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic('load_ext', 'tpukit')
shell.push({'torch': torch, 'rt': rt})
assert shell.run_cell('def f(n):\\n    return torch.sigmoid(torch.randn(n, 5, device=rt.device)).sum()', store_history=True).success
assert shell.run_cell('for n in (2, 2, 9):\\n    f(n)', store_history=True).success
assert shell.run_cell('%%xla\\nz = torch.exp(torch.randn(3, 7, device=rt.device))', store_history=True).success
n2 = count()
eager_mode(False)
stack = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
lazy = torch.cos(torch.randn(5, 3, device=rt.device)).sum()
tpukit._xla.sync()
evs = compiles.events_since(e0)
s = tracker.summary()
from tpukit.widgets import render
rows = dict(render.counter_rows(tracker.dashboard.state.view()))
print('RESULT', json.dumps({
    'metric': [n1 - n0, n2 - n0], 'active': eager.active(), 'stack': stack,
    'steps': [[r.compiles, r.eager_compiles, [e.describe() for e in r.compile_events]] for r in tracker.history],
    'all': [e.describe() for e in evs], 'eager_events': sum(e.eager for e in evs), 'loop_events': e1 - e0,
    'eager': s['eager_compiles'], 'note': s['eager_note'], 'rows': rows}))
"""


def test_eager_mode_compiles_are_named_at_the_users_lines(tmp_path):
    """Eager mode's per-op compiles (no compile analysis from torch_xla) are published by tpukit.eager as compile
    events at the user's line with the op's name, in a file and in cells, classified by place: new graph, a shape
    change a recompilation naming the shapes, a declared shape expected; the counts equal EagerOpCompileTime; after
    eager mode is switched off nothing watches the ops any more."""
    script = tmp_path / "loop.py"
    script.write_text(EAGER_LOOP)
    out = run_python(f"exec(compile(open({str(script)!r}).read(), {str(script)!r}, 'exec'))",
                     env={"PJRT_DEVICE": "CPU", "TPUKIT_DASHBOARD": "text"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.split("RESULT ", 1)[1])
    report = out.stdout.split("RESULT ", 1)[0]
    (c1, e1, ev1), (c2, e2, ev2), (c3, e3, ev3) = r["steps"]
    assert c1 == e1 == len(ev1) >= 3 and (c2, e2, ev2) == (0, 0, []), r["steps"]  # matmul, tanh, sum; then cached
    assert all(d.startswith("new graph: eager op ") for d in ev1), ev1  # the tracker's .to(device) at line 12
    assert sum(" at loop.py:13 in <module> " in d for d in ev1) >= 3, ev1
    assert {d.split(" at ")[0] for d in ev1} >= {"new graph: eager op matmul", "new graph: eager op tanh",
                                                 "new graph: eager op sum"}, ev1
    assert c3 == e3 == len(ev3) >= 3 and all(d.startswith("recompilation: eager op ") for d in ev3), ev3
    assert any("matmul: (4, 8) -> (6, 8)" in d for d in ev3) and any("tanh: (4, 5) -> (6, 5)" in d for d in ev3)
    assert r["metric"][0] == r["eager"] == c1 + c3 == r["loop_events"], r  # counts equal torch_xla's metric
    assert r["metric"][1] == r["eager_events"], r  # every eager compile is one event, in cells too
    body = [d for d in r["all"] if "at loop.py:16 in body" in d]
    assert any(d.startswith("new graph: eager op matmul") for d in body), body
    assert any(d.startswith("expected compile: eager op matmul") and "matmul: (3, 8) -> (7, 8)" in d
               and "a declared shape" in d for d in body), body
    cell = [d for d in r["all"] if " at cell [1] line 2 " in d]
    assert any(d.startswith("new graph: eager op sigmoid") for d in cell), r["all"]
    assert any(d.startswith("recompilation: eager op sigmoid") and "sigmoid: (2, 5) -> (9, 5)" in d for d in cell)
    assert re.search(r"new graph: eager op exp at cell \[3\] line 2 \(1 -> 1\), [\d.]+ s: first graph here", report)
    assert not r["active"] and "EagerOps" not in r["stack"], r  # lazy mode: no per-op hook left
    assert not any("eager op cos" in d for d in r["all"]) and r["all"][-1].startswith("new graph: step graph at loop.py:31")
    assert r["note"].startswith(f"{r['eager']} of the compiles: {compiles.EAGER_NOTE}: eager op ")
    assert "eager op matmul at loop.py:13 in <module>" in r["note"], r["note"]
    assert r["rows"]["eager-mode ops"].startswith(f"{r['eager']} compiled one by one: ") and (
        "matmul at loop.py:13 in <module>" in r["rows"]["eager-mode ops"]), r["rows"]  # the dashboard
