"""Profile from a notebook: ``with tpukit.profile() as prof:`` then ``prof.summary()``.

The capture is torch_xla's profiler session (through the adapter) over the ``with``
block, or with ``steps=N`` over the next N steps of a :func:`~tpukit.track` loop
(counted by a listener on the events registry), written where TensorBoard and XProf
look: ``<logdir>/plugins/profile/<run>/<host>.xplane.pb``. The summary reads it with
XProf (``pip install 'tpukit[profile]'``), whose ``trace_viewer`` tool converts it to
trace events; its aggregated tools (``hlo_stats``, ``op_profile``) read accelerator
planes only and are empty on XLA:CPU. On XLA:CPU each HLO op is an event with
``hlo_op``/``hlo_module`` and each execution a ``ThunkExecutor::Execute`` span; on a
TPU they are the device plane's "XLA Ops" and "XLA Modules" lines.

Two modules: :mod:`.capture` runs the profiler session (:class:`Profile`,
:func:`profile`, the listener that follows a tracked loop) and :mod:`.trace`
reads what it wrote (:func:`read_trace`, :func:`trace_stats`, :class:`ProfileSummary`).

``tpukit/__init__`` imports :func:`profile` from here, which rebinds the name
``tpukit.profile`` to the function: ``tpukit.profile(...)`` is the call, and
``from tpukit.profile import Profile`` still finds this package (Python looks
the package up in ``sys.modules``, not as an attribute of ``tpukit``).
"""

from __future__ import annotations

from .capture import DEFAULT_ROOT, Profile, default_logdir, profile
from .trace import INSTALL, OpTime, ProfileSummary, TraceStats, read_trace, trace_stats

__all__ = ["Profile", "profile", "default_logdir", "DEFAULT_ROOT",
           "ProfileSummary", "TraceStats", "OpTime", "read_trace", "trace_stats", "INSTALL"]
