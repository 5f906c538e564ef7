"""What ``%tpu``, ``%xla_metrics``, ``%xla_dashboard`` and ``%xla_profile`` show, and the helpers
every magic shares.

The magics' argument parsing lives in ``tpukit.magics``; the bodies of the
cell-running magics (``%%xla``, ``%xla_ir``, ``%xla_hlo``, ``%xla_watch``) in
``tpukit._magic_cells``. IPython is imported inside the functions, never at
import time.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from . import _xla, events, metrics, runtime
from .errors import TpukitError
from .profile import Profile
from ._text import table_html, table_text


def usage(message: str) -> Exception:
    """A one-line IPython usage error (shown without a traceback)."""
    from IPython.core.error import UsageError

    return UsageError(message)


def show(text: str, html_text: str | None = None) -> None:
    """Display text in a terminal and HTML in a notebook front end."""
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text:
        bundle["text/html"] = html_text
    display(bundle, raw=True)


def snapshot_now() -> metrics.Snapshot:
    """The counters now, without importing torch_xla."""
    # Counters start at zero when torch_xla is imported: before that, a zero snapshot is exact.
    return metrics.snapshot() if _xla.is_imported() else metrics.Snapshot(time=time.time())


# ----------------------------------------------------------------- %tpu

def tpu(args: Any) -> None:
    """Set the runtime up (idempotent) and show its report."""
    if args.cpu_devices is not None and args.cpu_devices < 1:
        raise usage(f"%tpu --cpu-devices needs a positive number of virtual CPU devices, not {args.cpu_devices}.")
    try:
        rt = runtime.setup(device=args.device, cpu_devices=args.cpu_devices, spmd=args.spmd,
                           compile_cache=args.compile_cache, trace_compiles=not args.no_trace)
    except (ValueError, TpukitError) as exc:  # a busy or missing TPU, a missing torch_xla: the message, no traceback
        raise usage(f"%tpu: {exc}") from None
    show(rt.report(), rt._repr_html_())


# ----------------------------------------------------------------- %xla_metrics

def xla_metrics(ext: Any, args: Any) -> None:
    """The metrics table (or its change since ``ext``'s mark, or JSON); moves the mark to now."""
    if not _xla.is_imported():
        print("%xla_metrics: torch_xla is not imported yet, so nothing has run on an XLA device.")
        return
    now = metrics.snapshot(memory=args.full and _xla.runtime_initialized())
    mark, label = (ext.metrics_mark, ext.metrics_mark_label) if ext else (None, "")
    if ext is not None:
        ext.metrics_mark, ext.metrics_mark_label = now, "since the previous %xla_metrics"
    if args.reset:
        print("%xla_metrics: baseline set; %xla_metrics --since-last counts from here.")
        return
    if args.since_last and mark is not None:
        data: Any = now - mark
        title = f"XLA metrics {label} ({data.seconds:.1f} s)"
    else:
        data = now
        title = "XLA metrics since the runtime started"
    if args.json:
        print(json.dumps({"kind": "delta" if data is not now else "snapshot", **dataclasses.asdict(data)},
                         sort_keys=True))
        return
    rows = metrics.table(data, full=args.full)
    show(table_text(rows, title=title), table_html(rows, title=title, css_class="tpukit-metrics"))


# ----------------------------------------------------------------- %xla_dashboard

def xla_dashboard() -> None:
    """Display the live compile/execute dashboard."""
    from IPython.display import display

    display(events.open_dashboard())


# ----------------------------------------------------------------- %xla_profile

def new_profile(args: Any, magic: str) -> Profile:
    """The profile ``%xla_profile`` / ``%%xla_profile`` asked for (bad arguments: a usage error)."""
    if args.steps is not None and args.steps < 1:
        raise usage(f"{magic} N needs a positive number of tracked-loop steps, not {args.steps}.")
    if args.top < 1:
        raise usage(f"{magic} --top needs a positive number of ops to list, not {args.top}.")
    try:
        return Profile(logdir=args.logdir, steps=args.steps)
    except (TpukitError, ValueError) as exc:
        raise usage(f"{magic}: {exc}") from None


def show_profile(prof: Profile, top: int, magic: str) -> None:
    """Display a finished profile's summary (or where its trace is and why there is no summary)."""
    try:
        summary = prof.summary(top=top)
    except TpukitError as exc:
        print(f"{magic}: no summary ({exc}) Trace directory: {prof.logdir}")
        return
    show(summary.text(), summary._repr_html_())


class ArmedProfile:
    """``%xla_profile N``: a profile waiting for (or tracing) a tracked loop; its summary shows
    after the cell where it ended (the extension keeps this object to remove its callback)."""

    def __init__(self, ext: Any, prof: Profile, top: int):
        self.ext, self.prof, self.top = ext, prof, top

    def post(self, result: Any = None) -> None:
        if self.prof.done:
            self.ext.disarm_profile()
            show_profile(self.prof, self.top, "%xla_profile")


def xla_profile(ext: Any, args: Any) -> None:
    """``%xla_profile N``: arm a profile of the next N tracked steps; ``--cancel``; or the status."""
    armed = ext.armed if ext is not None else None
    if args.cancel:
        if armed is None:
            print("%xla_profile: no profile is armed.")
            return
        tracing = armed.prof.state == "tracing"
        ext.disarm_profile()
        print(f"%xla_profile: cancelled{' (it was tracing: what it traced is below)' if tracing else ''}.")
        if tracing:
            show_profile(armed.prof, armed.top, "%xla_profile")
        return
    if args.steps is None:
        if armed is None:
            print("%xla_profile: no profile is armed. %xla_profile N traces the next N steps of a tracked "
                  "loop; %%xla_profile traces a whole cell.")
        else:
            print(f"%xla_profile: {armed.prof.state}, {armed.prof.steps} steps of the next tracked loop "
                  f"({len(armed.prof.records)} so far), trace to {armed.prof.logdir}.")
        return
    prof = new_profile(args, "%xla_profile")
    if ext is None:
        raise usage("%xla_profile N needs the extension loaded: %load_ext tpukit.")
    ext.arm_profile(ArmedProfile(ext, prof.start(), args.top))
    print(f"%xla_profile: the next {args.steps} steps of a tracked loop (tpukit.track) will be traced "
          f"to {prof.logdir}; the summary shows after the cell where they run.")
