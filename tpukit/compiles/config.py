"""Where compile evidence comes from, configured once per process: torch_xla's compile-trace
file and XLA's HLO dump folder.

With ``PT_XLA_DEBUG_LEVEL=1`` and ``PT_XLA_DEBUG_FILE`` set before torch_xla starts,
torch_xla appends a "Compilation Analysis" block to the file when a compilation starts;
with tpukit's ``--xla_dump_to`` flags, XLA writes the compiled graph's HLO to the folder
next to it. Both are read by :mod:`tpukit.compiles.reader`, the only reader.

Everything that sets, names or removes these lives here: :func:`configure` (called by
``tpukit.setup()``), :func:`release` once the runtime has read them (so processes started
from this one do not dump into this process's folder), ``_inherit/sitecustomize.py`` on the
children's ``PYTHONPATH`` (so they do not append to this process's trace), and the clean-up of
this process's files at exit and of files left by processes that are gone.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading

from .. import environment

TRACE_LEVEL_ENV = "PT_XLA_DEBUG_LEVEL"
TRACE_FILE_ENV = "PT_XLA_DEBUG_FILE"
FRAMES_ENV, FRAMES = "PT_XLA_DEBUG_MAX_FRAME", "64"
HLO_SUFFIX = ".hlo"
_NAME = re.compile(r"^compiles-(\d+)\.log(?:\.hlo)?$")
TRACE_NAME = r"tpukit-[^/\\]*[/\\]compiles-(\d+)\.log$"  # a tpukit trace file's path; its pid is the owner
# Put on the PYTHONPATH of the processes this one starts: their sitecustomize drops this trace.
CHILD_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_inherit")
_DUMP_FLAG = re.compile(r"--xla_dump_to=\S*tpukit-[^\s/\\]*[/\\]compiles-\d+\.log\.hlo\S*|--xla_dump_hlo_as_text|"
                        r"--xla_dump_hlo_as_proto|--xla_dump_hlo_pass_re=\^\$")

_LOCK = threading.Lock()
_CONFIGURED: str | None = None  # the trace file configure() made for this process
_CLEANUP_REGISTERED = False


def folder() -> str:
    """The per-user folder holding every process's trace file and HLO dump folder."""
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"tpukit-{user}")


def dump_flags(path: str) -> str:
    """The XLA_FLAGS that make XLA dump each compiled step graph's HLO into ``path``: the text the
    reader compares graphs by, and the proto a TPU target compiles (read only when a target is set)."""
    return f"--xla_dump_to={path} --xla_dump_hlo_as_text --xla_dump_hlo_as_proto --xla_dump_hlo_pass_re=^$"


def _env_trace_file() -> str | None:
    try:
        level = int(os.environ.get(TRACE_LEVEL_ENV, "0") or 0)
    except ValueError:
        level = 0
    path = os.environ.get(TRACE_FILE_ENV)
    return path if level >= 1 and path else None


def inherited(path: str) -> bool:
    """True for a trace file tpukit made for another process (its pid is in the name)."""
    m = re.search(TRACE_NAME, path)
    return bool(m) and int(m.group(1)) != os.getpid()


def trace_file() -> str | None:
    """The compile-trace file torch_xla writes to in this process: the one :func:`configure` made,
    else one set in the environment (``PT_XLA_DEBUG_LEVEL>=1`` and ``PT_XLA_DEBUG_FILE``: the user's,
    or a forked parent's once torch_xla is loaded); None when tracing is off."""
    return _CONFIGURED or _env_trace_file()


def hlo_dir() -> str | None:
    """The folder XLA dumps this process's compiled graphs into (next to the trace file), if any."""
    trace = trace_file()
    path = trace + HLO_SUFFIX if trace else None
    return path if path and os.path.isdir(path) else None


def configure(runtime_imported: bool) -> tuple[str | None, list[str]]:
    """Turn compile tracing on for this process, before torch_xla is imported: a fresh trace file,
    64 Python frames per compile, and the HLO dump next to it (unless the user dumps elsewhere).

    ``runtime_imported``: torch_xla is already imported, so it is too late. Returns the trace
    file (None when off) and the problems to report.
    """
    with _LOCK:
        trace = trace_file()
        if trace and not (inherited(trace) and not runtime_imported):
            return trace, []  # the user's own file, or the parent's that a loaded torch_xla writes to
        if runtime_imported:
            return None, [
                "Compile causes are unavailable: torch_xla was imported before tpukit configured compile "
                "tracing (counts still work). Restart the kernel and call tpukit.setup() or %load_ext tpukit "
                "before importing torch_xla."]
        return _take(), []


def _take() -> str:
    """Make this process's trace file and dump folder and point torch_xla and XLA at them."""
    global _CONFIGURED
    sweep()
    os.makedirs(folder(), exist_ok=True)
    path = os.path.join(folder(), f"compiles-{os.getpid()}.log")
    open(path, "w").close()  # start empty: torch_xla appends
    _CONFIGURED = path
    os.environ[TRACE_LEVEL_ENV] = "1"
    os.environ[TRACE_FILE_ENV] = path
    # torch_xla keeps 8 frames by default: too few to reach the user's line under a library
    # loop (a Trainer, a device loader, dynamo). Only written when something compiles.
    os.environ.setdefault(FRAMES_ENV, FRAMES)
    _children_drop_trace()
    _configure_dump(path)
    _cleanup_at_exit()
    return path


def _children_drop_trace() -> None:
    """Processes started from this one inherit its environment, trace settings included; put
    :data:`CHILD_PATH` first on their ``PYTHONPATH`` so their ``sitecustomize`` drops this process's
    trace before their torch_xla reads it (torch_xla reads the variables again at every compile, so
    this process cannot take them back after start)."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != CHILD_PATH]
    os.environ["PYTHONPATH"] = os.pathsep.join([CHILD_PATH] + parts)


def _configure_dump(trace: str) -> None:
    """Have XLA dump each compiled graph's HLO next to the trace file (only when it compiles),
    unless the user dumps somewhere already; drops another process's tpukit dump flags."""
    flags = _DUMP_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split()
    if any(f.startswith("--xla_dump_to") for f in flags):
        os.environ["XLA_FLAGS"] = " ".join(flags)
        return  # the user's own dump wins; compile evidence then comes from the batches alone
    path = trace + HLO_SUFFIX
    os.makedirs(path, exist_ok=True)
    os.environ["XLA_FLAGS"] = " ".join(flags + dump_flags(path).split())


def release() -> None:
    """Take tpukit's dump flags out of ``XLA_FLAGS`` once XLA has read them (at its first compile),
    so processes started from here (``!python train.py``) do not dump into this process's folder.
    The trace settings stay: torch_xla reads them again at every compile."""
    rest = _DUMP_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).split()
    if rest:
        os.environ["XLA_FLAGS"] = " ".join(rest)
    else:
        os.environ.pop("XLA_FLAGS", None)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


def sweep() -> list[str]:
    """Remove the trace files and dump folders of tpukit processes that are gone (a killed kernel
    cannot clean up after itself); returns what was removed."""
    removed = []
    try:
        entries = os.listdir(folder())
    except OSError:
        return removed
    for entry in entries:
        m = _NAME.match(entry)
        if m and int(m.group(1)) != os.getpid() and not environment.pid_alive(int(m.group(1))):
            _remove(os.path.join(folder(), entry))
            removed.append(entry)
    return removed


def _cleanup() -> None:
    """At exit: remove this process's trace file and dump folder (a forked child keeps its parent's)."""
    path = _CONFIGURED
    if path and not inherited(path):
        _remove(path + HLO_SUFFIX)
        _remove(path)


def _cleanup_at_exit() -> None:
    global _CLEANUP_REGISTERED
    if not _CLEANUP_REGISTERED:
        _CLEANUP_REGISTERED = True
        atexit.register(_cleanup)


def _forget_in_child() -> None:
    """A forked child writes nothing of its own yet: it must not remove its parent's files."""
    global _CONFIGURED
    if _CONFIGURED and inherited(_CONFIGURED):
        _CONFIGURED = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
