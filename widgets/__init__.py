"""tpukit.widgets: the notebook UI (live dashboard, timeline plot, HTML/text renderers).

It consumes tpukit's records through listeners and never calls torch_xla.
``tpukit/__init__.py`` hands :func:`open_view` to ``tpukit.events`` as the dashboard
factory (``tpukit.dashboard()``, ``track(dashboard=True)``); importing this package
registers nothing. ipywidgets, matplotlib and IPython are imported lazily, only by
the front end that needs them, so ``mode="text"`` works without.

Modules, one job each: ``dashboard`` (the controller: listener, state updates, the
report at loop end, failures), ``frontend`` (which context, which front end),
``ui`` (the front-end interface and its thread), ``ui_widgets`` / ``ui_text`` (the two
front ends), ``live`` (the ipywidgets view), ``model`` (thread-safe state fed by
listener calls), ``view`` (the frozen records renderers draw), ``render`` (HTML/text),
``plot`` (PNG timeline), ``report`` (the static report, which replaces the live view
when a tracked loop ends), ``slice`` (the per-host view of a ``tpukit.run_on_slice`` run),
``progress`` (the view of long TPU work: an estimate, a batch search).
"""

from __future__ import annotations

from typing import Any

from .dashboard import Dashboard
from .frontend import choose_frontend, detect_context
from .model import DashboardState
from .progress import ProgressView
from .report import Report
from .slice import SliceState, SliceSummary, SliceView
from .view import View


def open_view(hosts: int | None = None, **options: Any) -> Dashboard | SliceView:
    """What ``tpukit.dashboard(**options)`` opens: the :class:`Dashboard`, or with ``hosts=N`` the
    per-host :class:`SliceView` of a slice of N hosts (``run_on_slice(..., dashboard=True)``)."""
    return SliceView(hosts, **options) if hosts is not None else Dashboard(**options)


__all__ = ["Dashboard", "ProgressView", "Report", "DashboardState", "View", "SliceView", "SliceState", "SliceSummary",
           "open_view", "choose_frontend", "detect_context"]
