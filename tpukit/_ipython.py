"""The IPython shell, whether it runs in a kernel, and notebook cell labels.

IPython is never imported here: when it is not loaded there is no shell.
"""

from __future__ import annotations

import re
import sys
from typing import Any

_IPY_INPUT_RE = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>")


def shell() -> Any:
    """The running IPython shell, or None (never imports IPython)."""
    ip = sys.modules.get("IPython")
    getter = getattr(ip, "get_ipython", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:
        return None


def in_kernel() -> bool:
    """True inside a Jupyter/Colab/Kaggle kernel (a shell with a kernel attached)."""
    if "ipykernel" not in sys.modules:
        return False
    sh = shell()
    return sh is not None and getattr(sh, "kernel", None) is not None


def cell_label(filename: str) -> str | None:
    """'[N]' when ``filename`` is a notebook/IPython cell of this process, else None."""
    m = _IPY_INPUT_RE.match(filename)
    if m:
        return f"[{m.group(1)}]"
    sh = shell()
    if sh is None:
        return None
    fmap = getattr(getattr(sh, "compile", None), "_filename_map", None) or {}
    n = fmap.get(filename)
    return f"[{n}]" if n is not None else None
