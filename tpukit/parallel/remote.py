"""What ``tpukit.launch`` and ``tpukit.run_on_slice`` share: code that runs in another process (a
launch replica, a slice host) and the notebook that shows what it does.

* :class:`Message`: the one thing a remote process sends back, with named fields: a host's
  hello, a piece of output, a step record or compile event, the function's result or its error.
* :class:`Redirect`: the remote side's file-descriptor-level capture. fds 1 and 2, ``sys.stdout``
  / ``sys.stderr`` and the logging handlers that wrote to them go to pipes or files, so ``print``,
  ``logging`` and C-level output (XLA's) all reach the notebook.
* :class:`Prefixer`: the notebook side of output: each line written to this process's own
  stdout or stderr once it is complete, prefixed ``[rank N]`` or ``[host N]``.
* :func:`run` calls the user's function and says how it ended; :func:`user_traceback` starts a
  remote traceback at the user's own code; :func:`with_sources` makes it read, in the notebook,
  like one of the notebook's own.
* :class:`Forwarder`: a listener on the remote side that sends its step records and compile
  events as Messages; :func:`publish` hands them to this process's listeners.
"""

from __future__ import annotations

import codecs
import io
import linecache
import logging
import os
import re
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from .. import _ipython, events

HELLO, OUTPUT, STEP, COMPILE, RESULT, ERROR = "hello", "output", "step", "compile", "result", "error"
KINDS = (HELLO, OUTPUT, STEP, COMPILE, RESULT, ERROR)
_HOOKS = {STEP: "on_step", COMPILE: "on_compile"}  # the listener method a forwarded record goes to


@dataclass(frozen=True)
class Message:
    """One message from a remote process (a launch replica, a slice host) to the notebook.

    ``kind`` says which fields mean something; ``source`` is the sender's rank or host index.
    The class methods build each kind. It crosses processes by pickle (a multiprocessing pipe,
    a Ray object), so it holds plain data and tpukit records only.
    """

    kind: str
    source: int
    stream: str = ""        # OUTPUT: "stdout" or "stderr"
    text: str = ""          # OUTPUT: what was written
    sent: int = 0           # OUTPUT: bytes of that stream sent so far, this text included
    record: Any = None      # STEP: a StepRecord; COMPILE: a CompileEvent
    value: Any = None       # RESULT: the function's value (pickled bytes when it crosses Ray)
    primary: bool = False   # RESULT: the value is the one the caller returns (rank 0's, host 0's)
    summary: str = ""       # ERROR: what went wrong, in one line
    traceback: str = ""     # ERROR: the user's traceback, "" when the function itself did not raise
    hostname: str = ""      # HELLO: the machine the sender runs on
    pid: int = 0            # HELLO: the sender's process id
    node: str = ""          # HELLO: the sender's Ray node id

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Message kind {self.kind!r} is not one of {', '.join(KINDS)}.")
        if self.kind == OUTPUT and self.stream not in ("stdout", "stderr"):
            raise ValueError(f"an output Message needs stream='stdout' or 'stderr', got {self.stream!r}.")

    @classmethod
    def hello(cls, source: int, hostname: str, pid: int, node: str = "") -> "Message":
        """The first message of a slice host: where it runs."""
        return cls(HELLO, source, hostname=hostname, pid=pid, node=node)

    @classmethod
    def output(cls, source: int, stream: str, text: str, sent: int = 0) -> "Message":
        """``text`` written to ``stream``; ``sent``: bytes of that stream sent so far."""
        return cls(OUTPUT, source, stream=stream, text=text, sent=sent)

    @classmethod
    def result(cls, source: int, value: Any, primary: bool) -> "Message":
        """The function returned ``value``; ``primary`` when it is the value the caller returns."""
        return cls(RESULT, source, value=value, primary=primary)

    @classmethod
    def error(cls, source: int, summary: str, traceback: str = "") -> "Message":
        """The function failed: ``summary`` in one line, and the user's traceback when it raised."""
        return cls(ERROR, source, summary=summary, traceback=traceback)


# ------------------------------------------------------------------------------ the remote side

class Redirect:
    """Points fds 1 and 2 at ``stdout_fd`` / ``stderr_fd`` (a pipe's or a file's; the caller keeps
    them), ``sys.stdout`` / ``sys.stderr`` at line-buffered streams over fds 1 and 2, and the logging
    handlers that wrote to the old streams (a notebook's ``logging.basicConfig()``) at the new ones.
    :meth:`restore` (or leaving the ``with`` block) puts everything back.

    ``flush_first``: flush the old streams before redirecting, so what they hold is not captured.
    A forked child must not (its streams are its parent's, a notebook's may talk to the kernel).
    """

    def __init__(self, stdout_fd: int, stderr_fd: int, flush_first: bool = True):
        self.targets = {1: stdout_fd, 2: stderr_fd}
        self.flush_first = flush_first
        # Kept alive on purpose: collecting an inherited stream object could flush the
        # parent's buffered output (or a notebook's zmq stream) into the new targets.
        self.streams = (sys.stdout, sys.stderr)
        self.saved: dict[int, int] = {}
        self.handlers: list[tuple[logging.StreamHandler, Any]] = []

    def start(self) -> "Redirect":
        """Redirect; returns ``self``."""
        if self.flush_first:
            for stream in self.streams:
                _flush(stream)
        for fd, target in self.targets.items():
            self.saved[fd] = os.dup(fd)
            os.dup2(target, fd)
        old_out, old_err = self.streams
        sys.stdout, sys.stderr = _line_stream(1), _line_stream(2)
        loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                           if isinstance(lg, logging.Logger)]
        for handler in {h for lg in loggers for h in lg.handlers}:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                new = {id(old_out): sys.stdout, id(old_err): sys.stderr}.get(id(handler.stream))
                if new is not None:
                    self.handlers.append((handler, handler.stream))
                    handler.setStream(new)
        return self

    def restore(self) -> None:
        """Flush what was captured and put fds 1 and 2, the streams and the handlers back."""
        for stream in (sys.stdout, sys.stderr):
            _flush(stream)
        for handler, stream in self.handlers:
            handler.setStream(stream)
        self.handlers.clear()
        sys.stdout, sys.stderr = self.streams
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self.saved.clear()

    def __enter__(self) -> "Redirect":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _line_stream(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except Exception:  # a closed or broken stream has nothing left to give
        pass


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # tpukit/, not parallel/
_PLUMBING = (os.sep + os.path.join("torch_xla", "_internal") + os.sep,  # torch_xla's replica set-up
             os.sep + os.path.join("concurrent", "futures") + os.sep,  # its thread pool
             os.sep + "threading.py")


def user_traceback(exc: BaseException) -> str:
    """``exc``'s formatted traceback from the user's own code on: the leading frames of tpukit
    itself and of the plumbing that called the user's function (torch_xla's replica set-up, thread
    pools) are dropped. The whole traceback when every frame is such plumbing."""
    tb = exc.__traceback__
    while tb is not None:
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not path.startswith(_PACKAGE) and not any(p in path for p in _PLUMBING):
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def run(source: int, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Message:
    """Call ``fn(*args, **kwargs)`` and say how it ended: a RESULT Message with its value (not yet
    ``primary``: the caller decides), or an ERROR one with the user's traceback. ``SystemExit(0)``
    is a result of None; anything else raised, KeyboardInterrupt included, is an error."""
    try:
        value = fn(*args, **(kwargs or {}))
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return Message.error(source, f"SystemExit({exc.code!r})", user_traceback(exc))
        value = None
    except BaseException as exc:  # reported, whatever it is: the remote process must answer
        return Message.error(source, f"{type(exc).__name__}: {exc}", user_traceback(exc))
    return Message.result(source, value, primary=False)


def unsendable(source: int, value: Any, exc: BaseException, receiver: str) -> Message:
    """The ERROR Message for a ``value`` that could not be pickled to ``receiver``."""
    return Message.error(source, f"it returned a {type(value).__name__} that cannot be sent back to {receiver} "
                                 f"({type(exc).__name__}: {exc}); return plain Python data or CPU tensors (t.cpu())")


class Forwarder:
    """A tpukit listener that sends this process's step records and compile events as Messages.

    ``send`` takes a Message (a pipe's ``send``, a queue's ``put``); ``tag(record, source)``
    rewrites each record first (a slice host marks its records with its index); ``when()``, called
    at each record, says whether to send it (a launch replica: only device ordinal 0's thread).
    """

    def __init__(self, send: Callable[[Message], Any], source: int, *,
                 tag: Callable[[Any, int], Any] | None = None, when: Callable[[], bool] | None = None):
        self.send, self.source, self.tag, self.when = send, source, tag, when
        self.lock = threading.Lock()  # one message at a time (threads share the pipe)

    def _forward(self, kind: str, record: Any) -> None:
        if self.when is not None and not self.when():
            return
        if self.tag is not None:
            record = self.tag(record, self.source)
        with self.lock:
            self.send(Message(kind, self.source, record=record))

    def on_step(self, record: Any) -> None:
        """Send a step record."""
        self._forward(STEP, record)

    def on_compile(self, event: Any) -> None:
        """Send a compile event."""
        self._forward(COMPILE, event)


# ------------------------------------------------------------------------------ the notebook side

def publish(message: Message) -> None:
    """Hand a forwarded step record or compile event to this process's listeners (the dashboard)."""
    if message.kind not in _HOOKS:
        raise ValueError(f"only step and compile Messages carry records for listeners, not {message.kind!r}.")
    events.call(_HOOKS[message.kind], message.record)


_LINE = re.compile(r"(\r\n|\n|\r)")


class Prefixer:
    """Remote output to this process's own stdout and stderr, line by line, each line prefixed
    ``[<label> N]`` (``[rank 1]``, ``[host 3]``).

    A line is written once it is complete (``\\n``, ``\\r\\n`` as ``\\n``, or ``\\r``, which stays:
    progress bars); a partial line waits for the rest of it, per source and stream, until
    :meth:`flush` or ``final=True``. Bytes are decoded as UTF-8 incrementally, so a character split
    across two reads is not garbled.
    """

    def __init__(self, label: str):
        self.label = label
        self.partial: dict[tuple[int, str], str] = {}
        self.decoders: dict[tuple[int, str], Any] = {}

    def write(self, source: int, stream: str, data: str | bytes, final: bool = False) -> None:
        """Write what ``source`` sent to ``stream`` ("stdout" or "stderr"); ``final``: that stream
        has ended, so its last partial line is written too."""
        key = (source, stream)
        if isinstance(data, bytes) or (final and key in self.decoders):
            decoder = self.decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")("replace"))
            data = decoder.decode(data if isinstance(data, bytes) else data.encode(), final=final)
        text = self.partial.pop(key, "") + data
        parts = _LINE.split(text)
        ends = ["\n" if end == "\r\n" else end for end in parts[1::2]]
        out = [f"[{self.label} {source}] {line}{end}" for line, end in zip(parts[0::2], ends)]
        rest = parts[-1]
        if rest and final:
            out.append(f"[{self.label} {source}] {rest}\n")
        elif rest:
            self.partial[key] = rest
        if final:
            self.decoders.pop(key, None)
        if out:
            target = getattr(sys, stream)
            target.write("".join(out))
            target.flush()

    def flush(self) -> None:
        """Write every partial line that is waiting (the run is over)."""
        for source, stream in dict.fromkeys([*self.partial, *self.decoders]):
            self.write(source, stream, "", final=True)


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>, in .*)$')


def with_sources(text: str) -> str:
    """A remote traceback as this notebook shows its own: a frame in one of this kernel's cells
    reads ``Cell In[8], line 3``, and a frame whose source the remote process lacked gets it from
    here (a function defined in the notebook travels by value: the remote side has its code, not
    its text)."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if not m:
            out.append(line)
            continue
        label = _ipython.cell_label(m["file"])
        out.append(f"  Cell In{label}, line {m['line']}{m['rest']}" if label else line)
        if not (i + 1 < len(lines) and lines[i + 1].startswith("    ")):
            source = linecache.getline(m["file"], int(m["line"])).strip()
            if source:
                out.append(f"    {source}")
    return "\n".join(out)
