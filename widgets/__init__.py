"""tpukit.widgets: the notebook UI (dashboard, plots, renderers).

Imported only on demand; it consumes tpukit's records and never calls torch_xla.
"""

__all__: list[str] = []
