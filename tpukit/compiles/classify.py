"""Why a graph compiled: the alarm contract, one place.

- **new graph**: the first graph at a place, or one whose *structure* differs
  from every graph compiled there before (the optimizer creating its state,
  an accumulation step, eval after train, a new code path). Not an alarm.
- **expected**: the same computation as before with the input shapes the user
  declared (a bucket of ``tpukit.data.BucketBatcher`` seen for the first time,
  or ``track(shapes=...)``). Not an alarm.
- **recompilation**: the same computation compiled again because an input
  shape/dtype or a baked-in value changed. The alarm: it keeps happening.

Every classification comes with its evidence (what changed, measured by
comparing the two graphs and the two batches) and a hint for *that* cause.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from .frames import Frame
from .graphs import Graph, diff

NEW, EXPECTED, RECOMPILATION = "new graph", "expected", "recompilation"
KINDS = (NEW, EXPECTED, RECOMPILATION)

# A batch signature: ((path, shape, dtype), ...) of the step's input tensors.
Signature = tuple


@dataclass(frozen=True)
class Finding:
    """The classification of one compile: kind, evidence phrases and what to do."""

    kind: str
    evidence: tuple[str, ...] = ()
    hint: str | None = None


def _key_name(path: str) -> str:
    """``"['input_ids']"`` -> ``input_ids``; ``"[0]"`` -> ``batch[0]``."""
    if path.startswith("['") and path.endswith("']") and path.count("[") == 1:
        return path[2:-2]
    return "batch" + path if path else "batch"


def batch_changes(old: Signature | None, new: Signature | None) -> list[str]:
    """``input_ids: (8, 16) -> (8, 24)`` for each batch tensor whose shape or dtype changed."""
    if not old or not new:
        return []
    before = {p: (s, d) for p, s, d in old}
    out = []
    for p, s, d in new:
        if p not in before:
            continue
        s0, d0 = before[p]
        if s0 != s:
            out.append(f"{_key_name(p)}: {tuple(s0)} -> {tuple(s)}")
        elif d0 != d:
            out.append(f"{_key_name(p)}: {d0.replace('torch.', '')} -> {d.replace('torch.', '')}")
    return out


def _declared(old: Signature | None, new: Signature | None, shapes: frozenset) -> bool:
    """True when every batch tensor that changed shape now has a declared shape or length."""
    if not shapes or not old or not new:
        return False
    before = {p: s for p, s, _ in old}
    changed = [(before[p], s) for p, s, _ in new if p in before and before[p] != s]
    if not changed:
        return False
    for s0, s in changed:
        if tuple(s) in shapes:
            continue
        moved = [d for a, d in zip(s0, s) if a != d] if len(s0) == len(s) else list(s)
        if not moved or any(d not in shapes for d in moved):
            return False
    return True


FORCED_HINT = ("a tensor value was read before the step's sync (.item(), print, .cpu() or Python control flow "
               "on a tensor): it cuts the step in two graphs and waits for the device; log it with tpukit.log() "
               "or read it after the step")
# Reads inside libraries whose remedy is known, by the file that reads (Frame.package_path).
KNOWN_READS = {
    "transformers/masking_utils.py": ("it checks the 2-D attention mask for padding (mask.all()): pass the mask "
                                      "in 4-D, tpukit.data.bert_mask(mask), which transformers uses as it is"),
}


def forced_hint(read_at: Frame | None) -> str:
    """The hint for a forced read: the user's own (:data:`FORCED_HINT`), or one inside a library
    (``read_at``: the library's line), with the remedy when :data:`KNOWN_READS` knows it."""
    if read_at is None:
        return FORCED_HINT
    path = read_at.package_path or read_at.filename
    lib = path.split("/", 1)[0] if read_at.package_path else "the library"
    remedy = KNOWN_READS.get(path, f"look for an argument or setting of {lib} that spares the read")
    return (f"{lib} reads the value in its own code, during your call: it cuts the step in two graphs and "
            f"makes the host wait for the device; {remedy}")


def _hint(evidence: list[str], from_batch: bool) -> str:
    text = " ".join(evidence)
    if from_batch:
        return ("bucket or pad the batches to a few fixed lengths (tpukit.data.BucketBatcher), "
                "or declare the shapes you expect with track(..., shapes=...)")
    if "became an input" in text:
        return ("create that value once as a device tensor, or keep it away from exactly 0 and 1 "
                "(XLA_NO_SPECIAL_SCALARS=1 turns the special case off)")
    if "input " in text:
        return "an input tensor changed shape or dtype: pad it to a fixed size or keep its dtype fixed"
    if "output " in text:
        return ("a shape computed inside the step changed (e.g. torch.randn(n, ...) or slicing with a Python "
                "int that varies): keep it fixed or pad")
    if "->" in text:
        return ("a Python number that changes is baked into the graph as a constant: pass it as a tensor "
                "(torch.tensor(value, device=...)) so it becomes an input")
    return "the graph changed in a way XLA's text does not show: compare the two with %%xla --explain"


_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]$")  # an input's type as Graph.inputs writes it: f32[8,16]


def input_changes(old: Graph, new: Graph) -> list[str]:
    """``input 2: f32[8,16] -> f32[12,16]`` for each input of ``new`` that is an input of ``old`` with another
    shape (same dtype and rank) or dtype (same dims), the inputs aligned as sequences, so that the inputs a
    graph of another structure added (an optimizer's state) or dropped are not paired with the others; the
    phrase of :func:`~.graphs.diff` for graphs of one structure."""
    out = []
    matcher = difflib.SequenceMatcher(a=old.inputs, b=new.inputs, autojunk=False)
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op != "replace" or a1 - a0 != b1 - b0:
            continue
        for k, (a, b) in enumerate(zip(old.inputs[a0:a1], new.inputs[b0:b1])):
            ma, mb = _SHAPE.match(a), _SHAPE.match(b)
            if ma and mb and ((ma[1] == mb[1] and ma[2].count(",") == mb[2].count(",")) or ma[2] == mb[2]):
                out.append(f"input {b0 + k}: {a} -> {b}")
    return out


def _state_became_input(seen: list, graph: Graph, inputs: Signature | None) -> bool:
    """The second graph at a place, with the same batch and more inputs than the first: tensors the first
    step created (an optimizer's state) are read by the second."""
    return (len(seen) == 1 and seen[0].graph is not None and len(graph.inputs) > len(seen[0].graph.inputs)
            and not batch_changes(seen[0].inputs, inputs))


@dataclass
class _Seen:
    graph: Graph | None
    inputs: Signature | None
    counts: tuple[int, int]


@dataclass
class Classifier:
    """Remembers the graphs compiled at each place and classifies the next one there."""

    places: dict = field(default_factory=dict)  # place key -> [_Seen, ...]

    def classify(self, place: Any, graph: Graph | None, inputs: Signature | None, counts: tuple[int, int],
                 declared: frozenset = frozenset(), batch_hint: str | None = None) -> Finding:
        """Classify a compile at ``place`` (graph from XLA's dump when available, the step's
        batch signature, the (inputs, outputs) counts from torch_xla's trace, declared shapes;
        ``batch_hint``: the loop's own hint for a batch that changed shape)."""
        seen = self.places.setdefault(place, [])
        finding = self._judge(seen, graph, inputs, counts, declared, batch_hint)
        seen.append(_Seen(graph, inputs, counts))
        return finding

    @staticmethod
    def _judge(seen: list[_Seen], graph: Graph | None, inputs: Signature | None, counts: tuple[int, int],
               declared: frozenset, batch_hint: str | None = None) -> Finding:
        if not seen:
            size = f" ({graph.size})" if graph else ""
            return Finding(NEW, (f"first graph here{size}",))
        if graph is not None and all(s.graph is not None for s in seen):
            same = [s for s in seen if s.graph.structure == graph.structure]
            if not same:
                first_state = () if not _state_became_input(seen, graph, inputs) else (
                    "state the first step created (an optimizer's, e.g. Adam's moments) is an input now: expected once",)
                # the inputs that changed shape since the last graph here (a batch made again in another cell)
                changed = tuple(batch_changes(seen[-1].inputs, inputs) or input_changes(seen[-1].graph, graph))
                return Finding(NEW, first_state + changed + tuple(diff(seen[-1].graph, graph)) or ("a new structure",))
            prev = same[-1]
            from_batch = batch_changes(prev.inputs, inputs)
            evidence = from_batch or diff(prev.graph, graph)
        else:  # no HLO to compare: judge by the batch and the trace's counts alone
            prev = seen[-1]
            from_batch = batch_changes(prev.inputs, inputs)
            if counts != prev.counts or not from_batch:
                return Finding(NEW, (f"{counts[0]} -> {counts[1]} inputs/outputs (no HLO to compare)",))
            evidence = from_batch
        if _declared(prev.inputs, inputs, declared):
            return Finding(EXPECTED, tuple(evidence) + ("a declared shape",))
        return Finding(RECOMPILATION, tuple(evidence) or ("same computation, nothing visible changed",),
                       (from_batch and batch_hint) or _hint(evidence, bool(from_batch)))
