"""Eager mode's per-op compiles, named at the user's line.

torch_xla writes no compilation analysis for eager-mode ops, so tpukit watches
them itself: while eager mode is on (``_xla.eager.follow`` reports the switch),
a ``TorchFunctionMode`` sits on the torch-function stack of the thread that
switched it on and reads the runtime's compile counter around each torch call.
When the counter moved, the call compiled: each compile is published through
:meth:`compiles.Reader.add_seen` as ``eager op <name>`` at the innermost user
frame, classified by place (first compile of the op there: a new graph; the
same op there again with other input shapes: a recompilation naming them, or
expected when the shapes were declared). When eager mode is off the mode is
off the stack: lazy code pays nothing.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from . import _ipython, _tree, _xla, compiles, metrics
from .compiles import Frame

_COUNTER = "UncachedCompile"  # every compile, eager ones included; 0.2 us to read


class EagerOps(TorchFunctionMode):
    """Reads the compile counter around each torch call; publishes the compiles a call caused."""

    def __init__(self) -> None:
        super().__init__()
        self._library: dict[str, bool] = {}  # file name -> Frame.is_library
        # A run of one user statement: its frame and instruction, numbered when it changes.
        self._statement: tuple = ()
        self._run = 0
        self._seen: dict[tuple, tuple[int, int]] = {}  # place -> (run, compiles there in that run)
        self._positions: dict[Any, list | None] = {}  # code object -> source positions of its code units

    def __torch_function__(self, func, types, args=(), kwargs=None):
        user = self._user_frame(sys._getframe(1))
        statement = (id(user), self._instruction(user))
        if statement != self._statement:
            self._statement, self._run = statement, self._run + 1
        before = _xla.counter_value(_COUNTER) or 0
        out = func(*args, **(kwargs or {}))
        n = (_xla.counter_value(_COUNTER) or 0) - before
        if n > 0:
            self._publish(func, args, kwargs, out, n, user)
        return out

    def _instruction(self, f) -> Any:
        """Where ``f`` is in its code: the source position of its current instruction (Python >= 3.11),
        not the raw ``f_lasti``, which Python 3.12 points into an instruction's inline cache once it is
        specialized (a for-loop's first iteration and the next ones differ); the offset on 3.10."""
        if f is None:
            return -1
        code = f.f_code
        pos = self._positions.get(code, False)
        if pos is False:
            pos = self._positions[code] = list(code.co_positions()) if hasattr(code, "co_positions") else None
        i = f.f_lasti // 2
        return pos[i] if pos is not None and 0 <= i < len(pos) else f.f_lasti

    def _user_frame(self, f):
        """The innermost frame outside torch, torch_xla, tpukit and installed packages (None if none)."""
        while f is not None:
            name = f.f_code.co_filename
            lib = self._library.get(name)
            if lib is None:
                lib = self._library[name] = Frame("", name, 0).is_library
            if not lib:
                return f
            f = f.f_back
        return None

    def _publish(self, func, args, kwargs, out, n: int, user) -> None:
        name = getattr(func, "__name__", None) or str(func)
        name = name[2:-2] if name.startswith("__") and name.endswith("__") else name  # __matmul__
        frames = []
        f = sys._getframe(2)  # the caller of __torch_function__
        while f is not None:
            fr = Frame(f.f_code.co_name, f.f_code.co_filename, f.f_lineno)
            if not self._library.get(fr.filename, True):  # a cell is never a library file
                fr = Frame(fr.function, fr.filename, fr.line, _ipython.cell_label(fr.filename))
            frames.append(fr)
            f = f.f_back
        tensors = [t for _, t in _tree.tree_leaves((args, kwargs), _tree.is_tensor)]
        results = [t for _, t in _tree.tree_leaves(out, _tree.is_tensor)]
        # The op's "batch" for the classifier: its tensor inputs, or its results for a factory (randn).
        inputs = tuple((f"['{name}']" if i == 0 else f"['{name} arg {i + 1}']", tuple(t.shape), str(t.dtype))
                       for i, t in enumerate(tensors or results))
        lasti = self._instruction(user)
        # Calls of one op at one place within one run of the user's statement (the layers of an
        # nn.Sequential, the parameters of an optimizer) are told apart by their rank in that run.
        key = ("eager op", name, lasti) + tuple((fr.filename, fr.line) for fr in frames if not fr.is_library)
        samples = metrics.compile_samples("EagerOpCompileTime")[-n:]
        for k in range(n):
            run, rank = self._seen.get(key, (0, -1))
            rank = rank + 1 if run == self._run else 0
            self._seen[key] = (self._run, rank)
            end, seconds = samples[k] if len(samples) == n else (samples[-1] if samples else (0.0, 0.0))
            compiles.reader().add_seen(f"eager op {name}", tuple(frames), (len(tensors), len(results)), key + (rank,),
                                    inputs, end - seconds, end)


_MODE = EagerOps()


def active() -> bool:
    """True when the eager-op watcher is on this thread's torch-function stack."""
    return any(m is _MODE for m in _get_current_function_mode_stack())


def _switch(enabled: bool) -> None:
    """Follow torch_xla's eager mode: put the watcher on the stack, or take it off (others stay)."""
    if enabled == active():
        return
    if enabled:
        torch._C._push_on_torch_function_stack(_MODE)
        return
    above = []
    while True:
        mode = torch._C._pop_torch_function_stack()
        if mode is _MODE:
            break
        above.append(mode)
    for mode in reversed(above):
        torch._C._push_on_torch_function_stack(mode)


_xla.eager.follow(_switch)  # the switch's one follower (tpukit/_xla/eager.py)
