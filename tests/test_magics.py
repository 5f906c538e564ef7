"""The IPython extension (issue 5): %tpu, %%xla, %xla_metrics, %xla_ir/%xla_hlo, %xla_watch, %xla_dashboard.

Runs a real InteractiveShell on the real XLA:CPU runtime. Two fresh processes
(started at module set-up, in parallel) cover what depends on when the extension
is loaded: before torch_xla is imported (tracing on, causes mapped to cell
lines) and after (a one-line note, counts only).
"""

import json
import os
import subprocess
import sys
import types

import pytest

import tpukit
from tpukit import events, magics

EXT = "tpukit"
HERE = os.path.dirname(os.path.abspath(__file__))
LINE_MAGICS = {"tpu", "tpu_info", "xla_metrics", "xla_ir", "xla_hlo", "xla_watch", "xla_dashboard"}
CELL_MAGICS = {"xla"}
EVENTS = ("pre_execute", "pre_run_cell", "post_execute", "post_run_cell")


# ----------------------------------------------------------------- fixtures

def _start_session(mode, tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD"))}
    env.update(PJRT_DEVICE="CPU", TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "_magics_session.py"), EXT, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module", autouse=True)
def sessions(tmp_path_factory):
    """Both fresh-process sessions, started together; ``sessions(mode)`` waits for one."""
    procs = {mode: _start_session(mode, tmp_path_factory.mktemp(mode)) for mode in ("fresh", "late")}
    done = {}

    def get(mode):
        if mode not in done:
            out, err = procs[mode].communicate(timeout=300)
            assert procs[mode].returncode == 0, err[-3000:]
            done[mode] = json.loads(out.strip().splitlines()[-1])
        return done[mode]

    yield get
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def shell(rt, tmp_path_factory):
    """A real InteractiveShell (history in memory, its own user module) in this process."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    saved = {k: os.environ.get(k) for k in ("IPYTHONDIR",)}
    os.environ["IPYTHONDIR"] = str(tmp_path_factory.mktemp("ipython"))
    hooks = sys.displayhook, sys.excepthook
    existed = InteractiveShell.initialized()
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=config, user_module=types.ModuleType("tpukit_magics_test"))
    sh.run_cell("import torch, torch_xla\ndev = torch_xla.device()")
    yield sh
    sh.run_line_magic("unload_ext", EXT)
    if not existed:
        InteractiveShell.clear_instance()
    sys.displayhook, sys.excepthook = hooks
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def ext(shell):
    """The extension loaded for one test, unloaded after it."""
    shell.run_line_magic("load_ext", EXT)
    yield shell
    shell.run_line_magic("unload_ext", EXT)


def run(shell, source):
    """Run a cell as the front end would (execution count, cell filename map)."""
    return shell.run_cell(source, store_history=True)


def _state(shell):
    mm = shell.magics_manager
    return ({e: len(shell.events.callbacks[e]) for e in EVENTS},
            set(mm.magics["line"]) & LINE_MAGICS, set(mm.magics["cell"]) & CELL_MAGICS,
            "TpukitMagics" in mm.registry)


# ----------------------------------------------------------------- load / unload / reload

def test_package_is_the_extension():
    assert tpukit.load_ipython_extension is magics.load_ipython_extension
    assert tpukit.unload_ipython_extension is magics.unload_ipython_extension


def test_load_unload_and_reload_twice_leave_nothing_behind(shell, capsys):
    callbacks, line, cell, registered = _state(shell)
    assert not line and not cell and not registered
    run(shell, f"%load_ext {EXT}")
    run(shell, "%xla_watch on")
    on = _state(shell)
    assert on[1:] == (LINE_MAGICS, CELL_MAGICS, True)
    assert on[0]["pre_run_cell"] == callbacks["pre_run_cell"] + 1
    assert on[0]["post_run_cell"] == callbacks["post_run_cell"] + 1
    for _ in range(2):
        assert run(shell, f"%reload_ext {EXT}").error_in_exec is None
        assert _state(shell) == (callbacks, LINE_MAGICS, CELL_MAGICS, True)
        run(shell, "%xla_watch on")  # every reload starts from a clean slate
        assert _state(shell) == on
        methods = [shell.magics_manager.magics["line"][n] for n in LINE_MAGICS]
        assert len({id(m.__self__) for m in methods}) == 1  # one live instance, not stale ones
    capsys.readouterr()
    run(shell, "%xla_watch")
    assert "%xla_watch is on" in capsys.readouterr().out
    run(shell, f"%unload_ext {EXT}")
    assert _state(shell) == (callbacks, set(), set(), False)


def test_loading_under_both_names_registers_once(shell):
    before = _state(shell)
    run(shell, "%load_ext tpukit.magics")
    run(shell, f"%load_ext {EXT}")
    run(shell, "%xla_watch on")
    assert _state(shell)[0]["post_run_cell"] == before[0]["post_run_cell"] + 1
    run(shell, "%unload_ext tpukit.magics")
    run(shell, f"%unload_ext {EXT}")
    assert _state(shell) == before


# ----------------------------------------------------------------- usage errors and help

BAD = [
    "%xla_watch maybe",
    "%xla_ir",
    "%xla_hlo   ",
    "%xla_ir 1 +",
    "%xla_ir nothing_by_this_name",
    "%xla_ir 3",
    "%xla_hlo __import__('torch').ones(2)",
    "%xla_metrics --nope",
    "%xla_dashboard now",
    "%tpu --cpu-devices 0",
    "%tpu --device gpu",
    "%tpu_info --cpu-devices many",
    "%%xla --max-compiles -1\nran = True",
    "%%xla --max-compiles many\nran = True",
    "%%xla --bogus\nran = True",
]


@pytest.mark.parametrize("source", BAD)
def test_bad_arguments_are_one_line_usage_errors(ext, capsys, source):
    from IPython.core.error import UsageError

    ext.user_ns.pop("ran", None)
    result = run(ext, source)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert message and "\n" not in message
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "ran" not in ext.user_ns  # a %%xla cell with bad arguments does not run


def test_help_lists_the_arguments(ext, capsys):
    run(ext, "%xla_metrics?")
    run(ext, "%%xla?")
    run(ext, "%tpu_info?")
    out = capsys.readouterr().out
    for flag in ("--since-last", "--reset", "--json", "--max-compiles", "--hlo", "--cpu-devices", "--no-trace"):
        assert flag in out


# ----------------------------------------------------------------- %%xla

def test_max_compiles_0_fails_on_a_compiling_cell_and_passes_when_warm(ext, capsys):
    cell = "%%xla --max-compiles 0\nt = torch.ones(13, 7, device=dev) * 5"
    first = run(ext, cell)
    assert isinstance(first.error_in_exec, tpukit.RecompilationError)
    assert "--max-compiles 0" in str(first.error_in_exec) and "compiled 1 graph" in str(first.error_in_exec)
    capsys.readouterr()
    second = run(ext, cell)
    assert second.error_in_exec is None
    assert capsys.readouterr().out.startswith("%%xla: 0 compiles")
    assert run(ext, "%%xla --max-compiles 1 --quiet\nt = torch.ones(13, 8, device=dev) * 5").error_in_exec is None


def test_xla_returns_the_last_value_quiet_and_semicolon(ext, capsys):
    result = run(ext, "%%xla --quiet\nq = torch.ones(3, device=dev) + 1\nq.sum().item()")
    assert result.error_in_exec is None and result.result == 6.0
    assert "%%xla" not in capsys.readouterr().out
    assert run(ext, "%%xla --quiet\n40 + 2;").result is None
    failed = run(ext, "%%xla\nraise ValueError('boom')")
    assert isinstance(failed.error_in_exec, ValueError)
    assert "%%xla:" not in capsys.readouterr().out


def test_xla_hlo_shows_the_pending_graph_before_the_sync(ext, capsys):
    run(ext, "%%xla --hlo\nh = torch.ones(6, 5, device=dev) * 2\nk = 1")
    out = capsys.readouterr().out
    assert "pending graph of 1 tensor held by h" in out
    assert "HloModule" in out and "multiply" in out and "f32[6,5]" in out
    assert out.rstrip().splitlines()[-2].startswith("%%xla: 1 compile")
    run(ext, "%%xla --hlo\nh2 = (torch.ones(2, device=dev) * 2).sum().item()")
    assert "no variable holds a pending XLA tensor" in capsys.readouterr().out


# ----------------------------------------------------------------- %xla_watch

def test_watch_prints_one_line_only_for_cells_that_compile_or_fall_back(ext, capsys):
    run(ext, "%xla_watch on")
    capsys.readouterr()
    cells = [
        ("w0 = 1 + 1", 0),
        ("w1 = torch.ones(17, 3, device=dev).sum().item()", 1),
        ("w1 = torch.ones(17, 3, device=dev).sum().item()", 0),  # warm: same graph, cached
        ("w2 = torch.arange(5).to(dev).nonzero(); torch_xla.sync()", 1),  # CPU fallback, no compile
    ]
    for source, lines in cells:
        assert run(ext, source).error_in_exec is None
        out = capsys.readouterr().out
        assert len(out.splitlines()) == lines, (source, out)
        assert all(line.startswith("%xla_watch [") for line in out.splitlines())
        if "nonzero" in source:
            assert "CPU fallbacks: aten::nonzero x1" in out
    run(ext, "%xla_watch off")
    capsys.readouterr()
    run(ext, "w3 = torch.ones(17, 4, device=dev).sum().item()")
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------- %xla_ir / %xla_hlo

def test_xla_ir_and_hlo_of_pending_and_materialised_tensors(ext, capsys):
    run(ext, "a = torch.ones(3, device=dev)\nb = a * 2 + 1\nc = torch.arange(4).to(dev)")
    run(ext, "%xla_ir b")
    ir = capsys.readouterr().out
    assert ir.startswith("IR {") and "aten::mul" in ir and "aten::add" in ir
    run(ext, "%xla_hlo [b, c]")
    hlo = capsys.readouterr().out
    assert hlo.startswith("HloModule") and "multiply" in hlo and "s64[4]" in hlo
    run(ext, "%xla_ir c")  # transferred, never computed: data only
    assert "`c` is already materialised" in capsys.readouterr().out
    run(ext, "torch_xla.sync()")
    run(ext, "%xla_hlo b")
    out = capsys.readouterr().out
    assert "`b` is already materialised" in out and "float32[3] on xla:0" in out


# ----------------------------------------------------------------- %xla_metrics and %tpu

def test_xla_metrics_table_since_last_reset_and_json(ext, capsys):
    run(ext, "%xla_metrics")
    table = capsys.readouterr().out
    assert table.startswith("XLA metrics since the runtime started")
    assert "executions" in table and "syncs (MarkStep)" in table and "Metric:" not in table
    run(ext, "%xla_metrics --reset")
    assert "baseline set" in capsys.readouterr().out
    run(ext, "m = torch.ones(19, device=dev).sum().item()")
    run(ext, "%xla_metrics --since-last --json")
    delta = json.loads(capsys.readouterr().out)
    assert delta["kind"] == "delta" and delta["compiles"] == 1 and delta["item_reads"] == 1
    run(ext, "%xla_metrics --since-last --json")
    assert json.loads(capsys.readouterr().out)["compiles"] == 0
    run(ext, "%xla_metrics --since-last --full")
    out = capsys.readouterr().out
    assert "since the previous %xla_metrics" in out and "device memory" in out


def test_tpu_shows_the_report_and_passes_flags_to_setup(ext, capsys):
    run(ext, "%tpu")
    out = capsys.readouterr().out
    assert out.startswith("tpukit runtime") and "compile tracing" in out
    run(ext, "%tpu_info --cpu-devices 4")
    assert "problem: cpu_devices=4 was requested" in capsys.readouterr().out


# ----------------------------------------------------------------- fresh processes

def _cell(session, start):
    return next(c for c in session["cells"] if c["source"].startswith(start))


def test_loaded_first_it_traces_compiles_to_cell_lines(sessions):
    s = sessions("fresh")
    assert not s["imported_ipython"] and not s["imported_torch_xla"]  # import tpukit.magics is cheap
    assert s["tracing"]
    assert all(c["error"] is None for c in s["cells"]), s["cells"]
    assert _cell(s, "%load_ext")["out"] == ""
    pending = _cell(s, "%%xla\nx =")
    assert pending["out"].startswith("%%xla: 1 compile")
    assert f"at the end of cell [{pending['n']}] (the sync %%xla adds): user torch_xla.sync" in pending["out"]
    loop = _cell(s, "%%xla\nfor")
    lines = loop["out"].splitlines()
    assert lines[0].startswith("%%xla: 3 compiles")
    assert all(f"at cell [{loop['n']}] line 3: " in line for line in lines[1:4])  # line 1 is %%xla
    assert lines[3].startswith("  recompilation of graph")
    watched = [c for c in s["cells"] if c["source"].startswith("z =")]
    assert watched[0]["out"].count("\n") == 1
    assert watched[0]["out"].startswith(f"%xla_watch [{watched[0]['n']}]: 1 compile")
    assert f"compile at cell [{watched[0]['n']}] line 1" in watched[0]["out"]
    assert watched[1]["out"] == ""
    warm = _cell(s, "%%xla --max-compiles 0")
    assert warm["out"].startswith("%%xla: 0 compiles") and "%xla_watch" not in warm["out"]


def test_loaded_after_torch_xla_says_causes_are_unavailable(sessions):
    s = sessions("late")
    assert not s["tracing"]
    load = _cell(s, "%load_ext")
    assert load["out"] == magics.CAUSES_UNAVAILABLE + "\n"
    cell = _cell(s, "%%xla")
    assert cell["error"] is None and cell["out"].startswith("%%xla: 1 compile")
    assert "causes unavailable" in cell["out"]
    watched = _cell(s, "v =")
    assert watched["out"].startswith("%xla_watch [") and "causes unavailable" in watched["out"]


# ----------------------------------------------------------------- %xla_dashboard

def test_xla_dashboard_displays_what_tpukit_dashboard_returns(ext, capsys, monkeypatch):
    class Board:
        def __repr__(self):
            return "<dashboard stand-in>"

    monkeypatch.setattr(events, "open_dashboard", lambda **options: Board())
    assert run(ext, "%xla_dashboard").error_in_exec is None
    assert "<dashboard stand-in>" in capsys.readouterr().out


def test_xla_dashboard_opens_the_live_dashboard(ext, capsys):
    from tpukit import widgets  # noqa: F401  (importing it registers the dashboard with events)

    before = events.listeners()
    try:
        result = run(ext, "%xla_dashboard")
        assert result.error_in_exec is None, result.error_in_exec
        assert capsys.readouterr().out.strip()  # the text front end (TPUKIT_DASHBOARD=text) shows something
    finally:
        for lst in events.listeners():
            if lst not in before:
                getattr(lst, "close", lambda: tpukit.remove_listener(lst))()
