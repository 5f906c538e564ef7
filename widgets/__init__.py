"""tpukit.widgets: the notebook UI (live dashboard, timeline plot, HTML/text renderers).

``import tpukit`` imports it to register the dashboard with ``tpukit.events``
(``tpukit.dashboard()``, ``track(dashboard=True)``); it consumes tpukit's
records through listeners and never calls torch_xla. ipywidgets, matplotlib and IPython are imported
lazily, only by the front end that needs them, so ``mode="text"`` works without.

Modules, one job each: ``frontend`` (which context, which renderer), ``model``
(thread-safe state fed by listener calls), ``render`` (HTML/text), ``plot``
(PNG timeline), ``live`` (the ipywidgets view), ``report`` (the static report,
which replaces the live view when a tracked loop ends), ``dashboard`` (listener, threads).
"""

from tpukit import events

from .dashboard import Dashboard
from .frontend import choose_frontend, detect_context
from .model import DashboardState, View
from .report import Report

events.set_dashboard_factory(Dashboard)

__all__ = ["Dashboard", "Report", "DashboardState", "View", "choose_frontend", "detect_context"]
