"""The IPython extension: ``%load_ext tpukit``.

- ``%tpu`` (alias ``%tpu_info``) ``[--device auto|tpu|cpu] [--cpu-devices N] [--spmd]
  [--no-trace] [--compile-cache DIR]``: set the runtime up if needed and show its report.
- ``%%xla [--max-compiles N] [--quiet] [--hlo]``: run the cell, sync, and print what it
  cost (compiles with cause and cell line, executions, transfers, CPU fallbacks);
  ``--max-compiles N`` raises ``RecompilationError`` beyond N compiles.
- ``%xla_metrics [--full] [--since-last] [--reset] [--json]``: a readable metrics table,
  or the change since the previous ``%xla_metrics``.
- ``%xla_ir EXPR`` / ``%xla_hlo EXPR``: the lazy IR / HLO that would compute a tensor.
- ``%xla_watch on|off``: after each cell, one line when it compiled or fell back to the
  CPU, nothing otherwise.
- ``%xla_dashboard``: the live compile/execute dashboard.

Load the extension before torch_xla is imported and compile tracing is switched
on (``runtime.configure``, without starting the runtime), so ``%%xla`` and
``%xla_watch`` can say *why* and *where* a graph compiled; loaded later, they
still count. ``%unload_ext`` removes exactly the magics and callbacks the load
added, so ``%reload_ext tpukit`` is safe.

This module imports neither IPython nor torch_xla at import time: the magics
class is built when the extension loads, and torch_xla is only touched through
``_xla`` once the user's code imported it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import html
import json
import sys
import time
from typing import Any

from . import _xla

CAUSES_UNAVAILABLE = (
    "tpukit: compile causes are unavailable because torch_xla was imported before %load_ext tpukit "
    "(compile counts still work); restart the kernel and load the extension first to see them.")
_NO_TRACING = ("causes unavailable: compile tracing is off in this process; restart the kernel and "
               "%load_ext tpukit before importing torch_xla")


class _Extension:
    """What one load registered in one shell, so that unload removes exactly that."""

    def __init__(self, shell: Any, magics: Any):
        self.shell = shell
        self.magics = magics
        self.names = {kind: list(table) for kind, table in magics.magics.items()}
        self.callbacks: list[tuple[str, Any]] = []
        self.watch: _Watch | None = None
        self.metrics_mark = _snapshot_now()
        self.metrics_mark_label = "since %load_ext tpukit"

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
            self.watch = _Watch()
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
    from . import compiles, runtime

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
    from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
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
            _tpu(parse_argstring(self.tpu, line))

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
        @cell_magic
        def xla(self, line: str, cell: str) -> Any:
            """Run the cell, sync, and print what it cost.

            The summary line is the metrics change (compiles, executions, transfers,
            .item() reads, CPU fallbacks), then one line per compile with its cause
            and the cell line that triggered it ("the end of cell [N]" for the sync
            %%xla adds). Work pending from earlier cells is synced first so it is not
            counted here. The value of a last expression is returned (shown as Out).
            """
            __tracebackhide__ = True
            return _xla_cell(self.shell, parse_argstring(self.xla, line), line, cell)

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
            _metrics(_EXT, parse_argstring(self.xla_metrics, line))

        @magic_arguments()
        @argument("expression", help="A Python expression giving an XLA tensor (or a list of them).")
        @line_magic
        def xla_ir(self, line: str = "") -> None:
            """Print the lazy IR that would compute a tensor, before it is synced."""
            _lazy_text(self.shell, line, "ir")

        @magic_arguments()
        @argument("expression", help="A Python expression giving an XLA tensor (or a list of them).")
        @line_magic
        def xla_hlo(self, line: str = "") -> None:
            """Print the HLO that would compute a tensor, before it is synced."""
            _lazy_text(self.shell, line, "hlo")

        @magic_arguments()
        @argument("state", nargs="?", choices=("on", "off"), default=None,
                  help="on: after every cell, print one line when it compiled or hit a CPU fallback; "
                       "off: stop. Without it, say whether watching is on.")
        @line_magic
        def xla_watch(self, line: str = "") -> None:
            """Watch every cell for compiles and CPU fallbacks (one line when they happen, else nothing).

            Compiles happen where the lazy graph is cut: a sync, or a tensor value
            read (.item(), print, .cpu()). A cell that only builds a graph shows
            nothing; the cell that syncs it does.
            """
            _watch(_EXT, parse_argstring(self.xla_watch, line).state)

        @magic_arguments()
        @line_magic
        def xla_dashboard(self, line: str = "") -> None:
            """Open the live compile/execute dashboard (tpukit.dashboard())."""
            parse_argstring(self.xla_dashboard, line)
            _dashboard()

    return TpukitMagics


# ----------------------------------------------------------------- helpers

def _usage(message: str) -> Exception:
    from IPython.core.error import UsageError

    return UsageError(message)


def _show(text: str, html_text: str | None = None) -> None:
    """Display text in a terminal and HTML in a notebook front end."""
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text:
        bundle["text/html"] = html_text
    display(bundle, raw=True)


def _snapshot_now():
    from . import metrics

    # Counters start at zero when torch_xla is imported: before that, a zero snapshot is exact.
    return metrics.snapshot() if _xla.is_imported() else metrics.Snapshot(time=time.time())


def _synced_snapshot():
    """Sync pending work (when the runtime runs), wait for it, then read the counters."""
    if _xla.runtime_initialized():
        _xla.sync(wait=True)
        _xla.wait_device_ops()  # executions are counted when they finish, after sync(wait=True)
    return _snapshot_now()


def _torch():
    return sys.modules.get("torch")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# ----------------------------------------------------------------- %tpu

def _tpu(args: Any) -> None:
    from . import runtime

    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise _usage(f"%tpu --cpu-devices needs a positive number of virtual CPU devices, not {args.cpu_devices}.")
    try:
        rt = runtime.setup(device=args.device, cpu_devices=args.cpu_devices, spmd=args.spmd,
                           compile_cache=args.compile_cache, trace_compiles=not args.no_trace)
    except ValueError as exc:
        raise _usage(f"%tpu: {exc}") from None
    _show(rt.report(), rt._repr_html_())


# ----------------------------------------------------------------- %%xla

def _cache_cell(shell: Any, text: str, number: int) -> str:
    """Register ``text`` as cell ``number``'s source; returns the filename to compile with."""
    try:
        return shell.compile.cache(text, number, raw_code=text)  # IPython >= 8 (maps the name to the cell)
    except TypeError:
        return shell.compile.cache(text, number)  # IPython 7: '<ipython-input-N-...>'


def _cell_number(shell: Any) -> int:
    """The execution count of the cell running %%xla, as compile events will name it.

    Read from the calling cell's frame, because IPython versions differ on whether
    ``execution_count`` is incremented before or after a cell runs; else from the
    running ExecutionResult.
    """
    from . import compiles

    frame = sys._getframe(1)
    while frame is not None:
        label = compiles.cell_label(frame.f_code.co_filename)
        if label:
            return int(label.strip("[]"))
        frame = frame.f_back
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return int(number) if number is not None else int(shell.execution_count)


def _compile_cell(shell: Any, line: str, cell: str, number: int) -> tuple[Any, Any, str]:
    """Compile the cell body so frames say 'cell [N] line L' with L counted from the %%xla line."""
    shown = "%%xla" + (f" {line.strip()}" if line.strip() else "") + "\n" + cell
    name = _cache_cell(shell, shown, number)
    tree = shell.compile.ast_parse(shell.transform_cell(cell), filename=name)
    tree = shell.transform_ast(tree)
    ast.increment_lineno(tree, 1)  # line 1 of the cell is the %%xla line
    flags = shell.compile.flags
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        expr = tree.body.pop()
        if cell.rstrip().endswith(";"):  # a trailing ';' hides the value, as in a plain cell
            tree.body.append(expr)
        else:
            last = compile(ast.Expression(expr.value), name, "eval", flags, True)
    return compile(tree, name, "exec", flags, True), last, name


def _namespace_tensors(shell: Any) -> list[tuple[str, Any]]:
    """(variable name, XLA tensor) for each distinct tensor the user's variables hold."""
    torch = _torch()
    if torch is None:
        return []
    hidden = getattr(shell, "user_ns_hidden", {})
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, value in list(shell.user_ns.items()):
        if name.startswith("_") or (name in hidden and hidden[name] is value):
            continue
        if isinstance(value, torch.nn.Module):
            params = list(value.parameters())
            items = params + [p.grad for p in params if p.grad is not None] + list(value.buffers())
        elif isinstance(value, torch.optim.Optimizer):
            items = [t for state in value.state.values() for t in state.values()]
        elif isinstance(value, (list, tuple)):
            items = list(value)[:1000]
        elif isinstance(value, dict):
            items = list(value.values())[:1000]
        else:
            items = [value]
        for t in items:
            if isinstance(t, torch.Tensor) and _xla.is_xla_tensor(t) and id(t) not in seen:
                seen.add(id(t))
                found.append((name, t))
    return found


def _pending_hlo_report(shell: Any) -> str:
    held = _namespace_tensors(shell)
    flags = _xla.has_pending([t for _, t in held])
    pending = [t for (_, t), f in zip(held, flags) if f]
    names = list(dict.fromkeys(n for (n, _), f in zip(held, flags) if f))
    if not pending:
        return ("%%xla --hlo: no variable holds a pending XLA tensor before the sync (the cell synced "
                "itself, e.g. with .item() or print, or its results are not stored in variables).")
    head = (f"%%xla --hlo: pending graph of {_plural(len(pending), 'tensor')} held by "
            f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}, before the sync:")
    return head + "\n" + _xla.pending_hlo(pending).rstrip()


def _event_line(ev: Any, where: str, hint: str | None, recompilation: bool) -> str:
    took = "still compiling" if ev.end is None else f"{ev.duration:.1f} s"
    flag = "recompilation" if recompilation else "compile"
    text = f"  {flag} of graph {ev.graph_hash[:6] or '?'}… ({took}) at {where}: {ev.cause or 'cause not recorded'}"
    return text + (f". {hint}" if hint else "")


def _cell_event_lines(events: list, sync_from: int, number: int, delta: Any) -> list[str]:
    """One line per compile; compiles of the closing sync are placed at the end of the cell."""
    from . import compiles

    lines = []
    hints: set[str] = set()
    for ev in events:
        hint, recompilation = ev.hint, ev.recompilation
        if ev.index >= sync_from:
            where = f"the end of cell [{number}] (the sync %%xla adds)"
            if ev.user_frame is None or ev.user_frame.cell is None:
                # No user location on the stack (only wrappers such as IPython 7's `decorator`
                # frames): a "recompilation at the same location" would be meaningless.
                hint, recompilation = None, False
        else:
            where = ev.where
        lines.append(_event_line(ev, where, None if hint in hints else hint, recompilation))
        hints.add(hint)  # each hint once per report
    if not lines and delta.compiles and not compiles.tracing_enabled():
        lines.append(f"  ({_NO_TRACING})")
    return lines


def _xla_cell(shell: Any, args: Any, line: str, cell: str) -> Any:
    __tracebackhide__ = True
    from . import compiles
    from .errors import RecompilationError

    if args.max_compiles is not None and args.max_compiles < 0:
        raise _usage(f"%%xla --max-compiles needs N >= 0 (0 asserts that the cell compiles nothing), not {args.max_compiles}.")
    number = _cell_number(shell)
    code, last, _name = _compile_cell(shell, line, cell, number)

    before = _synced_snapshot()  # earlier cells' pending work is theirs, not this cell's
    first_event = compiles.event_count()
    exec(code, shell.user_global_ns, shell.user_ns)
    value = eval(last, shell.user_global_ns, shell.user_ns) if last is not None else None
    sync_from = compiles.event_count()
    hlo = _pending_hlo_report(shell) if args.hlo and _xla.runtime_initialized() else None
    after = _synced_snapshot()

    delta = after - before
    lines = _cell_event_lines(compiles.events_since(first_event), sync_from, number, delta)
    if hlo is not None and not args.quiet:
        print(hlo)
    elif args.hlo and not args.quiet:
        print("%%xla --hlo: nothing ran on an XLA device in this cell.")
    if args.max_compiles is not None and delta.compiles > args.max_compiles:
        message = (f"the cell compiled {_plural(delta.compiles, 'graph')}, more than the {args.max_compiles} "
                   f"allowed by %%xla --max-compiles {args.max_compiles}:\n" + "\n".join(lines or [f"  {delta}"]))
        raise RecompilationError(message)
    if not args.quiet:
        print("\n".join([f"%%xla: {delta}"] + lines))
    return value


# ----------------------------------------------------------------- %xla_metrics

def _text_table(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _html_table(title: str, rows: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
                    f"<td style='text-align:left'>{html.escape(v)}</td></tr>" for k, v in rows)
    return (f"<table class='tpukit-metrics'><caption style='text-align:left'><b>{html.escape(title)}</b>"
            f"</caption>{cells}</table>")


def _metrics(ext: _Extension | None, args: Any) -> None:
    from . import metrics

    if not _xla.is_imported():
        print("%xla_metrics: torch_xla is not imported yet, so nothing has run on an XLA device.")
        return
    now = metrics.snapshot(memory=args.full and _xla.runtime_initialized())
    mark, label = (ext.metrics_mark, ext.metrics_mark_label) if ext else (None, "")
    if ext is not None:
        ext.metrics_mark, ext.metrics_mark_label = now, "since the previous %xla_metrics"
    if args.reset:
        print("%xla_metrics: baseline set; %xla_metrics --since-last counts from here.")
        return
    if args.since_last and mark is not None:
        data: Any = now - mark
        title = f"XLA metrics {label} ({data.seconds:.1f} s)"
    else:
        data = now
        title = "XLA metrics since the runtime started"
    if args.json:
        print(json.dumps({"kind": "delta" if data is not now else "snapshot", **dataclasses.asdict(data)},
                         sort_keys=True))
        return
    rows = metrics.table(data, full=args.full)
    _show(_text_table(title, rows), _html_table(title, rows))


# ----------------------------------------------------------------- %xla_ir / %xla_hlo

def _as_tensors(value: Any) -> list | None:
    torch = _torch()
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    return None


def _lazy_text(shell: Any, line: str, kind: str) -> None:
    magic = "%xla_ir" if kind == "ir" else "%xla_hlo"
    expr = line.strip()
    if not expr:
        raise _usage(f"{magic} needs an expression that gives an XLA tensor, e.g. `{magic} loss`.")
    try:
        value = shell.ev(expr)
    except Exception as exc:
        raise _usage(f"{magic}: evaluating `{expr}` raised {type(exc).__name__}: {exc}") from None
    tensors = _as_tensors(value)
    if tensors is None:
        raise _usage(f"{magic}: `{expr}` is of type {type(value).__name__}, not a tensor; give an expression "
                     f"that evaluates to an XLA tensor (or a list of them).")
    off = [t for t in tensors if not _xla.is_xla_tensor(t)]
    if off:
        raise _usage(f"{magic}: `{expr}` is a tensor on {off[0].device}, not on an XLA device, so it has no "
                     f"lazy graph; move it with .to(torch_xla.device()).")
    if not any(_xla.has_pending(tensors)):
        t = tensors[0]
        what = (f"{str(t.dtype).replace('torch.', '')}{list(t.shape)} on {t.device}" if len(tensors) == 1
                else f"{len(tensors)} tensors on {t.device}")
        print(f"{magic}: `{expr}` is already materialised: device data ({what}) with nothing pending, so "
              f"there is no graph to show. Use {magic} before the sync (or .item(), print, .cpu()) that computes it.")
        return
    text = _xla.pending_ir(tensors) if kind == "ir" else _xla.pending_hlo(tensors)
    print(text.rstrip())


# ----------------------------------------------------------------- %xla_watch

class _Watch:
    """The pre/post cell callbacks of ``%xla_watch on`` (kept so unload removes these exact objects)."""

    def __init__(self) -> None:
        self.before: tuple[Any, int] | None = None

    def pre(self, info: Any = None) -> None:
        from . import compiles

        try:
            self.before = (_snapshot_now(), compiles.event_count())
        except Exception as exc:
            self._fail(exc)

    def post(self, result: Any = None) -> None:
        before, self.before = self.before, None
        if before is None or not _xla.is_imported():
            return
        raw = getattr(getattr(result, "info", None), "raw_cell", None) or ""
        if raw.lstrip().startswith("%%xla"):
            return  # %%xla already reported this cell
        try:
            line = self._line(before, getattr(result, "execution_count", None))
        except Exception as exc:
            self._fail(exc)
            return
        if line:
            print(line)

    @staticmethod
    def _line(before: tuple[Any, int], number: int | None) -> str | None:
        from . import compiles, metrics

        delta = metrics.snapshot() - before[0]
        if not delta.compiles and not delta.fallbacks:
            return None
        text = f"%xla_watch [{number}]: {delta}" if number is not None else f"%xla_watch: {delta}"
        events = compiles.events_since(before[1])
        if events:
            ev = events[0]
            flag = "recompilation" if ev.recompilation else "compile"
            more = f" (+{len(events) - 1} more)" if len(events) > 1 else ""
            text += f" — {flag} at {ev.where}: {ev.cause or 'cause not recorded'}{more}"
        elif delta.compiles and not compiles.tracing_enabled():
            text += " — causes unavailable (compile tracing is off)"
        return text

    def _fail(self, exc: Exception) -> None:
        if _EXT is not None:
            _EXT.stop_watch()
        print(f"%xla_watch: turned off after an internal error ({type(exc).__name__}: {exc}).")


def _watch(ext: _Extension | None, state: str | None) -> None:
    if ext is None:
        return
    if state is None:
        print(f"%xla_watch is {'on' if ext.watch else 'off'}.")
    elif state == "on":
        ext.start_watch()
        print("%xla_watch on: one line after each cell that compiles or falls back to the CPU.")
    else:
        ext.stop_watch()
        print("%xla_watch off.")


# ----------------------------------------------------------------- %xla_dashboard

def _dashboard() -> None:
    from IPython.display import display

    from . import steps

    display(steps.dashboard())
