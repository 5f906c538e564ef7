"""Following torch_xla's eager-mode switch.

torch_xla writes no compilation analysis for the per-op compiles of eager
mode, so tpukit has to know when eager mode is on to watch them itself
(``tpukit.eager``). There is no torch_xla event for the switch; but every way
to flip it (``torch_xla.experimental.eager_mode(bool)``, its context manager,
and ``torch_xla.compile``, which turns eager mode off around the compiled
function) goes through one C function, ``torch_xla._XLAC._set_use_eager_mode``.
:func:`watch` wraps that function once; the wrapper sets the mode, then reports
the new state to the follower.

There is one follower, set explicitly with :func:`follow` (``tpukit.eager``
does so when it is imported): a single slot, not a list of listeners, since
one module owns what happens on a switch. Listeners of tpukit's records go
through ``tpukit.events``, never through here.

This module never imports torch_xla: it wraps the switch only once torch_xla
is loaded (the loader calls :func:`watch` after each first import).
"""

from __future__ import annotations

import sys
from typing import Callable

_follower: Callable[[bool], None] | None = None


def follow(fn: Callable[[bool], None] | None) -> None:
    """Call ``fn(enabled)`` on every eager-mode switch from now on, and at once if eager mode is
    already on. ``fn`` takes the one slot (a second call replaces the first follower; None clears it)."""
    global _follower
    _follower = fn
    xlac = _loaded_xlac()
    if fn is None or xlac is None:
        return  # torch_xla not loaded yet: the loader calls watch() when it is
    _wrap_once(xlac)
    if xlac._get_use_eager_mode():
        fn(True)


def watch() -> None:
    """Wrap ``_XLAC._set_use_eager_mode`` if torch_xla is loaded, a follower is set and the switch is
    not wrapped yet; the follower then hears at once if eager mode is already on. Idempotent."""
    xlac = _loaded_xlac()
    if _follower is None or xlac is None or not _wrap_once(xlac):
        return
    if xlac._get_use_eager_mode():
        _follower(True)


def _loaded_xlac():
    """torch_xla's C extension if torch_xla is loaded (never imports it), else None."""
    xlac = getattr(sys.modules.get("torch_xla"), "_XLAC", None)
    return xlac if hasattr(xlac, "_set_use_eager_mode") else None


def _wrap_once(xlac) -> bool:
    """Replace ``xlac._set_use_eager_mode`` by a wrapper that reports to the follower; False if done before."""
    setter = xlac._set_use_eager_mode
    if hasattr(setter, "tpukit_original"):
        return False

    def set_use_eager_mode(enable: bool) -> None:
        setter(enable)
        if _follower is not None:
            _follower(bool(enable))

    set_use_eager_mode.tpukit_original = setter  # marks the wrapper: never wrapped twice
    xlac._set_use_eager_mode = set_use_eager_mode
    return True
