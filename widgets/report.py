"""The static report, and where the dashboard's outputs go in the notebook.

A tracked loop's cell ends up holding one thing: the report. The live widget
box is displayed with a display id; when the loop ends, that very output is
updated in place with the :class:`Report` (an HTML page with the timeline PNG
inside it, and a text fallback), so the closed widget and the report are never
both left in the cell. Front ends without a widget view (GitHub, nbval's text
comparison, a saved notebook without widget state) keep the report's HTML and
text. IPython is imported only here, only when something is displayed.
"""

from __future__ import annotations

import sys
from typing import Any

from tpukit import _ipython
from tpukit._text import plural

from . import render
from .view import View


class Report:
    """The static report: ``text/html`` (tables, and the timeline when ``png`` is given)
    plus a ``text/plain`` summary; no widget state needed."""

    def __init__(self, view: View, runtime: Any, tracing: bool, png: bytes | None = None):
        self.view, self.runtime, self.tracing, self.png = view, runtime, tracing, png

    def _repr_html_(self) -> str:
        return render.report_html(self.view, self.runtime, self.tracing, png=self.png)

    def __repr__(self) -> str:
        return render.text_report(self.view, self.runtime)


def title(view: View) -> str:
    """'24 steps · 3 compiles · 1 recompilation' (the timeline's title)."""
    return " · ".join([plural(view.steps, "step"), plural(view.compiles, "compile"),
                       plural(view.recompilations, "recompilation")])


def display(*objs: Any) -> None:
    """IPython's display, or print where IPython is missing."""
    try:
        from IPython.display import display as show_
    except ImportError:  # pragma: no cover (IPython is there wherever widgets are)
        print(*objs)
        return
    show_(*objs)


def current_cell() -> int | None:
    """The execution count of the cell running now (None without IPython)."""
    sh = _ipython.shell()
    return getattr(sh, "execution_count", None) if sh is not None else None


class Slot:
    """One displayed output that can be replaced later: its display handle and the cell that showed it."""

    def __init__(self, handle: Any, cell: int | None):
        self.handle, self.cell = handle, cell

    def replace(self, obj: Any) -> None:
        """Put ``obj`` in place of what the slot shows (an ``update_display_data`` message)."""
        self.handle.update(obj)


def show(obj: Any) -> Slot | None:
    """Display ``obj`` so it can be replaced later; None where there is no display to update."""
    try:
        from IPython.display import display as show_
    except ImportError:  # pragma: no cover
        print(obj)
        return None
    if _is_ipywidgets7_widget(obj):
        # ipywidgets 7 (Colab's) displays a widget by sending its view itself, without the
        # display id, so a later update would target no output: send the same view ourselves.
        data = {"text/plain": repr(obj), "application/vnd.jupyter.widget-view+json":
                {"version_major": 2, "version_minor": 0, "model_id": obj.model_id}}
        handle = show_(data, raw=True, display_id=True)
    else:
        handle = show_(obj, display_id=True)  # None (and printed) without a running shell
    return Slot(handle, current_cell()) if handle is not None else None


def _is_ipywidgets7_widget(obj: Any) -> bool:
    """True for a widget of ipywidgets 7 (its own display path drops the display id)."""
    ipw = sys.modules.get("ipywidgets")
    if ipw is None or not str(getattr(ipw, "__version__", "8")).startswith("7."):
        return False
    return isinstance(obj, ipw.Widget) and getattr(obj, "model_id", None) is not None
