"""The TPU compiler's dump of one compile, read: the buffers that hold the program's HBM, and which are live
at the peak of its temporaries.

A compile asked for with a dump folder (``xla_dump_to``: the worker's ``dump_to``)
makes libtpu write, per module, its optimized HLO and its buffer assignment as
text (libtpu 0.0.17 and 0.0.21.1: ``*after_optimizations-buffer-assignment.txt``,
``*after_optimizations-memory-usage-report.txt``, ``*after_optimizations.txt``;
no ``*live-range.txt``: the live ranges are at the end of the buffer assignment).
The buffer assignment lists every allocation (size; ``parameter N``;
``maybe-live-out``: an output; ``preallocated-temp``: the block the program's
temporaries are packed into; ``color N``: another memory space than HBM, e.g. the
on-chip VMEM), the values in each (size, offset), each value's positions (the
entry tuple's index, for an output) and the instruction that defines it, with
its metadata: the op name and, when the graph was traced with torch_xla's
source metadata on, the Python file and line (:mod:`tpukit.tpu.trace`). Its
``BufferLiveRange`` section gives each value's [start, end] in the schedule.

:func:`read` turns that into plain :class:`Held` records: every parameter and
output allocation (live for the whole program: the runtime allocates them around
it), the temporaries live at the moment they add up to most, and the free space
of the block then. Pure text parsing: it runs in the parent, no jax needed.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .._hlo_text import strip_layout

PARAMETER, OUTPUT, TEMPORARY, FREE, CONSTANT = "parameter", "output", "temporary", "free", "constant"
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
_SCOPE = "module."  # tpukit.tpu.trace's op-name scope of a module ("module.layers.0.3/aten__addmm")


@dataclass(frozen=True)
class Held:
    """One buffer of the compiled program in HBM (bytes as allocated: padded to the TPU layout)."""

    bytes: int
    role: str  # PARAMETER, OUTPUT, TEMPORARY, FREE (the temporaries block's unused space) or CONSTANT
    instruction: str  # the HLO value ("fusion.72{1}", "Arg_5.6{}") or what it is
    shape: str = ""  # without its TPU layout: "f32[32,2048,2048]"
    index: int | None = None  # the entry parameter's number, or the output's index
    op_name: str | None = None  # torch_xla's op name ("aten__softmax")
    source: str | None = None  # "file:line" of the Python that traced it
    module: str | None = None  # the module path whose forward traced it ("layers.0.attn")
    phase: str | None = None  # FORWARD, BACKWARD or OPTIMIZER, when the metadata tells
    kept: bool = False  # a forward value still live after the backward pass began: kept for it
    origin: int | None = None  # the entry parameter this buffer copies, when it is a copy of one


@dataclass(frozen=True)
class Dump:
    """What the buffer assignment says is in HBM at the program's peak."""

    held: tuple[Held, ...]
    temp_block_bytes: int  # the temporaries' allocations (the block the compiler packs them into)
    peak_time: int | None  # the schedule position where the live temporaries add up to most

    def to_json(self) -> dict:
        """Plain data (kept beside the compiler's answer in the cache)."""
        return {"held": [asdict(h) for h in self.held], "temp_block_bytes": self.temp_block_bytes,
                "peak_time": self.peak_time}

    @classmethod
    def from_json(cls, data: dict) -> "Dump":
        """The inverse of :meth:`to_json`."""
        return cls(tuple(Held(**h) for h in data["held"]), int(data["temp_block_bytes"]), data.get("peak_time"))


def files(folder: str | Path) -> dict[str, Path]:
    """The dump's text files of the optimized module: ``buffer-assignment``, ``memory-usage-report``,
    ``hlo`` (the optimized HLO), ``live-range`` (only when the compiler writes one), by what they hold."""
    found: dict[str, Path] = {}
    for key, pattern in (("buffer-assignment", "*after_optimizations-buffer-assignment.txt"),
                         ("memory-usage-report", "*after_optimizations-memory-usage-report.txt"),
                         ("hlo", "*after_optimizations.txt"), ("live-range", "*live-range.txt")):
        candidates = sorted(Path(folder).glob(pattern), key=lambda p: p.stat().st_size)
        if candidates:
            found[key] = candidates[-1]  # several modules: the largest is the step's
    return found


def planned(folder: str | Path, _sizes: dict | None = None) -> int | None:
    """The HBM the compiler's buffer assignment allocates (bytes per chip: every allocation but other memory
    spaces'), once the compile being dumped into ``folder`` has written it whole, else None (not yet).

    The buffer assignment comes before code generation, most of a TPU compile's time (Llama-3.2-1B's step:
    at 5.3 s of 42 s with libtpu 0.0.17): polled while the compile runs, it answers the memory question
    early. Whole: the optimized module after buffer assignment is dumped after it, or (a compiler that
    writes no such file) its size did not change since the last call with the same ``_sizes`` dict."""
    folder = Path(folder)
    found = sorted(folder.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not found or not any(folder.glob("*after_optimizations-memory-usage-report.txt")):
        return None
    path = found[-1]
    size = path.stat().st_size
    marker = any(folder.glob("*after_optimizations_after_buffer_assignment.txt"))
    if not marker:
        if _sizes is None:
            return None
        last, _sizes[str(path)] = _sizes.get(str(path)), size
        if last != size:
            return None
    total = 0
    with open(path, errors="replace") as text:
        for line in text:
            if line.startswith("Used values:"):
                break
            m = re.match(r"allocation \d+: size (\d+)(.*)", line)
            if m and not re.search(r"\bcolor [1-9]", m.group(2)):
                total += int(m.group(1))
    return total


def _name(value: str) -> str:
    return value if "{" in value else value + "{}"


def _metadata(instruction: str) -> dict[str, str]:
    m = re.search(r"metadata=\{([^{}]*)\}", instruction)
    if not m:
        return {}
    return {k: a or b for k, a, b in re.findall(r'(\w+)=(?:"([^"]*)"|([^\s}]+))', m.group(1))}


def module_of(op_name: str | None) -> str | None:
    """The innermost module path in an op name scoped by tpukit's trace ("module.layers.0/module.layers.0.qkv/
    aten__addmm" -> "layers.0.qkv"), or None."""
    paths = [p[len(_SCOPE):] for p in (op_name or "").split("/") if p.startswith(_SCOPE)]
    return paths[-1] if paths else None


def phase_of(op_name: str | None, source: str | None) -> str | None:
    """Which part of a training step traced an operation, from its metadata: the optimizer's code, the
    backward (autograd traces without Python frames, or from torch/autograd), else the forward."""
    if source and "/torch/optim/" in source:
        return OPTIMIZER
    if source and "/torch/autograd/" in source:
        return BACKWARD
    if source:
        return FORWARD
    if op_name and not op_name.rsplit("/", 1)[-1].startswith("xla__device_data"):
        return BACKWARD
    return None


class _Text:
    """The sections of a buffer-assignment file."""

    def __init__(self, text: str):
        self.allocations: list[dict] = []
        self.defined: dict[str, str] = {}  # value -> the instruction line that defines it
        self.positions: dict[str, list[str]] = {}
        self.at: dict[str, str] = {}  # a position (a get-tuple-element, "tuple.5 {3}") -> the value held there
        self.live: dict[str, tuple[int, int]] = {}
        used = text.find("\nUsed values:")
        ranges = text.find("BufferLiveRange:")
        head = text[:used if used >= 0 else len(text)]
        current = None
        for line in head.splitlines():
            m = re.match(r"allocation (\d+): size (\d+)(?:, (.*))?:$", line)
            if m:
                current = {"size": int(m.group(2)), "attrs": m.group(3) or "", "values": []}
                self.allocations.append(current)
                continue
            m = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$", line)
            if m and current is not None:
                current["values"].append((_name(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)))
        if used >= 0:
            body = text[used:ranges if ranges > used else len(text)]
            for block in re.split(r"\n(?=<\d+ )", body)[1:]:
                m = re.match(r"<\d+ (\S+) @\d+>", block)
                if not m:
                    continue
                name = _name(m.group(1))
                pos = re.search(r"\n positions:\n((?:  \S.*\n?)*)", block)
                self.positions[name] = [p.strip() for p in pos.group(1).splitlines()] if pos else []
                for p in self.positions[name]:
                    self.at.setdefault(p, name)
                ins = re.search(r"\n from instruction: (.*)", block)
                if ins:
                    self.defined[name] = ins.group(1)
        if ranges >= 0:
            for m in re.finditer(r"^    (\S+):(\d+)-(\d+)$", text[ranges:], re.M):
                self.live[_name(m.group(1))] = (int(m.group(2)), int(m.group(3)))


def _trace_back(name: str, text: _Text, depth: int = 8) -> tuple[dict[str, str], int | None]:
    """The metadata of a value, or of what it copies when it has none (copies, bitcasts, prefetches), and the
    entry parameter it comes from, if any."""
    line = text.defined.get(name, "")
    for _ in range(depth):
        param = re.search(r"\sparameter\((\d+)\)", line)
        if param:  # its metadata is where the parameter was first used: not what it holds
            return {}, int(param.group(1))
        meta = _metadata(line)
        if meta.get("source_file") or (meta.get("op_name") and
                                       not meta["op_name"].rsplit("/", 1)[-1].startswith("xla__device")):
            return meta, None
        operand = re.search(r"\w[\w-]*\((?:[^%)]*)%([\w.\-]+)", line.split("=", 1)[-1])
        if not operand:
            return meta, None
        target = operand.group(1)  # an instruction, or a get-tuple-element: a position of another value
        line = text.defined.get(target + "{}") or text.defined.get(text.at.get(target, ""), "") or next(
            (v for k, v in text.defined.items() if k.startswith(target + "{")), "")
        if not line:
            return meta, None
    return {}, None


def _held(name: str, size: int, shape: str, role: str, text: _Text, index: int | None = None,
          backward_from: int | None = None) -> Held:
    meta, origin = _trace_back(name, text)
    src = f"{meta['source_file']}:{meta.get('source_line', '?')}" if meta.get("source_file") else None
    op = meta.get("op_name") or None
    phase = phase_of(op, src)
    end = text.live.get(name, (0, -1))[1]
    kept = phase == FORWARD and backward_from is not None and end > backward_from
    return Held(size, role, name, strip_layout(shape), index, op.rsplit("/", 1)[-1] if op else None, src,
                module_of(op), phase, kept, origin)


def _peak(values: list[tuple[str, int, int, str]], live: dict[str, tuple[int, int]]) -> tuple[int | None, list]:
    """The schedule position where the live values add up to most, and those values."""
    events = []
    for v in values:
        if v[0] in live:
            start, end = live[v[0]]
            events += [(start, 0, v[1]), (end + 1, -1, -v[1])]
    best, when, total = -1, None, 0
    for t, _, delta in sorted(events):
        total += delta
        if total > best:
            best, when = total, t
    if when is None:
        return None, []
    return when, [v for v in values if v[0] in live and live[v[0]][0] <= when <= live[v[0]][1]]


def read(folder: str | Path) -> Dump:
    """The buffers in HBM at the program's peak, from the dump in ``folder`` (see the module's docstring).
    Raises FileNotFoundError when the folder has no buffer assignment."""
    found = files(folder)
    if "buffer-assignment" not in found:
        raise FileNotFoundError(f"the compiler wrote no buffer assignment into {folder}")
    text = _Text(found["buffer-assignment"].read_text(errors="replace"))
    root = next((v[0].split("{")[0] for a in text.allocations if "output shape is" in a["attrs"]
                 for v in a["values"]), None)
    backward = [text.live[n][0] for n in text.live if n in text.defined
                and phase_of(_metadata(text.defined[n]).get("op_name"), _source(text.defined[n])) == BACKWARD]
    backward_from = min(backward) if backward else None
    held: list[Held] = []
    temps: list[tuple[str, int, int, str]] = []
    block = 0
    for a in text.allocations:
        attrs = a["attrs"]
        if re.search(r"\bcolor [1-9]", attrs):
            continue  # another memory space (VMEM, SMEM, ...), not HBM
        param = re.search(r"\bparameter (\d+)", attrs)
        if param:
            shape = re.search(r"shape \|([^|]*)\|", attrs)
            held.append(_held(a["values"][0][0] if a["values"] else f"parameter {param.group(1)}", a["size"],
                              shape.group(1) if shape else "", PARAMETER, text, int(param.group(1))))
        elif "preallocated-temp" in attrs:
            block += a["size"]
            temps += a["values"]
        elif "output shape is" in attrs:
            held.append(Held(a["size"], OUTPUT, "the outputs' tuple"))
        elif "maybe-live-out" in attrs:
            index, name, shape = None, a["values"][0][0] if a["values"] else "?", ""
            for v in a["values"]:
                at = [p for p in text.positions.get(v[0], []) if root and p.startswith(root + " {")]
                if at:
                    index, name, shape = int(re.search(r"\{(\d+)", at[0]).group(1)), v[0], v[3]
                    break
            held.append(_held(name, a["size"], shape or (a["values"][0][3] if a["values"] else ""), OUTPUT, text,
                              index))
        elif "constant" in attrs or "thread-local" in attrs:
            held.append(Held(a["size"], CONSTANT, "constants and scalars"))
        else:  # a temporary with an allocation of its own (compilers other than libtpu's)
            block += a["size"]
            temps += a["values"]
    when, live = _peak(temps, text.live)
    for v in sorted(live, key=lambda v: -v[1]):
        held.append(_held(v[0], v[1], v[3], TEMPORARY, text, backward_from=backward_from))
    free = block - sum(v[1] for v in live)
    if free > 0:
        held.append(Held(free, FREE, "unused space of the temporaries block at its peak"))
    return Dump(tuple(held), block, when)


def _source(line: str) -> str | None:
    meta = _metadata(line)
    return f"{meta['source_file']}:{meta.get('source_line', '?')}" if meta.get("source_file") else None
