"""The IPython extension: ``%load_ext tpukit``.

- ``%tpu`` (alias ``%tpu_info``) ``[--device auto|tpu|cpu] [--cpu-devices N] [--spmd]
  [--no-trace] [--compile-cache DIR]``: set the runtime up if needed and show its report.
- ``%%xla [--max-compiles N] [--quiet] [--hlo] [--explain] [--target TPU]``: run the cell, sync, and print
  what it cost (executions, transfers, CPU fallbacks, and each compile: new graph, expected
  compile or recompilation, where, the evidence and a hint); ``--max-compiles N`` raises
  ``RecompilationError`` beyond N compiles; ``--explain`` adds torch_xla's own
  "Compilation Analysis" of each compile.
- ``%xla_metrics [--full] [--since-last] [--reset] [--json]``: a readable metrics table,
  or the change since the previous ``%xla_metrics``.
- ``%xla_ir EXPR`` / ``%xla_hlo EXPR``: the lazy IR / HLO that would compute a tensor.
- ``%xla_watch on|off``: after each cell, one line when it compiled or fell back to the
  CPU (its first recompilation, with the evidence, when there is one), nothing otherwise.
- ``%xla_dashboard``: the live compile/execute dashboard.
- ``%%xla_profile [N] [--logdir DIR] [--top K]``: profile the cell with torch_xla's profiler
  (only N steps of its tracked loop when N is given) and show the summary;
  ``%xla_profile N``: the next N steps of a tracked loop in the cells that follow, the
  summary shown after the cell where they ran (``%xla_profile --cancel`` drops it).

Load the extension before torch_xla is imported and compile tracing is switched
on (``runtime.configure``, without starting the runtime), so ``%%xla`` and
``%xla_watch`` can say *why* and *where* a graph compiled; loaded later, they
still count. ``%unload_ext`` removes exactly the magics and callbacks the load
added, so ``%reload_ext tpukit`` is safe.

This module is the extension itself: load/unload, the Magics class and its
argument parsing. What the magics do lives beside it: ``_magic_cells`` for
``%%xla``, ``%xla_ir``/``%xla_hlo`` and ``%xla_watch``; ``_magic_reports`` for
``%tpu``, ``%xla_metrics``, ``%xla_dashboard`` and ``%xla_profile N``; ``%%xla_profile`` runs
its cell in ``_magic_cells``. None of them imports IPython
or torch_xla at import time: the magics class is built when the extension
loads, and torch_xla is only touched through ``_xla`` once the user's code
imported it.
"""

from __future__ import annotations

import functools
from typing import Any

from . import _magic_cells, _magic_reports, _xla, compiles, runtime

CAUSES_UNAVAILABLE = (
    "tpukit: compile causes are unavailable because torch_xla was imported before %load_ext tpukit "
    "(compile counts still work); restart the kernel and load the extension first to see them.")


class _Extension:
    """What one load registered in one shell, so that unload removes exactly that."""

    def __init__(self, shell: Any, magics: Any):
        self.shell = shell
        self.magics = magics
        self.names = {kind: list(table) for kind, table in magics.magics.items()}
        self.callbacks: list[tuple[str, Any]] = []
        self.watch: _magic_cells.Watch | None = None
        self.metrics_mark = _magic_reports.snapshot_now()
        self.metrics_mark_label = "since %load_ext tpukit"
        self.armed: _magic_reports.ArmedProfile | None = None  # %xla_profile N

    def arm_profile(self, armed: _magic_reports.ArmedProfile) -> None:
        self.disarm_profile()
        self.armed = armed
        self.add_callback("post_run_cell", armed.post)

    def disarm_profile(self) -> None:
        """Stop the armed profile (writing what it traced) and remove its callback."""
        if self.armed is not None:
            armed, self.armed = self.armed, None
            self.remove_callback("post_run_cell", armed.post)
            armed.prof.stop()

    def add_callback(self, event: str, fn: Any) -> None:
        self.shell.events.register(event, fn)
        self.callbacks.append((event, fn))

    def remove_callback(self, event: str, fn: Any) -> None:
        if (event, fn) in self.callbacks:
            self.callbacks.remove((event, fn))
        try:
            self.shell.events.unregister(event, fn)
        except ValueError:  # already gone (someone else removed it)
            pass

    def start_watch(self) -> None:
        if self.watch is None:
            self.watch = _magic_cells.Watch(stop=self.stop_watch)
            self.add_callback("pre_run_cell", self.watch.pre)
            self.add_callback("post_run_cell", self.watch.post)

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.remove_callback("pre_run_cell", self.watch.pre)
            self.remove_callback("post_run_cell", self.watch.post)
            self.watch = None

    def close(self) -> None:
        """Remove every callback and magic this load added (and nothing else)."""
        self.stop_watch()
        self.disarm_profile()
        for event, fn in list(self.callbacks):
            self.remove_callback(event, fn)
        mm = self.shell.magics_manager
        for kind, names in self.names.items():
            table = mm.magics.get(kind, {})
            for name in names:
                # Leave a magic of the same name that someone registered after us.
                if getattr(table.get(name), "__self__", None) is self.magics:
                    del table[name]
        key = type(self.magics).__name__
        if mm.registry.get(key) is self.magics:
            del mm.registry[key]


# Survives importlib.reload(tpukit.magics), so a reload never orphans callbacks.
_EXT: _Extension | None = globals().get("_EXT")


def load_ipython_extension(ipython: Any) -> None:
    """Register tpukit's magics in ``ipython`` (what ``%load_ext tpukit`` calls)."""
    global _EXT
    if _EXT is not None:
        if _EXT.shell is ipython:
            return  # already loaded (e.g. as both tpukit and tpukit.magics)
        _EXT.close()
        _EXT = None
    note = _prepare_tracing()
    magics = _magics_class()(ipython)
    ipython.register_magics(magics)
    _EXT = _Extension(ipython, magics)
    if note:
        print(note)


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics and event callbacks the load added (``%unload_ext tpukit``)."""
    global _EXT
    if _EXT is not None:
        _EXT.close()
        _EXT = None


def _prepare_tracing() -> str | None:
    """Turn compile tracing on if torch_xla is not imported yet; else a note when it is off."""
    if not _xla.is_imported():
        try:
            runtime.configure(runtime.Request())
        except Exception as exc:  # a broken environment must not stop the magics from loading
            return f"tpukit: compile tracing could not be configured ({type(exc).__name__}: {exc}); counts still work."
        return None
    return None if compiles.tracing_enabled() else CAUSES_UNAVAILABLE


# ----------------------------------------------------------------- the Magics class

@functools.lru_cache(maxsize=None)
def _magics_class() -> type:
    """Build the Magics subclass (IPython is imported only when the extension loads)."""
    from IPython.core.magic import Magics, cell_magic, line_cell_magic, line_magic, magics_class
    from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

    @magics_class
    class TpukitMagics(Magics):
        """tpukit's magics; see ``tpukit.magics``."""

        @magic_arguments()
        @argument("--device", choices=("auto", "tpu", "cpu"), default="auto",
                  help="Device kind: auto (PJRT_DEVICE, else TPU if attached, else CPU), tpu or cpu.")
        @argument("--cpu-devices", type=int, metavar="N", default=None,
                  help="Number of virtual XLA:CPU devices (try multi-core code without a TPU).")
        @argument("--spmd", action="store_true", help="Turn SPMD on (one process drives every device).")
        @argument("--no-trace", action="store_true",
                  help="Do not record compile causes (counts only).")
        @argument("--compile-cache", metavar="DIR", default=None,
                  help="Directory of the persistent compilation cache (TPU only).")
        @line_magic("tpu_info")
        @line_magic("tpu")
        def tpu(self, line: str = "") -> None:
            """Set the XLA runtime up if needed and show its report (HTML in notebooks, text elsewhere).

            Idempotent like ``tpukit.setup()``: once the runtime runs, settings it
            cannot take any more are listed as problems in the report, with the fix.
            """
            _magic_reports.tpu(parse_argstring(self.tpu, line))

        @magic_arguments()
        @argument("--max-compiles", type=int, metavar="N", default=None,
                  help="Raise tpukit.RecompilationError if the cell compiles more than N graphs "
                       "(N=0 asserts a warm cell, e.g. under nbval).")
        @argument("--quiet", "-q", action="store_true",
                  help="Print nothing (the --max-compiles check still runs).")
        @argument("--hlo", action="store_true",
                  help="Before the closing sync, print the HLO of the computation the cell left pending "
                       "in its variables (tensors, modules' parameters, grads and buffers, optimizer state, "
                       "one level of list/tuple/dict): the graph that sync compiles, minus temporaries.")
        @argument("--explain", action="store_true",
                  help="Also print torch_xla's own \"Compilation Analysis\" of each compile of the cell "
                       "(its cause, graph hash, input/output counts and the Python frames that triggered it).")
        @argument("--target", metavar="TPU", default=None,
                  help="Also compile each graph of the cell for this TPU (e.g. v5e-1, v5e-8) with the real TPU "
                       "compiler, ahead of time, and print whether it fits in HBM, its TPU compile time and the "
                       "step's roofline floor (default: the target of tpukit.setup(target=...), if any).")
        @cell_magic
        def xla(self, line: str, cell: str) -> Any:
            """Run the cell, sync, and print what it cost.

            The summary line is the metrics change (compiles, executions, transfers,
            .item() reads, CPU fallbacks), then one line per compile: its kind (new
            graph, expected compile, or recompilation: the same computation compiled
            again because an input shape/dtype or a baked-in value changed), the
            graph's name (what cut it, the cell line, "the end of cell [N]" for the sync
            %%xla adds, and its size), the evidence, a hint, and the graph hash last.
            --max-compiles counts every compile, whatever its kind. --explain adds
            torch_xla's own "Compilation Analysis" text of each compile. --target TPU
            compiles each graph for that TPU and prints what the TPU compiler says. Work pending
            from earlier cells is synced first so it is not counted here. The value of
            a last expression is returned (shown as Out).
            """
            __tracebackhide__ = True
            return _magic_cells.xla(self.shell, parse_argstring(self.xla, line), line, cell)

        @magic_arguments()
        @argument("--full", action="store_true", help="Every row, including device memory.")
        @argument("--since-last", action="store_true",
                  help="The change since the previous %%xla_metrics (or since the extension loaded).")
        @argument("--reset", action="store_true",
                  help="Only set the --since-last baseline to now (torch_xla's counters are never cleared).")
        @argument("--json", action="store_true", help="Print the numbers as one JSON object.")
        @line_magic
        def xla_metrics(self, line: str = "") -> None:
            """A readable table of torch_xla's counters (not the raw text report)."""
            _magic_reports.xla_metrics(_EXT, parse_argstring(self.xla_metrics, line))

        @magic_arguments()
        @argument("expression", help="A Python expression giving an XLA tensor (or a list of them).")
        @line_magic
        def xla_ir(self, line: str = "") -> None:
            """Print the lazy IR that would compute a tensor, before it is synced."""
            _magic_cells.lazy_text(self.shell, line, "ir")

        @magic_arguments()
        @argument("expression", help="A Python expression giving an XLA tensor (or a list of them).")
        @line_magic
        def xla_hlo(self, line: str = "") -> None:
            """Print the HLO that would compute a tensor, before it is synced."""
            _magic_cells.lazy_text(self.shell, line, "hlo")

        @magic_arguments()
        @argument("state", nargs="?", choices=("on", "off"), default=None,
                  help="on: after every cell, print one line when it compiled (naming its first "
                       "recompilation, with the evidence, when there is one) or hit a CPU fallback; "
                       "off: stop. Without it, say whether watching is on.")
        @line_magic
        def xla_watch(self, line: str = "") -> None:
            """Watch every cell for compiles and CPU fallbacks (one line when they happen, else nothing).

            Compiles happen where the lazy graph is cut: a sync, or a tensor value
            read (.item(), print, .cpu()). A cell that only builds a graph shows
            nothing; the cell that syncs it does.
            """
            _magic_cells.watch(_EXT, parse_argstring(self.xla_watch, line).state)

        @magic_arguments()
        @line_magic
        def xla_dashboard(self, line: str = "") -> None:
            """Open the live compile/execute dashboard (tpukit.dashboard())."""
            parse_argstring(self.xla_dashboard, line)
            _magic_reports.xla_dashboard()

        @magic_arguments()
        @argument("steps", nargs="?", type=int, default=None, metavar="N",
                  help="Profile only N steps of a tracked loop (tpukit.track): as a line magic, the next "
                       "loop to run (in a later cell); in a cell, the loop in the cell.")
        @argument("--logdir", metavar="DIR", default=None,
                  help="Directory for the trace (default ./tpukit-profiles/<date>-<time>, created when "
                       "missing). Open it with %%load_ext tensorboard and %%tensorboard --logdir DIR.")
        @argument("--top", type=int, metavar="K", default=10, help="How many device ops the summary lists.")
        @argument("--cancel", action="store_true",
                  help="Line magic: drop the profile %%xla_profile N armed (one already tracing is stopped "
                       "and shown).")
        @line_cell_magic
        def xla_profile(self, line: str = "", cell: str | None = None) -> Any:
            """Profile with torch_xla's profiler and show the summary: the top device ops by time,
            device busy vs idle between executions, host time, and the bottleneck verdict.

            As a cell magic (%%xla_profile) the whole cell is traced, then synced, or only N
            steps of its tracked loop. As a line magic (%xla_profile N) the next N steps of
            a tracked loop are traced, in whatever cell it runs; the summary shows after
            that cell. The trace opens in TensorBoard's Profile tab (%tensorboard --logdir).
            Without N or --cancel, the line magic says whether a profile is armed.
            """
            __tracebackhide__ = True
            args = parse_argstring(self.xla_profile, line)
            if cell is None:
                return _magic_reports.xla_profile(_EXT, args)
            return _magic_cells.xla_profile(self.shell, args, line, cell)

    return TpukitMagics
