"""Which front end is listening: detect the context once and pick a renderer.

Modelled on ``tqdm.autonotebook`` and TensorBoard's ``notebook.py``: look at what
is already imported (never import a UI library to find out) and dispatch to
widgets or text. Nothing here imports ipywidgets, matplotlib or IPython.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from tpukit import _ipython

MODES = ("auto", "widgets", "text")
ENV_VAR = "TPUKIT_DASHBOARD"  # "text" or "widgets": overrides mode="auto" (set it for nbval/nbconvert runs)
# Environments where a kernel runs without anyone looking at widgets. nbval and
# nbclient set no marker of their own, hence TPUKIT_DASHBOARD=text in the Makefile.
_HEADLESS_VARS = ("NBVAL", "CI")


def detect_context() -> str:
    """Where this code runs: ``"colab"``, ``"jupyter"`` (a kernel with a front end
    that can show widgets: Lab, Notebook, VS Code), ``"ipython"`` (a terminal shell
    or a console-only kernel such as qtconsole/Spyder) or ``"none"`` (a script)."""
    shell = _ipython.shell()
    if shell is None:
        return "none"
    if "google.colab" in sys.modules:
        return "colab"
    kernel = "IPKernelApp" in getattr(shell, "config", {}) or type(shell).__name__ == "ZMQInteractiveShell"
    if not kernel:
        return "ipython"
    name = type(shell).__name__.lower()
    if "qt" in name or "spyder" in name or any(k == "QT_API" or k.startswith("SPYDER") for k in os.environ):
        return "ipython"  # a console that cannot render widgets
    return "jupyter"


def has_rich_display(context: str | None = None) -> bool:
    """True when displayed HTML and images are kept (a notebook kernel), not just printed."""
    return (context or detect_context()) in ("colab", "jupyter")


def choose_frontend(mode: str = "auto", context: str | None = None) -> str:
    """Return ``"widgets"`` or ``"text"`` for a dashboard opened with ``mode``.

    An explicit ``mode="widgets"``/``"text"`` wins. With ``"auto"``, the
    ``TPUKIT_DASHBOARD`` environment variable decides if set (the Makefile sets
    ``text`` for nbval/nbconvert runs, whose kernels have no widget front end);
    otherwise ``NBVAL`` or ``CI`` in the environment mean text, and so does any
    context but Colab or a Jupyter kernel. Widgets also need ipywidgets installed.
    """
    if mode not in MODES:
        raise ValueError(f"Dashboard(mode={mode!r}) is not one of {MODES}; 'auto' picks widgets in a "
                         f"notebook and text elsewhere.")
    if mode == "auto":
        forced = os.environ.get(ENV_VAR, "").strip().lower()
        if forced in ("text", "widgets"):
            mode = forced
        elif any(os.environ.get(v, "").strip().lower() not in ("", "0", "false", "no") for v in _HEADLESS_VARS):
            mode = "text"
        else:
            mode = "widgets" if has_rich_display(context) else "text"
    if mode == "widgets" and not widgets_available():
        return "text"
    return mode


def widgets_available() -> bool:
    """True when ipywidgets can be imported (checked without importing it twice)."""
    if "ipywidgets" in sys.modules:
        return True
    return importlib.util.find_spec("ipywidgets") is not None
