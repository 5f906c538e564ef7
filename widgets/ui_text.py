"""The text front end: a short line of text every ``text_every`` seconds, and one at the end.

Lines are printed after a step (on the training thread, when one is due) and, in a
terminal or a script, by the thread during a long compile, when no step can print.
In a notebook kernel that got the text front end (``TPUKIT_DASHBOARD=text``: nbval,
nbconvert) the thread prints nothing: lines would pile up in the cell.
"""

from __future__ import annotations

import time
from typing import Any

from . import frontend, render
from .ui import FrontEnd, runtime_info


class TextFrontEnd(FrontEnd):
    """Periodic text summaries (``print``, flushed)."""

    mode = "text"

    def __init__(self, state: Any, **options: Any):
        super().__init__(state, **options)
        self._last_print = time.monotonic()

    def _print(self, line: str) -> None:
        self._last_print = self._rendered()
        print(line, flush=True)

    def _due(self) -> bool:
        return time.monotonic() - self._last_print >= self.text_every

    def show(self) -> None:
        """Print the header and how often a summary comes."""
        print(f"{render.header_text(runtime_info()[0])} (text mode: a summary every "
              f"{self.text_every:g} s and at the end)")
        self.displayed = True

    def stepped(self) -> None:
        """Print a summary line when one is due."""
        if self._due():
            self._print(render.text_line(self.state.view()))

    def tick(self, force: bool = False) -> None:
        """In a terminal or a script: say so during a long compile, when no step can print."""
        if frontend.has_rich_display(self.context):
            return
        view = self.state.view()
        if view.now_kind == "compiling" and self._due():
            self._print(render.text_line(view))

    def close(self) -> None:
        """Print the closing line (``tpukit: done · ...``, or ``tpukit: stopped by <exception> at step N · ...``)."""
        self._print(render.text_line(self.state.view(), final=True))
        self.final_printed = True

    def late_estimate(self) -> None:
        """Print the answer that came after the closing line: ``tpukit: on the target TPU: <graph>: ...``."""
        latest = self.state.latest_estimate()
        if latest is not None:
            self._print(render.late_tpu_line(*latest))

    def display(self) -> None:
        """A bare dashboard as a cell's value: one summary line, unless it was shown at open."""
        if not self.displayed:
            self.displayed = True
            print(render.text_line(self.state.view()))
