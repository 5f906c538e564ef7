"""``tpukit.compare``: one step, traced once, compiled for several targets by several TPU compilers: one table.

The TPU compiler is in libtpu, and the libtpu a runtime loads is pinned by its
torch_xla release (:mod:`.compilers`): Colab's v5e-1 runs torch_xla 2.9's,
Kaggle's v5e-8 torch_xla 2.8's, a fresh ``pip install "jax[tpu]"`` the newest.
Two of them can disagree about the same step (one refuses it, one compiles it),
so the question "will it fit where I will run it" is asked of each, side by
side. The step is traced once (:mod:`.trace`); its graph goes to each
compiler's worker (:mod:`.worker`), in its own environment (:mod:`.envs`).
"""

from __future__ import annotations

import contextvars
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from .._text import table_html, table_text
from . import progress as _progress
from .ask import ask, begin, check, fsdp_chips, resolve
from .compiler import worker
from .compiler.pins import Compiler, role
from .compiler.targets import Target
from .outcome import TpuEstimate, cells
from .trace import trace

HEAD = ("target", "compiler", "fits", "HBM per chip", "TPU compile", "step at best")


def _who(est: TpuEstimate) -> str:
    """``"torch_xla 2.9: libtpu 0.0.21.1 (jax 0.7.2)"``; the pair alone when the name is its libtpu."""
    return f"{est.compiler_name}: {est.compiler}" if role(est.compiler_name) else est.compiler or est.compiler_name


@dataclass(frozen=True)
class Comparison:
    """The same step's :class:`TpuEstimate` for each (target, compiler) asked, in that order; its text and
    HTML reprs are one table. ``disagree`` says whether two compilers gave one target different verdicts."""

    step: str
    estimates: tuple[TpuEstimate, ...]
    note: str | None = None  # what the step's estimate is of, when it may not be what was meant
    unsharded: tuple[str, ...] = ()  # several-chip targets this one-device step was compiled for on one chip

    def of(self, target: str, compiler: str) -> TpuEstimate:
        """The estimate for ``target`` by the compiler asked as ``compiler`` (its name: ``"torch_xla 2.8"``)."""
        for est in self.estimates:
            if est.target == target and est.compiler_name == compiler:
                return est
        raise KeyError(f"no estimate for ({target!r}, {compiler!r}) in this comparison: it has "
                       f"{[(e.target, e.compiler_name) for e in self.estimates]}")

    @property
    def disagree(self) -> bool:
        """True when one target fits by one compiler and not by another."""
        return bool(self._split())

    def _split(self) -> list[str]:
        """The targets two compilers gave different verdicts, in the order asked."""
        targets = dict.fromkeys(e.target for e in self.estimates)
        return [t for t in targets if len({e.fits for e in self.estimates if e.target == t}) > 1]

    def rows(self) -> list[tuple[str, ...]]:
        """One row per estimate, in :data:`HEAD`'s columns."""
        return [(e.target, _who(e), *cells(e)) for e in self.estimates]

    def notes(self) -> list[str]:
        """What the table cannot hold: each refusal's first line, whether the compilers disagree, what a
        several-chip row of a one-device step is, the note."""
        out = [f"{e.target} by {e.compiler_name or e.compiler}: {(e.message or '').splitlines()[0][:200]}"
               for e in self.estimates if not e.fits and e.message]
        split = self._split()
        if split:
            out.append(f"the compilers disagree on {', '.join(split)}: the runtime you will run decides")
        if self.unsharded:
            out.append(f"{', '.join(self.unsharded)}: one chip's program of this one-device step (nothing is split "
                       "over the chips; the same as one chip's row): fsdp=True asks for it sharded over them")
        return out + ([self.note] if self.note else [])

    def __str__(self) -> str:
        text = table_text(self.rows(), title=f"tpukit.compare: {self.step} (traced once), per chip", head=HEAD)
        return "\n".join([text] + [f"  note: {n}" for n in self.notes()])

    def _repr_html_(self) -> str:
        notes = "".join(f"<div style='font-size:90%'>note: {n}</div>" for n in map(_escape, self.notes()))
        return table_html(self.rows(), title=f"tpukit.compare: {self.step} (traced once), per chip",
                          head=HEAD) + notes


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def compare(step: Callable, *args: Any, targets: Iterable[str | Target | None] = (None,),
            compilers: Iterable[str | Compiler | None] = (None,),
            pairs: Iterable[tuple[str | Target | None, str | Compiler | None]] | None = None,
            fsdp: bool = False, progress: bool = True, **kwargs: Any) -> Comparison:
    """``step(*args, **kwargs)`` traced once and compiled for every target in ``targets`` by every compiler
    in ``compilers`` (or for each ``(target, compiler)`` of ``pairs``); one :class:`Comparison` table.

    Targets and compilers are named as for :func:`tpukit.estimate` (None: the runtime's). For Colab's
    runtime against Kaggle's against the newest compiler: ``pairs=[("v5e-1", "torch_xla 2.9"),
    ("v5e-8", "torch_xla 2.8"), ("v5e-1", "newest")]``. A compiler not installed here runs in its own
    environment, built on first use. A compiler that refuses the step (for memory, or any other reason) is
    a row that says so; ``fsdp=True`` as for :func:`tpukit.estimate`. Nothing of the step is run or kept.
    Each compiler has its own worker process: the compilers work at the same time (one thread each, as many
    at once as this machine has cores), each compiling its targets in turn. ``progress``: show what is
    compiling and what is done while it runs (:mod:`.progress`).
    """
    asked = list(pairs) if pairs is not None else [(t, c) for t in targets for c in compilers]
    if not asked:
        raise ValueError("tpukit.compare needs at least one target and one compiler.")
    resolved = [resolve(t, c) for t, c in asked]  # unknown names fail before anything is traced
    for comp in dict.fromkeys(c for _, c in resolved):
        worker.require(comp)
    name = begin(step, args, kwargs, resolved[0][1], "tpukit.compare")
    with _progress.job(f"tpukit.compare({name})", None, progress):
        return _compare(step, args, kwargs, name, resolved, fsdp)


def _compare(step: Callable, args: tuple, kwargs: dict, name: str, resolved: list[tuple[Target, Compiler]],
             fsdp: bool) -> Comparison:
    """:func:`compare`'s work, inside its job: one trace, each compiler's pairs on a thread of its own."""
    traced = trace(step, args, kwargs)
    note = check(traced, name, "tpukit.compare")

    def one(tgt: Target, comp: Compiler) -> TpuEstimate:  # a refusal of any kind is a row, not the end
        return replace(ask(traced, tgt, comp, name, fsdp_chips(traced, tgt, fsdp),
                           what=f"{tgt.name} by {comp.name}"), note=note)

    def each(comp: Compiler) -> dict[int, TpuEstimate]:  # one compiler's pairs, in turn, on its worker
        return {i: one(tgt, c) for i, (tgt, c) in enumerate(resolved) if c == comp}

    by = list(dict.fromkeys(c for _, c in resolved))
    with ThreadPoolExecutor(max_workers=max(1, min(len(by), os.cpu_count() or 1)),
                            thread_name_prefix="tpukit-compare") as pool:
        # each thread in a copy of this context: its compiles belong to this call's job
        futures = [pool.submit(contextvars.copy_context().run, each, comp) for comp in by]
        done = {i: est for f in futures for i, est in f.result().items()}
    unsharded = () if fsdp or traced.num_partitions > 1 else tuple(
        dict.fromkeys(t.name for t, _ in resolved if t.chips > 1))
    return Comparison(name, tuple(done[i] for i in range(len(resolved))), note, unsharded)
