"""The IPython shell, whether it runs in a kernel, and notebook cell labels.

IPython is never imported here: when it is not loaded there is no shell.
"""

from __future__ import annotations

import re
import sys
import threading
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
    """'[N]' when ``filename`` is a notebook/IPython cell of this process, else None.

    Three namings exist: IPython's own ``<ipython-input-N-hash>``; ipykernel >= 6's
    ``/tmp/ipykernel_<pid>/<hash>.py``, which IPython >= 8 records in
    ``shell.compile._filename_map``; and the same ipykernel names under IPython 7.34
    (Colab's pairing), which records nothing: there the name is recomputed from the
    input history with the kernel's own ``compile.get_code_name``.
    """
    m = _IPY_INPUT_RE.match(filename)
    if m:
        return f"[{m.group(1)}]"
    sh = shell()
    if sh is None:
        return None
    fmap = getattr(getattr(sh, "compile", None), "_filename_map", None)
    n = fmap.get(filename) if fmap else None
    if n is None and fmap is None:
        n = _hashed_cell_number(sh, filename)
    return f"[{n}]" if n is not None else None


_NAMES_LOCK = threading.Lock()
_NAMES: dict[int, tuple[int, dict[str, int]]] = {}  # id(shell) -> (cells hashed, {file name: cell})


def _hashed_cell_number(sh: Any, filename: str) -> int | None:
    """The execution count whose cell the kernel compiled under ``filename`` (IPython 7 + ipykernel 6)."""
    get_name = getattr(getattr(sh, "compile", None), "get_code_name", None)
    history = getattr(getattr(sh, "history_manager", None), "input_hist_raw", None)
    if get_name is None or not history:
        return None
    with _NAMES_LOCK:
        done, names = _NAMES.get(id(sh), (0, {}))
        for n in range(done, len(history)):
            # History keeps the cell without its trailing newlines; the kernel hashed it as sent.
            for text in (history[n], history[n] + "\n"):
                try:
                    names.setdefault(get_name(text, text, n), n)
                except Exception:
                    break
        _NAMES[id(sh)] = (len(history), names)
        return names.get(filename)


def watch_cells() -> None:
    """Record each cell's file name as it starts (IPython 7 + ipykernel 6 only; newer IPython
    records it itself), so cell labels do not depend on the history's copy of the text."""
    sh = shell()
    comp = getattr(sh, "compile", None)
    get_name = getattr(comp, "get_code_name", None)
    if sh is None or get_name is None or getattr(comp, "_filename_map", None) is not None:
        return
    if getattr(sh, "_tpukit_cell_watch", False):
        return

    def pre_run_cell(info: Any = None) -> None:
        raw = getattr(info, "raw_cell", None)
        if raw is None:
            return
        try:
            name = get_name(raw, raw, sh.execution_count)
        except Exception:
            return
        with _NAMES_LOCK:
            done, names = _NAMES.get(id(sh), (0, {}))
            names[name] = sh.execution_count
            _NAMES[id(sh)] = (done, names)

    sh.events.register("pre_run_cell", pre_run_cell)
    sh._tpukit_cell_watch = True
