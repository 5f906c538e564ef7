"""tpukit.profile (issue 17): a torch_xla profiler trace of a block, or of N steps of a tracked
loop, written where TensorBoard/XProf read it, and its summary read back with XProf.

Runs on XLA:CPU in this process: torch_xla's profiler session is in-process (no server
is started), so nothing outlives a test.
"""

import importlib.util
import os
import re
import sys

import pytest
import torch

import tpukit
from tpukit import events
from tpukit.profile import Profile, ProfileSummary, read_trace, trace_stats
from tpukit.verdict import BOTTLENECKS

needs_xprof = pytest.mark.skipif(importlib.util.find_spec("xprof") is None,
                                 reason="XProf (tpukit[profile]) is not installed")


def kind(op):
    """``dot.93`` -> ``dot`` (XLA numbers each instance of an op)."""
    return re.sub(r"\.\d+$", "", op.name)


@pytest.fixture
def mlp(rt):
    """A small MLP, its optimizer, and a train(loader) running one tracked loop over it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 6)).to(rt.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def batches(n):
        return [(torch.randn(24, 48), torch.randint(0, 6, (24,))) for _ in range(n)]

    def train(n, on_step=None):
        tracker = tpukit.track(batches(n), progress=False)
        for i, (x, y) in enumerate(tracker):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            tpukit.log(loss=loss)
            if on_step is not None:
                on_step(i)
        return tracker

    train(3)  # compiled once, so the profiles below measure steady steps
    return train


def _xplane(prof, logdir):
    assert prof.trace_file and prof.trace_file.endswith(".xplane.pb"), prof.trace_file
    assert os.path.getsize(prof.trace_file) > 0
    rel = os.path.relpath(prof.trace_file, logdir).split(os.sep)
    assert rel[:2] == ["plugins", "profile"] and len(rel) == 4, rel  # TensorBoard/XProf's layout


@needs_xprof
def test_a_profiled_tracked_loop_writes_a_trace_whose_summary_names_its_matmul(mlp, tmp_path):
    with tpukit.profile(logdir=tmp_path) as prof:
        tracker = mlp(6)
    assert prof.done and [r.step for r in prof.records] == [1, 2, 3, 4, 5, 6]
    _xplane(prof, tmp_path)
    s = prof.summary()
    assert isinstance(s, ProfileSummary) and s.logdir == str(tmp_path.resolve())
    assert "dot" in [kind(op) for op in s.top_ops], s.text()  # the Linear layers' matmuls
    st = s.stats
    assert st.executions >= 6 and 0 < st.busy_s <= s.window_s and st.idle_s >= 0
    assert 0 < st.op_time_s and sum(op.total_s for op in st.ops) == pytest.approx(st.op_time_s)
    assert [op.total_s for op in st.ops] == sorted((op.total_s for op in st.ops), reverse=True)
    assert s.steps == 6 and s.verdict_from == "steps" and s.tracing_s > 0
    assert s.verdict is not None and s.verdict.bottleneck in BOTTLENECKS
    assert len(tracker.history) == 6
    text, page = repr(s), s._repr_html_()
    for part in ("6 steps of a tracked loop", "busy", "idle", "tracing", "verdict", prof.trace_file,
                 f"%tensorboard --logdir {s.logdir}", "%load_ext tensorboard", "XProf"):
        assert part in text, (part, text)
    assert "<table" in page and "%tensorboard --logdir" in page and "dot" in page
    assert len(prof.summary(top=2).top_ops) == 2


@needs_xprof
def test_steps_n_traces_only_the_next_n_steps_of_the_loop(mlp, tmp_path):
    with tpukit.profile(logdir=tmp_path, steps=3) as prof:
        tracker = mlp(7)
        assert prof.done  # stopped by the loop, at its third step
    assert len(tracker.history) == 7  # the loop itself ran on
    assert [r.step for r in prof.records] == [1, 2, 3]
    s = prof.summary()
    dots = [op for op in s.stats.ops if kind(op) == "dot"]
    assert dots and {op.calls for op in dots} == {3}, s.text()  # one execution per profiled step
    assert s.steps == 3 and "3 steps of a tracked loop" in repr(s)
    assert events.listeners() == []


@needs_xprof
def test_a_profile_started_inside_a_running_loop_takes_its_next_steps(mlp, tmp_path):
    started = {}

    def at(i):
        if i == 2:
            started["prof"] = tpukit.profile(logdir=tmp_path, steps=2).start()

    mlp(8, on_step=at)
    prof = started["prof"]
    assert prof.done
    got = [r.step for r in prof.records]
    assert len(got) == 2 and got[1] == got[0] + 1 and got[0] >= 3, got
    _xplane(prof, tmp_path)
    assert prof.summary().steps == 2


@needs_xprof
def test_a_block_without_a_tracked_loop_is_judged_from_the_trace(rt, tmp_path):
    with tpukit.profile(logdir=tmp_path) as prof:
        x = torch.randn(96, 96, device=rt.device)
        total = (x @ x).relu().sum().item()
    assert total >= 0
    s = prof.summary()
    assert s.steps == 0 and s.tracing_s is None and s.verdict_from == "trace"
    assert s.verdict is not None and "from the trace" in s.verdict.sentence
    assert "dot" in [kind(op) for op in s.top_ops], s.text()


@needs_xprof
def test_xprofs_own_log_lines_stay_out_of_the_output(mlp, tmp_path, capfd):
    with tpukit.profile(logdir=tmp_path) as prof:
        mlp(2)
    capfd.readouterr()
    prof.summary()
    err = capfd.readouterr().err
    assert not re.search(r"^[IWE]\d{4} ", err, re.M), err[-2000:]


def test_bad_arguments_are_clear_errors(tmp_path):
    for steps in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="positive number of tracked-loop steps"):
            tpukit.profile(steps=steps)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a directory")
    with pytest.raises(tpukit.TpukitError, match="is a file, not a directory"):
        tpukit.profile(logdir=a_file)
    with pytest.raises(tpukit.TpukitError, match="is a file, not a directory"):
        tpukit.profile(logdir=a_file / "run1")
    assert events.listeners() == []


def test_the_default_logdir_is_a_new_folder_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = tpukit.profile()
    assert first.logdir.parent == tmp_path.resolve() / "tpukit-profiles" and not first.logdir.exists()
    first.logdir.mkdir(parents=True)
    second = tpukit.profile()
    assert second.logdir != first.logdir and second.logdir.parent == first.logdir.parent


def test_summary_needs_a_finished_profile(rt, tmp_path):
    prof = tpukit.profile(logdir=tmp_path)
    with pytest.raises(tpukit.TpukitError, match="still running"):
        with prof:
            prof.summary()
    with pytest.raises(ValueError, match="positive number of ops"):
        prof.summary(top=0)
    with pytest.raises(tpukit.TpukitError, match="already been started"):
        prof.start()


def test_an_armed_profile_that_saw_no_loop_says_so(rt, tmp_path):
    prof = tpukit.profile(logdir=tmp_path / "never", steps=2).start()
    assert prof.state == "armed" and len(events.listeners()) == 1
    with pytest.raises(tpukit.TpukitError, match="still waiting for a tracked loop"):
        prof.summary()
    prof.stop()
    assert events.listeners() == [] and not (tmp_path / "never").exists()
    with pytest.raises(tpukit.TpukitError, match="no tracked loop ran"):
        prof.summary()


def test_only_one_profile_traces_at_a_time(rt, tmp_path):
    with tpukit.profile(logdir=tmp_path / "a"):
        with pytest.raises(tpukit.RuntimeStateError, match="already running"):
            tpukit.profile(logdir=tmp_path / "b").start()
        assert len(events.listeners()) == 1  # the failed one left nothing registered
    assert events.listeners() == []


def test_missing_xprof_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "xprof", None)
    with pytest.raises(tpukit.TpukitError, match=r"needs XProf.*tpukit\[profile\]"):
        read_trace(tmp_path / "host.xplane.pb")


def test_trace_stats_on_a_device_planes_lines():
    """The TPU shape of a trace (no TPU here): ops on the "XLA Ops" line, executions on "XLA
    Modules"; nested spans count their self time; compiles inside a sync are not sync time."""
    def meta(tid, name):
        return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}

    def span(tid, name, ts, dur, **args):
        return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}

    trace = [meta(1, "XLA Modules"), meta(2, "XLA Ops"), meta(3, "python"),
             span(1, "SyncTensorsGraph.9", 1000, 400), span(1, "SyncTensorsGraph.9", 2000, 600),
             span(2, "fusion.1", 1000, 300), span(2, "dot.2", 1050, 100), span(2, "dot.2", 2000, 500),
             span(3, "StepMarker", 0, 900), span(3, "XLAGraphExecutor::Compile", 100, 500)]
    st = trace_stats(trace)
    assert st.executions == 2 and st.busy_s == pytest.approx(0.001) and st.idle_s == pytest.approx(0.0006)
    ops = {op.name: (op.calls, round(op.total_s * 1e6)) for op in st.ops}
    assert ops == {"dot.2": (2, 600), "fusion.1": (1, 200)} and st.ops[0].name == "dot.2"
    assert st.compile_s == pytest.approx(0.0005) and st.sync_s == pytest.approx(0.0004)


def test_the_profile_is_exported():
    assert tpukit.profile is not Profile and isinstance(tpukit.profile.__doc__, str)
    assert {"profile", "Profile", "ProfileSummary"} <= set(tpukit.__all__)
