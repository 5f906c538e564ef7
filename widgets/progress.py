"""The view of long TPU work (an estimate, a batch search, a table): a listener of ``on_tpu_progress``.

It shows each :class:`tpukit.tpu.progress.TpuProgress` as it comes: tqdm's bar (``tqdm.auto``: a widget in a
notebook, a bar in a terminal) counting the compiles, its text what is compiling and for how long, the last
answer and the best so far; where the output is neither a notebook's nor a terminal's (a log, a test,
``TPUKIT_DASHBOARD=text`` under nbval) a line per compile answered, without a carriage-return bar. The job's last record closes it and prints
what ended the job early (a time budget). A failing display is detached by the listener registry.
"""

from __future__ import annotations

import sys
from typing import Any

from .frontend import choose_frontend

ANSWERED, ENDED = "answered", "ended"  # tpukit.tpu.progress's phases (the UI imports nothing of the core)


class ProgressView:
    """One job's progress on screen (see the module doc); ``mode``: ``"widgets"`` / ``"text"`` (default: as
    the dashboard would choose)."""

    def __init__(self, mode: str | None = None, file: Any = None):
        """``file``: where to write (default: stderr)."""
        self.mode = mode or choose_frontend("auto")
        out = file or sys.stderr
        self.lines_only = self.mode == "text" and not (hasattr(out, "isatty") and out.isatty())
        self.file = file
        self.bar = None
        self.lines: list[str] = []  # what text mode printed (and what a test reads)
        self.job: str | None = None  # the job it shows: the first it hears (its STARTED); others' records are not its

    def on_tpu_progress(self, p: Any) -> None:
        """Show ``p`` (a :class:`~tpukit.tpu.progress.TpuProgress`) when it is of this view's job."""
        self.job = self.job or p.job
        if p.job != self.job:  # another thread's call: its own view shows it
            return
        if self.lines_only:
            if p.phase in (ANSWERED, ENDED):
                self._print(f"{p.job}: {p.line()}")
            return
        if self.bar is None:
            if self.mode == "widgets":
                from tqdm.auto import tqdm
            else:
                from tqdm import tqdm
            self.bar = tqdm(total=None, desc=p.job, unit="compile", leave=True, file=self.file)
        self.bar.n = p.compiles
        self.bar.set_postfix_str(p.line(), refresh=True)
        if p.phase == ENDED:
            self.bar.close()

    def _print(self, text: str) -> None:
        self.lines.append(text)
        print(text, file=self.file or sys.stderr, flush=True)
