"""torch_xla's profiler as a session: start it, run the code, stop it and the trace is written.

``tpukit.profile`` captures a ``with`` block, or the next N steps of a tracked
loop, with these two calls. The trace lands where TensorBoard's Profile tab and
XProf look for it: ``<logdir>/plugins/profile/<run>/<host>.xplane.pb``.
"""

from __future__ import annotations

from ..errors import RuntimeStateError
from .loader import module


def profiler_start(logdir: str) -> None:
    """Start torch_xla's in-process profiler session (``xp.start_trace``): host and device
    activity from now until :func:`profiler_stop`, which writes it under ``logdir``.

    Unlike ``xp.trace_detached`` (a profiler server asked for a fixed duration), the
    session covers exactly the region between the two calls. Only one session runs at
    a time: starting a second raises :class:`~tpukit.RuntimeStateError`.
    """
    try:
        module("torch_xla.debug.profiler").start_trace(str(logdir))
    except RuntimeError as exc:  # "Profile has already been started"
        raise RuntimeStateError(
            f"a torch_xla profiler trace is already running ({exc}); only one can run at a time. "
            "Let the other profile finish (leave its `with` block) before starting this one.") from None


def profiler_stop() -> None:
    """Stop the session :func:`profiler_start` began and write
    ``<logdir>/plugins/profile/<run>/<host>.xplane.pb`` (XProf/TensorBoard's layout)."""
    module("torch_xla.debug.profiler").stop_trace()
