"""The package layout of README.md's "Layout" section, checked (one owner per concern).

Every module of ``tpukit/`` (with the ``tpukit/checkpoint/`` package) and of
``widgets/`` (installed as ``tpukit.widgets``, see pyproject's package-dir) is
read with ``ast``, never imported, and its project-internal imports, at module
level and inside functions, relative and absolute, make one import graph. The
tests then check its rules: no import cycle; each module imports only
from a lower layer; torch_xla only through the ``tpukit/_xla/`` package and never from the
widgets; no module over 400 lines; and the public API keeps every name it had.

Layers ("Imports point one way"). A module imports only modules in a
strictly lower layer, except inside one group, where imports may go either way
as long as they form no cycle: the bottom layer (``errors`` and the adapters
under everything: ``_xla`` raises tpukit errors), the ``checkpoint`` package,
the magics modules, and the ``widgets`` package.
"""

from __future__ import annotations

import ast
import functools
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"tpukit": ROOT / "tpukit", "tpukit.widgets": ROOT / "widgets"}  # import name -> folder
MAX_LINES = 400

LAYERS = {
    "errors": 0, "_version": 0, "cache": 0, "_xla": 0, "_tree": 0, "_hlo_text": 0, "_text": 0, "_ipython": 0, "_stderr": 0, "environment": 0, "samples": 0,
    "metrics": 1, "events": 1, "buckets": 1, "verdict": 1, "runtime_record": 1,
    "compiles": 2, "tpu.compiler": 2,  # tpu.compiler: running a TPU compiler, the worker's side (no torch)
    "runtime": 3, "steps": 3, "eager": 3, "rewrites": 3,
    "tpu": 4,  # the TPU room's side in this process: traces steps, asks the compiler; reads the runtime's defaults
    "spmd": 4, "data": 4, "guards": 4, "parallel": 4,  # parallel: launch, the slice runner, what they share
    "track": 5, "checkpoint": 5, "profile": 5,  # profile may not exist yet
    "magics": 6, "__main__": 6, "hf": 6,  # and tpukit.widgets.*, tpukit.magics_*, tpukit._magic*
}
TOP = 7  # tpukit/__init__.py: the public API, imports everything
PACKAGES = {"checkpoint", "compiles", "_xla", "profile", "tpu", "hf", "parallel"}  # sub-packages of tpukit (present or to come)
GROUPS = {"base", "checkpoint", "compiles", "profile", "tpu", "tpu.compiler", "magics", "widgets", "hf", "parallel"}  # same-layer imports allowed inside these (acyclic)

# The public API, as tpukit.__all__ promises it: a name added or removed there is a decision,
# made here too (test_public_api_is_the_list_here).
PUBLIC_API = [
    "__version__", "setup", "Runtime", "snapshot", "Snapshot", "Delta", "CompileEvent", "compiling_now",
    "log", "on_step", "track", "Tracker", "StepRecord", "add_listener", "remove_listener",
    "expect_compiles", "no_recompile_after", "dashboard", "save", "load", "verify", "Manifest",
    "CheckpointManager", "export_pretrained", "mesh", "shard_batch", "sharding_spec", "device_loader",
    "fsdp", "estimate", "largest_batch", "plan", "fit", "compare", "TpuEstimate", "launch", "run_on_slice", "LocalSlice", "profile",
    "Profile", "ProfileSummary", "rank", "ShardingError", "load_ipython_extension", "unload_ipython_extension",
    "TpukitError", "TpukitWarning", "TorchXlaMissingError", "TpuBusyError", "VersionMismatchError", "DeviceNotFoundError",
    "RuntimeStateError", "RecompilationError", "CheckpointError", "LaunchError", "SliceError",
]


@dataclass(frozen=True)
class Module:
    name: str  # import name: tpukit.steps, tpukit.checkpoint, tpukit.widgets.plot
    path: Path
    is_package: bool  # an __init__.py
    source: str

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool

    def where(self, mods: dict[str, Module]) -> str:
        return f"{mods[self.src].rel}:{self.line}" + (" (in a function)" if self.in_function else "")


def _all_modules() -> list[Module]:
    found = []
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            found.append(Module(name, path, is_package, path.read_text(encoding="utf-8")))
    return found


@functools.lru_cache(maxsize=None)
def modules() -> dict[str, Module]:
    """Every module of tpukit/ and widgets/ by import name (a package wins over a same-named file)."""
    return {m.name: m for m in sorted(_all_modules(), key=lambda m: m.is_package)}


def place(name: str) -> tuple[int, str] | None:
    """(layer, group) of a module, or None when the table does not know it."""
    if name == "tpukit":
        return TOP, "tpukit"
    if name == "tpukit.widgets" or name.startswith("tpukit.widgets."):
        return 6, "widgets"
    parts = name.split(".")
    if parts[0] != "tpukit" or len(parts) < 2:
        return None
    short = parts[1]
    if parts[1:3] == ["tpu", "compiler"]:  # the worker's side of the TPU room: a package below the runtime
        return LAYERS["tpu.compiler"], "tpu.compiler"
    if short in PACKAGES:  # a sub-package and its modules: one group at the package's layer
        return LAYERS[short], ("base" if LAYERS[short] == 0 else short)
    if len(parts) > 2:
        return None  # a submodule of a package the table does not know
    if short == "magics" or short.startswith(("magics_", "_magic")):
        return 6, "magics"
    if short in LAYERS:
        return LAYERS[short], ("base" if LAYERS[short] == 0 else name)
    return None


def _is_internal(name: str) -> bool:
    return name == "tpukit" or name.startswith("tpukit.")


def _is_torch_xla(name: str | None) -> bool:
    return bool(name) and (name == "torch_xla" or name.startswith("torch_xla."))


def _resolve(target: str, known: dict[str, Module]) -> str:
    """The module an import of ``target`` runs: itself, or its longest known parent."""
    probe = target
    while probe not in known and probe.count(".") > 1:
        probe = probe.rsplit(".", 1)[0]
    return probe if probe in known else target


class _Imports(ast.NodeVisitor):
    """Collect a module's internal import edges and its torch_xla imports."""

    def __init__(self, mod: Module, known: dict[str, Module]):
        self.mod, self.known = mod, known
        self.depth = 0
        self.edges: list[Edge] = []
        self.torch_xla: list[int] = []  # line numbers
        # The package a relative import starts from.
        self.package = mod.name if mod.is_package else mod.name.rsplit(".", 1)[0]

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _edge(self, dst: str, node: ast.AST) -> None:
        self.edges.append(Edge(self.mod.name, dst, node.lineno, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_internal(alias.name):
                self._edge(_resolve(alias.name, self.known), node)
            elif _is_torch_xla(alias.name):
                self.torch_xla.append(node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module or ""
        if _is_torch_xla(full):
            self.torch_xla.append(node.lineno)
        if not _is_internal(full):
            return
        for alias in node.names:
            sub = f"{full}.{alias.name}"  # `from . import x` imports the module tpukit.x when there is one
            self._edge(sub if sub in self.known else _resolve(full, self.known), node)

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("torch_xla...") / __import__("torch_xla...") with a literal name
        fn = node.func
        called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
        if called in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_torch_xla(arg.value):
                self.torch_xla.append(node.lineno)
        self.generic_visit(node)


@functools.lru_cache(maxsize=None)
def scan() -> tuple[dict[str, list[Edge]], dict[str, list[int]]]:
    """The import graph (module -> its internal imports) and each module's torch_xla import lines."""
    mods = modules()
    graph, txla = {}, {}
    for name, mod in mods.items():
        visitor = _Imports(mod, mods)
        visitor.visit(ast.parse(mod.source, filename=str(mod.path)))
        graph[name] = [e for e in visitor.edges if e.dst != name]
        txla[name] = visitor.torch_xla
    return graph, txla


def _short(name: str) -> str:
    return name if name == "tpukit" else name.removeprefix("tpukit.")


def _layer_text(name: str) -> str:
    p = place(name)
    return f"L{p[0]}" if p else "L?"


def format_graph(graph: dict[str, list[Edge]], only: set[str] | None = None) -> str:
    """The import graph, one line per module, lowest layer first; * marks an import inside a function."""
    def order(n):
        return (_rank(n), n)

    lines = ["import graph (module -> what it imports; * = only inside a function):"]
    for name in sorted(only or graph, key=order):
        deps: dict[str, bool] = {}
        for e in graph.get(name, []):
            deps[e.dst] = deps.get(e.dst, True) and e.in_function
        shown = ", ".join(f"{_short(d)}{'*' if fn else ''} ({_layer_text(d)})"
                          for d, fn in sorted(deps.items(), key=lambda kv: order(kv[0])))
        lines.append(f"  {_layer_text(name):>3} {_short(name):<22} -> {shown or '(nothing internal)'}")
    return "\n".join(lines)


def _cycles(graph: dict[str, list[Edge]]) -> list[list[Edge]]:
    """Import cycles as lists of edges: the shortest through each module of each strongly connected component."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, []):
            if e.dst not in graph:
                continue
            if e.dst not in index:
                strong(e.dst)
                low[v] = min(low[v], low[e.dst])
            elif e.dst in on_stack:
                low[v] = min(low[v], index[e.dst])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    found, seen = [], set()
    for comp in (c for c in comps if len(c) > 1):
        inside = [e for v in sorted(comp) for e in graph[v] if e.dst in comp]
        # Every cycle has an edge that does not point down: show the shortest cycle through each
        # upward edge (the likely culprits), else through each same-layer edge.
        up = [e for e in inside if _rank(e.dst) > _rank(e.src)] or [e for e in inside if _rank(e.dst) == _rank(e.src)]
        for edge in up or inside[:1]:
            cycle = [edge] + _shortest_path(graph, comp, edge.dst, edge.src)
            key = frozenset((e.src, e.dst) for e in cycle)
            if key not in seen:
                seen.add(key)
                found.append(cycle)
    return found


def _rank(name: str) -> int:
    p = place(name)
    return p[0] if p else 99


def _shortest_path(graph: dict[str, list[Edge]], comp: set[str], src: str, dst: str) -> list[Edge]:
    """The shortest chain of imports from ``src`` to ``dst`` inside one component (BFS); [] when src is dst."""
    prev: dict[str, Edge] = {}
    queue = deque([src])
    while queue and dst not in prev and src != dst:
        v = queue.popleft()
        for e in sorted(graph[v], key=lambda e: e.dst):
            if e.dst in comp and e.dst not in prev and e.dst != src:
                prev[e.dst] = e
                queue.append(e.dst)
    path, node = [], dst
    while node != src:
        path.append(prev[node])
        node = prev[node].src
    return path[::-1]


# ---------------------------------------------------------------------------- tests


def test_the_scan_sees_the_whole_package():
    mods = modules()
    for name in ("tpukit", "tpukit._xla", "tpukit.runtime", "tpukit.widgets", "tpukit.widgets.dashboard"):
        assert name in mods, f"{name} not found under {sorted(SOURCES.values())}"
    graph, txla = scan()
    assert any(e.dst == "tpukit.errors" for e in graph["tpukit"]), format_graph(graph, {"tpukit"})
    adapter = [n for n in mods if n == "tpukit._xla" or n.startswith("tpukit._xla.")]
    assert any(txla[n] or "import_module" in mods[n].source for n in adapter), adapter


def test_the_scanner_resolves_imports_like_python():
    known = {n: Module(n, ROOT / "x.py", pkg, "") for n, pkg in [
        ("tpukit", True), ("tpukit.errors", False), ("tpukit.steps", False), ("tpukit.checkpoint", True),
        ("tpukit.checkpoint.files", False), ("tpukit.widgets", True), ("tpukit.widgets.frontend", False)]}
    cases = {
        ("tpukit.steps", "from . import errors"): "tpukit.errors",
        ("tpukit.steps", "from .errors import TpukitError"): "tpukit.errors",
        ("tpukit.steps", "from . import __version__"): "tpukit",
        ("tpukit.steps", "import tpukit"): "tpukit",
        ("tpukit.steps", "from .checkpoint import files"): "tpukit.checkpoint.files",
        ("tpukit.steps", "from .checkpoint import save"): "tpukit.checkpoint",
        ("tpukit.steps", "def f():\n    from .profile import capture"): "tpukit.profile",
        ("tpukit.checkpoint.files", "from .. import errors"): "tpukit.errors",
        ("tpukit.checkpoint.files", "from ..errors import CheckpointError"): "tpukit.errors",
        ("tpukit.checkpoint", "from .files import atomic_write"): "tpukit.checkpoint.files",
        ("tpukit.checkpoint", "from . import files"): "tpukit.checkpoint.files",
        ("tpukit.widgets.frontend", "from tpukit import errors"): "tpukit.errors",
        ("tpukit.widgets.frontend", "from tpukit.errors import TpukitWarning"): "tpukit.errors",
        ("tpukit.widgets", "from . import frontend"): "tpukit.widgets.frontend",
        ("tpukit.widgets", "import tpukit.checkpoint.files"): "tpukit.checkpoint.files",
    }
    for (name, code), want in cases.items():
        visitor = _Imports(known[name], known)
        visitor.visit(ast.parse(code))
        assert [e.dst for e in visitor.edges] == [want], (name, code)
    visitor = _Imports(known["tpukit.steps"], known)
    visitor.visit(ast.parse("import torch_xla.core.xla_model as xm\ndef f():\n    from torch_xla import runtime\n"
                            "importlib.import_module('torch_xla.debug.metrics')"))
    assert visitor.torch_xla == [1, 3, 4] and visitor.edges == []


def test_no_module_is_shadowed():
    seen: dict[str, list[str]] = {}
    for m in _all_modules():
        seen.setdefault(m.name, []).append(m.rel)
    twice = {name: rels for name, rels in seen.items() if len(rels) > 1}
    assert not twice, f"a file and a package with the same import name (Python imports the package): {twice}"


def test_no_import_cycle():
    graph, _ = scan()
    mods = modules()
    cycles = _cycles(graph)
    report = []
    for path in cycles:
        chain = " -> ".join([_short(path[0].src)] + [_short(e.dst) for e in path])
        report.append(f"cycle: {chain}\n" + "\n".join(f"    {_short(e.src)} imports {_short(e.dst)} at {e.where(mods)}"
                                                      for e in path))
    involved = {e.src for p in cycles for e in p}
    if cycles:
        pytest.fail("\n".join(report) + "\n\n" + format_graph(graph, involved), pytrace=False)


def test_every_module_has_a_layer():
    missing = [f"{m.rel} ({name})" for name, m in modules().items() if place(name) is None]
    if missing:
        pytest.fail(
            "these modules have no layer: add each to LAYERS in tests/test_layout.py and to README.md's Layout, "
            "or move its code into the module that owns the concern:\n  " + "\n  ".join(missing), pytrace=False)


def test_imports_point_down():
    graph, _ = scan()
    mods = modules()
    bad = []
    for name, edges in graph.items():
        src = place(name)
        if src is None:
            continue  # reported by test_every_module_has_a_layer
        for e in edges:
            dst = place(e.dst)
            if e.dst not in mods and dst is None:
                bad.append(f"{_short(name)} (L{src[0]}) imports {e.dst}, which does not exist, at {e.where(mods)}")
            elif dst is None:
                continue  # the target has no layer: reported by test_every_module_has_a_layer
            elif dst[0] > src[0] or (dst[0] == src[0] and not (dst[1] == src[1] and src[1] in GROUPS)):
                bad.append(f"{_short(name)} (L{src[0]}) imports {_short(e.dst)} (L{dst[0]}) at {e.where(mods)}")
    if bad:
        pytest.fail("imports that do not point to a lower layer (a module imports only from below "
                    "itself):\n  " + "\n  ".join(bad) + "\n\n" + format_graph(graph), pytrace=False)


def test_torch_xla_is_imported_only_by_the_adapter():
    _, txla = scan()
    mods = modules()
    bad = [f"{mods[n].rel}:{line}" for n, lines in txla.items()
           if n != "tpukit._xla" and not n.startswith("tpukit._xla.") for line in lines]
    assert not bad, "torch_xla is imported outside tpukit/_xla/ (call the adapter instead):\n  " + "\n  ".join(bad)


def test_widgets_never_import_the_xla_adapter():
    graph, _ = scan()
    mods = modules()
    bad = [f"{_short(n)} at {e.where(mods)}" for n, edges in graph.items() if place(n) and place(n)[1] == "widgets"
           for e in edges if e.dst == "tpukit._xla" or e.dst.startswith("tpukit._xla.")]
    assert not bad, "widgets/ imports tpukit._xla (the UI consumes records, it never calls torch_xla):\n  " + "\n  ".join(bad)


def test_large_modules_are_reported_not_failed():
    # Size is a signal to look, not a rule: each module over MAX_LINES is named in a warning (pytest's
    # summary shows it), so that a reviewer asks whether it holds two concepts; none fails the run.
    sizes = {m.rel: len(m.source.splitlines()) for m in modules().values()}
    assert len(sizes) == len(modules()) and min(sizes.values()) >= 1, "a module was not read"
    for rel, lines in sorted(sizes.items(), key=lambda kv: -kv[1]):
        if lines > MAX_LINES:
            warnings.warn(f"layout: {rel} has {lines} lines (over {MAX_LINES}: does it hold two concepts?)")

def test_public_api_keeps_every_name_and_each_imports():
    import tpukit

    missing = [n for n in PUBLIC_API if n not in tpukit.__all__]
    assert not missing, f"tpukit.__all__ lost names it had before: {missing}"
    assert len(set(tpukit.__all__)) == len(tpukit.__all__), "tpukit.__all__ lists a name twice"
    broken = []
    for name in tpukit.__all__:
        try:
            exec(f"from tpukit import {name}", {})
        except ImportError as exc:
            broken.append(f"{name}: {exc}")
    assert not broken, "names in tpukit.__all__ that `from tpukit import ...` cannot import:\n  " + "\n  ".join(broken)


def test_public_api_is_the_list_here():
    import tpukit

    added = [n for n in tpukit.__all__ if n not in PUBLIC_API]
    assert not added, f"tpukit.__all__ has names PUBLIC_API does not list (add them here on purpose): {added}"


def test_jax_is_imported_only_by_the_tpu_compilers_adapter():
    # libtpu must never load into the process that runs torch_xla: only tpukit/tpu/_jax.py (run in the
    # TPU compiler's worker process) may import jax, jaxlib or libtpu. The one other: tpukit/_xla/kernels.py,
    # where torch_xla's Pallas kernels are lowered by jax (as torch_xla itself does) with jax's platforms set
    # to the CPU first, so libtpu stays out (tests/test_tpu_plan.py checks the process's mapped libraries).
    bad = []
    for name, mod in modules().items():
        if name in ("tpukit.tpu.compiler._jax", "tpukit._xla.kernels"):
            continue
        for node in ast.walk(ast.parse(mod.source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{mod.rel}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib", "libtpu")]
    assert not bad, "jax is imported outside tpukit/tpu/compiler/_jax.py (the worker's adapter):\n  " + "\n  ".join(bad)
    assert "tpukit.tpu.compiler._jax" in modules()
