"""tpukit.widgets: the notebook UI (live dashboard, timeline plot, HTML/text renderers).

Imported only on demand (``tpukit.dashboard()``); it consumes tpukit's records
and never calls torch_xla. ipywidgets, matplotlib and IPython are imported
lazily, only by the front end that needs them, so ``mode="text"`` works without.

Modules, one job each: ``frontend`` (which context, which renderer), ``model``
(thread-safe state fed by listener calls), ``render`` (HTML/text), ``plot``
(PNG timeline), ``live`` (the ipywidgets view), ``dashboard`` (listener, thread).
"""

from .dashboard import Dashboard, Report
from .frontend import choose_frontend, detect_context
from .model import DashboardState, View

__all__ = ["Dashboard", "Report", "DashboardState", "View", "choose_frontend", "detect_context"]
