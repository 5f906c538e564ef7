"""The bodies of the magics that run or watch notebook cells: ``%%xla``, ``%%xla_profile``,
``%xla_ir`` / ``%xla_hlo`` and ``%xla_watch``.

Their argument parsing lives in ``tpukit.magics``; ``%tpu``, ``%xla_metrics``,
``%xla_dashboard`` and the shared helpers (usage errors, snapshots) in
``tpukit._magic_reports``. Neither IPython nor torch_xla is imported here:
torch_xla is only touched through ``_xla`` once the user's code imported it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import sys
import types
from typing import Any, Callable

from . import _ipython, _xla, compiles, metrics, runtime, tpu
from ._magic_reports import new_profile, show_profile, snapshot_now, usage
from ._text import plural
from .errors import RecompilationError

_NO_TRACING = ("causes unavailable: compile tracing is off in this process; restart the kernel and "
               "%load_ext tpukit before importing torch_xla")


def _synced_snapshot() -> metrics.Snapshot:
    """Sync pending work (when the runtime runs), wait for it, then read the counters. The work is earlier
    cells': placed apart (compiles.flush) from this cell's graphs, whose closing sync is at the same line."""
    if _xla.runtime_initialized():
        compiles.flush(functools.partial(_xla.sync, wait=True))
        _xla.wait_device_ops()  # executions are counted when they finish, after sync(wait=True)
    return snapshot_now()


def _torch():
    """torch if the user imported it (the magics never import it themselves)."""
    return sys.modules.get("torch")


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
    frame = sys._getframe(1)
    while frame is not None:
        label = _ipython.cell_label(frame.f_code.co_filename)
        if label:
            return int(label.strip("[]"))
        frame = frame.f_back
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(result, "execution_count", None)
    return int(number) if number is not None else int(shell.execution_count)


def _compile_cell(shell: Any, line: str, cell: str, number: int, magic: str = "%%xla") -> tuple[Any, Any, str]:
    """Compile the cell body so frames say 'cell [N] line L' with L counted from the magic's line."""
    shown = magic + (f" {line.strip()}" if line.strip() else "") + "\n" + cell
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
    head = (f"%%xla --hlo: pending graph of {plural(len(pending), 'tensor')} held by "
            f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}, before the sync:")
    return head + "\n" + _xla.pending_hlo(pending).rstrip()


_XLA_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "s64",
               "int32": "s32", "int16": "s16", "int8": "s8", "uint8": "u8", "bool": "pred"}
_INPUT_CHANGED = re.compile(r"^input (\d+): (\S+) -> (\S+)$")  # graphs.diff's phrase


def _names_read(code: types.CodeType) -> set[str]:
    """The global names a cell's code (and the functions it defines) reads or binds."""
    return set(code.co_names).union(*(_names_read(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _outside_tensors(shell: Any, codes: list) -> dict[str, Any]:
    """``{variable: tensor}``: the XLA tensors of other cells that the cell's code names."""
    torch, names = _torch(), set().union(*(_names_read(c) for c in codes if c is not None))
    return {n: v for n, v in shell.user_ns.items()
            if torch is not None and n in names and isinstance(v, torch.Tensor) and _xla.is_xla_tensor(v)}


def _named_inputs(ev: Any, outside: dict[str, Any]) -> Any:
    """``ev`` with each ``input 1: f32[8,16] -> f32[8,24]`` of its evidence naming the variable of
    another cell that holds a tensor of the new type (``input 1 (x, from another cell): ...``)."""
    by_type: dict[str, list[str]] = {}
    for name, t in outside.items():
        dtype = str(t.dtype).replace("torch.", "")
        by_type.setdefault(f"{_XLA_TYPES.get(dtype, dtype)}[{','.join(map(str, t.shape))}]", []).append(name)

    def named(phrase: str) -> str:
        m = _INPUT_CHANGED.match(phrase)
        names = by_type.get(m.group(3)) if m else None
        return f"input {m[1]} ({' or '.join(names)}, from another cell): {m[2]} -> {m[3]}" if names else phrase

    return dataclasses.replace(ev, evidence=tuple(map(named, ev.evidence))) if by_type and ev.evidence else ev


def compile_line(ev: Any, where: str | None = None, trusted: bool = True, hint: bool = True) -> str:
    """One compile as ``%%xla`` and ``%xla_watch`` print it: :func:`tpukit.compiles.describe`, compact."""
    return compiles.describe(ev, where, trusted, hint, compact=True)


def _cell_event_lines(events: list, sync_from: compiles.Mark, number: int, delta: Any,
                      outside: dict[str, Any] | None = None) -> list[str]:
    """One line per compile; compiles of the closing sync are placed at the end of the cell. An input
    that changed is named after the variable of another cell holding it (``outside``)."""
    lines = []
    hints: set[str] = set()
    for ev in events:
        ev = _named_inputs(ev, outside or {})
        where, trusted = None, True
        if not sync_from.before(ev):
            where = f"the end of cell [{number}] (the sync %%xla adds)"
            # A place is keyed by the user frames on the stack. When no cell is among them
            # (torch_xla keeps only the innermost frames; wrappers such as IPython 7's
            # `decorator` can push the cell out), every %%xla cell's closing sync shares one
            # place, and its label would compare graphs of different cells: show no verdict.
            trusted = any(f.cell for f in ev.user_frames)
        show_hint = trusted and ev.hint not in hints  # each hint once per report
        lines.append("  " + compile_line(ev, where, trusted, hint=show_hint))
        if show_hint:
            hints.add(ev.hint)
    if not lines and delta.compiles and not compiles.tracing_enabled():
        lines.append(f"  ({_NO_TRACING})")
    return lines


def _explain(events: list, delta: Any) -> str:
    """``--explain``: torch_xla's own "Compilation Analysis" of each compile, separator rules dropped and its
    frames cut to the user's (:func:`tpukit.compiles.explained`: how many library frames were left out)."""
    if not events:
        if delta.compiles and not compiles.tracing_enabled():
            return f"%%xla --explain: no Compilation Analysis to show ({_NO_TRACING})."
        return "%%xla --explain: nothing compiled in this cell."
    out = []
    for k, ev in enumerate(events, 1):
        body = compiles.explained(ev.analysis, ev.frames)
        out.append(f"%%xla --explain: torch_xla's Compilation Analysis of compile {k} of {len(events)} "
                   f"(graph {ev.graph_hash[:8] or '?'}):")
        out += ["  " + ln.rstrip() for ln in body] or ["   (no analysis recorded)"]
    return "\n".join(out)


XLA_CELL = "%%xla --target"  # the owner of the graphs' HLO while such a cell runs (Reader.keep_protos)


def xla(shell: Any, args: Any, line: str, cell: str) -> Any:
    """``%%xla``: run the cell, sync, print what it cost; the value of a last expression."""
    __tracebackhide__ = True
    if args.max_compiles is not None and args.max_compiles < 0:
        raise usage(f"%%xla --max-compiles needs N >= 0 (0 asserts that the cell compiles nothing), not {args.max_compiles}.")
    number = _cell_number(shell)
    code, last, _name = _compile_cell(shell, line, cell, number)
    # --target, else the runtime's (setup(target=...)): checked before the cell runs; its graphs keep their HLO
    # for this cell (a follower keeps them for its own graphs)
    target = runtime.tpu_target(args.target, ready=True)
    with compiles.hlo_kept(XLA_CELL if target is not None else None):  # until every graph of the cell is read
        before = _synced_snapshot()  # earlier cells' pending work is theirs, not this cell's
        first_event = compiles.mark()
        outside = _outside_tensors(shell, [code, last])
        exec(code, shell.user_global_ns, shell.user_ns)
        value = eval(last, shell.user_global_ns, shell.user_ns) if last is not None else None
        outside = {n: t for n, t in outside.items() if shell.user_ns.get(n) is t}  # not bound again by the cell
        sync_from = compiles.mark()
        hlo = _pending_hlo_report(shell) if args.hlo and _xla.runtime_initialized() else None
        if _xla.runtime_initialized():
            # The closing sync, called here and not in a helper: torch_xla records only the innermost
            # frames (8 by default) and the cell's own frame must stay among them.
            _xla.sync(wait=True)
            _xla.wait_device_ops()
        delta = snapshot_now() - before

        found = compiles.settled(since=first_event) if not args.quiet or args.max_compiles is not None else []
    lines = _cell_event_lines(found, sync_from, number, delta, outside)
    explain = _explain(found, delta) if args.explain and not args.quiet else None
    if hlo is not None and not args.quiet:
        print(hlo)
    elif args.hlo and not args.quiet:
        print("%%xla --hlo: nothing ran on an XLA device in this cell.")
    if args.max_compiles is not None and delta.compiles > args.max_compiles:
        if explain:
            print(explain)  # asked for: shown even when the check fails
        message = (f"the cell compiled {plural(delta.compiles, 'graph')}, more than the {args.max_compiles} "
                   f"allowed by %%xla --max-compiles {args.max_compiles}:\n" + "\n".join(lines or [f"  {delta}"]))
        raise RecompilationError(message)
    if not args.quiet:
        print("\n".join([f"%%xla: {delta}"] + lines + ([explain] if explain else [])
                        + (_estimates(found, target) if target else [])))
    return value


def _estimates(found: list, target: Any) -> list[str]:
    """``%%xla --target``: each graph of the cell compiled for the target, one line each."""
    graphs = [e for e in found if e.graph is not None and e.graph.proto is not None]
    if not graphs:
        why = ("nothing compiled in this cell" if not found else
               "no graph of this cell was kept for the TPU compiler (compile tracing or the HLO dump is off)")
        return [f"%%xla --target {target.name}: {why}."]
    out = [f"%%xla --target {target.name}: each graph compiled by the TPU compiler, ahead of time:"]
    for ev in graphs:
        est = tpu.compile_graph(ev.graph.proto, target, ev.graph.partitions, name=ev.name)
        out.append(f"  {ev.name}: {tpu.line(est)}")
    return out


# ----------------------------------------------------------------- %%xla_profile

def xla_profile(shell: Any, args: Any, line: str, cell: str) -> Any:
    """``%%xla_profile``: run the cell (and sync it) inside a profile, show the summary; the value
    of a last expression."""
    __tracebackhide__ = True
    if args.cancel:
        raise usage("%%xla_profile takes no --cancel (that is for the line magic %xla_profile N).")
    prof = new_profile(args, "%%xla_profile")
    code, last, _name = _compile_cell(shell, line, cell, _cell_number(shell), magic="%%xla_profile")
    with prof:
        exec(code, shell.user_global_ns, shell.user_ns)
        value = eval(last, shell.user_global_ns, shell.user_ns) if last is not None else None
        if _xla.runtime_initialized():
            _xla.sync(wait=True)  # what the cell left pending runs inside the profile
    show_profile(prof, args.top, "%%xla_profile")
    return value


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


def lazy_text(shell: Any, line: str, kind: str) -> None:
    """``%xla_ir`` (kind "ir") / ``%xla_hlo`` (kind "hlo"): the pending graph of an expression's tensors."""
    magic = "%xla_ir" if kind == "ir" else "%xla_hlo"
    expr = line.strip()
    if not expr:
        raise usage(f"{magic} needs an expression that gives an XLA tensor, e.g. `{magic} loss`.")
    try:
        value = shell.ev(expr)
    except Exception as exc:
        raise usage(f"{magic}: evaluating `{expr}` raised {type(exc).__name__}: {exc}") from None
    tensors = _as_tensors(value)
    if tensors is None:
        raise usage(f"{magic}: `{expr}` is of type {type(value).__name__}, not a tensor; give an expression "
                    f"that evaluates to an XLA tensor (or a list of them).")
    off = [t for t in tensors if not _xla.is_xla_tensor(t)]
    if off:
        raise usage(f"{magic}: `{expr}` is a tensor on {off[0].device}, not on an XLA device, so it has no "
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

class Watch:
    """The pre/post cell callbacks of ``%xla_watch on`` (kept so unload removes these exact objects)."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop  # turns watching off (the extension's stop_watch)
        self.before: tuple[Any, compiles.Mark] | None = None

    def pre(self, info: Any = None) -> None:
        try:
            self.before = (snapshot_now(), compiles.mark())
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
    def _line(before: tuple[Any, compiles.Mark], number: int | None) -> str | None:
        delta = metrics.snapshot() - before[0]
        if not delta.compiles and not delta.fallbacks:
            return None
        text = f"%xla_watch [{number}]: {delta}" if number is not None else f"%xla_watch: {delta}"
        events = compiles.settled(since=before[1]) if delta.compiles else []
        if events:
            # The first recompilation (the alarm) when there is one, else the first compile.
            ev = next((e for e in events if e.recompilation), events[0])
            text += " — " + compile_line(ev, hint=ev.recompilation)
            rest = [e.label for e in events if e is not ev]
            if rest:
                counts = ", ".join(plural(rest.count(k), k) for k in dict.fromkeys(rest))
                text += f" (+{len(rest)} more: {counts})"
        elif delta.compiles and not compiles.tracing_enabled():
            text += " — causes unavailable (compile tracing is off)"
        return text

    def _fail(self, exc: Exception) -> None:
        self.stop()
        print(f"%xla_watch: turned off after an internal error ({type(exc).__name__}: {exc}).")


def watch(ext: Any, state: str | None) -> None:
    """``%xla_watch [on|off]``: turn ``ext``'s watch on or off, or say whether it is on."""
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
