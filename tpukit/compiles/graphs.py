"""What a compiled graph *is*: its HLO as XLA dumped it when compiling, reduced
to a small :class:`Graph` record (size, inputs, outputs, scalar constants and a
structure signature), and the difference between two graphs compiled at the
same place.

``setup()`` asks XLA to dump each module's HLO "before optimizations" as text
(``--xla_dump_to``). XLA writes that file only when it compiles, so a cache hit
costs nothing; :class:`HloDump` reads each new file once, keeps the record and
deletes the files. Two graphs with the same *structure* (the same operations in
the same order, shapes and constant values aside) are the same computation: if
the second one compiled anyway, an input shape, a dtype or a baked-in value
changed, and :func:`diff` says which.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections import Counter
import re
import threading
from dataclasses import dataclass, field

from .._hlo_text import varint

_MODULE_FILE = re.compile(r"^module_(\d+)\.(?P<name>[\w.\-]+?)\.before_optimizations\.txt$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_COMMENT = re.compile(r"/\*.*?\*/")  # XLA writes /*index=5*/ before every fifth parameter
# Left out of the structure: torch_xla lowers the same computation with more or fewer
# transposes/copies from one trace to the next, and a Python scalar used twice is two
# constants when baked in but one parameter when not. Scalar leaves are compared apart.
_NOT_STRUCTURE = ("transpose", "copy", "bitcast", "scalar")


@dataclass(frozen=True)
class Constant:
    """A scalar constant of a graph: its value as written by XLA and the op that uses it."""

    dtype: str
    value: str
    used_by: str


@dataclass(frozen=True)
class Graph:
    """One compiled module, reduced to what a person can compare."""

    module: int                 # XLA's module number (compile order in this process)
    name: str                   # e.g. "SyncTensorsGraph.128"
    ops: int                    # instructions, parameters and constants excluded
    inputs: tuple[str, ...]     # parameter shapes, e.g. ("f32[8,16]", "s64[]")
    outputs: tuple[str, ...]
    constants: tuple[Constant, ...]
    structure: str              # hash of the op sequence, shapes and values excluded
    op_counts: tuple[tuple[str, int], ...] = ()
    partitions: int = 1         # SPMD: the number of devices the module is partitioned over
    # The HloModuleProto XLA dumped beside the text, kept only when asked (a TPU target compiles it).
    proto: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> str:
        """``'312 ops, 12 -> 9'``: operations and inputs -> outputs."""
        return f"{self.ops} ops, {len(self.inputs)} -> {len(self.outputs)}"


def _split_top(text: str) -> list[str]:
    """Split a comma-separated list at top level (not inside brackets or braces)."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _shapes(text: str) -> tuple[str, ...]:
    text = _LAYOUT.sub("", _COMMENT.sub("", text)).strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return tuple(s for s in _split_top(text) if s)


def _entry_layout(header: str) -> str | None:
    """The ``(inputs)->outputs`` text of ``entry_computation_layout={...}``, braces matched
    (SPMD modules go on with ``, allow_spmd_sharding_propagation_to_output=..., num_partitions=N``)."""
    key = "entry_computation_layout={"
    start = header.find(key)
    if start < 0:
        return None
    i = start + len(key)
    depth = 1
    for j in range(i, len(header)):
        depth += header[j] == "{"
        depth -= header[j] == "}"
        if depth == 0:
            return header[i:j]
    return None


def _shape_and_op(rest: str) -> tuple[str, str, str]:
    """``'f32[8,16]{1,0} add(%a, %b), x=1'`` -> (shape, opcode, args-and-attributes)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                shape, tail = rest[:i + 1], rest[i + 1:].lstrip()
                break
        else:
            return rest, "", ""
    else:
        shape, _, tail = rest.partition(" ")
    op, _, args = tail.partition("(")
    return shape, op.strip(), args


def parse_hlo(text: str, module: int = -1) -> Graph:
    """Reduce an HLO module's text to a :class:`Graph`."""
    lines = text.splitlines()
    name = lines[0].split()[1].rstrip(",") if lines and lines[0].startswith("HloModule") else "?"
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    layout = _entry_layout(lines[0]) if lines else None
    m = re.match(r"^\((.*)\)->(.*)$", layout) if layout else None
    if m:
        inputs, outputs = _shapes(m.group(1)), _shapes(m.group(2))
    ops: list[str] = []
    consts: dict[str, tuple[str, str]] = {}
    opcode: dict[str, str] = {}
    consumer: dict[str, str] = {}  # instruction -> the first instruction that uses it
    for line in lines[1:]:
        im = _INSTR.match(line)
        if not im:
            continue
        shape, op, args = _shape_and_op(im.group("rest"))
        var = im.group("name")
        opcode[var] = op
        if op == "constant" and shape.endswith("[]"):
            consts[var] = (shape[:-2], args.split(")", 1)[0])
            ops.append("scalar")  # constants and scalar parameters are interchangeable leaves
            continue
        if op == "parameter":
            ops.append("scalar" if _LAYOUT.sub("", shape).endswith("[]") else "parameter")
            continue
        ops.append(op)
        for ref in re.findall(r"%([\w.\-]+)", args):
            consumer.setdefault(ref, var)
    counted = [o for o in ops if o not in ("scalar", "parameter")]
    counts: dict[str, int] = {}
    for o in counted:
        counts[o] = counts.get(o, 0) + 1
    structure = hashlib.sha1("\n".join(o for o in ops if o not in _NOT_STRUCTURE).encode()).hexdigest()[:16]
    constants = tuple(Constant(d, v, _user_op(n, consumer, opcode)) for n, (d, v) in consts.items())
    parts = re.search(r"num_partitions=(\d+)", lines[0]) if lines else None
    return Graph(module=module, name=name, ops=len(counted), inputs=inputs, outputs=outputs,
                 constants=constants, structure=structure,
                 op_counts=tuple(sorted(counts.items(), key=lambda kv: -kv[1])),
                 partitions=int(parts.group(1)) if parts else 1)


def module_proto(hlo_proto: bytes) -> bytes | None:
    """The ``HloModuleProto`` inside an ``HloProto`` as XLA dumps it (field 1, length-delimited)."""
    i = 0
    while i < len(hlo_proto):
        key, i = varint(hlo_proto, i)
        number, wire = key >> 3, key & 7
        if wire == 2:
            size, i = varint(hlo_proto, i)
            if number == 1:
                return hlo_proto[i:i + size]
            i += size
        elif wire == 0:
            _, i = varint(hlo_proto, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            return None
    return None


_PASS_THROUGH = ("broadcast", "reshape", "convert", "bitcast", "copy")


def _user_op(name: str, consumer: dict[str, str], opcode: dict[str, str]) -> str:
    """The op that really uses a value, looking through broadcasts, reshapes and converts."""
    seen = 0
    node = consumer.get(name)
    while node is not None and opcode.get(node) in _PASS_THROUGH and seen < 16:
        node, seen = consumer.get(node), seen + 1
    return opcode.get(node, "?") if node else "?"


def diff(old: Graph, new: Graph) -> list[str]:
    """What changed from ``old`` to ``new``, one short phrase each (empty when nothing visible did).

    Same structure: the inputs and outputs whose shape or dtype changed
    (``input 3: f32[8,16] -> f32[8,24]``), else the scalar constants whose value changed (``2.5 -> 3.5 in multiply``), or a
    special scalar 0/1 baked in as a constant that became an input. Different
    structure: how many operations, inputs and outputs were added or removed.
    """
    if old.structure != new.structure:
        parts = []
        if new.ops != old.ops:
            parts.append(f"{new.ops - old.ops:+d} ops ({old.ops} -> {new.ops})")
        if len(new.inputs) != len(old.inputs):
            parts.append(f"{len(new.inputs) - len(old.inputs):+d} inputs")
        if len(new.outputs) != len(old.outputs):
            parts.append(f"{len(new.outputs) - len(old.outputs):+d} outputs")
        added = _count_delta(old, new)
        if added:
            parts.append(added)
        return parts or ["the same size but other operations"]
    if len(new.inputs) != len(old.inputs):
        if len(new.inputs) < len(old.inputs):
            came = [c for c in Counter(new.constants) - Counter(old.constants) if c.value in ("0", "1")]
            what = f"the constant {came[0].value} in {came[0].used_by}" if came else "a baked-in scalar"
            return [f"an input became {what} ({len(old.inputs)} -> {len(new.inputs)} inputs): torch_xla bakes "
                    "0 and 1 into the graph, so a value that moves to 0 or 1 compiles once more"]
        gone = [c for c in Counter(old.constants) - Counter(new.constants) if c.value in ("0", "1")]
        what = f"the constant {gone[0].value} in {gone[0].used_by}" if gone else "a baked-in scalar"
        return [f"{what} became an input ({len(old.inputs)} -> {len(new.inputs)} inputs): torch_xla bakes "
                "0 and 1 into the graph, so a value that moves away from 0/1 compiles once more"]
    changed = [f"input {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old.inputs, new.inputs)) if a != b]
    changed += [f"output {i}: {a} -> {b}" for i, (a, b) in enumerate(zip(old.outputs, new.outputs)) if a != b]
    if changed:
        return changed
    return [f"{a.value} -> {b.value}" + (f" in {b.used_by}" if b.used_by != "?" else "")
            for a, b in zip(old.constants, new.constants) if a.value != b.value]


def _count_delta(old: Graph, new: Graph, top: int = 3) -> str:
    a, b = dict(old.op_counts), dict(new.op_counts)
    moved = sorted(((k, b.get(k, 0) - a.get(k, 0)) for k in set(a) | set(b)), key=lambda kv: -abs(kv[1]))
    moved = [(k, d) for k, d in moved if d][:top]
    return ", ".join(f"{d:+d} {k}" for k, d in moved)


class HloDump:
    """Reads the HLO files XLA dumps into one directory, once each, oldest first; thread-safe."""

    def __init__(self, path: str | None):
        self.path = path
        self.protos = False  # keep each module's proto (a TPU target compiles it); see Reader.keep_protos
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self.graphs: list[Graph] = []

    def poll(self) -> list[Graph]:
        """Parse the module files written since the last poll and delete every dumped file."""
        if not self.path:
            return []
        with self._lock:
            try:
                names = os.listdir(self.path)
            except OSError:
                return []
            fresh = []
            for n in names:  # the module texts first: a text's proto is read before it is deleted
                m = _MODULE_FILE.match(n)
                if m is None or n in self._seen:
                    continue
                full = os.path.join(self.path, n)
                try:
                    with open(full, errors="replace") as f:
                        text = f.read()
                except OSError:
                    continue
                if not text.rstrip().endswith("}"):
                    continue  # still being written
                self._seen.add(n)
                graph = parse_hlo(text, int(m.group(1)))
                if self.protos:
                    graph = dataclasses.replace(graph, proto=_read_proto(full))
                fresh.append(graph)
            for n in names:  # then every other dump (LLVM IR, MLIR, protos) and the parsed texts
                text_of = n[:-len(".hlo.pb")] + ".txt" if n.endswith(".before_optimizations.hlo.pb") else None
                if text_of is not None and text_of not in self._seen:
                    continue  # the proto of a module whose text is still being written
                if _MODULE_FILE.match(n) is None or n in self._seen:
                    try:
                        os.remove(os.path.join(self.path, n))
                    except OSError:
                        pass
            fresh.sort(key=lambda g: g.module)
            self.graphs.extend(fresh)
            return fresh


def _read_proto(text_file: str) -> bytes | None:
    """The module proto XLA dumped beside ``module_N.<name>.before_optimizations.txt``, if any."""
    try:
        with open(text_file[:-len(".txt")] + ".hlo.pb", "rb") as f:
            return module_proto(f.read())
    except OSError:
        return None
