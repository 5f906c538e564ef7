"""The child side of ``tpukit.launch``: what runs in each replica process.

:func:`main` is the process's entry point. It points its output at the launching process's
pipes (:class:`~tpukit.parallel.remote.Redirect`), leaves Ctrl-C to the parent and dies with it, runs the
user's function the way the launch plan says, forwards rank 0's step records and compile events,
and sends one :class:`~tpukit.parallel.remote.Message` with the result or the error. The parent's
supervision is in :mod:`tpukit.parallel.launcher`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .. import _xla, events, runtime
from . import remote

_REDIRECTS: list[remote.Redirect] = []  # this process's capture, kept for its whole life


@dataclass(frozen=True)
class Plan:
    """How ``launch`` starts replicas (decided before anything starts)."""

    mode: str  # "in-process" | "single" | "replicated" | "independent"
    nprocs: int
    start_method: str | None
    device_type: str


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this child when the launching process dies (best effort)."""
    try:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _is_rank0() -> bool:
    return runtime.rank() == 0


def _replicas(rank_: int, plan: Plan, fn: Callable[..., Any], args: tuple) -> dict[int, Any]:
    """Run ``fn`` as the plan says; ``{rank: value}`` of the replicas this process ran."""
    if plan.mode == "independent":
        os.environ[runtime.RANK_ENV] = str(rank_)
        return {rank_: fn(rank_, *args)}
    if plan.mode == "single":
        return {0: _xla.run_single_process(fn, args)}
    return _xla.run_replica_process(rank_, plan.nprocs, fn, args)


def main(rank_: int, plan: Plan, fn: Callable[..., Any], args: tuple, out_w: Any, err_w: Any, res_w: Any,
         parent_pid: int) -> None:
    """Entry point of one replica process; sends a RESULT Message (``primary`` when this process ran
    rank 0) or an ERROR one on ``res_w``, after rank 0's STEP and COMPILE Messages."""
    _REDIRECTS.append(remote.Redirect(out_w.fileno(), err_w.fileno(), flush_first=False).start())
    out_w.close()
    err_w.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    _die_with_parent()
    if plan.start_method != "forkserver" and os.getppid() != parent_pid:  # parent died before prctl
        os._exit(1)
    forwarder = events.add_listener(remote.Forwarder(res_w.send, rank_, when=_is_rank0)) if rank_ == 0 else None
    msg = remote.run(rank_, _replicas, (rank_, plan, fn, args))
    if msg.kind == remote.RESULT:
        values = msg.value  # None after SystemExit(0)
        if values is None:
            msg = remote.Message.result(rank_, None, primary=rank_ == 0)
        else:
            low = min(values) if values else None
            msg = remote.Message.result(rank_, values.get(0) if low == 0 else None, primary=low == 0)
    if forwarder is not None:
        events.remove_listener(forwarder)
    try:
        res_w.send(msg)
    except Exception as exc:  # an unpicklable return value
        res_w.send(remote.unsendable(rank_, msg.value, exc, "the launching process"))
    finally:
        res_w.close()
        sys.stdout.flush()
        sys.stderr.flush()
