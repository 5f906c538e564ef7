"""tpukit.widgets: the notebook UI (live dashboard, timeline plot, HTML/text renderers).

``import tpukit`` imports it to register the dashboard with ``tpukit.events``
(``tpukit.dashboard()``, ``track(dashboard=True)``); it consumes tpukit's
records through listeners and never calls torch_xla. ipywidgets, matplotlib and IPython are imported
lazily, only by the front end that needs them, so ``mode="text"`` works without.

Modules, one job each: ``frontend`` (which context, which renderer), ``model``
(thread-safe state fed by listener calls), ``render`` (HTML/text), ``plot``
(PNG timeline), ``live`` (the ipywidgets view), ``report`` (the static report,
which replaces the live view when a tracked loop ends), ``dashboard`` (listener, threads),
``slice`` (the per-host view of a ``tpukit.run_on_slice`` run).
"""

from tpukit import events

from .dashboard import Dashboard
from .frontend import choose_frontend, detect_context
from .model import DashboardState, View
from .report import Report
from .slice import SliceState, SliceSummary, SliceView


def open_view(hosts: int | None = None, **options):
    """What ``tpukit.dashboard(**options)`` opens: the :class:`Dashboard`, or with ``hosts=N`` the
    per-host :class:`SliceView` of a slice of N hosts (``run_on_slice(..., dashboard=True)``)."""
    return SliceView(hosts, **options) if hosts is not None else Dashboard(**options)


events.set_dashboard_factory(open_view)

__all__ = ["Dashboard", "Report", "DashboardState", "View", "SliceView", "SliceState", "SliceSummary",
           "open_view", "choose_frontend", "detect_context"]
