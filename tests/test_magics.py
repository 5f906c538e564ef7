"""The IPython extension (issue 5): %tpu, %%xla, %xla_metrics, %xla_ir/%xla_hlo, %xla_watch, %xla_dashboard,
and %%xla_profile / %xla_profile N (issue 17).

Runs a real InteractiveShell on the real XLA:CPU runtime. Two fresh processes
(started at module set-up, in parallel) cover what depends on when the extension
is loaded: before torch_xla is imported (tracing on, causes mapped to cell
lines) and after (a one-line note, counts only).
"""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import types

import pytest

import tpukit
from tpukit import _magic_cells, compiles, events, magics

EXT = "tpukit"
SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")
LINE_MAGICS = {"tpu", "tpu_info", "xla_metrics", "xla_ir", "xla_hlo", "xla_watch", "xla_dashboard", "xla_profile"}
CELL_MAGICS = {"xla", "xla_profile"}
EVENTS = ("pre_execute", "pre_run_cell", "post_execute", "post_run_cell")


# ----------------------------------------------------------------- fixtures

def _start_session(mode, tmp):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_XLA_DEBUG", "CPU_NUM_DEVICES", "XLA_USE_SPMD"))}
    env.update(PJRT_DEVICE="CPU", TMPDIR=str(tmp))
    return subprocess.Popen([sys.executable, os.path.join(SCENARIOS, "magics_session.py"), EXT, mode],
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
    "%xla_profile 0",
    "%xla_profile -2",
    "%xla_profile 3 --top 0",
    "%xla_profile many",
    "%%xla_profile 0\nran = True",
    "%%xla_profile --cancel\nran = True",
    "%%xla_profile --logdir /dev/null\nran = True",
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
    run(ext, "%%xla_profile?")
    out = capsys.readouterr().out
    for flag in ("--since-last", "--reset", "--json", "--max-compiles", "--hlo", "--explain", "--cpu-devices",
                 "--no-trace", "--logdir", "--top", "--cancel", "%tensorboard --logdir"):
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


def test_explain_prints_torch_xlas_compilation_analysis(ext, capsys):
    run(ext, "%%xla --explain\nex = torch.ones(21, 2, device=dev).sum().item()")
    out = capsys.readouterr().out
    summary, _, explained = out.partition("%%xla --explain: ")
    assert summary.startswith("%%xla: 1 compile") and "  new graph: forced read graph at cell [" in summary
    assert explained.startswith("torch_xla's Compilation Analysis of compile 1 of 1 (graph ")
    full_hash = re.search(r"Graph Hash: ([0-9a-f]+)", explained).group(1)  # torch_xla drops leading zeros
    assert summary.rstrip().endswith(f"[graph {full_hash[:8]}]")  # the same compile
    for text in ("Compilation Cause", "most likely user code trying to access tensor value",
                 "Number of Graph Inputs: 0", "Number of Graph Outputs: 1", "Python Frame Triggered Execution"):
        assert text in explained
    assert "====" not in explained and "----" not in explained  # the separator rules are dropped
    run(ext, "%%xla --explain\nex = torch.ones(21, 2, device=dev).sum().item()")
    assert capsys.readouterr().out.splitlines()[1:] == ["%%xla --explain: nothing compiled in this cell."]
    run(ext, "%%xla --explain --quiet\nex = torch.ones(21, 3, device=dev).sum().item()")
    assert capsys.readouterr().out == ""


def test_a_recompilation_in_a_cell_names_the_input_that_changed(ext, capsys):
    run(ext, "import tpukit\nrb = [{'input_ids': torch.ones(8, n)} for n in (16, 16, 24)]")
    run(ext, "%%xla\nfor b in tpukit.track(rb, progress=False):\n    loss = (b['input_ids'] * 3).sum()")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("%%xla: 2 compiles") and len(lines) == 3
    assert lines[1].startswith("  new graph: step graph at cell [") and " line 2 (" in lines[1]  # the for line
    assert lines[2].startswith("  recompilation: step graph at cell [") and " line 2 (" in lines[2]
    assert ": input_ids: (8, 16) -> (8, 24). Bucket or pad the batches" in lines[2]
    # The same loop with the lengths declared: an expected compile, never called a recompilation.
    run(ext, "rb = [{'input_ids': torch.ones(8, n)} for n in (32, 32, 40)]")
    run(ext, "%%xla\nfor b in tpukit.track(rb, progress=False, shapes=[32, 40]):\n"
             "    loss = (b['input_ids'] * 3).sum()")
    out = capsys.readouterr().out
    assert "recompilation" not in out
    assert "  expected compile: step graph at cell [" in out
    assert "input_ids: (8, 32) -> (8, 40); a declared shape" in out


def test_a_rerun_notebook_cell_is_the_same_place(ext, capsys, monkeypatch):
    """ipykernel names a cell's code by its source, so a re-run cell is the same code place: run
    again with a longer input, its closing sync is a recompilation that names the input."""
    from ipykernel.compiler import XCachingCompiler

    monkeypatch.setattr(ext, "compile", XCachingCompiler())
    cell = "%%xla\nrr = (rr_x * 5).sum()"
    for n in (27, 29):  # shapes no other test compiles (a cached graph would not compile again)
        run(ext, f"rr_x = torch.ones(5, {n}, device=dev); torch_xla.sync()")
        result = run(ext, cell)
        assert result.error_in_exec is None, result.error_in_exec
    first, second = [c.splitlines()[1] for c in capsys.readouterr().out.split("%%xla: ")[1:]]
    # (the cell numbers are not checked: under IPython 7 they come from the kernel's own compiler,
    # which this shell only borrows)
    sync = re.escape("step graph at the end of cell [") + r"\d+" + re.escape("] (the sync %%xla adds)")
    assert re.match("  new graph: " + sync, first), first
    assert re.match("  recompilation: " + sync, second), second
    assert re.search(r": input \d \(rr_x, from another cell\): f32\[5,27\] -> f32\[5,29\]\. An input tensor changed shape",
                     second), second


@pytest.mark.parametrize("naming, lengths", [("ipykernel", (17, 23)), ("IPython", (19, 31))])
def test_a_rerun_cell_whose_input_changed_shape_in_another_cell_names_the_input(ext, capsys, monkeypatch, naming,
                                                                                lengths):
    """Issue #37: cell B (%%xla) computes on x, cell A makes x again with another shape, B runs again. B's
    first sync runs A's pending work (x's graph) at B's line; that graph was the one B's own graph was compared
    with ("new graph: ...; -38 ops (46 -> 8)"). Now A's work is placed apart: B's first run is its first graph,
    its re-run a recompilation of the same graph that names x and both shapes. Under either naming of a cell's
    code: ipykernel's (by its source) and plain IPython's (a terminal; IPython 7 without ipykernel's names: by
    its execution count and its source, so B's re-run was a place never seen, "first graph here": issue 44)."""
    if naming == "ipykernel":
        from ipykernel.compiler import XCachingCompiler

        monkeypatch.setattr(ext, "compile", XCachingCompiler())
    cell_a = "rs_x = torch.randn(8, {}, device=dev) * 3 - 1"
    cell_b = "%%xla\nrs_y = (rs_x * 2 + 1).sum(dim=1)"
    for source in (cell_a.format(lengths[0]), cell_b, cell_a.format(lengths[1]), cell_b):  # shapes no other test compiles
        result = run(ext, source)
        assert result.error_in_exec is None, result.error_in_exec
    first, second = [c.splitlines()[1] for c in capsys.readouterr().out.split("%%xla: ")[1:]]
    sync = re.escape("step graph at the end of cell [") + r"\d+" + re.escape("] (the sync %%xla adds)")
    assert re.match("  new graph: " + sync + r" \(\d+ ops, \d+ -> 1\), [\d.]+ s: first graph here \[", first), first
    assert re.match("  recompilation: " + sync, second), second
    changed = re.escape(f"(rs_x, from another cell): f32[8,{lengths[0]}] -> f32[8,{lengths[1]}]. An input tensor")
    assert re.search(r": input \d " + changed, second), second


def test_a_new_graph_at_the_same_line_is_not_a_recompilation(ext, capsys):
    run(ext, "%%xla\nfor op in (torch.sin, torch.cos):\n    ng = op(torch.ones(4, 9, device=dev))\n"
             "    torch_xla.sync()")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("%%xla: 2 compiles") and len(lines) == 3
    assert all(line.startswith("  new graph: step graph at cell [") and " line 4 (" in line for line in lines[1:])
    assert ": first graph here [graph " in lines[1]
    assert "+1 cosine" in lines[2] and "-1 sine" in lines[2]


def test_a_closing_sync_without_its_cell_on_the_stack_gets_no_verdict():
    """Without a cell frame every %%xla cell's closing sync would share one place: no label then."""
    frames = (compiles.Frame("sync", "/x/site-packages/torch_xla/torch_xla.py", 87),
              compiles.Frame("<module>", "<decorator-gen-12>", 2))
    ev = compiles.CompileEvent(index=4, start=0.0, end=0.5, cause="user torch_xla.sync", graph_hash="ab" * 16,
                               inputs=1, outputs=1, frames=frames, recompilation=True, hint="pad it",
                               kind="recompilation", evidence=("input 0: f32[2] -> f32[3]",), offset=400)
    delta = types.SimpleNamespace(compiles=1)
    sync_from = compiles.Mark(size=300)  # the closing sync started after this point of the trace
    (line,) = _magic_cells._cell_event_lines([ev], sync_from, 9, delta)
    assert line == "  compile: step graph at the end of cell [9] (the sync %%xla adds) (1 -> 1), 0.5 s [graph abababab]"
    inside = dataclasses.replace(ev, frames=frames + (compiles.Frame("<module>", "cell", 1, cell="[9]"),))
    (line,) = _magic_cells._cell_event_lines([inside], sync_from, 9, delta)
    assert line.startswith("  recompilation: ")
    assert line.endswith(": input 0: f32[2] -> f32[3]. Pad it [graph abababab]")


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


def test_watch_names_a_recompilation_first(ext, capsys):
    run(ext, "%xla_watch on")
    capsys.readouterr()
    run(ext, "for n in (11, 13, 15):\n    wb = torch.ones(6, n, device=dev)\n    torch_xla.sync()\n"
             "    wy = (wb * 7).sum()\n    torch_xla.sync()")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("%xla_watch [")
    assert " — recompilation: step graph at cell [" in out and "f32[6,11] -> f32[6,13]" in out
    assert out.rstrip().endswith("(+5 more: 2 new graphs, 3 recompilations)")


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
    assert f"  new graph: step graph at the end of cell [{pending['n']}] (the sync %%xla adds) (" in pending["out"]
    loop = _cell(s, "%%xla\nfor")
    lines = loop["out"].splitlines()
    assert lines[0].startswith("%%xla: 3 compiles")
    # line 1 is %%xla; ones(n) bakes n into the graph, so each new n is the same computation again
    assert lines[1].startswith(f"  new graph: forced read graph at cell [{loop['n']}] line 3 (")
    assert all(line.startswith(f"  recompilation: forced read graph at cell [{loop['n']}] line 3 (")
               for line in lines[2:4])
    assert all(re.search(r" \[graph [0-9a-f]{8}\]$", line) for line in lines[1:4])  # the hash last
    watched = [c for c in s["cells"] if c["source"].startswith("z =")]
    assert watched[0]["out"].count("\n") == 1
    assert watched[0]["out"].startswith(f"%xla_watch [{watched[0]['n']}]: 1 compile")
    assert f" — new graph: forced read graph at cell [{watched[0]['n']}] line 1 (" in watched[0]["out"]
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


# ----------------------------------------------------------------- %%xla_profile / %xla_profile N

PROFILE_SETUP = """import tpukit
pmodel = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)).to(dev)
popt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
def ptrain(n):
    for x, y in tpukit.track([(torch.randn(8, 20), torch.randint(0, 3, (8,))) for _ in range(n)], progress=False):
        torch.nn.functional.cross_entropy(pmodel(x), y).backward()
        popt.step()
        popt.zero_grad()
    return n
ptrain(2)
"""


@pytest.mark.skipif(importlib.util.find_spec("xprof") is None, reason="XProf (tpukit[profile]) is not installed")
def test_xla_profile_cell_traces_the_cell_and_shows_the_summary(ext, capsys, tmp_path):
    assert run(ext, PROFILE_SETUP).error_in_exec is None
    capsys.readouterr()
    result = run(ext, f"%%xla_profile --logdir {tmp_path} --top 5\nptrain(4)")
    assert result.error_in_exec is None and result.result == 4  # the cell's value, as in a plain cell
    out = capsys.readouterr().out
    assert "tpukit profile" in out and "4 steps of a tracked loop" in out, out
    assert re.search(r"^  dot(\.\d+)? ", out, re.M), out  # the MLP's matmul among the top ops
    assert f"%tensorboard --logdir {tmp_path.resolve()}" in out
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
    assert events.listeners() == []


@pytest.mark.skipif(importlib.util.find_spec("xprof") is None, reason="XProf (tpukit[profile]) is not installed")
def test_xla_profile_n_traces_the_next_steps_and_shows_after_their_cell(ext, capsys, tmp_path):
    assert run(ext, PROFILE_SETUP).error_in_exec is None
    run(ext, f"%xla_profile 2 --logdir {tmp_path / 'n'}")
    assert "the next 2 steps of a tracked loop" in capsys.readouterr().out
    run(ext, "%xla_profile")
    assert "armed, 2 steps" in capsys.readouterr().out
    run(ext, "plain = 1")  # no loop: still waiting, nothing shown
    assert capsys.readouterr().out == ""
    assert run(ext, "ptrain(5)").error_in_exec is None
    out = capsys.readouterr().out
    assert "2 steps of a tracked loop" in out and "dot" in out, out
    run(ext, "%xla_profile")
    assert "no profile is armed" in capsys.readouterr().out
    run(ext, f"%xla_profile 3 --logdir {tmp_path / 'c'}")
    run(ext, "%xla_profile --cancel")
    assert "cancelled" in capsys.readouterr().out and events.listeners() == []


def test_unload_drops_an_armed_profile(shell, tmp_path):
    before = _state(shell)
    run(shell, f"%load_ext {EXT}")
    run(shell, f"%xla_profile 4 --logdir {tmp_path}")
    assert _state(shell)[0]["post_run_cell"] == before[0]["post_run_cell"] + 1 and len(events.listeners()) == 1
    run(shell, f"%unload_ext {EXT}")
    assert _state(shell) == before and events.listeners() == []


def test_xla_profile_without_xprof_says_where_the_trace_is_and_how_to_read_it(ext, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xprof", None)
    result = run(ext, f"%%xla_profile --logdir {tmp_path}\nz = (torch.ones(4, 4, device=dev) * 3).sum()")
    assert result.error_in_exec is None
    out = capsys.readouterr().out
    assert "%%xla_profile: no summary" in out and "tpukit[profile]" in out and str(tmp_path.resolve()) in out, out
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # the trace is written all the same
