"""The lazy state: which tensors hold computations not yet run, and the graph they would run.

torch_xla records ops on XLA tensors as lazy IR and compiles and runs them only
at a sync (or a read of a value). ``%%xla`` and the compile diagnosis ask what is
pending without running it: whether a tensor still needs materialisation, and
the IR or HLO text of the graph that would compute a set of tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

from .loader import xlac


def has_pending(tensors: Sequence[Any]) -> list[bool]:
    """For each XLA tensor, True when it holds a computation not yet run (lazy IR).

    Asks torch_xla directly: a synced tensor and a freshly transferred one
    (``t.to(device)``, data only) are False; a result of ops, or a view of
    device data, is True until the next sync.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    return [bool(x) for x in xlac()._check_tensor_need_materialization(tensors)]


def pending_ir(tensors: Sequence[Any]) -> str:
    """The lazy IR text that would compute ``tensors`` (nothing is compiled or run)."""
    return xlac()._get_xla_tensors_text(list(tensors))


def pending_hlo(tensors: Sequence[Any]) -> str:
    """The HLO text that would compute ``tensors`` (lowered, not compiled or run)."""
    return xlac()._get_xla_tensors_hlo(list(tensors))
