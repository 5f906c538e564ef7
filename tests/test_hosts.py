"""The parts of a slice run that need no cluster: what each host is told (tpukit.hosts), the records
tagged with their host, the per-host view (tpukit.widgets.SliceView), the main dashboard's host-0
filter and the ``[host N]`` output prefixes. No Ray here (it is optional: tests/test_pod.py runs
the real thing on a local multi-node cluster), no torch_xla.
"""

from __future__ import annotations

import pytest

import tpukit
from tpukit import events, runtime
from tpukit.compiles import CompileEvent
from tpukit.parallel import hosts, remote
from tpukit.steps import StepRecord
from tpukit.widgets import DashboardState, SliceState, SliceView
from tpukit.widgets.slice import summary_html, summary_text


def compile_event(index, start=0.0, end=1.0, kind="new graph", host=None):
    event = CompileEvent(index=index, start=start, end=end, cause="user mark_step", graph_hash=f"{index:08x}",
                         inputs=2, outputs=1, frames=(), kind=kind)
    return event if host is None else hosts.tag_event(event, host)


def step(n, wall, host=None, compiles=()):
    record = StepRecord(step=n, start=100.0, end=100.0 + wall, compiles=len(compiles), compile_events=tuple(compiles),
                        scalars={"loss": 1.0 / n})
    return record if host is None else hosts.tag_step(record, host)


def test_each_host_is_told_its_index_the_host_count_and_host_zeros_address():
    plan = {"count": 4, "slice": "my-slice", "hostnames": ["10.0.0.5", "10.0.0.6", "10.0.0.7", "10.0.0.8"]}
    always, defaults = hosts.host_env(2, plan)
    assert always == {hosts.INDEX_ENV: "2", hosts.COUNT_ENV: "4", hosts.SLICE_ENV: "my-slice", runtime.RANK_ENV: "2"}
    assert defaults == {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "10.0.0.5,10.0.0.6,10.0.0.7,10.0.0.8",
                        "MASTER_ADDR": "10.0.0.5"}
    assert set(defaults) == set(hosts.TORCH_XLA_ENV)
    # every host is told the run, under which host 0 publishes the group's port (process_group reads it)
    always, _ = hosts.host_env(1, dict(plan, run="0123abcd"))
    assert always[hosts.RUN_ENV] == "0123abcd" and hosts.GROUP_PORT_ENV not in always
    # a single-host slice has no peers to name
    assert hosts.host_env(0, {"count": 1, "slice": None, "hostnames": []}) == (
        {hosts.INDEX_ENV: "0", hosts.COUNT_ENV: "1", runtime.RANK_ENV: "0"}, {"TPU_WORKER_ID": "0"})


def test_host_zero_offers_a_free_port_unless_told_one(monkeypatch):
    import socket

    monkeypatch.delenv(hosts.GROUP_PORT_ENV, raising=False)
    port = hosts.group_port()
    with socket.socket() as check:
        check.bind(("", port))  # free: it binds
    monkeypatch.setenv(hosts.GROUP_PORT_ENV, "41234")
    assert hosts.group_port() == 41234


def test_current_host_comes_from_the_environment_run_on_slice_sets(monkeypatch):
    for key in (hosts.INDEX_ENV, hosts.COUNT_ENV, hosts.SLICE_ENV, "MASTER_ADDR", runtime.RANK_ENV):
        monkeypatch.delenv(key, raising=False)
    assert hosts.current() == hosts.Host(0, 1) and hosts.current().first
    always, defaults = hosts.host_env(3, {"count": 4, "slice": "s", "hostnames": ["a", "b", "c", "d"]})
    for key, value in {**always, **defaults}.items():
        monkeypatch.setenv(key, value)
    assert hosts.current() == hosts.Host(3, 4, "s", "a") and not hosts.current().first
    assert tpukit.rank() == 3  # what checkpoint saving asks to decide who writes
    assert tpukit.hosts is hosts  # what a function on a slice calls: tpukit.hosts.current()


def test_accelerator_names_people_use_are_rays_names():
    assert hosts.ray_version("v5e") == "v5litepod"
    assert hosts.ray_version("TPU-V6E") == "v6e"
    with pytest.raises(tpukit.SliceError, match=r"accelerator_version='v1' is not a TPU generation.*'v5e'"):
        hosts.ray_version("v1")


def test_records_from_a_host_carry_its_index_and_stay_records():
    record = step(2, 0.25, host=3, compiles=[compile_event(5)])
    assert isinstance(record, StepRecord) and record.host == 3
    assert record.wall == 0.25 and record.scalars == {"loss": 0.5}
    assert [(type(e).__name__, e.host) for e in record.compile_events] == [("HostCompileEvent", 3)]
    event = compile_event(7, host=1)
    assert isinstance(event, CompileEvent) and event.host == 1 and event.duration == 1.0
    assert hosts.tag_step(record, 0).host == 0  # re-tagging replaces the host


def test_slice_state_shows_each_host_and_names_the_slowest():
    state = SliceState(hosts=4)
    for host, wall in ((0, 0.20), (1, 0.22), (2, 0.50)):
        state.add_compile(compile_event(1, end=None, host=host))  # compiling step 1
        state.add_compile(compile_event(1, host=host))            # ... done
        state.add_step(step(1, 3.0, host=host, compiles=[compile_event(1, host=host)]))
        for n in (2, 3):
            state.add_step(step(n, wall, host=host))
    state.add_compile(compile_event(2, kind="recompilation", host=2))
    state.add_compile(compile_event(3, end=None, host=1))
    s = state.summary()
    assert [r.host for r in s.rows] == [0, 1, 2]
    assert [r.steps for r in s.rows] == [3, 3, 3]
    assert [r.median_step_s for r in s.rows] == pytest.approx([0.20, 0.22, 0.50])  # the compile step is not typical
    assert [r.compiles for r in s.rows] == [1, 2, 2] and [r.recompilations for r in s.rows] == [0, 0, 1]
    assert [r.compiling for r in s.rows] == [False, True, False]
    assert s.slowest == 2 and s.spread == pytest.approx(2.5)
    text = summary_text(s)
    assert text.startswith("slice: 3 of 4 hosts reporting, steps 3/3/3; slowest host 2 (median step 500.0 ms, "
                           "2.50× the fastest)"), text
    assert "slowest" in text.splitlines()[-1] and "compiling" in text.splitlines()[-2]
    assert "<table" in summary_html(s) and "slowest host 2" in summary_html(s)


def test_a_record_without_a_host_is_host_zeros():
    state = SliceState()
    state.add_step(step(1, 0.1))
    assert [r.host for r in state.summary().rows] == [0] and state.summary().slowest is None


def test_the_slice_view_listens_until_closed_and_prints_its_table(capsys):
    view = events.open_dashboard(hosts=2, mode="text")  # what run_on_slice(dashboard=True) opens
    assert isinstance(view, SliceView) and view in events.listeners()
    events.call("on_step", step(1, 0.1, host=0))
    events.call("on_step", step(1, 0.3, host=1))
    events.call("on_compile", compile_event(1, host=1))
    assert repr(view).startswith("<tpukit SliceView live: slice: 2 of 2 hosts reporting")
    assert "slowest host 1" in view._repr_html_()  # what a notebook shows for the object itself
    view.close()
    assert view not in events.listeners()
    out = capsys.readouterr().out
    assert "slice: 2 of 2 hosts reporting, steps 1/1; slowest host 1" in out, out
    assert view.summary().row(1).compiles == 1


def test_the_main_dashboard_keeps_to_host_zero():
    state = DashboardState()
    state.add_step(step(1, 0.1))
    state.add_step(step(2, 0.1, host=0))
    state.add_step(step(2, 0.9, host=1))
    state.add_compile(compile_event(9, host=3))
    view = state.view()
    assert view.steps == 2 and view.compile_events == 0


def test_host_output_reaches_the_cell_line_by_line_with_the_host_prefix(capsys):
    lines = remote.Prefixer("host")  # what run_on_slice writes the hosts' output with
    lines.write(1, "stdout", "epoch 1 ")
    lines.write(0, "stdout", "ready\r\nloss 0.5\n")
    lines.write(1, "stdout", "done\nstep 3\rstep 4")
    lines.write(2, "stderr", "warning: slow\n")
    lines.flush()
    captured = capsys.readouterr()
    assert captured.out == "[host 0] ready\n[host 0] loss 0.5\n[host 1] epoch 1 done\n[host 1] step 3\r[host 1] step 4\n"
    assert captured.err == "[host 2] warning: slow\n"


def test_a_hosts_traceback_reads_like_the_notebooks_own():
    here = __file__
    line = test_a_hosts_traceback_reads_like_the_notebooks_own.__code__.co_firstlineno
    text = ("Traceback (most recent call last):\n"
            f'  File "{here}", line {line}, in test_a_hosts_traceback_reads_like_the_notebooks_own\n'
            '  File "<ipython-input-3-0f1e2d>", line 2, in train\n'
            '  File "/somewhere/else.py", line 5, in g\n'
            "    already = 'shown'\n"
            "ValueError: no")
    assert remote.with_sources(text).splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{here}", line {line}, in test_a_hosts_traceback_reads_like_the_notebooks_own',
        "    def test_a_hosts_traceback_reads_like_the_notebooks_own():",  # the host had no source: ours
        "  Cell In[3], line 2, in train",                                 # a cell of the notebook
        '  File "/somewhere/else.py", line 5, in g',
        "    already = 'shown'",
        "ValueError: no"]


def test_a_dead_hosts_last_output_is_read_from_where_it_was_sent_so_far(tmp_path):
    files = hosts.output_files(4242, str(tmp_path))
    with open(files["stdout"], "wb") as f:
        f.write("sent already\nlast words: out of memory\n".encode())
    with open(files["stderr"], "wb") as f:
        f.write(b"")
    assert hosts.read_output(4242, {"stdout": len(b"sent already\n")}, str(tmp_path)) == {
        "stdout": "last words: out of memory\n", "stderr": ""}
    assert not any(tmp_path.iterdir()), "the files are removed once read"
    assert hosts.read_output(4242, {}, str(tmp_path)) == {}  # nothing there: nothing to show


def test_output_files_of_hosts_long_gone_are_removed_and_no_others(tmp_path):
    import os
    import subprocess
    import sys
    import time

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    old, recent, alive = (hosts.output_files(pid, str(tmp_path))["stdout"] for pid in (dead_pid, dead_pid + 10**7, os.getpid()))
    for path in (old, recent, alive):
        open(path, "w").close()
    long_ago = time.time() - hosts._STALE_S - 60
    os.utime(old, (long_ago, long_ago))
    os.utime(alive, (long_ago, long_ago))
    hosts._remove_stale(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(os.path.basename(p) for p in (recent, alive))
