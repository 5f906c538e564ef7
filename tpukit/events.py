"""THE listener registry: everything that happens (steps, compiles, tracked loops)
reaches listeners through here, and only through here.

A listener is any object with some of these optional methods, called as the
thing happens:

- ``on_step(record)``: a :class:`~tpukit.steps.StepRecord` after each step;
- ``on_compile(event)``: a :class:`~tpukit.compiles.CompileEvent` when a
  compilation starts and again when it ends;
- ``on_track_start(tracker)`` / ``on_track_end(tracker)``: a tracked loop;
- ``on_tpu_pending(event)``: a compile's graph was sent to the target's TPU compiler (the follower);
- ``on_tpu_estimate(event, estimate)``: what the TPU compiler says about a compile
  event's graph on the target TPU (``tpukit.setup(target=...)``), once per event;
- ``on_tpu_progress(progress)``: a :class:`~tpukit.tpu.progress.TpuProgress` while an estimate, a
  search or a table runs: what it compiles, for how long, what is done (every second while it compiles).

A tracked loop reads the values logged in its steps several steps at once, so its
step records reach listeners in small bursts, up to about a second late. A listener
that needs each step's record before the next step is launched (a profile of N
steps) sets the attribute ``exact_steps = True``; while one is registered, loops
read and publish every step before launching the next (:func:`wants_exact_steps`).

:func:`call` dispatches one hook to every listener that has it, the way
Lightning's ``Fabric.call`` does. A listener that raises is removed and reported
once with a :class:`~tpukit.TpukitWarning`: a broken UI never breaks training.
The registry and its lock are the only state here; :func:`_reset` empties it
for tests.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

from .errors import TpukitError, TpukitWarning

HOOKS = ("on_step", "on_compile", "on_track_start", "on_track_end", "on_tpu_pending", "on_tpu_estimate",
         "on_tpu_progress")

_LOCK = threading.RLock()
_LISTENERS: list[Any] = []
# Builds each kind of view ("dashboard", "progress"): tpukit/__init__.py sets them from tpukit.widgets (the core
# cannot import the UI).
_UI_FACTORIES: dict[str, Callable[..., Any]] = {}


def add_listener(listener: Any) -> Any:
    """Register an object whose optional ``on_step(record)``, ``on_compile(event)``,
    ``on_track_start(tracker)`` and ``on_track_end(tracker)`` methods receive records as they happen."""
    if not any(callable(getattr(listener, h, None)) for h in HOOKS):
        raise TypeError(f"{listener!r} has none of the listener methods {', '.join(HOOKS)}; "
                        "define at least one, or use tpukit.on_step(fn) for a plain function.")
    with _LOCK:
        if listener in _LISTENERS:
            return listener
        _LISTENERS.append(listener)
    return listener


def remove_listener(listener: Any) -> None:
    """Unregister a listener (no error if it was not registered)."""
    with _LOCK:
        if listener in _LISTENERS:
            _LISTENERS.remove(listener)


def listeners(hook: str | None = None) -> list[Any]:
    """The registered listeners (a copy), only those with ``hook`` when given."""
    with _LOCK:
        found = list(_LISTENERS)
    return found if hook is None else [lst for lst in found if callable(getattr(lst, hook, None))]


def has(hook: str) -> bool:
    """True when at least one listener implements ``hook``."""
    return bool(listeners(hook))


def wants_exact_steps() -> bool:
    """True while a listener with ``exact_steps = True`` is registered: tracked loops then publish
    each step's record before they launch the next step."""
    with _LOCK:
        return any(getattr(lst, "exact_steps", False) for lst in _LISTENERS)


def call(hook: str, *args: Any) -> None:
    """Call ``listener.<hook>(*args)`` on every listener that has it, in registration order.

    Runs outside the lock (a listener may add or remove listeners). One that
    raises is removed and reported once; the caller never sees its exception.
    """
    if hook not in HOOKS:
        raise ValueError(f"unknown listener hook {hook!r}; hooks are {', '.join(HOOKS)}")
    for lst in listeners(hook):
        try:
            getattr(lst, hook)(*args)
        except Exception as exc:  # a broken UI must never break the training loop
            with _LOCK:
                was_registered = lst in _LISTENERS
                if was_registered:
                    _LISTENERS.remove(lst)
            if was_registered:
                warnings.warn(f"tpukit: listener {_name(lst)} failed in {hook} and was detached: "
                              f"{type(exc).__name__}: {exc}", TpukitWarning, stacklevel=2)


def _name(listener: Any) -> str:
    inner = getattr(listener, "fn", None)
    if inner is not None:
        return repr(getattr(inner, "__name__", inner))
    return repr(listener)


def set_ui_factory(kind: str, factory: Callable[..., Any]) -> None:
    """Register how to build a view of ``kind``: ``"dashboard"`` (``tpukit.widgets.open_view``) or
    ``"progress"`` (``tpukit.widgets.progress.ProgressView``); ``tpukit/__init__.py`` registers both."""
    with _LOCK:
        _UI_FACTORIES[kind] = factory


def open_ui(kind: str, **options: Any) -> Any:
    """Build and return a view of ``kind`` with the registered UI factory."""
    with _LOCK:
        factory = _UI_FACTORIES.get(kind)
    if factory is None:
        raise TpukitError(f"no {kind} UI is available: tpukit.widgets was not imported. "
                          "Import tpukit (not only a submodule) or reinstall tpukit.")
    return factory(**options)


def open_dashboard(**options: Any) -> Any:
    """Build and return a live dashboard with the registered UI factory."""
    return open_ui("dashboard", **options)


def _reset() -> None:
    """Forget every listener (for tests); the UI factories stay."""
    with _LOCK:
        _LISTENERS.clear()
