"""The live dashboard (tpukit.widgets): state, renderers, thread, front-end choice, report.

Synthetic StepRecords/CompileEvents drive most tests; a tiny MLP trained with
tpukit.track on XLA:CPU gives real records. The alarm contract: only
recompilations are alerts (the red counter, the alert list); new graphs and
expected compiles are counted and listed apart. When the tracked loop that
opened the dashboard ends, its report takes the live widget's place. The long-compile and SPMD checks run
in a subprocess that calls tpukit.setup() before torch_xla starts (compile
tracing and virtual devices are fixed when the runtime starts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from types import SimpleNamespace

import pytest

import tpukit
from tpukit import compiles, events
from tpukit.compiles import CompileEvent, Frame
from tpukit.errors import TpukitWarning
from tpukit.runtime import Runtime
from tpukit.steps import StepRecord
from tpukit.verdict import Verdict
from tpukit.widgets import Dashboard, DashboardState, Report, choose_frontend, detect_context
from tpukit.widgets import frontend, render
from tpukit.widgets import report as report_mod
from tpukit.widgets.model import Timeline
from tpukit.widgets.plot import TimelinePlot

PNG = b"\x89PNG\r\n\x1a\n"
HASH = "5ca807d1e2f3a4b5"
HINT = "bucket or pad the batches to a few fixed lengths (tpukit.data.BucketBatcher)"
EVIDENCE = ("input_ids: (8, 16) -> (8, 24)",)


@pytest.fixture(scope="module")
def rt():
    return tpukit.setup(device="cpu")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("TPUKIT_DASHBOARD", "NBVAL", "CI"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def opened():
    """Dashboards opened by a test; closed afterwards whatever happens."""
    made: list[Dashboard] = []
    yield made
    for d in made:
        d.close()


def event(index, *, kind="recompilation", end=0.0, start=0.0, graph=HASH, line=5, cause="user code",
          evidence=None):
    """A CompileEvent as the core publishes it: ``kind`` "recompilation", "new graph",
    "expected", or "compile" (not classified yet, e.g. still compiling)."""
    frames = (Frame("train_step", "/tmp/ipykernel/cell7.py", line, cell="[7]"),)
    alarm = kind == "recompilation"
    if evidence is None:
        evidence = EVIDENCE if alarm else ("first graph here",) if kind == "new graph" else ()
    return CompileEvent(index=index, start=start, end=end, cause=cause, graph_hash=graph, inputs=3, outputs=2,
                        frames=frames, recompilation=alarm, hint=HINT if alarm else None, kind=kind,
                        evidence=tuple(evidence))


def record(step, *, t0=1000.0, wall=0.05, compiles_=0, events=(), loss=None, fallbacks=None, batch=None,
           times=None):
    """A StepRecord; ``times``: (input, tracing, wait, device) seconds as track() measures them."""
    start = t0 + step
    measured = dict(zip(("input_time", "tracing_time", "wait_time", "device_time"), times)) if times else {}
    return StepRecord(step=step, start=start, end=start + wall, compiles=compiles_,
                      compile_time=0.5 * compiles_, executions=1, execute_time=wall / 2, to_host=1,
                      scalars={} if loss is None else {"loss": loss}, batch_size=batch,
                      compile_events=tuple(events), fallbacks=fallbacks or {}, **measured)


def three_steps():
    """3 steps: step 1 compiles a new graph (warm-up), step 3 recompiles at cell [7] line 5."""
    first, recompile = event(100, kind="new graph"), event(101, graph="a1b2c3d4", line=5)
    recs = [record(1, compiles_=1, events=[first], loss=1.0, fallbacks={"aten::nonzero": 2}),
            record(2, loss=0.8),
            record(3, compiles_=1, events=[recompile], loss=0.6)]
    return recs, recompile


def counter(html_text: str, label: str) -> str:
    m = re.search(re.escape(label) + r"</span></td><td[^>]*>(.*?)</td>", html_text)
    assert m, f"no {label!r} counter in {html_text}"
    return m.group(1)


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def dashboard_threads():
    return [t for t in threading.enumerate() if t.name.startswith("tpukit-dashboard") and t.is_alive()]


# ---------------------------------------------------------------- front-end choice

def test_frontend_choice_per_context_env_and_mode(monkeypatch):
    assert detect_context() == "none"  # pytest: no IPython shell
    assert [choose_frontend("auto", c) for c in ("colab", "jupyter", "ipython", "none")] == \
        ["widgets", "widgets", "text", "text"]
    assert choose_frontend("text", "jupyter") == "text"
    assert choose_frontend("widgets", "none") == "widgets"
    monkeypatch.setenv("TPUKIT_DASHBOARD", "text")  # what nbval/nbconvert runs set
    assert choose_frontend("auto", "jupyter") == "text"
    assert choose_frontend("widgets", "jupyter") == "widgets"  # an explicit mode wins
    monkeypatch.setenv("TPUKIT_DASHBOARD", "widgets")
    assert choose_frontend("auto", "none") == "widgets"
    monkeypatch.delenv("TPUKIT_DASHBOARD")
    monkeypatch.setenv("CI", "true")
    assert choose_frontend("auto", "colab") == "text"
    with pytest.raises(ValueError, match="mode"):
        choose_frontend("html")


def test_detect_context_kernel_colab_terminal(monkeypatch):
    import IPython

    class ZMQInteractiveShell:  # what ipykernel runs
        config: dict = {"IPKernelApp": {}}

    class TerminalInteractiveShell:
        config: dict = {}

    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    assert detect_context() == "jupyter"
    monkeypatch.setitem(sys.modules, "google.colab", SimpleNamespace())
    assert detect_context() == "colab"
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.setattr(IPython, "get_ipython", lambda: TerminalInteractiveShell())
    assert detect_context() == "ipython"


# ---------------------------------------------------------------- pure state

def test_state_counts_steps_compiles_and_recompilation_alert():
    st = DashboardState(max_alerts=2)
    recs, recompile = three_steps()
    st.add_compile(recompile)  # the polling thread sees it before the step record
    for r in recs:
        st.add_step(r)
    v = st.view(now=2000.0)
    assert (v.steps, v.compiles, v.recompilations, v.new_graphs, v.expected, v.executions) == (3, 2, 1, 1, 0, 3)
    assert v.fallbacks == {"aten::nonzero": 2} and v.scalars == {"loss": 0.6}
    (alert,) = v.alerts
    assert alert.step == 3 and alert.where == "cell [7] line 5" and alert.hint == HINT
    assert alert.name == "step graph at cell [7] line 5 (3 -> 2)" and alert.evidence == EVIDENCE
    html_counters = render.counters_html(v)
    assert counter(html_counters, "steps") == "3"
    assert counter(html_counters, "recompilations").endswith(">1</b>")
    alerts = render.alerts_html(v)
    assert "<b>1 recompilation</b>" in alerts  # singular: "1 recompilations" was a bug
    assert "step graph at cell [7] line 5 (3 -&gt; 2)" in alerts and "a1b2c3…" in alerts
    assert "input_ids: (8, 16) -&gt; (8, 24)" in alerts and "Bucket or pad the batches" in alerts
    assert alerts.index("input_ids") < alerts.index("Bucket or pad") < alerts.index("a1b2c3…")  # hash last
    for i in range(5):  # the list is capped, latest on top, the total still counts all
        st.add_compile(event(200 + i, line=10 + i))
    v = st.view()
    assert v.recompilations == 6 and [a.where for a in v.alerts] == ["cell [7] line 14", "cell [7] line 13"]
    assert "latest 2 shown" in render.alerts_html(v)


def test_only_recompilations_are_alarms_new_graphs_and_expected_are_shown_apart():
    st = DashboardState()
    st.add_compile(event(1, kind="compile", end=None))  # still compiling: not classified, nowhere yet
    v = st.view()
    assert (v.recompilations, v.new_graphs, v.expected, v.alerts, v.graphs) == (0, 0, 0, (), ())
    st.add_compile(event(1, kind="new graph", evidence=("first graph here (139 ops, 12 -> 17)",)))
    st.add_compile(event(2, kind="new graph", line=9, evidence=("+21 ops (118 -> 139); +5 inputs",)))
    st.add_compile(event(3, kind="expected", evidence=("input_ids: (8, 32) -> (8, 64)", "a declared shape")))
    st.add_compile(event(3, kind="expected"))  # the same event again: counted once
    st.add_step(record(1, compiles_=3, events=[event(1, kind="new graph"), event(2, kind="new graph", line=9),
                                                event(3, kind="expected")]))
    v = st.view()
    assert (v.recompilations, v.new_graphs, v.expected, v.alerts_total) == (0, 2, 1, 0)
    assert [(g.step, g.label) for g in v.graphs] == [(1, "expected compile"), (1, "new graph"), (1, "new graph")]
    html_counters = render.counters_html(v)
    assert counter(html_counters, "recompilations") == "0"  # not red: nothing to fix
    assert counter(html_counters, "new graphs") == f"<span style='color:{render.MUTED}'>2</span>"
    assert counter(html_counters, "expected compiles").endswith(">1</span>")
    assert render.alerts_html(v) == f"<div style='color:{render.MUTED}'>no recompilations</div>"
    graphs = render.graphs_html(v)
    assert "2 new graphs, 1 expected compile (not alarms)" in graphs
    assert "+21 ops (118 -&gt; 139); +5 inputs" in graphs and "step graph at cell [7] line 9" in graphs
    assert "a declared shape" in graphs and render.BAD not in graphs
    text = render.text_report(v)
    assert "new graph at step 1: step graph at cell [7] line 9 (3 -> 2): +21 ops (118 -> 139); +5 inputs" in text
    assert "expected compile at step 1" in text and "recompilation at" not in text
    assert render.text_line(v).startswith("tpukit: step 1 · 3 compiles · step ")  # no recompilation part


def test_now_line_idle_executing_compiling():
    clock = [5000.0]
    st = DashboardState(clock=lambda: clock[0])
    assert st.view().now == "idle"
    st.track_started()
    assert st.view().now == "executing step 1"
    st.add_step(record(1, t0=4990.0))
    assert st.view().now == "executing step 2"
    running = event(7, kind="compile", start=clock[0] - 12.0, end=None)
    st.add_compile(running)
    v = st.view()
    assert v.now == "compiling step graph at cell [7] line 5 (3 -> 2) for 12 s" and v.now_kind == "compiling"
    st.add_compile(event(7, kind="compile", start=clock[0] - 12.0, end=clock[0]))  # the same compile, finished
    assert st.view().now == "executing step 2"
    st.track_ended()
    assert st.view().now == "idle"


def test_header_shows_spmd_devices_and_problems():
    runtime = Runtime(platform="colab", device_type="TPU", accelerator_type="v2-8", device="xla:0", device_count=8,
                      process_count=1, world_size=1, spmd=True, versions={"torch": "2.9.0", "torch_xla": "2.9.0"},
                      compile_cache=None, trace_file="/tmp/t.log", problems=("torch_xla was imported before setup",))
    h = render.header_html(runtime, tracing=True)
    assert "8 × TPU · SPMD" in h and "colab" in h and "torch_xla 2.9.0" in h
    assert f"color:{render.WARN}'>⚠ torch_xla was imported before setup" in h
    assert "not set up yet" in render.header_html(None, tracing=False)


# ---------------------------------------------------------------- widgets

def test_widget_values_after_synthetic_events(rt, opened):
    # Earlier tests' compiles (some written to the trace by their child processes) read and
    # classified before this dashboard listens: it must count only the synthetic events below.
    compiles.settled()
    d = Dashboard(mode="widgets", show=False)
    opened.append(d)
    assert d.mode == "widgets" and d.running and d in events.listeners()
    recs, recompile = three_steps()
    events.call("on_compile", recompile)  # the core's own listener path
    for r in recs:
        events.call("on_step", r)
    d.refresh()
    values = d.values()
    assert counter(values["counters"], "steps") == "3"
    assert "cell [7] line 5" in values["alerts"] and "Bucket or pad the batches" in values["alerts"]
    assert "1 new graph (not alarms)" in values["graphs"]
    assert "aten::nonzero" in values["fallbacks"] and ">2<" in values["fallbacks"]
    assert "CPU" in values["header"]
    assert wait_for(lambda: d.image is not None), "the thread never drew the timeline"
    assert d.image.startswith(PNG)
    assert repr(d._live.box).startswith("tpukit dashboard (live widgets")  # what GitHub/nbval see
    assert d._live.image.layout.display is None  # shown once it holds a PNG


def test_image_is_hidden_until_the_first_plot(rt, opened):
    d = Dashboard(mode="widgets", show=False)
    opened.append(d)
    assert d.image is None and d._live.image.layout.display == "none"  # no broken-image icon (Colab)
    d._live.update({}, PNG + b"...")
    assert d._live.image.layout.display is None and d.image.startswith(PNG)


def test_thread_updates_now_line_while_main_thread_is_blocked(rt, opened):
    running = event(9, kind="compile", start=time.time() - 12.0, end=None)
    d = Dashboard(mode="widgets", show=False, plot=False)
    opened.append(d)
    events.call("on_compile", running)  # the reader publishes a compile as it starts
    time.sleep(1.2)  # the main thread does nothing: only the dashboard's thread can update the widget
    now = d.values()["now"]
    assert re.search(r"compiling step graph at cell \[7\] line 5 \(3 -&gt; 2\) for 1[23] s", now), now


def test_text_mode_in_a_terminal_reports_a_long_compile_from_the_thread(rt, opened, capsys):
    running = event(11, kind="compile", start=time.time() - 30.0, end=None)
    d = Dashboard(mode="text", text_every=0.2, show=False)
    opened.append(d)
    events.call("on_compile", running)  # started, never finished: the thread says so
    assert wait_for(lambda: "compiling step graph at cell [7] line 5" in capsys.readouterr().out, timeout=3.0)
    time.sleep(0.3)
    d.close()
    assert "tpukit: done · no steps yet" in capsys.readouterr().out


def test_compiling_now_comes_from_the_events_and_the_threads_never_ask_the_reader(rt, opened, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the dashboard asked the compile reader")

    d = Dashboard(mode="widgets", show=False)
    t = Dashboard(mode="text", show=False, text_every=0.0)
    opened += [d, t]
    for name in ("reader", "compiling_now", "tracing_enabled", "settled", "mark"):
        monkeypatch.setattr(compiles, name, forbidden)  # what the dashboards' threads must never call
    started = event(10_000, kind="compile", start=time.time() - 3.0, end=None)
    events.call("on_compile", started)  # as the reader publishes it when the compile starts
    time.sleep(1.2)  # a few periods of both threads
    assert "compiling step graph at cell [7] line 5" in d.values()["now"]
    assert t.view().now_kind == "compiling"
    events.call("on_compile", dataclasses.replace(started, end=time.time(), kind="new graph",
                                                   evidence=("first graph here",)))  # its finished version
    events.call("on_compile", started)  # a late duplicate of the start cannot make it compile again
    d.refresh()
    assert "compiling" not in d.values()["now"] and d.view().new_graphs == 1 and t.view().now_kind == "idle"
    assert not d.disabled and not t.disabled and d.running and t.running


def test_refreshes_are_throttled_to_two_per_second(rt, opened):
    d = Dashboard(mode="widgets", show=False, refresh_hz=2)
    opened.append(d)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 1.0 or n < 100:  # a second and 100 steps at least, however loaded the machine
        n += 1
        events.call("on_step", record(n, loss=1.0 / n))
        time.sleep(0.004)
    t1 = time.monotonic()
    in_window = [t for t in d.render_times if t0 <= t < min(t1, t0 + 1.0)]  # its first second
    assert 1 <= len(in_window) <= 2, in_window
    assert wait_for(lambda: d.view().steps == n)
    gaps = [b - a for a, b in zip(d.render_times, list(d.render_times)[1:])]
    assert all(g >= 0.5 - 1e-6 for g in gaps), gaps
    with pytest.raises(ValueError, match="refresh_hz"):
        Dashboard(mode="text", refresh_hz=10)


def test_plot_reuses_its_frame_for_a_1000_step_history():
    n = 1000
    tl = Timeline(list(range(1, n + 1)), [5.0, 5.0] + [0.0] * (n - 2), [0.005] * n, [0.01] * n, [0.03] * n,
                  {"loss": (list(range(1, n + 1)), [1.0 / k for k in range(1, n + 1)])}, 1)
    p = TimelinePlot()
    first = p.render(tl)
    tl2 = Timeline(tl.steps + [n + 1], tl.compile + [0.0], tl.input + [0.005], tl.tracing + [0.01],
                   tl.device + [0.031], {"loss": (tl.scalars["loss"][0] + [n + 1], tl.scalars["loss"][1] + [0.0009])},
                   2)
    second = p.render(tl2)
    assert first.startswith(PNG) and second.startswith(PNG) and first != second
    assert p.frames_drawn == 1  # same limits: only the data artists were redrawn
    assert "mean of 4 steps" in p.title.get_text() and "▲ 1 bar clipped" in p.clip_text.get_text()


def test_timeline_splits_steps_and_the_x_axis_stops_at_the_loops_total():
    st = DashboardState()
    st.track_started(SimpleNamespace(total=24, history=[], finished=None))
    st.add_step(record(1, wall=0.5, times=(0.1, 0.2, 0.15, 0.3)))
    st.add_step(record(2, wall=0.1))  # a sync outside track(): host and execution time instead
    tl = st.timeline()
    assert tl.steps == [1, 2] and tl.x_end == 24
    assert (tl.input[0], tl.tracing[0], tl.device[0]) == (0.1, 0.2, 0.15)
    assert (tl.input[1], tl.tracing[1], tl.device[1]) == (0.0, pytest.approx(0.05), 0.05)
    p = TimelinePlot()
    for k in range(3, 17):
        st.add_step(record(k, times=(0.01, 0.02, 0.01, 0.01)))
    p.render(st.timeline())
    assert p.ax_t.get_xlim()[1] <= 24 + 1  # live: nice limits, but never past step 24
    for k in range(17, 21):  # the loop stops early (a break at step 20)
        st.add_step(record(k, times=(0.01, 0.02, 0.01, 0.01)))
    st.track_ended()
    report_plot = TimelinePlot(stable_limits=False)
    report_plot.render(st.timeline())
    assert 20 < report_plot.ax_t.get_xlim()[1] < 21
    st.track_started(SimpleNamespace(total=5, history=[], finished=None))
    st.add_step(record(1))  # the next loop starts at step 1 again: the plot goes on after step 20
    assert st.timeline().steps[-1] == 21 and st.timeline().x_end == 25


# ---------------------------------------------------------------- failures and lifecycle

def test_listener_failure_disables_once_without_core_warning(rt, opened, monkeypatch):
    d = Dashboard(mode="text", text_every=0.0, show=False)
    opened.append(d)

    def broken(view, final=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(render, "text_line", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(1, 4):
            events.call("on_step", record(i))
    mine = [w for w in caught if issubclass(w.category, TpukitWarning)]
    assert len(mine) == 1 and "dashboard stopped after an error in on_step" in str(mine[0].message)
    assert d.disabled and d not in events.listeners()
    assert wait_for(lambda: not d.running)


def test_render_failure_in_thread_is_isolated_from_a_real_loop(rt, monkeypatch):
    import torch
    from torch import nn

    monkeypatch.setenv("TPUKIT_DASHBOARD", "widgets")
    calls = []
    real = render.counters_html

    def flaky(view):
        calls.append(threading.current_thread().name)
        if len(calls) > 1:  # the first (synchronous) render at open works, the thread's fail
            raise RuntimeError("renderer exploded")
        return real(view)

    monkeypatch.setattr(render, "counters_html", flaky)
    model = nn.Linear(4, 2).to(tpukit._xla.device())
    data = [torch.randn(2, 4) for _ in range(12)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = tpukit.track(data, dashboard=True, progress=False)
        for x in loop:
            tpukit.log(y=model(x).sum())
            time.sleep(0.1)  # long enough for the thread to refresh mid-loop
    d = loop.dashboard
    assert len(loop.history) == 12
    mine = [w for w in caught if issubclass(w.category, TpukitWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "renderer exploded" in str(mine[0].message) and "training loop is not affected" in str(mine[0].message)
    assert d.disabled and not d.running and d not in events.listeners()
    assert "tpukit-dashboard" in calls and "dashboard stopped" in d.values()["now"]


def test_close_stops_threads_and_two_dashboards_coexist(rt):
    a = Dashboard(mode="widgets", show=False, plot=False)
    b = Dashboard(mode="text", show=False)
    assert a.running and b.running and len(dashboard_threads()) >= 2
    events.call("on_step", record(1))
    assert a.view().steps == 1 and b.view().steps == 1
    a.close()
    b.close()
    b.close()  # idempotent
    assert not a.running and not b.running and not dashboard_threads()
    assert a not in events.listeners() and b not in events.listeners()
    events.call("on_step", record(2))
    assert a.view().steps == 1 and b.view().steps == 1


def test_text_mode_prints_throttled_summary_end_line_and_report(rt, capsys):
    d = Dashboard(mode="text", text_every=0.3)
    assert "text mode: a summary every 0.3 s" in capsys.readouterr().out
    tracker = SimpleNamespace(dashboard=d)
    events.call("on_track_start", tracker)
    recs, _ = three_steps()
    events.call("on_step", recs[0])
    assert capsys.readouterr().out == ""  # less than text_every since the dashboard opened
    time.sleep(0.35)
    events.call("on_step", recs[1])
    events.call("on_step", recs[2])  # right after a print: stays quiet
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("tpukit: step 2 · 1 compile") and "loss 0.8" in out[0]
    events.call("on_track_end", tracker)  # the loop that owns the dashboard ended: close + last line
    assert not d.running and d not in events.listeners()
    end = capsys.readouterr().out
    assert end.startswith("tpukit: done · step 3 · 2 compiles · 1 recompilation")
    d.report()  # no front end: plain text, the recompilation by name, evidence and hint, hash last
    rep = capsys.readouterr().out
    assert ("recompilation at step 3: step graph at cell [7] line 5 (3 -> 2): input_ids: (8, 16) -> (8, 24). "
            "Bucket or pad the batches to a few fixed lengths (tpukit.data.BucketBatcher) [graph a1b2c3d4]") in rep
    assert "new graph at step 1: step graph at cell [7] line 5 (3 -> 2): first graph here" in rep
    assert "CPU fallback aten::nonzero x2" in rep


class FakeSlot:
    """Stands in for a display handle: records what replaced the output."""

    def __init__(self, obj, cell):
        self.shown, self.cell, self.replaced = obj, cell, []

    def replace(self, obj):
        self.replaced.append(obj)


@pytest.fixture
def notebook(monkeypatch):
    """A notebook front end: what the dashboard displays (``shown``) and the outputs it shows
    with a display id (``slots``), in cell ``cell[0]``."""
    nb = SimpleNamespace(shown=[], slots=[], cell=[4])

    def show(obj):
        nb.slots.append(FakeSlot(obj, nb.cell[0]))
        return nb.slots[-1]

    monkeypatch.setattr(report_mod, "show", show)
    monkeypatch.setattr(report_mod, "display", lambda *objs: nb.shown.extend(objs))
    monkeypatch.setattr(report_mod, "current_cell", lambda: nb.cell[0])
    monkeypatch.setattr(frontend, "detect_context", lambda: "jupyter")
    return nb


def verdict(kind="input"):
    shares = {"compile": 0.05, "input": 0.7, "tracing": 0.2, "device": 0.04}
    return Verdict(kind, shares, 20, True, f"{kind}-bound over the 20 steps after step 2: compile 5%, input 70%, "
                   "tracing 20%, device 4% of the wall time", "the loop waits for its data: use more workers")


def test_verdict_line_and_warm_up_from_the_tracked_loop():
    st = DashboardState()
    assert render.verdict_html(st.view()) == "" and render.warmup_text(st.view()) is None  # no tracked loop
    tracker = SimpleNamespace(total=None, history=[], finished=None, verdict=lambda: None,
                              settled_after=lambda: None)
    st.track_started(tracker)
    st.add_step(record(1, compiles_=1))
    v = st.view()
    assert v.verdict is None and counter(render.counters_html(v), "warm-up").endswith(">not settled yet</span>")
    tracker.history = [object()] * 22  # the loop went on: the tracker is asked again, at most once a second
    tracker.verdict, tracker.settled_after = verdict, lambda: 2
    assert st.view().verdict is None  # throttled (a long history costs a walk over it)
    st.judge(force=True)
    v = st.view()
    assert v.verdict.bottleneck == "input" and v.settled_after == 2
    line = render.verdict_html(v)
    assert "<b>where the time goes:</b>" in line and "<b>input-bound</b> over the 20 steps after step 2" in line
    assert "input 70%" in line and "use more workers." in line
    assert render.verdict_text(v) == verdict().sentence + "; " + verdict().suggestion + "."
    assert dict(render.counter_rows(v))["warm-up"] == "settled after step 2"
    tracker.finished, tracker.settled_after = 99.0, lambda: None
    st.track_ended(tracker)
    v = st.view()
    assert v.loop_done and dict(render.counter_rows(v))["warm-up"] == "never settled: new graphs kept compiling"
    assert "where the time goes: input-bound over the 20 steps" in render.text_report(v)
    assert render.text_line(v, final=True).endswith("· input-bound · " + f"{v.elapsed:.1f} s")
    assert render.warmup_text(dataclasses.replace(v, settled_after=0)) == "none: nothing compiled"


def test_loop_cell_keeps_only_the_report(rt, notebook):
    d = Dashboard(mode="widgets", plot=True)  # shown in cell [4], replaceable
    (slot,) = notebook.slots
    assert slot.shown is d._live.box and slot.cell == 4
    tracker = SimpleNamespace(dashboard=d, total=3, history=[], finished=None, verdict=verdict,
                              settled_after=lambda: 1)
    events.call("on_track_start", tracker)
    recs, _ = three_steps()
    for r in recs:
        events.call("on_step", r)
    tracker.finished = time.time()
    events.call("on_track_end", tracker)  # the owner's loop ended: the dashboard closes...
    assert not d.running and not slot.replaced
    d.report()  # ... and track() asks for the report, in the same cell
    (rep,) = slot.replaced
    assert notebook.shown == []  # nothing else was added to the cell: the widget became the report
    assert isinstance(rep, Report) and rep.png.startswith(PNG)
    page = rep._repr_html_()
    assert page.count("class='tpukit-report'") == 1 and "tpukit-dashboard" not in page
    assert "src='data:image/png;base64," in page  # the timeline inside the one output
    assert "<b>input-bound</b>" in page and "settled after step 1" in page and "1 recompilation" in page
    text = repr(rep)  # the text/plain of the same output (GitHub without widget state, nbval)
    assert "where the time goes: input-bound" in text and "recompilation at step 3: step graph" in text
    assert d._live.box.comm is None  # the widget models are closed; their values stay readable
    assert "closed: 3 steps" in d.values()["now"]
    d.report()  # asked again: the live output is gone, so a new report is displayed
    assert len(slot.replaced) == 1 and isinstance(notebook.shown[0], Report)


def test_report_from_another_cell_is_shown_there(rt, notebook):
    d = Dashboard(mode="widgets", plot=False)  # cell [4]
    events.call("on_step", record(1))
    d.close()
    notebook.cell[0] = 5
    d.report()
    (slot,) = notebook.slots
    assert slot.replaced == []  # cell [4] keeps the frozen dashboard; cell [5] asked for the report
    rep, image = notebook.shown
    assert isinstance(rep, Report) and rep.png is None and image.data.startswith(PNG)


def test_real_loop_widgets_then_static_report(rt, notebook):
    import torch
    from torch import nn

    dev = tpukit._xla.device()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(6)]
    loop = tpukit.track(data, dashboard=True, batch_size=4, progress=False)
    for x, y in loop:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        tpukit.log(loss=loss)
    d = loop.dashboard
    assert d.mode == "widgets" and not d.running and d not in events.listeners()
    (slot,) = notebook.slots  # the live widget at open ...
    (report,) = slot.replaced  # ... became the report at the end, in the same output
    assert slot.shown is d._live.box and notebook.shown == []
    v = d.view()
    assert v.last_step == 6 and v.steps >= 6 and v.compiles >= 1 and v.executions >= 6
    assert v.scalars["loss"] == pytest.approx(loop.history[-1].scalars["loss"])
    assert "examples/s (batch 4)" in d.values()["counters"] and "closed: " in d.values()["now"]
    assert d.image.startswith(PNG)  # the final refresh drew the timeline
    page = report._repr_html_()
    assert "<table" in page and ">steps<" in page and "no recompilations" in page
    assert "new graph (not alarms)" in page or "new graphs (not alarms)" in page  # this loop's first graphs
    assert "steps" in repr(report) and "compiles" in repr(report)  # text/plain of the same output
    assert report.png.startswith(PNG)
    want = loop.verdict()
    assert v.verdict == want and v.settled_after == loop.settled_after()  # the tracker's own numbers
    assert f"{want.bottleneck}-bound</b>" in page and want.suggestion in page.replace("&#x27;", "'")
    assert loop.summary()["verdict"] in repr(report)


def small_mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(tpukit._xla.device())
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def classify(model, opt, x, y, reduction="mean"):
    import torch

    loss = torch.nn.functional.cross_entropy(model(x), y, reduction=reduction)
    loss.backward()
    opt.step()
    opt.zero_grad()
    tpukit.log(loss=loss)


def test_a_loop_whose_first_step_raises_ends_stopped_by_the_exception_in_text_and_summary(rt, capsys):
    import torch

    model, opt = small_mlp()
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(4)]
    loop = tpukit.track(data, dashboard=True, progress=False)
    with pytest.raises(RuntimeError, match="only for scalar outputs") as raised:
        for x, y in loop:
            classify(model, opt, x, y, reduction="none")  # a loss per example: backward() refuses it
    assert loop.dashboard.mode == "text"
    out = capsys.readouterr().out
    assert "tpukit: done" not in out, out
    (final,) = [line for line in out.splitlines() if line.startswith("tpukit: stopped")]
    assert final.startswith("tpukit: stopped by RuntimeError at step 1 · "), final
    assert "  stopped by RuntimeError at step 1" not in out  # the closing line said it: the report does not repeat it
    assert str(loop.stopped) == "stopped by RuntimeError at step 1" and loop.stopped.message == str(raised.value)
    assert loop.summary()["stopped"] == {"error": "RuntimeError", "message": str(raised.value), "step": 1,
                                         "hint": None}  # hint: the fix for a known failure on XLA


def test_a_loop_raising_at_step_3_shows_it_in_the_widgets_and_the_report(rt, notebook):
    import torch

    model, opt = small_mlp()
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(6)]
    loop = tpukit.track(data, dashboard=True, progress=False)
    with pytest.raises(KeyError, match="no such label"):
        for step, (x, y) in enumerate(loop, 1):
            classify(model, opt, x, y)
            if step == 3:
                {}["no such label"]
    d = loop.dashboard
    assert d.mode == "widgets" and not d.running
    assert [r.step for r in loop.history] == [1, 2, 3]  # the step that raised is recorded too
    assert "stopped by KeyError at step 3" in d.values()["now"] and render.BAD in d.values()["now"]
    (slot,) = notebook.slots
    (report,) = slot.replaced  # the report took the widget's place
    page = report._repr_html_()
    assert "<b>stopped by KeyError at step 3</b>: the loop ended with this exception" in page
    assert "\n  stopped by KeyError at step 3\n" in repr(report)  # its text/plain
    assert loop.summary()["stopped"]["step"] == 3


def test_a_loop_left_by_break_is_done_even_after_an_exception_it_caught(rt, capsys):
    import torch

    model, opt = small_mlp()
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(6)]
    caught = []
    loop = tpukit.track(data, dashboard=True, progress=False)
    for step, (x, y) in enumerate(loop, 1):
        classify(model, opt, x, y)
        try:
            {}["a label"]
        except KeyError as exc:  # kept: its traceback still points at this frame
            caught.append(exc)
        if step == 2:
            break
    out = capsys.readouterr().out
    assert "tpukit: done · step 2 · " in out and "stopped" not in out, out
    assert loop.stopped is None and loop.summary()["stopped"] is None


def test_a_guard_that_raises_ends_the_loop_stopped_by_it(rt, capsys):
    import torch

    model, opt = small_mlp()
    sizes = [5, 5, 5, 7, 7, 7]  # sizes no other test here compiles: step 4 recompiles, after 2 warm-up steps
    data = [(torch.randn(n, 8), torch.randint(0, 2, (n,))) for n in sizes]
    loop = tpukit.track(data, dashboard=True, progress=False, guard=tpukit.no_recompile_after(2))
    with pytest.raises(tpukit.RecompilationError, match="step 4 recompiled"):
        for x, y in loop:
            classify(model, opt, x, y)
    out = capsys.readouterr().out
    assert "tpukit: done" not in out
    assert re.search(r"^tpukit: stopped by RecompilationError at step 4 · ", out, re.M), out  # the step it judged
    assert loop.summary()["stopped"]["error"] == "RecompilationError"


# ---------------------------------------------------------------- real compile, SPMD (subprocess)

SCRIPT = textwrap.dedent("""
    import json, sys
    import tpukit
    dash = tpukit.dashboard(mode="widgets", show=False)  # opened first: must not import torch_xla
    imported_early = "torch_xla" in sys.modules
    rt = tpukit.setup(device="cpu", cpu_devices=2, spmd=True)  # so setup still configures the runtime
    import torch, torch_xla
    import torch_xla.distributed.spmd as xs
    from torch import nn
    from tpukit.widgets import render
    seen = []
    real = render.now_html
    def spy(view):
        seen.append(view.now)
        return real(view)
    render.now_html = spy
    dev = torch_xla.device()
    x = torch.randn(64, 64, device=dev)
    for i in range(150):  # one big unrolled graph: a compilation of a few seconds (it grows with the length:
        # 1200 steps took 130 s to compile on two busy cores, 300 took 32 s)
        x = torch.tanh(x @ x * 0.01 + i)
    torch_xla.sync()  # LONG_COMPILE_LINE: the main thread is blocked here
    mesh = xs.Mesh(list(range(2)), (2, 1))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(4)]
    for xb, yb in tpukit.track(data, progress=False):
        xs.mark_sharding(xb, mesh, (0, None))
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward(); opt.step(); opt.zero_grad()
        tpukit.log(loss=loss)
    dash.close()
    print("RESULT " + json.dumps({"tracing": tpukit.compiles.tracing_enabled(), "seen": seen,
                                  "imported_early": imported_early, "spmd": rt.spmd, "problems": rt.problems,
                                  "values": dash.values(), "last_step": dash.view().last_step,
                                  "running": dash.running}))
""")


@pytest.mark.slow
def test_real_long_compile_and_spmd_seen_by_the_thread(tmp_path):
    script = tmp_path / "long_compile.py"
    script.write_text(SCRIPT)
    line = next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if "LONG_COMPILE_LINE" in text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "XLA_", "CPU_NUM"))}
    env["PJRT_DEVICE"] = "CPU"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and out, proc.stderr[-3000:]
    res = json.loads(out[-1][len("RESULT "):])
    assert not res["imported_early"] and res["tracing"] and res["spmd"] and not res["problems"]
    during = [s for s in res["seen"] if f"long_compile.py:{line} in <module>" in s]
    assert during and all(s.startswith("compiling step graph at ") for s in during), res["seen"]
    assert any(int(re.search(r"for (\d+) s", s).group(1)) >= 1 for s in during), during  # it ticked during it
    assert "2 × CPU · SPMD" in res["values"]["header"]
    assert res["last_step"] == 4 and not res["running"]
    assert int(counter(res["values"]["counters"], "steps")) >= 4
