"""The live dashboard (tpukit.widgets): state, renderers, thread, front-end choice, report.

Synthetic StepRecords/CompileEvents drive most tests; a tiny MLP trained with
tpukit.track on XLA:CPU gives real records. The long-compile and SPMD checks run
in a subprocess that calls tpukit.setup() before torch_xla starts (compile
tracing and virtual devices are fixed when the runtime starts).
"""

from __future__ import annotations

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
from tpukit.widgets import Dashboard, DashboardState, choose_frontend, detect_context
from tpukit.widgets import dashboard as dash_mod
from tpukit.widgets import frontend, render
from tpukit.widgets.model import Timeline
from tpukit.widgets.plot import TimelinePlot

PNG = b"\x89PNG\r\n\x1a\n"
HASH = "5ca807d1e2f3a4b5"
HINT = "This line produced a new graph with the same inputs: most likely a tensor shape changed."


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


def event(index, *, recompilation=False, end=0.0, start=0.0, graph=HASH, line=5, cause="user code"):
    frames = (Frame("train_step", "/tmp/ipykernel/cell7.py", line, cell="[7]"),)
    return CompileEvent(index=index, start=start, end=end, cause=cause, graph_hash=graph, inputs=3, outputs=2,
                        frames=frames, recompilation=recompilation, hint=HINT if recompilation else None)


def record(step, *, t0=1000.0, wall=0.05, compiles_=0, events=(), loss=None, fallbacks=None, batch=None):
    start = t0 + step
    return StepRecord(step=step, start=start, end=start + wall, compiles=compiles_,
                      compile_time=0.5 * compiles_, executions=1, execute_time=wall / 2, to_host=1,
                      scalars={} if loss is None else {"loss": loss}, batch_size=batch,
                      compile_events=tuple(events), fallbacks=fallbacks or {})


def three_steps():
    """3 steps: step 1 compiles (warm-up), step 3 recompiles at cell [7] line 5."""
    first, recompile = event(100), event(101, recompilation=True, graph="a1b2c3d4", line=5)
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
    assert (v.steps, v.compiles, v.recompilations, v.executions) == (3, 2, 1, 3)
    assert v.fallbacks == {"aten::nonzero": 2} and v.scalars == {"loss": 0.6}
    (alert,) = v.alerts
    assert alert.step == 3 and alert.where == "cell [7] line 5" and alert.hint == HINT
    html_counters = render.counters_html(v)
    assert counter(html_counters, "steps") == "3"
    assert counter(html_counters, "recompilations").endswith(">1</b>")
    alerts = render.alerts_html(v)
    assert "cell [7] line 5" in alerts and "a1b2c3…" in alerts and "most likely a tensor shape changed" in alerts
    for i in range(5):  # the list is capped, latest on top, the total still counts all
        st.add_compile(event(200 + i, recompilation=True, line=10 + i))
    v = st.view()
    assert v.recompilations == 6 and [a.where for a in v.alerts] == ["cell [7] line 14", "cell [7] line 13"]
    assert "(latest 2 shown)" in render.alerts_html(v)


def test_now_line_idle_executing_compiling():
    clock = [5000.0]
    st = DashboardState(clock=lambda: clock[0])
    assert st.view().now == "idle"
    st.track_started()
    assert st.view().now == "executing step 1"
    st.add_step(record(1, t0=4990.0))
    assert st.view().now == "executing step 2"
    running = event(7, start=clock[0] - 12.0, end=None)
    st.add_compile(running)
    v = st.view()
    assert v.now == "compiling graph 5ca807… for 12 s, triggered by cell [7] line 5" and v.now_kind == "compiling"
    st.add_compile(event(7, start=clock[0] - 12.0, end=clock[0]))  # the same compile, finished
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
    assert "cell [7] line 5" in values["alerts"] and "most likely a tensor shape changed" in values["alerts"]
    assert "aten::nonzero" in values["fallbacks"] and ">2<" in values["fallbacks"]
    assert "CPU" in values["header"]
    assert wait_for(lambda: d.image is not None), "the thread never drew the timeline"
    assert d.image.startswith(PNG)
    assert repr(d._live.box).startswith("tpukit dashboard (live widgets")  # what GitHub/nbval see


def test_thread_updates_now_line_while_main_thread_is_blocked(rt, opened, monkeypatch):
    running = event(9, start=time.time() - 12.0, end=None)
    monkeypatch.setattr(compiles, "tracing_enabled", lambda: True)
    monkeypatch.setattr(compiles, "compiling_now", lambda: running)
    d = Dashboard(mode="widgets", show=False, plot=False)
    opened.append(d)
    time.sleep(1.2)  # the main thread does nothing: only the dashboard's thread can update the widget
    now = d.values()["now"]
    assert re.search(r"compiling graph 5ca807… for 1[23] s, triggered by cell \[7\] line 5", now), now


def test_text_mode_in_a_terminal_reports_a_long_compile_from_the_thread(rt, opened, monkeypatch, capsys):
    running = event(11, start=time.time() - 30.0, end=None)
    monkeypatch.setattr(compiles, "tracing_enabled", lambda: True)
    monkeypatch.setattr(compiles, "compiling_now", lambda: running)
    d = Dashboard(mode="text", text_every=0.2, show=False)
    opened.append(d)
    assert wait_for(lambda: "compiling graph" in capsys.readouterr().out, timeout=3.0)
    time.sleep(0.3)
    d.close()
    assert "tpukit: done · no steps yet" in capsys.readouterr().out


def test_refreshes_are_throttled_to_two_per_second(rt, opened):
    d = Dashboard(mode="widgets", show=False, refresh_hz=2)
    opened.append(d)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 1.0:
        n += 1
        events.call("on_step", record(n, loss=1.0 / n))
        time.sleep(0.004)
    t1 = time.monotonic()
    assert n > 100
    in_window = [t for t in d.render_times if t0 <= t < t1]
    assert 1 <= len(in_window) <= 2, in_window
    assert wait_for(lambda: d.view().steps == n)
    gaps = [b - a for a, b in zip(d.render_times, list(d.render_times)[1:])]
    assert all(g >= 0.5 - 1e-6 for g in gaps), gaps
    with pytest.raises(ValueError, match="refresh_hz"):
        Dashboard(mode="text", refresh_hz=10)


def test_plot_reuses_its_frame_for_a_1000_step_history():
    n = 1000
    tl = Timeline(list(range(1, n + 1)), [5.0, 5.0] + [0.0] * (n - 2), [0.03] * n, [0.01] * n,
                  {"loss": (list(range(1, n + 1)), [1.0 / k for k in range(1, n + 1)])}, 1)
    p = TimelinePlot()
    first = p.render(tl)
    tl2 = Timeline(tl.steps + [n + 1], tl.compile + [0.0], tl.execute + [0.031], tl.host + [0.01],
                   {"loss": (tl.scalars["loss"][0] + [n + 1], tl.scalars["loss"][1] + [0.0009])}, 2)
    second = p.render(tl2)
    assert first.startswith(PNG) and second.startswith(PNG) and first != second
    assert p.frames_drawn == 1  # same limits: only the data artists were redrawn
    assert "mean of 4 steps" in p.title.get_text() and "clipped" in p.clip_text.get_text()


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
    d.report()  # no front end: plain text, the recompilation with its cell and line
    rep = capsys.readouterr().out
    assert "recompilation at step 3, cell [7] line 5: user code." in rep and "CPU fallback aten::nonzero x2" in rep


def test_real_loop_widgets_then_static_report(rt, monkeypatch):
    import torch
    from torch import nn

    shown = []
    monkeypatch.setattr(dash_mod, "_display", lambda *objs: shown.extend(objs))
    monkeypatch.setattr(frontend, "detect_context", lambda: "jupyter")
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
    box, report, image = shown  # the live widget at open, then the report at the end
    assert box is d._live.box
    v = d.view()
    assert v.last_step == 6 and v.steps >= 6 and v.compiles >= 1 and v.executions >= 6
    assert v.scalars["loss"] == pytest.approx(loop.history[-1].scalars["loss"])
    assert "examples/s (batch 4)" in d.values()["counters"] and "closed: " in d.values()["now"]
    assert d.image.startswith(PNG)  # the final refresh drew the timeline
    page = report._repr_html_()
    assert "<table" in page and ">steps<" in page and "no recompilations" in page
    assert "steps" in repr(report) and "compiles" in repr(report)  # text/plain of the same output
    assert image.data.startswith(PNG)


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
    for i in range(1200):  # one big unrolled graph: a compilation of a few seconds
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
    assert during and all(s.startswith("compiling graph ") for s in during), res["seen"]
    assert any(int(re.search(r"for (\d+) s", s).group(1)) >= 1 for s in during), during  # it ticked during it
    assert "2 × CPU · SPMD" in res["values"]["header"]
    assert res["last_step"] == 4 and not res["running"]
    assert int(counter(res["values"]["counters"], "steps")) >= 4
